"""The commit-last write, one implementation: a file that makes something visible (a window's manifest, a
slot's `.metadata`, a received copy's manifest, the run lock, a JIT marker) appears whole or not at all, and
only after everything it vouches for was written.

Local files: a temporary name in the same directory, then an atomic rename over the final name. Object stores
put an object whole, so there the order of the puts is the commit (files.StoreFiles.write_last).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def write_last(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` as `path` atomically (temporary file + rename): readers see the old file, no file, or
    all of `data`, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")  # two writers never share one
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
