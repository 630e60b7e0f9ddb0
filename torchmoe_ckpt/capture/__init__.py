"""The copy engine: slot copies on a side stream into pinned arenas or mapped files, the slot pools and their
allocator choice, and the host-memory budget."""
