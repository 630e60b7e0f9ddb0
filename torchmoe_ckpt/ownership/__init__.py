"""Who may write a run: the run lock on a local directory (run_lock) and the lease on an object store's run
prefix (store_lease). Above the storage format, below the tiers (the orphan sweep asks the run lock)."""
