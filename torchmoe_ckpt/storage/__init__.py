"""The storage tiers, each implemented once behind one contract (tier.py): host memory (host_tier), peers
(peer_tier), the object store in the DCP (object_tier) and the tensorstore format (tensorstore_tier); what they
share, one place each: layout, slot_format, manifest, checksums, commit, retry, files, store_open; and what runs
them: persist_thread, uploader, tier_health, run_lock, tiers (building them), recover (the window to recover)."""
