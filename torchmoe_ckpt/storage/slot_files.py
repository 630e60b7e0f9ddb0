"""Slot buffers that are views of mapped data files in node-local shared memory (`<run>/.slots/<writer>/`, each laid
out as its raw DCP data file): the snapshot copy IS the persist, a hard link into the window plus one summing pass.
A set is reused only when none of its files has another link, so no window still committed, written, uploaded or
pushed is overwritten. `FileSlotPool` is the slot allocator over these files (CPU with the host tier; opt-in on CUDA,
`host_buffers="shm-registered"`: docs/gpu.md).
"""

from __future__ import annotations

import logging
import os
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..schedule import WindowPlan
from ..slot_pool import ArenaSlotPool, SlotAllocator, signature
from ..snapshot import Slot, build_slot
from .checksums import BLOCK
from .layout import slots_dir
from .mapped_files import map_file

log = logging.getLogger("torchmoe_ckpt.slot_files")
MAX_SETS = 8  # sets kept without a host-memory limit: current, committed, still linked, one being collected


@dataclass
class Backing:
    """The mapped data file a slot's buffers are views of."""

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
        if reuse is not None:
            spare.remove(reuse)
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

    def build(self, plan, ops: dict, compute_dtype: torch.dtype, recycle: list[list[Slot]] = ()) -> list[Slot]:
        """The slots of a window plan; files of the free sets in `recycle` are reused (those sets are spent)."""
        spare = [b for slots in recycle for b in map(backing, slots) if b is not None and b.free()]
        return [self.build_slot(i, sp.active, sp.frozen, ops, compute_dtype, spare) for i, sp in enumerate(plan.slots)]


def backing(slot: Slot) -> Backing | None:
    return getattr(slot, "backing", None)


def _backings(sets) -> list[Backing]:
    return [b for s in sets for b in map(backing, s.slots) if b is not None]


@dataclass(eq=False)  # compared by identity (list.remove): its fields hold tensors
class _FileSet:
    slots: list[Slot]
    sig: tuple
    nbytes: list[int] = field(default_factory=list)  # per slot (the items' bytes)
    ticket: int | None = None  # None: in use by a window


class FileSlotPool(SlotAllocator):
    """The slot allocator over shared-memory slot files (a set = one file per slot). A released set is reused once
    the persist thread is past it and no window links its files; a new plan takes the free sets' files. When shared
    memory cannot be allocated, that plan's slots come from a plain arena (the host tier copies them into files)."""

    kind = "shm-files"

    def __init__(
        self,
        files: SlotFiles,
        ops: dict,
        compute_dtype: torch.dtype,
        writer=None,
        max_sets: int = MAX_SETS,
        pin_fallback: bool = False,
    ):
        super().__init__(writer)
        self.slot_files, self.ops, self.compute_dtype, self.max_sets = files, ops, compute_dtype, max_sets
        self.sets: list[_FileSet] = []
        self.fallback = ArenaSlotPool(ops, compute_dtype, pin_fallback, writer)  # shared memory full or read-only
        self._sizes: dict[tuple, int] = {}

    def close(self) -> None:
        self.fallback.close()

    def _free(self, s: _FileSet) -> bool:
        return self._writer_done(s.ticket) and all(b.free() for b in _backings([s]))

    def slots_for(self, plan: WindowPlan) -> list[Slot]:
        sig = signature(plan)
        with self.lock:
            free = [s for s in self.sets if self._free(s)]
            s = next((s for s in free if s.sig == sig), None)
            if s is not None:
                s.ticket = None
                return s.slots
            before = self.slot_files.created, self.slot_files.created_bytes
            try:
                slots = self.slot_files.build(plan, self.ops, self.compute_dtype, [f.slots for f in free])
            except OSError as exc:  # shared memory full or read-only: train on, the host tier reports its state
                log.debug("slot files not allocated (%s): slots in plain memory for this plan", exc)
                return self.fallback.slots_for(plan)
            finally:  # a free set any of whose files went to the new plan is spent
                for f in free:
                    if any(not b.finalizer.alive for b in _backings([f])):
                        self.sets.remove(f)
            if self.slot_files.created != before[0]:
                self.allocations += 1
                self.allocated_bytes += self.slot_files.created_bytes - before[1]
            self.sets.append(_FileSet(slots, sig, [sl.nbytes for sl in slots]))
            while len(self.sets) > self.max_sets:  # the oldest released set goes (a window linking it keeps it)
                old = [f for f in self.sets if f.ticket is not None]
                if not old:
                    break
                self.sets.remove(next((f for f in old if self._free(f)), old[0]))
            return slots

    def release(self, slots: list[Slot], ticket: int | None = None) -> None:
        with self.lock:
            s = self._set_of(slots)
            if s is not None and s.ticket is None:
                s.ticket = self._ticket(ticket)
                return
        self.fallback.release(slots, ticket)

    def _set_of(self, slots: list[Slot]) -> _FileSet | None:
        return next((s for s in self.sets if s.slots and slots and s.slots[0] is slots[0]), None)

    def slot_bytes(self, slots: list[Slot]) -> list[int]:
        s = self._set_of(slots)
        return list(s.nbytes) if s is not None else self.fallback.slot_bytes(slots)

    def set_bytes(self, plan: WindowPlan) -> int:
        """The plan's slot files: every item at a BLOCK-aligned offset, each file at least one BLOCK."""
        sig = signature(plan)
        got = self._sizes.get(sig)
        if got is None:
            got = self._sizes[sig] = self.fallback.file_bytes(plan, BLOCK)
            if len(self._sizes) > 8:
                self._sizes.pop(next(iter(self._sizes)))
        return got

    def has_free(self, plan: WindowPlan) -> bool:
        """A free set of this plan, or free sets whose files are as large as the plan's (recycled whole)."""
        sig, need = signature(plan), self.set_bytes(plan)
        with self.lock:
            free = [s for s in self.sets if self._free(s)]
            held = sum(os.fstat(b.fd).st_blocks * 512 for b in _backings(free))
            return any(s.sig == sig for s in free) or held >= need or self.fallback.has_free(plan)

    def trim(self) -> int:
        with self.lock:
            free = [s for s in self.sets if self._free(s)]
            n = sum(b.t.numel() for b in _backings(free))
            for s in free:
                self.sets.remove(s)
            return n + self.fallback.trim()

    def host_bytes(self) -> dict[str, int]:
        """The sets' files as tmpfs holds them (allocated blocks), plus plain-memory sets."""
        with self.lock:
            n = sum(os.fstat(b.fd).st_blocks * 512 for b in _backings(self.sets))
            return {"slot_sets": n + self.fallback.host_bytes()["slot_sets"]}

    def files(self) -> set[tuple[int, int]]:
        with self.lock:
            return {(st.st_dev, st.st_ino) for st in (os.fstat(b.fd) for b in _backings(self.sets))}
