"""The slot allocator over the shared-memory slot files of storage_format/slot_files.py: a set is one file per slot,
reused once the persist thread is past it and no window links its files (CPU with the host tier; opt-in on CUDA,
`host_buffers="shm-registered"`: docs/gpu.md)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..core.plan import WindowPlan
from ..core.slot import Slot
from ..storage_format.checksums import BLOCK
from ..storage_format.slot_files import Backing, SlotFiles, backing
from .slot_pool import ArenaSlotPool, SlotPoolBase, signature

log = logging.getLogger("torchmoe_ckpt.slot_files")
RESERVE_HEADROOM = 4  # reserve: free bytes the file system must keep, in sets (the node's other ranks, small files)
MAX_SETS = 8  # sets kept without a host-memory limit: current, committed, still linked, one being collected


def _backings(sets) -> list[Backing]:
    return [b for s in sets for b in map(backing, s.slots) if b is not None]


@dataclass(eq=False)  # compared by identity (list.remove): its fields hold tensors
class _FileSet:
    slots: list[Slot]
    sig: tuple
    nbytes: list[int] = field(default_factory=list)  # per slot (the items' bytes)
    ticket: int | None = None  # None: in use by a window


class FileSlotPool(SlotPoolBase):
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
            try:
                slots = self._new_set(plan, sig, free).slots
            except OSError as exc:  # shared memory full or read-only: train on, the host tier reports its state
                log.debug("slot files not allocated (%s): slots in plain memory for this plan", exc)
                return self.fallback.slots_for(plan)
            finally:  # a free set any of whose files went to the new plan is spent
                for f in free:
                    if any(b.reused for b in _backings([f])):
                        self.sets.remove(f)
            while len(self.sets) > self.max_sets:  # the oldest released set goes (a window linking it keeps it)
                old = [f for f in self.sets if f.ticket is not None]
                if not old:
                    break
                self.sets.remove(next((f for f in old if self._free(f)), old[0]))
            return slots

    def reserve(self, plan: WindowPlan, count: int, room: Callable[[int], bool] | None = None) -> int:
        """`count` free sets of `plan`'s slot files, allocated and mapped in now (before training: a set built at a
        window start maps its pages in on the training thread, ~0.5 s per 133 MB under training here, against ~0.03 s
        before the loop). Each only while `room(nbytes)` (HostMemory.room_for) allows; stops at the first one shared
        memory refuses (the window start then falls back as it always does), and while the file system keeps
        RESERVE_HEADROOM times the set free (other ranks of the node reserve too; windows need their small files)."""
        built = 0
        nbytes = self.set_bytes(plan)
        sig = signature(plan)
        for _ in range(min(count, self.max_sets)):
            if room is not None and not room(nbytes):
                break
            try:
                st = os.statvfs(self.slot_files.dir)
            except OSError:
                break
            if st.f_bavail * st.f_frsize < RESERVE_HEADROOM * nbytes:
                log.debug(
                    "slot files not reserved: %d bytes free on %s", st.f_bavail * st.f_frsize, self.slot_files.dir
                )
                break
            with self.lock:
                try:
                    self._new_set(plan, sig, ahead=True)
                except OSError as exc:
                    log.debug("slot files not reserved (%s)", exc)
                    break
            built += 1
        return built

    def _new_set(
        self, plan: WindowPlan, sig: tuple, recycle: list[_FileSet] | None = None, ahead: bool = False
    ) -> _FileSet:
        """A new set of `plan`'s slot files, taking free files of the `recycle` sets, and what it allocated counted
        (slots_for's and reserve's one bookkeeping). `ahead`: reserved before training, free (ticket 0: never
        written); else in use by the window starting now. OSError when shared memory refuses (nothing counted)."""
        before = self.slot_files.created, self.slot_files.created_bytes
        slots = self.slot_files.build(plan, self.ops, self.compute_dtype, [f.slots for f in recycle or ()])
        if self.slot_files.created != before[0]:
            self.allocations += 1
            self.allocated_bytes += self.slot_files.created_bytes - before[1]
            if not ahead:
                self.alloc_count["training_thread"] += 1  # slot files are built at the window start
        if ahead:
            self.prepared += 1
        s = _FileSet(slots, sig, [sl.nbytes for sl in slots], ticket=0 if ahead else None)
        self.sets.append(s)
        return s

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
