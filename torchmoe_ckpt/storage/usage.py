"""How much memory a tier's files hold, read from the file system (not estimated): the blocks each file has
allocated (on tmpfs: its pages), every inode counted once, per part of the host-memory account
(host_memory.py). A writer counts only its own files of a shared run directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from .layout import belongs_to, parse_window_dirname

_MEMORY_FS = ("tmpfs", "ramfs", "hugetlbfs")


def allocated(st: os.stat_result) -> int:
    return st.st_blocks * 512


def _count(path: str, seen: set, skip: set) -> int:
    """Allocated bytes of one file, unless its inode is in `seen` or `skip` (then 0); adds it to `seen`."""
    try:
        st = os.lstat(path)
    except OSError:  # collected meanwhile
        return 0
    key = (st.st_dev, st.st_ino)
    if key in seen or key in skip:
        return 0
    seen.add(key)
    return allocated(st)


def tree_bytes(root: Path, seen: set, skip: set = frozenset()) -> int:
    """Allocated bytes of every file under `root` not in `seen` or `skip` ((dev, inode) sets); adds them to
    `seen`."""
    return sum(_count(os.path.join(d, n), seen, skip) for d, _dirs, names in os.walk(root) for n in names)


def window_bytes(run_dir: Path, writer: str, seen: set, skip: set = frozenset()) -> dict[int, int]:
    """Window id -> allocated bytes of `writer`'s files in that window directory (its slot pieces, replay
    records, manifest)."""
    out: dict[int, int] = {}
    try:
        names = os.listdir(run_dir)
    except OSError:
        return out
    for name in names:
        wid = parse_window_dirname(name)
        if wid is None:
            continue
        wdir = run_dir / name
        out[wid] = sum(
            _count(os.path.join(d, f), seen, skip)
            for d, _dirs, files in os.walk(wdir)
            for f in files
            if belongs_to(os.path.relpath(os.path.join(d, f), wdir), writer)
        )
    return out


def in_memory(path: str | Path) -> bool:
    """Whether `path` lies on a memory file system (tmpfs, ramfs): its files are host memory, not disk."""
    try:
        p = os.path.realpath(path)
        best, kind = "", ""
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and (p == parts[1] or p.startswith(parts[1].rstrip("/") + "/")):
                    if len(parts[1]) > len(best):
                        best, kind = parts[1], parts[2]
        return kind in _MEMORY_FS
    except OSError:
        return False
