"""Slot buffers that are views of mapped data files in node-local shared memory (`<run>/.slots/<writer>/`, each laid
out as its raw DCP data file): the snapshot copy IS the persist, a hard link into the window plus one summing pass.
A set is reused only when none of its files has another link, so no window still committed, written, uploaded or
pushed is overwritten. `FileSlotPool` (capture/file_slot_pool.py) is the slot allocator over these files (CPU with
the host tier; opt-in on CUDA, `host_buffers="shm-registered"`: docs/gpu.md).
"""

from __future__ import annotations

import os
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.slot import Slot, build_slot
from .checksums import BLOCK
from .layout import slots_dir
from .mapped_files import map_file


@dataclass
class Backing:
    """The mapped data file a slot's buffers are views of (`Slot.backing`, typed in core by `SlotBacking`)."""

    path: str
    fd: int
    t: torch.Tensor  # uint8 view of the whole file (keeps the mapping alive)
    finalizer: weakref.finalize | None = None  # unlinks the name and closes the fd when the slot dies
    unregister: Callable[[], None] | None = None  # undoes a cudaHostRegister of the mapping (opt-in, CUDA)

    def free(self) -> bool:
        """No window directory links this file, and nobody cut it short (writing past the end would be a SIGBUS)."""
        st = os.fstat(self.fd)
        if st.st_nlink != 1 or st.st_size != self.t.numel():
            return False
        try:  # the one link left must be our own name (not a window's, after someone removed ours)
            return os.stat(self.path).st_ino == st.st_ino
        except OSError:
            return False

    @property
    def reused(self) -> bool:
        """The file went to another slot (`SlotFiles.build_slot` took it from a spare set)."""
        return self.finalizer is not None and not self.finalizer.alive


def _release(path: str, fd: int, unregister=None) -> None:
    if unregister is not None:
        unregister()
    try:
        os.unlink(path)
    except OSError:
        pass
    os.close(fd)


class SlotFiles:
    def __init__(self, run_dir: str | Path, writer: str, register=None):
        """`register(t)`: page-lock the mapping `t` for device copies, returns the undo (opt-in, CUDA)."""
        self.dir = Path(run_dir) / slots_dir(writer)
        self.register = register
        self.created, self.created_bytes = 0, 0  # files allocated (the rest were reused)
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
        """A slot whose buffers are views of a mapped data file laid out like its raw DCP data file: the smallest
        large-enough file of `spare` (free files of other plans' slots; only the padding is zeroed), else a new one."""
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
        if spare is not None and reuse is not None:
            spare.remove(reuse)
            if reuse.finalizer is not None:
                reuse.finalizer.detach()  # the file now belongs to the new slot
            if reuse.unregister is not None:
                reuse.unregister()  # its mapping is replaced below
            path, fd = reuse.path, reuse.fd
        else:
            path = str(self.dir / f"{uuid.uuid4().hex}.distcp")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            self.created += 1
            self.created_bytes += size
        it = iter(offsets)

        def alloc(shape, dtype) -> torch.Tensor:
            off, n, shp, dt = next(it)
            assert shp == tuple(shape) and dt == dtype
            return base[off : off + n].view(dtype).view(shape)

        try:  # a reused file shrinks to this layout (its tail pages are freed); a new one is allocated whole
            _, base = map_file(fd, size, allocate=reuse is None)
            if reuse is not None:  # the padding between items must read as zeros (the checksums cover it)
                ends = [off + n for off, n, _, _ in offsets]
                for a, b in zip(ends, [off for off, _, _, _ in offsets[1:]] + [size]):
                    base[a:b].zero_()
            slot = build_slot(index, active, frozen, ops, compute_dtype, alloc=alloc)
            unreg = self.register(base) if self.register is not None else None
        except BaseException:
            # not mapped or not page-locked: the file goes, the allocator takes an arena for this plan
            _release(path, fd)
            raise
        slot.backing = Backing(path, fd, base, weakref.finalize(slot, _release, path, fd, unreg), unreg)
        return slot

    def build(self, plan, ops: dict, compute_dtype: torch.dtype, recycle: Sequence[list[Slot]] = ()) -> list[Slot]:
        """The slots of a window plan; files of the free sets in `recycle` are reused (those sets are spent)."""
        spare = [b for slots in recycle for b in map(backing, slots) if b is not None and b.free()]
        return [self.build_slot(i, sp.active, sp.frozen, ops, compute_dtype, spare) for i, sp in enumerate(plan.slots)]


def backing(slot: Slot) -> Backing | None:
    """`slot.backing` as the Backing this module set (what recycling its file needs beyond `SlotBacking`)."""
    b = slot.backing
    return b if isinstance(b, Backing) else None
