"""Slot buffers that are views of mapped data files in node-local shared memory: the snapshot copy IS the persist.

With the host tier on (CPU training), the checkpointer allocates each slot's buffers, once per window plan,
as views of one data file under `<run>/.slots/<writer>/`, laid out as the slot's raw DCP data file
(slot_format.py: items BLOCK-aligned, zero padding). The snapshot copy then writes the slot's bytes straight
into shared memory, and persisting the slot (HostTier.write_slot) is: hard-link that file into the window's
directory, one summing pass over it for the checksums, and the small per-save `.metadata` record.

Reuse is decided by the file system, so it stays right across threads, tiers and restarts: a slot file is
linked into a window directory from the moment its slot is persisted until the host tier collects that window
(HostTier.collect unlinks it instead of keeping it as a spare). A set of slot buffers may be handed to a new
window only when every one of its files has no other link (`free`): the last committed window, the window
being written, and windows kept for the uploader or being pushed to peers are never overwritten.
A new plan (another W, a reorder) takes the files of free sets of other plans (their pages are allocated
already; the file is cut to the new layout and its padding zeroed), so a plan change allocates no shared memory
on the training thread while such sets exist. A set whose slots die unlinks its names here (the window links keep
committed data readable); a new process
unlinks the names a previous one left (its committed windows stay readable through their window links, and
their memory comes back when they are collected).

Not used with pinned CUDA host buffers: pinning (cudaHostRegister) a file-backed shared mapping is not
reliably supported, and the async device-to-host copy needs page-locked memory to overlap.
"""

from __future__ import annotations

import os
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from ..snapshot import Slot, build_slot
from .checksums import BLOCK
from .layout import slots_dir
from .mapped_files import map_file


@dataclass
class Backing:
    """The mapped data file a slot's buffers are views of."""

    path: str
    fd: int
    t: torch.Tensor  # uint8 view of the whole file (keeps the mapping alive)
    finalizer: weakref.finalize | None = None  # unlinks the name and closes the fd when the slot dies

    def free(self) -> bool:
        """No window directory links this file (nothing committed or being written reads it), and nobody cut it
        short (writing a page past a truncated end of a mapping is a SIGBUS)."""
        st = os.fstat(self.fd)
        if st.st_nlink != 1 or st.st_size != self.t.numel():
            return False
        try:  # the one link left must be our own name (not a window's, after someone removed ours)
            return os.stat(self.path).st_ino == st.st_ino
        except OSError:
            return False


def _release(path: str, fd: int) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
    os.close(fd)


class SlotFiles:
    def __init__(self, run_dir: str | Path, writer: str):
        self.dir = Path(run_dir) / slots_dir(writer)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            for f in self.dir.glob("*.distcp"):  # a previous process's names (this rank's process is the only writer)
                f.unlink(missing_ok=True)
        except OSError:  # a read-only or full tier: build() fails too, and the checkpointer uses plain memory
            pass

    def build_slot(
        self,
        index: int,
        active: tuple,
        frozen: tuple,
        ops: dict,
        compute_dtype: torch.dtype,
        spare: list[Backing] | None = None,
    ) -> Slot:
        """A slot whose buffers are views of a mapped data file, laid out like its raw DCP data file: the smallest
        large-enough file of `spare` (free files of another plan's slots: their pages are allocated already,
        only the padding is zeroed), else a new one."""
        offsets: list[tuple[int, int, tuple, torch.dtype]] = []
        pos = 0

        def plan(shape, dtype) -> torch.Tensor:
            nonlocal pos
            n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            offsets.append((pos, n, tuple(shape), dtype))
            pos = (pos + n + BLOCK - 1) // BLOCK * BLOCK
            return torch.empty(shape, dtype=dtype, device="meta")

        build_slot(index, active, frozen, ops, compute_dtype, alloc=plan)
        size = max(pos, BLOCK)
        reuse = min((b for b in spare or () if b.t.numel() >= size), key=lambda b: b.t.numel(), default=None)
        if reuse is not None:
            spare.remove(reuse)
            reuse.finalizer.detach()  # the file now belongs to the new slot
            path, fd = reuse.path, reuse.fd
        else:
            path = str(self.dir / f"{uuid.uuid4().hex}.distcp")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:  # a reused file shrinks to this layout (its tail pages are freed); a new one is allocated whole
            _, base = map_file(fd, size, allocate=reuse is None)
        except BaseException:
            _release(path, fd)
            raise
        if reuse is not None:  # the padding between items must read as zeros (the checksums cover it)
            ends = [off + n for off, n, _, _ in offsets]
            for a, b in zip(ends, [off for off, _, _, _ in offsets[1:]] + [size]):
                base[a:b].zero_()
        it = iter(offsets)

        def alloc(shape, dtype) -> torch.Tensor:
            off, n, shp, dt = next(it)
            assert shp == tuple(shape) and dt == dtype
            return base[off : off + n].view(dtype).view(shape)

        slot = build_slot(index, active, frozen, ops, compute_dtype, alloc=alloc)
        slot.backing = Backing(path, fd, base, weakref.finalize(slot, _release, path, fd))
        return slot

    def build(self, plan, ops: dict, compute_dtype: torch.dtype, recycle: list[list[Slot]] = ()) -> list[Slot]:
        """The slots of a window plan; files of the free sets in `recycle` are reused (those sets are spent)."""
        spare = [b for slots in recycle for b in map(backing, slots) if b is not None and b.free()]
        return [self.build_slot(i, sp.active, sp.frozen, ops, compute_dtype, spare) for i, sp in enumerate(plan.slots)]


def backing(slot: Slot) -> Backing | None:
    return getattr(slot, "backing", None)


def all_free(slots: list[Slot]) -> bool:
    """Every slot's file is unlinked from every window (or the slots are plain memory)."""
    return all(b is None or b.free() for b in map(backing, slots))
