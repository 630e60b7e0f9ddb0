"""Window size and per-slot active/frozen sets (MoEvement Algorithm 1, priced with real sizes).

Operators arrive in checkpoint order. Slot i copies the full state of its active set and the compute
weights of every operator after it; operators before it cost nothing. The paper prices only the first
slot with uniform operator sizes; here every slot is priced with the real sizes and the worst one counts.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

log = logging.getLogger("torchmoe_ckpt.schedule")


@dataclass(frozen=True)
class SlotPlan:
    active: tuple[str, ...]   # full state (master + optimizer) copied in this slot
    frozen: tuple[str, ...]   # operators after `active`: only compute weights copied
    bytes: int


@dataclass(frozen=True)
class WindowPlan:
    slots: tuple[SlotPlan, ...]
    budget_bytes: float
    fits: bool
    order: tuple[str, ...]

    @property
    def window(self) -> int:
        return len(self.slots)

    @property
    def worst_slot_bytes(self) -> int:
        return max(s.bytes for s in self.slots)

    def slot_of(self, op: str) -> int:
        for i, s in enumerate(self.slots):
            if op in s.active:
                return i
        raise KeyError(f"operator {op!r} is not in this plan")

    def to_dict(self) -> dict:
        return {"budget_bytes": self.budget_bytes if math.isfinite(self.budget_bytes) else None, "fits": self.fits,
                "order": list(self.order),
                "slots": [{"active": list(s.active), "frozen": list(s.frozen), "bytes": s.bytes} for s in self.slots]}

    @staticmethod
    def from_dict(d: dict) -> "WindowPlan":
        budget = float("inf") if d["budget_bytes"] is None else float(d["budget_bytes"])
        return WindowPlan(tuple(SlotPlan(tuple(s["active"]), tuple(s["frozen"]), int(s["bytes"])) for s in d["slots"]),
                          budget, bool(d["fits"]), tuple(d["order"]))


def copy_budget(t_iter_s: float, bandwidth_bytes_per_s: float, overlap: float = 1.0) -> float:
    """Bytes one slot may copy while one iteration runs."""
    if not (t_iter_s > 0 and bandwidth_bytes_per_s > 0 and overlap > 0):
        raise ValueError(f"budget needs positive T_iter, bandwidth and overlap; got {t_iter_s}, "
                         f"{bandwidth_bytes_per_s}, {overlap}")
    return t_iter_s * bandwidth_bytes_per_s * overlap


def _slots_from_ends(order: list[str], ends: list[int], full: dict[str, int], comp: dict[str, int]):
    """Slots for active sets order[ends[i-1]:ends[i]]."""
    suffix = [0] * (len(order) + 1)  # compute bytes of order[k:]
    for k in range(len(order) - 1, -1, -1):
        suffix[k] = suffix[k + 1] + comp[order[k]]
    slots, start = [], 0
    for end in ends:
        act = order[start:end]
        slots.append(SlotPlan(tuple(act), tuple(order[end:]), sum(full[o] for o in act) + suffix[end]))
        start = end
    return slots


def _greedy_ends(order: list[str], full: dict[str, int], comp: dict[str, int], budget: float) -> list[int]:
    """Each slot takes the longest prefix of the remaining operators whose cost fits; a lone operator that
    does not fit still gets a slot of its own. Extending a slot moves one operator from compute price to
    full price (full >= compute), so a slot's cost grows with its end: greedy stays ahead of any other
    split, and the number of slots is minimal."""
    n = len(order)
    suffix = [0] * (n + 1)
    for k in range(n - 1, -1, -1):
        suffix[k] = suffix[k + 1] + comp[order[k]]
    ends, start = [], 0
    while start < n:
        end, active = start + 1, full[order[start]]
        while end < n and active + full[order[end]] + suffix[end + 1] <= budget:
            active += full[order[end]]
            end += 1
        ends.append(end)
        start = end
    return ends


def plan_window(order: list[str], full_bytes: dict[str, int], compute_bytes: dict[str, int],
                budget_bytes: float, forced_window: int | None = None, warn: bool = True) -> WindowPlan:
    """Plan one window. `warn=False` lets a caller that re-plans every window report an impossible budget once."""
    if not order:
        raise ValueError("cannot plan a window without operators")
    n = len(order)
    if forced_window is None:
        ends = _greedy_ends(order, full_bytes, compute_bytes, budget_bytes)
    else:
        if not 1 <= forced_window <= n:
            raise ValueError(f"window {forced_window} is impossible with {n} operators: use 1..{n} or 'auto'")
        ends = _forced_ends(order, full_bytes, compute_bytes, forced_window)
    slots = _slots_from_ends(order, ends, full_bytes, compute_bytes)
    fits = all(s.bytes <= budget_bytes for s in slots)
    if not fits and warn:
        worst = max(slots, key=lambda s: s.bytes)
        log.warning("sparse checkpoint slots do not fit the copy budget: worst slot %d bytes > budget %.0f bytes "
                    "per iteration (W=%d). Training goes on with the smallest feasible slots and will wait for "
                    "copies; raise the overlap/bandwidth budget or force a larger window.",
                    worst.bytes, budget_bytes, len(slots))
    return WindowPlan(tuple(slots), float(budget_bytes), fits, tuple(order))


def _forced_ends(order: list[str], full: dict[str, int], comp: dict[str, int], w: int) -> list[int]:
    """Exactly `w` slots minimising the worst slot: binary search the smallest budget for which the greedy
    needs <= w slots, then split the largest active sets until there are w."""
    lo = 0
    hi = sum(full[o] for o in order) + sum(comp[o] for o in order)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_greedy_ends(order, full, comp, mid)) <= w:
            hi = mid
        else:
            lo = mid + 1
    ends = _greedy_ends(order, full, comp, lo)
    while len(ends) < w:  # splitting a slot never raises the worst cost: both halves cost <= the original
        starts = [0] + ends[:-1]
        i = max(range(len(ends)), key=lambda k: (ends[k] - starts[k] > 1, ends[k] - starts[k]))
        ends.insert(i, starts[i] + (ends[i] - starts[i]) // 2)
    return ends


def measure_copy_bandwidth(nbytes: int = 64 << 20, repeats: int = 3) -> float:
    """Host copy bandwidth (bytes/s), best of `repeats`, with preallocated buffers."""
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch pages
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best
