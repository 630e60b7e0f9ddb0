"""Data files written through a kept shared mapping (MAP_SHARED: the tmpfs page cache itself), one per file, so
persisting into node-local shared memory costs one memcpy per item, and the same pass gives the file's block sums.
A mapping is keyed by inode (it survives the host tier's renames: spare -> window -> spare); one of a file deleted
meanwhile is dropped on the next write, or at once by `forget` (its pages stay pinned while mapped).
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from .checksums import BLOCK, tensor_block_sums

MADV_POPULATE_WRITE = 23  # Linux 5.14+ (not every Python names it): map every page writable in one call


def populate(mm: mmap.mmap) -> bool:
    """Map every page of `mm` into this process now, writable (the pages are already allocated). Without it the
    first copy into a new mapping takes one page fault per 4 KiB, each under the process's memory-map lock, which
    the training thread's own allocations also take: measured here, the first 133 MB copy into a new slot file
    during training took ~0.6 s against ~0.04 s for the next ones; populated first it takes ~0.03 s on an idle
    core. Returns False where the kernel cannot (older than 5.14): the pages then fault in on first use, as before."""
    try:
        mm.madvise(MADV_POPULATE_WRITE)
    except (OSError, ValueError, AttributeError):
        return False
    return True


def map_file(fd: int, size: int, allocate: bool = True) -> tuple[mmap.mmap, torch.Tensor]:
    """A shared read/write mapping of the open file `fd` cut to `size` bytes, and its uint8 view. `allocate`: every
    page now, so a full /dev/shm is an OSError (ENOSPC) here, never a SIGBUS in a later copy; the pages are mapped
    in at once too (`populate`), so that no later copy pays their first-touch faults."""
    if os.fstat(fd).st_size != size:
        os.ftruncate(fd, size)
    if allocate:
        os.posix_fallocate(fd, 0, size)
    mm = mmap.mmap(fd, size)
    populate(mm)
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


@dataclass
class _Map:
    mm: mmap.mmap
    fd: int  # kept open: st_nlink == 0 tells that the file was deleted
    t: torch.Tensor  # uint8 view of the whole file
    size: int
    sig: tuple = ()  # the item layout the views below were made for
    key: object = None  # the caller's layout key of `sig` (compared by identity: no re-hash)
    views: list = field(default_factory=list)


class MappedFiles:
    def __init__(self, limit: int = 64):
        self._maps: dict[tuple[int, int], _Map] = {}
        self.limit = limit  # mappings kept (oldest dropped first): bounds pinned shared memory
        self._lock = threading.Lock()  # the persist thread writes while another may collect (forget)

    def __len__(self) -> int:
        return len(self._maps)

    def _drop(self, key) -> None:
        m = self._maps.pop(key, None)
        if m is not None:
            os.close(m.fd)  # the mapping itself goes with its last tensor view

    def _map(self, path: str, size: int) -> _Map:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        with self._lock:
            for k in [k for k, m in self._maps.items() if os.fstat(m.fd).st_nlink == 0]:
                self._drop(k)  # deleted since: do not pin its pages
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            m = self._maps.get(key)
            if m is not None and m.size == size:
                os.close(fd)
                return m
            self._drop(key)
            try:
                mm, t = map_file(fd, size)  # once per mapping
            except BaseException:
                os.close(fd)
                raise
            m = self._maps[key] = _Map(mm, fd, t, size)
            while len(self._maps) > self.limit:
                self._drop(next(iter(self._maps)))
            return m

    def write(self, path: str, size: int, items: list, key: object = None) -> np.ndarray:
        """Write `items` [(offset, nbytes, tensor or bytes-like)] into file `path` of `size` bytes (BLOCK-aligned),
        zeros between them; returns the file's block sums. `key`: an object standing for this layout."""
        assert size % BLOCK == 0, size
        if size == 0:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
            return np.zeros(0, dtype="<i8")
        m = self._map(path, size)
        if key is None or m.key is not key:  # else the layout `key` stands for is the one mapped (no re-hash)
            m.key = key
            sig = tuple(
                (off, n, src.dtype, tuple(src.shape)) if isinstance(src, torch.Tensor) else (off, n)
                for off, n, src in items
            )
            if m.sig != sig:  # a new layout (or a reused file of another one): padding must read as zeros
                m.t.zero_()
                m.views = [
                    m.t[off : off + n].view(src.dtype).view(src.shape)
                    if isinstance(src, torch.Tensor) and n
                    else m.t[off : off + n]
                    for off, n, src in items
                ]
                m.sig = sig
        dst, src = [], []
        for v, (_off, n, s) in zip(m.views, items):
            if not n:
                continue
            if isinstance(s, torch.Tensor):
                dst.append(v)
                src.append(s if s.device.type == "cpu" else s.cpu())
            else:
                v.copy_(torch.frombuffer(s, dtype=torch.uint8))
        if dst:
            # one memcpy per item, no Python per byte (torch's batched copy, not in its public stubs)
            torch._foreach_copy_(dst, src)  # pyright: ignore[reportPrivateImportUsage]
        return tensor_block_sums(m.t).numpy()

    def unlinked_bytes(self) -> int:
        """Bytes of kept mappings whose file was deleted meanwhile: their pages stay until dropped (next write)."""
        with self._lock:
            return sum(m.size for m in self._maps.values() if os.fstat(m.fd).st_nlink == 0)

    def forget(self, path) -> None:
        """Drop the mapping of a file about to be deleted (no-op when there is none)."""
        try:
            st = os.stat(path)
        except OSError:
            return
        with self._lock:
            self._drop((st.st_dev, st.st_ino))
