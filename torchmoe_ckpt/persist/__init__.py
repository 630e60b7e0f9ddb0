"""What runs the tiers: building them from the config (build_tiers), the persist thread that writes and commits
each window, the uploader to the object store, tier health and the status lines (run_status)."""
