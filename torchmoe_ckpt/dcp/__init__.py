"""DCP planners and storage tiers for sparse checkpoint windows."""
