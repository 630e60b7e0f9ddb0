"""Recovery: find the newest usable window every rank can get, across the tiers (agreed_window, collective), and
rebuild the dense state from its slots by replaying frozen operators (resume, sparse_to_dense), the replay
checks, RNG states, the replay records' use, and the just-in-time checkpoint."""
