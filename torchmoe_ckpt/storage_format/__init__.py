"""The storage format, the lowest of storage's four layers: the bytes every tier writes and reads. The run's
directory layout, window manifests, the slot file format, checksums, the commit marker, file access on a local
directory or an object store (files, mapped_files, slot_files, spare_files), space accounting (usage), retries,
opening a store URI, the tensorstore array specs. Imports core/ (and model/'s parameter names) only."""
