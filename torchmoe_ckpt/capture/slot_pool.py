"""Slot buffers: the allocator contract (`SlotAllocator`; `slot_alloc.make_slot_allocator` picks one), the base
the allocators share (`SlotPoolBase`) and the arena allocator (`ArenaSlotPool`).

A *set* (one window's W slots) is ONE allocation (an arena, pinned on CUDA) carved into *groups*: an operator's
items for one slot, or one tensor's 0-dim states. A new plan re-assembles a free set from its own groups, carving
only missing ones. Pinning is slow (~3 s for 8 GiB), so `prepare` allocates the next window's set on a helper
thread, and a pinned set larger than a new plan needs is kept (freeing it would synchronise the device). When W
grows (a larger set), the checkpointer prepares for the next window's plan (`WindowPlanner.next_plan`: its W is
proposed a window ahead), so the new arena is pinned on the helper a window early, not on the training thread at
the window start (which would also hand the old arena back: `_host_emptyCache`, a device-wide sync).
`alloc_count` says which thread allocated.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..core.operator import Operator, Piece
from ..core.plan import WindowPlan
from ..core.slot import Slot, SlotItem, compute_specs, full_specs

Group = tuple[list[SlotItem], int]  # (items, bytes)
ALIGN = 64  # bytes: every item view starts at a multiple (any dtype may view it; vectorised copies stay aligned)
PAGE = 4096  # what a file system (tmpfs) allocates a file in
HEADROOM = 1 / 8  # spare capacity of a plain arena, for the groups a reorder adds without a new arena


def signature(plan: WindowPlan) -> tuple:
    """What makes two plans' slots identical (the same operators in the same slots)."""
    return tuple((s.active, s.frozen) for s in plan.slots)


def pageup(n: int, page: int = PAGE) -> int:
    return (int(n) + page - 1) // page * page


class SlotAllocator(Protocol):
    """The slot-buffer allocator contract: where a window's W slots (host buffers) come from, and when they can be
    written over again. `slot_alloc.make_slot_allocator` picks one per checkpointer (`ArenaSlotPool` or
    `FileSlotPool`); both build on `SlotPoolBase`.

    Call order (one allocator per SparseCheckpointer; "T": the training thread, "M": any thread that reads the
    host-memory account, e.g. the status line; the allocator's own lock makes M's reads safe):

    1. (T, at a window start, with a host_memory_limit) `HostMemory.before_window` asks `has_free(plan)`, else
       `set_bytes(plan)` (the new set's bytes); when those would pass the limit it calls `trim()` (every free set
       given back) before refusing.
    2. (T) `slots_for(plan)`: the new window's slots, a free set re-assembled or a new one allocated.
    3. (T) `prepare(plan, room)`: the next window's set allocated ahead on a helper thread when none would be
       free and `room(nbytes)` (HostMemory.room_for) allows; `preparing` says whether that helper is still at
       it. `slot_bytes(slots)`: the bytes each copy of the new window moves.
    4. (T, when the checkpointer drops a window) `release(slots, ticket)`: the persist thread still reads them
       until it is past `ticket` (None: every job queued so far); only then is the set free for step 2.
    5. (M, at any time) `host_bytes()`, `files()` and the counters (`kind`, `allocations`, `prepared`,
       `alloc_seconds`, `alloc_count`): what the allocator holds, for host_memory.py.
    6. (T, once, at the end) `close()`: the helper joined, the sets let go.

    Before step 1, once (T, in the checkpointer's constructor): `reserve(plan, count, room)` may build `count`
    free sets of `plan` before training starts (the dense snapshot's, when the policy may take one).
    """

    kind: str  # "pinned-arena" | "plain-arena" | "shm-files": what the sets are
    allocations: int  # new memory allocated (arenas, or slot files): 0 per window in steady state
    prepared: int  # sets allocated ahead by `prepare`, off the training thread
    alloc_seconds: dict[str, float]  # time spent allocating, by thread ("training_thread", "helper")
    alloc_count: dict[str, int]  # allocations by thread: the helper's when W grows (prepared a window ahead)

    def slots_for(self, plan: WindowPlan) -> list[Slot]:
        """The slots of a new window with this plan."""
        ...

    def release(self, slots: list[Slot], ticket: int | None = None) -> None:
        """`slots`' window was dropped; the writer reads them until past `ticket` (None: every job queued so far)."""
        ...

    def slot_bytes(self, slots: list[Slot]) -> list[int]:
        """This rank's bytes per slot (what each copy moves)."""
        ...

    def set_bytes(self, plan: WindowPlan) -> int:
        """Host bytes one set for `plan` holds."""
        ...

    def has_free(self, plan: WindowPlan) -> bool:
        """Whether a window start with `plan` would reuse a set (allocate nothing)."""
        ...

    def trim(self) -> int:
        """Drop every free set (memory pressure); returns the bytes given back."""
        ...

    def prepare(self, plan: WindowPlan, room: Callable[[int], bool] | None = None) -> bool:
        """Allocate the next window's set off the training thread if `room(nbytes)` allows; returns whether an
        allocation started."""
        ...

    @property
    def preparing(self) -> bool:
        """A set is being allocated ahead (`prepare`), off the training thread."""
        ...

    def reserve(self, plan: WindowPlan, count: int, room: Callable[[int], bool] | None = None) -> int:
        """Build up to `count` free sets of `plan` now, each while `room(nbytes)` allows; returns how many."""
        ...

    def host_bytes(self) -> dict[str, int]:
        """What it holds, {part: bytes}, for host_memory.py."""
        ...

    def files(self) -> set[tuple[int, int]]:
        """(device, inode) of the files the sets are (shm-files), so that they are not counted twice."""
        ...

    def close(self) -> None:
        """The checkpointer is done: join the helper thread, if any, and let the sets go."""
        ...


class SlotPoolBase(SlotAllocator):
    """What every `SlotAllocator` shares: the defaults of the optional steps (`prepare`, `preparing`, `files`,
    `close`), the counters, and the reuse bookkeeping (a released set is reusable once the writer is past its
    ticket; a lock for readers on other threads). Subclasses add `slots_for`, `release`, `set_bytes`, `has_free`,
    `trim` and `host_bytes`."""

    kind = "?"  # "pinned-arena" | "plain-arena" | "shm-files": what the sets are

    def __init__(self, writer=None):
        self.writer = writer  # the persist thread (ticket() / done(ticket)) or None
        self.lock = threading.RLock()
        self.allocations = 0  # new memory allocated (arenas, or slot files): 0 per window in steady state
        self.allocated_bytes = 0
        self.prepared = 0  # sets allocated ahead by `prepare`, off the training thread
        self.alloc_seconds = {"training_thread": 0.0, "helper": 0.0}  # time spent allocating, by thread
        self.alloc_count = {"training_thread": 0, "helper": 0}  # allocations (arenas, slot files), by thread

    def slot_bytes(self, slots: list[Slot]) -> list[int]:
        """This rank's bytes per slot (what each copy moves)."""
        return [sl.nbytes for sl in slots]

    def prepare(self, plan: WindowPlan, room: Callable[[int], bool] | None = None) -> bool:
        """Allocate the next window's set off the training thread if `room(nbytes)` allows; returns whether an
        allocation started (allocators that allocate quickly do nothing)."""
        return False

    @property
    def preparing(self) -> bool:
        """A set is being allocated ahead (`prepare`), off the training thread."""
        return False

    def reserve(self, plan: WindowPlan, count: int, room: Callable[[int], bool] | None = None) -> int:
        """Build up to `count` free sets of `plan` before training (allocators whose first use is cheap build
        none)."""
        return 0

    def close(self) -> None:
        """The checkpointer is done: join the helper thread, if any, and let the sets go."""

    def files(self) -> set[tuple[int, int]]:
        """(device, inode) of the files the sets are (shm-files), so that they are not counted twice."""
        return set()

    def _ticket(self, ticket: int | None = None) -> int:
        """The ticket a released set waits for: the one given, else the writer's latest job (0: no writer)."""
        if ticket is not None:
            return ticket
        if self.writer is None:
            return 0
        return self.writer.ticket()

    def _writer_done(self, ticket: int | None) -> bool:
        return ticket is not None and (self.writer is None or self.writer.done(ticket))


def arena_bytes(need: int, pin: bool) -> int:
    """An arena's capacity: pinned, the caching host allocator's power-of-two block (all of it is used); plain,
    `need` plus the headroom."""
    if pin:
        return 1 << max(0, int(need) - 1).bit_length()
    return int(need * (1 + HEADROOM)) + ALIGN


class Arena:
    """One allocation a slot set's buffers are views of, carved front to back."""

    def __init__(self, need: int, pin: bool):
        self.t = torch.empty(max(arena_bytes(need, pin), ALIGN), dtype=torch.uint8, pin_memory=pin)
        self.capacity, self.used = self.t.numel(), 0

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor | None:
        n = torch.Size(shape).numel() * dtype.itemsize
        off = (self.used + ALIGN - 1) // ALIGN * ALIGN
        if off + n > self.capacity:
            return None
        self.used = off + n
        return self.t[off : off + n].view(dtype).view(shape)


class _Full(Exception):
    """The arena of a set cannot hold the groups a plan needs."""


@dataclass(eq=False)  # compared by identity (list.remove): its fields hold tensors
class _Set:
    arena: Arena
    groups: dict[tuple, list[Group]] = field(default_factory=dict)  # every group carved in the arena
    slots: list[Slot] = field(default_factory=list)  # the current assembly
    sig: tuple | None = None
    nbytes: list[int] = field(default_factory=list)  # per slot
    ticket: int | None = None  # None: in use by a window


class ArenaSlotPool(SlotPoolBase):
    def __init__(self, ops: dict[str, Operator], compute_dtype: torch.dtype, pin_memory: bool = False, writer=None):
        super().__init__(writer)
        self.ops, self.compute_dtype, self.pin_memory = ops, compute_dtype, pin_memory
        self.kind = "pinned-arena" if pin_memory else "plain-arena"
        self.sets: list[_Set] = []
        # (form, op) -> full/compute: [(key, role, piece, shape, dtype)]; scalar: [(fqn, piece, [(key, dtype)])]
        self._specs: dict[tuple[str, str], list[tuple]] = {}
        self._bytes: dict[tuple[str, str, int], int] = {}  # (form, name, alignment) -> group bytes
        self._shape_memo: dict[tuple[str, str], list[tuple]] = {}  # (form, name) -> [(shape, dtype)] of its items
        self.new_memory_groups = 0  # groups carved in newly allocated arenas
        self._spare: threading.Thread | None = None  # allocating a set for the next window (prepare)
        self._spare_bytes = 0  # what it allocates: counted as held from the start
        self._taken: _Set | None = None  # the set the last window start handed out
        self._need_memo: tuple[tuple | None, int] = (None, 0)  # (signature, set_need) of the last plan priced

    def slots_for(self, plan: WindowPlan) -> list[Slot]:
        sig = signature(plan)
        self._join_spare()
        with self.lock:
            free = [s for s in self.sets if self._writer_done(s.ticket)]
            s = next((s for s in free if s.sig == sig), None)
            if s is None:
                need = self.set_need(plan)
                fits = [s for s in free if self._serves(s.arena.capacity, need)]
                s = min(fits, key=lambda s: s.arena.capacity, default=None)
                if s is None and free:  # no free set of a fitting size: the largest one gets a new arena
                    s = max(free, key=lambda s: s.arena.capacity)
                    self._new_arena(s, need)
                elif s is None:
                    s = _Set(self._alloc(need))
                    self.sets.append(s)
                try:
                    self._assemble(s, plan)
                except _Full:  # a reorder needs groups the arena has no room left for
                    self._new_arena(s, need)
                    self._assemble(s, plan)
                s.sig = sig
            s.ticket = None
            self._taken = s
            for other in [o for o in free if o is not s][1:]:  # keep at most one idle set
                self._drop(other)
            return s.slots

    def prepare(self, plan: WindowPlan, room: Callable[[int], bool] | None = None) -> bool:
        """Only when no set but the one just handed out would serve `plan`; the bytes count as held from now."""
        need = self.set_need(plan)
        with self.lock:
            if self._spare is not None or any(  # another set (the last window's, soon released) will do
                s is not self._taken and self._serves(s.arena.capacity, need) for s in self.sets
            ):
                return False
        nbytes = self.set_bytes(plan)
        if room is not None and not room(nbytes):
            return False
        with self.lock:
            self._spare_bytes = nbytes
            self._spare = threading.Thread(target=self._allocate_spare, args=(need,), name="tmoe-slot-alloc")
            self._spare.daemon = True  # close() joins it; an interpreter exit mid-allocation must not hang
            self._spare.start()
            return True

    def _allocate_spare(self, need: int) -> None:
        try:
            arena = self._alloc(need, "helper")
        except Exception:  # out of pinned memory: the window start allocates, and reports it
            arena = None
        with self.lock:
            if arena is not None:
                self.sets.append(_Set(arena, ticket=0))  # free: nothing was ever written from it
                self.prepared += 1
            self._spare_bytes = 0

    @property
    def preparing(self) -> bool:
        t = self._spare
        return t is not None and t.is_alive()

    def _join_spare(self) -> None:
        t = self._spare
        if t is not None:
            t.join()  # normally long done: it started a whole window ago
            self._spare = None

    def close(self) -> None:
        self._join_spare()
        with self.lock:
            held, self.sets, self._taken = bool(self.sets), [], None
        if held:  # pinned: back to the system, or the caching host allocator keeps every block for good
            _return_pinned(self.pin_memory)

    def _serves(self, capacity: int, need: int) -> bool:
        """Large enough, and a plain one at most twice too large (a pinned one is kept whatever its size)."""
        return need <= capacity and (self.pin_memory or capacity <= 2 * max(need, 1) + ALIGN)

    def _holding(self, slots: list[Slot]) -> list[_Set]:
        return [s for s in self.sets if s.slots and slots and s.slots[0] is slots[0]]

    def release(self, slots: list[Slot], ticket: int | None = None) -> None:
        with self.lock:
            for s in self._holding(slots):
                if s.ticket is None:
                    s.ticket = self._ticket(ticket)

    def slot_bytes(self, slots: list[Slot]) -> list[int]:
        held = self._holding(slots)
        return list(held[0].nbytes) if held else super().slot_bytes(slots)

    def set_bytes(self, plan: WindowPlan) -> int:
        return arena_bytes(self.set_need(plan), self.pin_memory)

    def has_free(self, plan: WindowPlan) -> bool:
        need = self.set_need(plan)
        self._join_spare()
        with self.lock:
            return any(self._writer_done(s.ticket) and s.arena.capacity >= need for s in self.sets)

    def trim(self) -> int:
        self._join_spare()
        with self.lock:
            free = [s for s in self.sets if self._writer_done(s.ticket)]
            for s in free:
                self._drop(s)
            return sum(s.arena.capacity for s in free)

    def host_bytes(self) -> dict[str, int]:
        with self.lock:
            return {"slot_sets": sum(s.arena.capacity for s in self.sets) + self._spare_bytes}

    def set_need(self, plan: WindowPlan, align: int = ALIGN) -> int:
        """Bytes `plan`'s groups take, items at multiples of `align` (the last plan's figure is kept)."""
        sig = signature(plan) if align == ALIGN else None
        if sig is not None and self._need_memo[0] == sig:
            return self._need_memo[1]
        total = sum(self._group_bytes(form, name, align) for sp in plan.slots for form, name in self._groups(sp))
        if sig is not None:
            self._need_memo = (sig, total)
        return total

    def file_bytes(self, plan: WindowPlan, block: int) -> int:
        """`plan`'s slots as data files: items at multiples of `block`, each file at least one block, whole pages."""
        return sum(
            pageup(max(self.set_need(WindowPlan((sp,), plan.budget_bytes, plan.fits, plan.order), block), block))
            for sp in plan.slots
        )

    def item_counts(self, plan: WindowPlan) -> list[int]:
        """Items per slot of `plan` (what a slot's metadata lists)."""
        return [sum(len(self._shapes(form, name)) for form, name in self._groups(sp)) for sp in plan.slots]

    def _groups(self, sp) -> list[tuple[str, str]]:
        """(form, name) of a slot's groups: full states, 0-dim states (once per tensor), compute weights."""
        fqns = dict.fromkeys(fqn for a in sp.active for fqn, _, _ in self._spec("scalar", a))
        return [("full", a) for a in sp.active] + [("scalar", f) for f in fqns] + [("compute", f) for f in sp.frozen]

    def _alloc(self, need: int, thread: str = "training_thread") -> Arena:
        t0 = time.perf_counter()
        a = Arena(need, self.pin_memory)
        with self.lock:
            self.allocations += 1
            self.allocated_bytes += a.capacity
            self.alloc_seconds[thread] += time.perf_counter() - t0
            self.alloc_count[thread] += 1
        return a

    def _new_arena(self, s: _Set, need: int) -> None:
        s.arena, s.groups, s.slots, s.sig = self._alloc(need), {}, [], None
        _return_pinned(self.pin_memory)

    def _drop(self, s: _Set) -> None:
        self.sets.remove(s)
        s.slots, s.groups = [], {}
        _return_pinned(self.pin_memory)

    def _assemble(self, s: _Set, plan: WindowPlan) -> None:
        fresh = s.arena.used == 0
        avail = {k: list(v) for k, v in s.groups.items()}  # this set's groups, all free
        slots, sizes = [], []
        for i, sp in enumerate(plan.slots):
            groups: list[Group] = []
            first: dict[str, tuple[Piece, str, list]] = {}  # 0-dim states: the tensor's first piece in slot order
            for name in sp.active:
                for fqn, pc, sc in self._spec("scalar", name):
                    first.setdefault(fqn, (pc, name, sc))
                groups.append(self._take(s, avail, "full", name, fresh))
            for fqn, (pc, name, sc) in first.items():
                g = self._take(s, avail, "scalar", fqn, fresh, pc, sc)
                for it, (k, _dt) in zip(g[0], sc):
                    it.key, it.piece, it.op = f"optim.{fqn}.{k}", pc, name
                groups.append(g)
            for name in sp.frozen:
                groups.append(self._take(s, avail, "compute", name, fresh))
            items = [it for its, _ in groups for it in its]
            slots.append(Slot(i, tuple(sp.active), tuple(sp.frozen), items))
            sizes.append(sum(n for _, n in groups))
        s.slots, s.nbytes = slots, sizes

    def _take(  # noqa: PLR0913  (a group's whole address: set, free groups, form, name, and the 0-dim extras)
        self,
        s: _Set,
        avail: dict,
        form: str,
        name: str,
        fresh: bool,
        piece: Piece | None = None,
        scalars: list[tuple[str, torch.dtype]] | None = None,
    ) -> Group:
        specs: list[tuple] = []
        scalars = scalars or []  # "scalar" only: the tensor's 0-dim states, [(key, dtype)]
        if form == "scalar":  # `name` is the tensor's fqn; its items are relabelled by the caller
            key = ("scalar",) + tuple(scalars)
        else:
            specs = self._spec(form, name)
            key = ("full", name) if form == "full" else ("compute",) + tuple((sh, dt) for _, _, _, sh, dt in specs)
        free = avail.get(key)
        if free:
            g = free.pop()
            if form == "compute":
                for it, (k, role, pc, _sh, _dt) in zip(g[0], specs):
                    it.key, it.role, it.piece, it.op = k, role, pc, name
            return g
        if form == "scalar":
            made = [(f"optim.{name}.{k}", k, "", piece, (), dt) for k, dt in scalars]
        else:
            made = [(k, role, name, pc, sh, dt) for k, role, pc, sh, dt in specs]
        items = []
        for k, role, op, pc, sh, dt in made:
            buf = s.arena.take(sh, dt)
            if buf is None:
                raise _Full
            items.append(SlotItem(k, role, op, pc, buf))  # pyright: ignore[reportArgumentType]  (piece: set for "scalar")
        g = (items, sum(it.nbytes for it in items))
        s.groups.setdefault(key, []).append(g)
        self.new_memory_groups += fresh
        return g

    def _spec(self, form: str, name: str) -> list[tuple]:
        if (form, name) not in self._specs:
            op = self.ops[name]
            got = compute_specs(op, self.compute_dtype) if form == "compute" else full_specs(op)[form == "scalar"]
            self._specs[(form, name)] = got
        return self._specs[(form, name)]

    def _shapes(self, form: str, name: str) -> list[tuple]:
        """[(shape, dtype)] of a group's items; for "scalar" `name` is a tensor's fqn (from an operator that has it)."""
        key = (form, name)
        if key not in self._shape_memo:
            if form == "scalar":
                sc = next(sc for o in self.ops for fqn, _, sc in self._spec("scalar", o) if fqn == name)
                self._shape_memo[key] = [((), dt) for _, dt in sc]
            else:
                self._shape_memo[key] = [(sh, dt) for _, _, _, sh, dt in self._spec(form, name)]
        return self._shape_memo[key]

    def _group_bytes(self, form: str, name: str, align: int) -> int:
        if (form, name, align) not in self._bytes:
            shapes = self._shapes(form, name)
            self._bytes[(form, name, align)] = sum(
                (math.prod(sh) * dt.itemsize + align - 1) // align * align for sh, dt in shapes
            )
        return self._bytes[(form, name, align)]


def _return_pinned(pinned: bool) -> None:
    """Hand the caching host allocator's free blocks back to the system after a pinned arena was dropped."""
    if pinned:
        empty = getattr(torch._C, "_host_emptyCache", None)  # CUDA only
        if empty is not None:
            import gc

            gc.collect()  # the dropped views must be gone for the block to be free
            empty()
