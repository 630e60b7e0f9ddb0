"""Recovery: find the newest usable window and rebuild the dense state from its slots by replaying frozen operators
(sparse_to_dense), the replay checks, RNG states, the replay records' use, and the just-in-time checkpoint."""
