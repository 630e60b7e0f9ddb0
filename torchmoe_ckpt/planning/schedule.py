"""Window size and per-slot active/frozen sets (MoEvement Algorithm 1, every slot priced with the real sizes).

Slot i copies the full state of its active set and the compute weights of every operator after it. A sliding
plan copies the compute weights of every operator not active in the slot, so that any W consecutive slots hold
what a recovery needs: it is split like a standard one on full - compute, with compute(all) added per slot.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from itertools import accumulate

import torch

from ..core.plan import SlotPlan, WindowPlan

log = logging.getLogger("torchmoe_ckpt.schedule")


def copy_budget(t_iter_s: float, bandwidth_bytes_per_s: float, overlap: float = 1.0) -> float:
    """Bytes one slot may copy while one iteration runs."""
    if not (t_iter_s > 0 and bandwidth_bytes_per_s > 0 and overlap > 0):
        raise ValueError(
            f"budget needs positive T_iter, bandwidth and overlap; got {t_iter_s}, {bandwidth_bytes_per_s}, {overlap}"
        )
    return t_iter_s * bandwidth_bytes_per_s * overlap


def _suffix_compute(order: list[str], comp: dict[str, int]) -> list[int]:
    """[k] = compute bytes of order[k:], the frozen cost of a slot ending at k (len(order) + 1 entries)."""
    return list(accumulate(reversed([comp[o] for o in order]), initial=0))[::-1]


def _slots_from_ends(
    order: list[str], ends: list[int], full: dict[str, int], comp: dict[str, int], sliding: bool = False
):
    """Slots for active sets order[ends[i-1]:ends[i]]."""
    suffix = _suffix_compute(order, comp)
    slots = []
    for start, end in zip([0] + ends[:-1], ends):
        act = order[start:end]
        frozen, cost = order[end:], suffix[end]
        if sliding:  # the operators before the active set too
            frozen, cost = order[:start] + order[end:], suffix[0] - sum(comp[o] for o in act)
        slots.append(SlotPlan(tuple(act), tuple(frozen), sum(full[o] for o in act) + cost))
    return slots


def _sliding_sizes(order: list[str], full: dict[str, int], comp: dict[str, int]) -> tuple[dict, dict, int]:
    """A sliding slot's cost as a standard one's: full - compute per active operator, nothing for the frozen
    ones, plus compute(all) on every slot (returned separately: subtracted from a budget, added to a floor)."""
    return {o: full[o] - comp[o] for o in order}, dict.fromkeys(order, 0), sum(comp[o] for o in order)


def _greedy_ends(order: list[str], full: dict[str, int], comp: dict[str, int], budget: float) -> list[int]:
    """Each slot takes the longest prefix of the remaining operators that fits (at least one operator)."""
    n = len(order)
    suffix = _suffix_compute(order, comp)
    ends, start = [], 0
    while start < n:
        end, active = start + 1, full[order[start]]
        # Cost grows with `end` (full >= compute), so the first operator that does not fit ends the slot.
        while end < n and active + full[order[end]] + suffix[end + 1] <= budget:
            active += full[order[end]]
            end += 1
        ends.append(end)
        start = end
    return ends


def _check_sizes(order: list[str], full: dict[str, int], comp: dict[str, int]) -> None:
    if len(set(order)) != len(order):
        dup = sorted({o for o in order if order.count(o) > 1})
        raise ValueError(f"operator order lists {dup} more than once; each operator needs exactly one slot")
    for o in order:
        f, c = full.get(o), comp.get(o)
        if not (isinstance(f, numbers.Integral) and isinstance(c, numbers.Integral)):
            raise ValueError(f"operator {o!r} needs integer full_bytes and compute_bytes, got {f!r} and {c!r}")
        # The greedy's minimality and the forced split rely on full >= compute.
        if not 0 <= c <= f:
            raise ValueError(f"operator {o!r}: need 0 <= compute_bytes <= full_bytes, got {c} and {f}")


def plan_window(  # noqa: PLR0913  (Algorithm 1's inputs, and its mode options with defaults)
    order: list[str],
    full_bytes: dict[str, int],
    compute_bytes: dict[str, int],
    budget_bytes: float,
    forced_window: int | None = None,
    warn: bool = True,
    auto_window: int | None = None,
    sliding: bool = False,
) -> WindowPlan:
    """Plan one window over `order` (in checkpoint order). Auto mode is greedy, and its W the smallest possible
    (a slot's cost is monotone in its ends: the greedy stays ahead); an operator that alone does not fit gets its
    own slot, `fits` is False and one warning is logged (`warn`). Forced mode: exactly `forced_window` slots with
    the smallest worst slot. `auto_window`: a W `choose_window` chose, split like a forced one (the split then
    depends only on W and the order, so slot buffers are reused), reported as auto."""
    if not order:
        raise ValueError("cannot plan a window without operators")
    if not budget_bytes > 0:  # also rejects NaN
        raise ValueError(f"copy budget must be > 0 bytes (or inf), got {budget_bytes}")
    order = list(order)
    _check_sizes(order, full_bytes, compute_bytes)
    n = len(order)
    f, c, base = _sliding_sizes(order, full_bytes, compute_bytes) if sliding else (full_bytes, compute_bytes, 0)
    w = auto_window if auto_window is not None else forced_window
    if w is not None and (not isinstance(w, numbers.Integral) or not 1 <= w <= n):
        what, alt = ("auto window", "") if auto_window is not None else ("window", " or auto (None)")
        raise ValueError(f"{what} {w!r} is impossible with {n} operators: use 1..{n}{alt}")
    ends = _greedy_ends(order, f, c, max(budget_bytes - base, 0)) if w is None else _forced_ends(order, f, c, int(w))
    slots = _slots_from_ends(order, ends, full_bytes, compute_bytes, sliding)
    fits = all(s.bytes <= budget_bytes for s in slots)
    if not fits and warn:  # one message per call, naming the worst slot, however many slots are over
        i, worst = max(enumerate(slots), key=lambda x: x[1].bytes)
        names = ", ".join(worst.active[:3]) + (", ..." if len(worst.active) > 3 else "")
        forced = forced_window is not None and auto_window is None
        fix = "a larger forced window or auto (None)" if forced else "set a forced window to accept the wait"
        # "do not fit the copy budget" is matched by tests/recovery/test_recovery.py: keep the phrase.
        log.warning(
            f"sparse checkpoint slots do not fit the copy budget: slot {i} of W={len(slots)} (active: "
            f"{names}) copies {worst.bytes} bytes, over the budget of {budget_bytes:.0f} bytes per iteration, "
            f"so training will wait for the copy. Raise the copy budget (overlap, bandwidth or iteration "
            f"time) or {fix}."
        )
    return WindowPlan(tuple(slots), float(budget_bytes), fits, tuple(order), sliding)


def _forced_ends(order: list[str], full: dict[str, int], comp: dict[str, int], w: int) -> list[int]:
    """Exactly `w` slots minimising the worst slot: binary search the smallest budget for which the greedy
    needs <= w slots, then split the largest active sets until there are w."""
    lo = 0
    hi = sum(full[o] for o in order) + sum(comp[o] for o in order)  # no slot can cost more
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_greedy_ends(order, full, comp, mid)) <= w:
            hi = mid
        else:
            lo = mid + 1
    ends = _greedy_ends(order, full, comp, lo)
    while len(ends) < w:  # splitting a slot never raises the worst cost: both halves cost <= the original
        starts = [0] + ends[:-1]
        i = max(range(len(ends)), key=lambda k: ends[k] - starts[k])
        ends.insert(i, starts[i] + (ends[i] - starts[i]) // 2)
    return ends


class CopyCost:
    """What a slot copy costs while training runs, learned from the copies (Algorithm 1's budget): EWMAs of the
    copy's wall seconds per byte (under training, contention included; at least the wait it caused) and of the
    iteration time. `prior_bytes_per_s` stands in until the first copy is observed."""

    def __init__(self, prior_bytes_per_s: float, alpha: float = 0.3):
        if not prior_bytes_per_s > 0:
            raise ValueError(f"prior bandwidth must be > 0, got {prior_bytes_per_s}")
        self.prior_s_per_byte = 1.0 / prior_bytes_per_s
        self.alpha = alpha
        self.seconds_per_byte: float | None = None
        self.t_iter: float | None = None
        self.copies = 0

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def observe_step(self, seconds: float) -> None:
        if seconds > 0:
            self.t_iter = self._ewma(self.t_iter, seconds)

    def observe_copy(self, nbytes: int, seconds: float, waited_s: float = 0.0) -> None:
        if nbytes > 0 and seconds > 0:
            self.seconds_per_byte = self._ewma(self.seconds_per_byte, max(seconds, waited_s) / nbytes)
            self.copies += 1

    @property
    def bytes_per_s(self) -> float:
        return 1.0 / (self.seconds_per_byte if self.seconds_per_byte is not None else self.prior_s_per_byte)

    def budget_bytes(self, overlap: float) -> float:
        """Bytes one slot may copy for its copy to take `overlap` x T_iter."""
        return copy_budget(self.t_iter, self.bytes_per_s, overlap)  # pyright: ignore[reportArgumentType]  (a step is observed before any plan)


def choose_window(  # noqa: PLR0913  (Algorithm 1's inputs, and the W in use with its hysteresis)
    order: list[str],
    full: dict[str, int],
    comp: dict[str, int],
    budget_bytes: float,
    current: int | None = None,
    hysteresis: float = 0.15,
    sliding: bool = False,
) -> int:
    """The smallest W whose greedy slots fit `budget_bytes` (Algorithm 1). Against `current`, a larger W is taken at
    once, a smaller one only with `hysteresis` to spare (noise must not flip W). A budget no W can meet stops W
    where its worst slot is within 25% of the least possible (a larger W would only add replay)."""
    order = list(order)
    _check_sizes(order, full, comp)
    # Sliding plans are priced as they will be split (see plan_window).
    full, comp, base = _sliding_sizes(order, full, comp) if sliding else (full, comp, 0)
    budget_bytes -= base
    suffix = _suffix_compute(order, comp)
    floor = max(full[o] + suffix[k + 1] for k, o in enumerate(order))  # worst slot with one operator per slot
    budget_bytes = max(budget_bytes, 1.25 * (floor + base) - base)
    w = len(_greedy_ends(order, full, comp, budget_bytes))
    if current is None or w >= current:
        return w
    return min(current, len(_greedy_ends(order, full, comp, budget_bytes / (1 + hysteresis))))


def measure_copy_bandwidth(nbytes: int = 64 << 20, repeats: int = 3) -> float:
    """Host copy bandwidth (bytes/s), best of `repeats`, with preallocated buffers (no allocation timed)."""
    if nbytes < 1 or repeats < 1:
        raise ValueError(f"need nbytes >= 1 and repeats >= 1, got {nbytes} and {repeats}")
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch pages so the timed copies do not pay for first-touch faults
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / max(best, 1e-9)  # a tiny copy can time as 0 on a coarse clock
