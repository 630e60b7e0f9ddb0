"""Data files of deleted windows, kept aside (bounded, in a `.spare` directory, never a `window-*` name) to be
written over by the next ones: their page-cache or shared-memory pages are reused, not allocated and zeroed again.
"""

from __future__ import annotations

import os
from pathlib import Path


def keep_spares(files: list[Path], spare_dir: Path, limit: int, tag: str) -> list[Path]:
    """Move as many of `files` as `spare_dir` has room for (at most `limit` spares) into it as `<tag>-<i>.distcp`
    (`tag` unique per deleted window); returns what the caller deletes: files not kept, spares beyond `limit`."""
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
