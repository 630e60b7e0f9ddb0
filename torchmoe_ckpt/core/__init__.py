"""Shared data with no threads and no behaviour: errors, the torch-free configs and their checks (SparseConfig,
TierConfig, ObjectStoreConfig), an operator's pieces, window plans, slots, windows, replay records. Imports
nothing of the library above it (tests/api/test_layering.py)."""
