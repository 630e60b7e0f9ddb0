"""How much memory a tier's files hold, read from the file system (not estimated): the blocks each file has
allocated (on tmpfs: its pages), every inode counted once, per part of the host-memory account (host_memory.py).
"""

from __future__ import annotations

import os
from collections.abc import Set
from pathlib import Path

from .layout import belongs_to, parse_window_dirname

_MEMORY_FS = ("tmpfs", "ramfs", "hugetlbfs")


def _count(path: str, seen: set, skip: Set) -> int:
    """Allocated bytes of one file, unless its inode is in `seen` or `skip` (then 0); adds it to `seen`."""
    try:
        st = os.lstat(path)
    except OSError:  # collected meanwhile
        return 0
    key = (st.st_dev, st.st_ino)
    if key in seen or key in skip:
        return 0
    seen.add(key)
    return st.st_blocks * 512


def tree_bytes(root: Path, seen: set, skip: Set = frozenset(), writer: str | None = None) -> int:
    """Allocated bytes of every file under `root` (only `writer`'s, when given) not in `seen` or `skip` ((dev,
    inode) sets); adds them to `seen`."""
    paths = (os.path.join(d, n) for d, _dirs, names in os.walk(root) for n in names)
    return sum(_count(p, seen, skip) for p in paths if writer is None or belongs_to(os.path.relpath(p, root), writer))


def window_bytes(run_dir: Path, writer: str, seen: set, skip: Set = frozenset()) -> dict[int, int]:
    """Window id -> allocated bytes of `writer`'s files in that window directory."""
    try:
        names = os.listdir(run_dir)
    except OSError:
        return {}
    return {w: tree_bytes(run_dir / n, seen, skip, writer) for n in names if (w := parse_window_dirname(n)) is not None}


def in_memory(path: str | Path) -> bool:
    """Whether `path` lies on a memory file system (tmpfs, ramfs): its files are host memory, not disk."""
    try:
        p = os.path.realpath(path)
        with open("/proc/self/mounts") as f:
            mounts = [m for line in f if len(m := line.split()) >= 3]
        under = [m for m in mounts if p == m[1] or p.startswith(m[1].rstrip("/") + "/")]
        return max(under, key=lambda m: len(m[1]), default=("", "", ""))[2] in _MEMORY_FS  # the innermost mount
    except OSError:
        return False
