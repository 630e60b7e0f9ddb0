"""The storage tiers, each once behind one contract (tier.py): host memory, peers, the object store in the DCP
and the tensorstore format; what they share (layout, slot_format, manifest, checksums, commit, retry, files,
store_open) and what runs them (persist_thread, uploader, tier_health, run_lock, tiers, recover)."""
