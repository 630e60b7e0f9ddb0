"""The commit-last write, one implementation: a file that makes something visible (a manifest, a slot's
`.metadata`, the run lock, a JIT marker) appears whole or not at all, after everything it vouches for. Object
stores put objects whole, so there the order of the puts is the commit (files.StoreFiles.write_last).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def write_last(path: str | os.PathLike, data: bytes | bytearray) -> None:
    """Write `data` as `path` atomically (a temporary file, then a rename): readers never see a part of it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")  # two writers never share one
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
