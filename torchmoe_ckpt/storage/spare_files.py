"""Data files of deleted windows, kept aside (bounded) to be written over by the next ones.

Every tier that writes whole window copies into page-cache or shared-memory files -- the host tier's slots
held in plain memory, peer copies, a local object store -- keeps a deleted window's data files in a `.spare`
directory and puts the next data files in their place: their pages are reused instead of being allocated and
zeroed again. A spare is never a `window-*` name, so it is never listed as a window.
"""

from __future__ import annotations

import os
from pathlib import Path


def keep_spares(files: list[Path], spare_dir: Path, limit: int, tag: str) -> list[Path]:
    """Move as many of `files` as `spare_dir` has room for (at most `limit` spares) into it, named
    `<tag>-<i>.distcp` (`tag` unique per deleted window); returns the files not kept, for the caller to delete,
    and the spares beyond `limit` (a limit that went down: fewer slots per window, memory pressure)."""
    spare_dir.mkdir(parents=True, exist_ok=True)
    have = spares(spare_dir)
    room = max(0, limit - len(have))
    for i, f in enumerate(files[:room]):
        f.rename(spare_dir / f"{tag}-{i}.distcp")
    return files[room:] + have[limit:]


def spares(spare_dir: Path) -> list[Path]:
    return sorted(spare_dir.glob("*.distcp")) if spare_dir.is_dir() else []


def place_new_file(path: Path, spare: Path | None = None) -> None:
    """Make `path` a new file to write: `spare` renamed into place, or no file at all. Whatever was at `path`
    is replaced, never written into (on a host tier it may be a link to live slot buffers)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if spare is not None:
        os.replace(spare, path)
    elif os.path.lexists(path):
        os.unlink(path)


def pwrite_all(fd: int, data: memoryview, pos: int) -> None:
    """Write all of `data` at offset `pos` (a regular file takes it at once; a short write is only resumed)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], pos + done)
