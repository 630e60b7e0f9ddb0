"""What runs the tiers: building them from the config (tiers), the persist thread that writes and commits each
window, the uploader to the object store, tier health and the status lines (run_status), and the tiers'
agreement at recovery (recover)."""
