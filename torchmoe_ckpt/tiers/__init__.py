"""The storage tiers, each once behind one contract (contracts.py): host memory (host_tier), peers (peer_tier over
peer_transport, with peer_lag and peer_interval), the object store in the DCP and the tensorstore format
(object_tier, tensorstore_tier, tensorstore_read); what the file-backed ones share (window_tier) and the sweep of
copies left by dead jobs (orphans). Built on the storage format and ownership layers."""
