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


def tree_bytes(root: Path, seen: set, skip: set = frozenset()) -> int:
    """Allocated bytes of every file under `root` not in `seen` or `skip` ((dev, inode) sets); adds them to
    `seen`."""
    total = 0
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            try:
                st = os.lstat(os.path.join(dirpath, n))
            except OSError:  # collected meanwhile
                continue
            key = (st.st_dev, st.st_ino)
            if key in seen or key in skip:
                continue
            seen.add(key)
            total += allocated(st)
    return total


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
        n = 0
        for dirpath, _dirs, files in os.walk(wdir):
            rel_dir = os.path.relpath(dirpath, wdir)
            for f in files:
                rel = f if rel_dir == "." else f"{rel_dir}/{f}"
                if not belongs_to(rel, writer):
                    continue
                try:
                    st = os.lstat(os.path.join(dirpath, f))
                except OSError:
                    continue
                key = (st.st_dev, st.st_ino)
                if key in seen or key in skip:
                    continue
                seen.add(key)
                n += allocated(st)
        out[wid] = n
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
