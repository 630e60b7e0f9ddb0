"""Shared data with no threads and no behaviour: errors, an operator's pieces, window plans, slots, windows, replay
records. Imports nothing of the library above it (tests/unit/test_layering.py)."""
