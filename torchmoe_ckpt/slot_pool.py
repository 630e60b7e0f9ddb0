"""Free slot buffers kept per operator, so a new window plan is assembled from whole groups of items.

A popularity reorder (or a new W) moves operators between slots; it does not change what any operator's
items are. Building a plan's slots item by item (~2,000 items on a 4 x 32-expert model) costs milliseconds of
Python on the training thread at every window start; here an operator's items for one slot -- its full state
(`"full"`: master weights, optimizer state, buffers) or its compute weights (`"compute"`) -- are one group,
taken and given back whole with their buffers. 0-dim optimizer states (step counters) are one group per tensor
(one counter is shared by the experts sliced from that tensor). Slots built here hold the same items as
`build_slot`'s (`snapshot.full_specs` says what a full copy holds).

    pool = SlotPool(ops, compute_dtype)
    slots = pool.build(plan)        # reuses given-back groups, allocates the rest once
    pool.give_back(old_window.slots)  # after that window can no longer be recovered from
"""

from __future__ import annotations

import weakref

import torch

from .operators import Operator, Piece
from .schedule import WindowPlan
from .snapshot import Slot, SlotItem, full_specs

Group = tuple[list[SlotItem], int]  # (items, bytes)


class SlotPool:
    def __init__(self, ops: dict[str, Operator], compute_dtype: torch.dtype, pin_memory: bool = False):
        self.ops, self.compute_dtype, self.pin_memory = ops, compute_dtype, pin_memory
        # Free groups by what makes them interchangeable: an operator's full state is its own (one per window);
        # compute groups of operators with the same layout (all experts of a layer) and step counters are
        # relabelled to the operator that takes them (a reorder changes how many compute copies each needs).
        self._free: dict[tuple, list[Group]] = {}
        self._specs: dict[tuple[str, str], list[tuple]] = {}  # (form, op) -> [(key, role, piece, shape, dtype)]
        self._scalars: dict[str, list[tuple]] = {}  # op -> [(fqn, piece, [(state key, dtype)])]
        # id(slot) -> (the slot, weakly: an id is reused once its slot is gone; its groups by pool key; its bytes)
        self._groups: dict[int, tuple[weakref.ref, list[tuple[tuple, Group]], int]] = {}
        self.allocated_groups = 0  # groups made with new buffers (the rest were reused)

    def build(self, plan: WindowPlan) -> list[Slot]:
        """This plan's slots. Free groups beyond what this plan used are let go (e.g. W went down)."""
        need: dict[tuple, int] = {}
        slots = []
        for i, sp in enumerate(plan.slots):
            groups: list[tuple[tuple, Group]] = []
            first: dict[str, tuple[Piece, str, list]] = {}  # 0-dim states: the tensor's first piece in slot order
            for name in sp.active:
                for fqn, pc, sc in self._scalar_spec(name):
                    first.setdefault(fqn, (pc, name, sc))
                groups.append(self._take("full", name, need))
            for fqn, (pc, name, sc) in first.items():
                key, g = self._take("scalar", fqn, need, pc, sc)
                for it, (k, _dt) in zip(g[0], sc):
                    it.key, it.piece, it.op = f"optim.{fqn}.{k}", pc, name
                groups.append((key, g))
            for name in sp.frozen:
                groups.append(self._take("compute", name, need))
            items: list[SlotItem] = []
            total = 0
            for _key, (its, n) in groups:
                items.extend(its)
                total += n
            slot = Slot(i, tuple(sp.active), tuple(sp.frozen), items)
            self._groups[id(slot)] = (weakref.ref(slot), groups, total)
            slots.append(slot)
        for key, free in self._free.items():
            del free[need.get(key, 0) :]
        return slots

    def give_back(self, slots: list[Slot]) -> None:
        """The groups of slots whose window is gone (their buffers are overwritten by later windows)."""
        for sl in slots:
            ref, groups, _ = self._groups.pop(id(sl), (None, (), 0))
            if ref is not None and ref() is sl:  # not a slot of another owner that took a dead slot's id
                for key, g in groups:
                    self._free.setdefault(key, []).append(g)

    def forget(self, slots: list[Slot]) -> None:
        """Slots that leave the pool's care for good (inherited by another owner, or dropped)."""
        for sl in slots:
            self._groups.pop(id(sl), None)

    def nbytes(self, slot: Slot) -> int:
        got = self._groups.get(id(slot))
        return got[2] if got is not None and got[0]() is slot else slot.nbytes

    # ---- groups --------------------------------------------------------------------------------------
    def _take(
        self, form: str, name: str, need: dict, piece: Piece | None = None, scalars: list | None = None
    ) -> tuple[tuple, Group]:
        if form == "scalar":  # `name` is the tensor's fqn; its items are relabelled by the caller
            key, specs = ("scalar",) + tuple(scalars), None
        else:
            specs = self._spec(form, name)
            key = ("full", name) if form == "full" else ("compute",) + tuple((sh, dt) for _, _, _, sh, dt in specs)
        need[key] = need.get(key, 0) + 1
        free = self._free.get(key)
        if free:
            g = free.pop()
            if form == "compute":
                for it, (k, role, pc, _sh, _dt) in zip(g[0], specs):
                    it.key, it.role, it.piece, it.op = k, role, pc, name
            return key, g
        self.allocated_groups += 1
        if form == "scalar":
            its = [SlotItem(f"optim.{name}.{k}", k, "", piece, self._alloc((), dt)) for k, dt in scalars]
        else:
            its = [SlotItem(k, role, name, pc, self._alloc(sh, dt)) for k, role, pc, sh, dt in specs]
        return key, (its, sum(it.nbytes for it in its))

    def _spec(self, form: str, name: str) -> list[tuple]:
        got = self._specs.get((form, name))
        if got is not None:
            return got
        if form == "full":
            out = full_specs(self.ops[name])[0]
        else:
            out = [
                (f"compute.{pc.fqn}", "compute", pc, pc.shape, self.compute_dtype)
                if pc.is_param
                else (f"model.{pc.fqn}", "buffer", pc, pc.shape, pc.dtype)
                for pc in self.ops[name].pieces
                if pc.numel > 0
            ]
        self._specs[(form, name)] = out
        return out

    def _scalar_spec(self, name: str) -> list[tuple]:
        got = self._scalars.get(name)
        if got is None:
            got = self._scalars[name] = full_specs(self.ops[name])[1]
        return got

    def _alloc(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self.pin_memory)
