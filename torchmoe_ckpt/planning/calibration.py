"""Auto W priced by what the device loses, measured (CUDA, `overlap` None): the rule and its measurements.

The rule (docs/sparse-checkpointing.md, "Auto W on a GPU"):

1. Calibration: the first CALIBRATION_STEPS iterations after WARMUP_STEPS run without a copy; their median step
   time is the base step time T0 (the first window starts after them). The step seconds are the caller's host
   timing of `train_step` (trainer.py, TorchTitan's loop): the checkpointer sees the step only after it, so CUDA
   events around it would need a hook at the step's start, and reading them a host sync or a step of lag. Host
   timing of an 80 ms step spreads by +-4 ms (the H200 run's `none` steps: 71-90 ms); with 8 steps the median's
   error is ~1-2 ms and one slow step (a GC pause, a stray allocation) does not move it, where the mean of 3 was
   good to +-4 ms against a 1.6 ms (2%) target.
2. Every later step is a sample (step seconds, bytes of the slot copy that ran during it). At each window start
   the last window's samples give the device's cost per copied byte, c = max(0, mean(T) - T0) / mean(bytes),
   smoothed over windows (an EWMA), and the measured overhead, (mean(T) - T0) / T0. The window's mean, not its
   median: a copy's cost may land in a few of its steps, and the overhead is their average. A window faster than
   T0 is noise (or a T0 too high): its c is clipped at 0, which biases c upwards, so every clip is counted
   (`clipped_windows` in stats) and said in a log line.
3. The copy budget of a slot is then `max_step_overhead * T0 / c` bytes, and Algorithm 1 picks the smallest W whose
   slots all fit it (schedule.choose_window, with its hysteresis): the smallest W whose predicted added step time
   `c * worst_slot_bytes` stays within `max_step_overhead` of T0. Until a copy has been measured (the first window),
   the fixed overlap CUDA_OVERLAP prices it; a measured c of 0 (copies cost nothing measurable) leaves the
   budget unbounded by this rule (W as small as the copy bandwidth allows, `overlap` 1.0).
4. Re-planned at every window start from the newest c: a measured overhead past the target raises c and with it
   W at the next window start (said once per change, counted in `replans`).

Agreement: every input is this rank's own; the only collective is the planner's MAX of the proposed W, issued
unconditionally at every window start (window_planner._agreed_w), so no rank takes a collective the others skip.
The calibration's length is configuration, the same on every rank.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field

__all__ = [
    "CALIBRATION_STEPS",
    "WARMUP_STEPS",
    "DeviceLoss",
    "cost_per_byte",
    "overhead_budget",
]

log = logging.getLogger("torchmoe_ckpt")

WARMUP_STEPS = 1  # the first step (allocations, autotuning) is not a sample
CALIBRATION_STEPS = 8  # steps without a copy that measure the base step time (their median: rule 1 above)
ALPHA = 0.5  # weight of the newest window's cost per byte


def cost_per_byte(base_s: float, samples: list[tuple[float, int]]) -> float | None:
    """The device's added step seconds per copied byte from (step seconds, bytes copied during it) samples against
    the base step time: max(0, mean(seconds) - base) / mean(bytes). None without a sample that copied."""
    copied = [(s, b) for s, b in samples if b > 0]
    if not copied or not base_s > 0:
        return None
    mean_s = sum(s for s, _ in copied) / len(copied)
    mean_b = sum(b for _, b in copied) / len(copied)
    return max(0.0, mean_s - base_s) / mean_b


def overhead_budget(base_s: float, s_per_byte: float, target: float) -> float:
    """Bytes one slot may copy for its predicted added step time, `s_per_byte * bytes`, to stay within `target`
    (a share) of the base step time. inf when copies cost nothing measurable."""
    if not (base_s > 0 and target > 0) or s_per_byte < 0:
        raise ValueError(f"need base_s > 0, target > 0, s_per_byte >= 0; got {base_s}, {target}, {s_per_byte}")
    return math.inf if s_per_byte == 0 else target * base_s / s_per_byte


@dataclass
class DeviceLoss:
    """The measurements of one rank (rule above). `observe(seconds, copy_bytes)` per step; `calibrating` while
    steps must run without a copy; `budget()` at a window start (None: not measured yet)."""

    target: float
    warmup: int = WARMUP_STEPS
    calibration: int = CALIBRATION_STEPS
    base_s: float | None = None
    s_per_byte: float | None = None
    overhead: float | None = None  # the last window's measured added share of the step
    replans: int = 0  # windows whose measured overhead was past the target (W re-priced up)
    clipped_windows: int = 0  # windows faster than the base step: their cost per byte clipped at 0 (rule 2)
    steps: int = 0
    _base: list[float] = field(default_factory=list)
    _window: list[tuple[float, int]] = field(default_factory=list)
    _over: bool = False
    _clipped: bool = False  # the last window was clipped (the log line is said once per run of clipped windows)

    @property
    def calibrating(self) -> bool:
        """True while the next step must run without a copy (the base step time is not measured yet)."""
        return self.base_s is None

    def observe(self, seconds: float, copy_bytes: int) -> None:
        self.steps += 1
        if self.steps <= self.warmup or not seconds > 0:
            return
        if self.base_s is None:
            if copy_bytes == 0:
                self._base.append(seconds)
            if len(self._base) >= self.calibration:
                self.base_s = statistics.median(self._base)
            return
        self._window.append((seconds, copy_bytes))

    def budget(self) -> float | None:
        """At a window start: fold the last window's samples into the cost per byte, then the copy budget per slot
        in bytes (inf: no measurable cost; None: no copy measured yet, the caller's prior prices it)."""
        samples, self._window = self._window, []
        if self.base_s is None:
            return None
        c = cost_per_byte(self.base_s, samples)
        if c is not None:
            copied = [s for s, b in samples if b > 0]
            self.overhead = (sum(copied) / len(copied) - self.base_s) / self.base_s
            self.s_per_byte = c if self.s_per_byte is None else (1 - ALPHA) * self.s_per_byte + ALPHA * c
            clipped = self.overhead < 0
            if clipped:
                self.clipped_windows += 1
                if not self._clipped:
                    log.info(
                        f"torchmoe: copies measured {self.overhead:.1%} of the base step {self.base_s * 1e3:.2f} ms "
                        f"(faster than without copies: noise): cost per byte clipped at 0 "
                        f"({self.clipped_windows} window(s) clipped so far, stats' clipped_windows)"
                    )
            self._clipped = clipped
            over = self.overhead > self.target
            if over:
                self.replans += 1
            if over != self._over:
                log.info(
                    f"torchmoe: copies add {self.overhead:.1%} to the step (max_step_overhead {self.target:.1%}): "
                    + ("W re-priced up" if over else "back within the target")
                    + f" ({self.clipped_windows} window(s) clipped at 0 so far)"
                )
            self._over = over
        if self.s_per_byte is None:
            return None
        return overhead_budget(self.base_s, self.s_per_byte, self.target)

    def stats(self) -> dict:
        return {
            "base_step_s": self.base_s,
            "s_per_byte": self.s_per_byte,
            "measured_overhead": self.overhead,
            "target": self.target,
            "replans": self.replans,
            "clipped_windows": self.clipped_windows,
            "calibration_steps": self.calibration,
        }
