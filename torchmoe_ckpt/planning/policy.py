"""The checkpoint policy: sparse windows or a dense snapshot every k iterations, whichever keeps more useful
training time (ETTR), predicted from what the run measures (docs/sparse-checkpointing.md, "Policy").

The model (the harness's simulator's, torchmoe_harness/ettr.py `ettr_exact`, now here: the library decides on it
and must not import the harness). A policy is a recovery point every `interval` iterations of `t` seconds (the
step without copies) plus `per_iter_s` added to every iteration and `stall_s` at each recovery point; a failure
(Poisson on the wall clock, MTBF `m`) costs `restart_s` plus `replay` iterations and redoes everything after the
last recovery point. Expected wall time per segment (Daly 2006): m e^{R/m} (e^{tau/m} - 1), tau the segment's
seconds, R the recovery's; ETTR = interval x t / that.

  sparse, W   every iteration copies one slot (mean slot bytes b_W): per_iter_s = cost(b_W); a failure replays
              W - 1 iterations; recovery points W iterations apart (a window commits every W).
  dense, k    one dense copy (D bytes) every k iterations: stall_s = cost(D); nothing replayed.

`cost(bytes)` is what a copy adds to the step: at least the measured added step seconds per copied byte times
the bytes (contention: copies share cores and memory bandwidth with the step), and at least the wait when the
copy outlasts the `overlap` share of the step it hides behind (bytes x copy seconds per byte - overlap x t).
Sparse windows win where a dense copy cannot hide behind an iteration; elsewhere the dense snapshot at a good
interval loses fewer iterations per failure at fewer bytes.

Every input is agreed across ranks before deciding (the slowest rank's figures, `PolicyInputs.agreed`), so every
rank computes the same decision; re-decided at window boundaries, a switch taken only when the new policy beats
the current one by `HYSTERESIS` (noise must not flip it).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from ..core.sparse_config import DEFAULT_MTBF_S, MTBF_REFERENCE_GPUS

__all__ = [
    "Candidate",
    "HYSTERESIS",
    "MAX_DENSE_INTERVAL",
    "PolicyChooser",
    "PolicyDecision",
    "PolicyInputs",
    "PolicyStatus",
    "PolicySwitch",
    "ettr",
    "resolved_mtbf_s",
]

HYSTERESIS = 0.01  # a switch needs this much more predicted ETTR (absolute) than the policy in use
MAX_DENSE_INTERVAL = 10_000  # the longest dense interval considered (iterations)
DEFAULT_RESTART_S = 30.0  # until a restart is measured: a torchrun restart re-forms the group and reloads


def resolved_mtbf_s(mtbf: float | None, ranks: int) -> float:
    """`SparseConfig.mtbf` in seconds (already parsed), or its default: ~3 h at 16,384 GPUs scaled to `ranks`."""
    if mtbf is not None:
        return float(mtbf)
    return DEFAULT_MTBF_S * MTBF_REFERENCE_GPUS / max(1, ranks)


def ettr(
    interval: int, t: float, mtbf_s: float, per_iter_s: float = 0.0, stall_s: float = 0.0, recovery_s: float = 0.0
):
    """Expected ETTR of a recovery point every `interval` iterations (module docstring; ettr.py `ettr_exact`)."""
    tau = interval * (t + per_iter_s) + stall_s
    try:
        expected = mtbf_s * math.exp(recovery_s / mtbf_s) * math.expm1(tau / mtbf_s)
    except OverflowError:
        return 0.0
    return interval * t / expected if expected > 0 else 0.0


@dataclass(frozen=True)
class PolicyInputs:
    """What the decision is fed, measured in the run (seconds and bytes of this rank, or agreed over every rank)."""

    step_s: float  # the step without copies (calibration)
    copy_s_per_byte: float  # a copy's wall seconds per byte under training (CopyCost)
    added_s_per_byte: float  # the step seconds a copy adds per copied byte (0: not measured, hidden)
    dense_bytes: int  # one dense snapshot of this rank
    sparse_window: int  # W auto-W would take (Algorithm 1), or the forced W
    sparse_slot_bytes: float  # the mean slot bytes of that window
    restart_s: float  # a restart: detect, re-form, load (measured after a restart, else DEFAULT_RESTART_S)
    mtbf_s: float  # the expected time between failures of the job
    overlap: float = 1.0  # the share of a step a copy hides behind

    def copy_cost(self, nbytes: float) -> float:
        """The seconds a copy of `nbytes` adds to the step it runs beside (module docstring)."""
        return max(self.added_s_per_byte * nbytes, nbytes * self.copy_s_per_byte - self.overlap * self.step_s, 0.0)

    def agreed(self, agree_max) -> PolicyInputs:
        """Every cost as the slowest rank measured it, the MTBF as the smallest: `agree_max(list) -> list` is a MAX
        over the ranks (collective), so every rank decides on the same figures."""
        vals = agree_max(
            [
                self.step_s,
                self.copy_s_per_byte,
                self.added_s_per_byte,
                float(self.dense_bytes),
                float(self.sparse_window),
                self.sparse_slot_bytes,
                self.restart_s,
                -self.mtbf_s,
            ]
        )
        return replace(
            self,
            step_s=vals[0],
            copy_s_per_byte=vals[1],
            added_s_per_byte=vals[2],
            dense_bytes=int(vals[3]),
            sparse_window=int(vals[4]),
            sparse_slot_bytes=vals[5],
            restart_s=vals[6],
            mtbf_s=-vals[7],
        )


@dataclass(frozen=True)
class Candidate:
    policy: str  # "sparse" or "dense"
    interval: int  # W (sparse) or k (dense)
    predicted_ettr: float
    per_iter_s: float  # what it adds to every iteration
    stall_s: float  # what it adds at each recovery point
    recovery_s: float  # what a failure costs before training goes on (restart and replay)


@dataclass(frozen=True)
class PolicyDecision:
    """The policy in force and why (`stats()["policy"]`, the status lines)."""

    policy: str  # "sparse" or "dense"
    interval_or_W: int
    predicted_ettr: dict[str, float]  # per candidate, "sparse W=4" / "dense k=12"
    reason: str
    candidates: tuple[Candidate, ...] = ()
    inputs: PolicyInputs | None = None
    forced: bool = False  # the config named the policy (or W / k): not re-decided

    @property
    def label(self) -> str:
        return f"{self.policy} {'W' if self.policy == 'sparse' else 'k'}={self.interval_or_W}"

    def to_dict(self) -> dict:
        return {
            "policy": self.policy,
            "interval_or_W": self.interval_or_W,
            "predicted_ettr": dict(self.predicted_ettr),
            "reason": self.reason,
            "forced": self.forced,
            "inputs": None if self.inputs is None else asdict(self.inputs),
        }

    def line(self) -> str:
        """What the status line says: the policy, its predicted ETTR against the other candidate, why."""
        return f"policy {self.label} ({self.reason})"


@dataclass(frozen=True)
class PolicySwitch:
    step: int | None  # the iteration whose boundary took it (None: forced between boundaries)
    from_label: str  # "sparse W=4"
    to_label: str  # "dense k=12"


@dataclass(frozen=True)
class PolicyStatus:
    """What `stats()["policy"]` shows (its `to_dict()`): the policy in force, its W or k, each candidate's
    predicted ETTR, why, what it was decided on, and the switches so far."""

    policy: str
    interval_or_W: int | None
    predicted_ettr: dict[str, float]
    reason: str
    forced: bool
    mtbf_s: float
    restart_s: float
    restart_measured: bool
    base_step_s: float | None
    inputs: PolicyInputs | None
    switches: tuple[PolicySwitch, ...] = ()

    def to_dict(self) -> dict:
        d = asdict(self)
        d["switches"] = [{"step": w.step, "from": w.from_label, "to": w.to_label} for w in self.switches]
        return d


def sparse_candidate(x: PolicyInputs) -> Candidate:
    w = max(1, x.sparse_window)
    per_iter = x.copy_cost(x.sparse_slot_bytes)
    rec = x.restart_s + (w - 1) * x.step_s  # replay: a frozen-operator iteration costs at most a step
    return Candidate("sparse", w, ettr(w, x.step_s, x.mtbf_s, per_iter, 0.0, rec), per_iter, 0.0, rec)


def dense_candidate(x: PolicyInputs, interval: int | None = None) -> Candidate:
    """At `interval`, or at the interval with the best predicted ETTR (ETTR is unimodal in k: climb from Young's
    first-order optimum, sqrt(2 stall MTBF) / step)."""
    stall = x.copy_cost(x.dense_bytes)
    rec = x.restart_s

    def at(k: int) -> float:
        return ettr(k, x.step_s, x.mtbf_s, 0.0, stall, rec)

    if interval is None:
        k = min(MAX_DENSE_INTERVAL, max(1, round(math.sqrt(2 * stall * x.mtbf_s) / x.step_s)))
        for step in (1, -1):  # hill-climb both ways from the first-order optimum
            while 1 <= k + step <= MAX_DENSE_INTERVAL and at(k + step) > at(k):
                k += step
        interval = k
    return Candidate("dense", interval, at(interval), 0.0, stall, rec)


class PolicyChooser:
    """Decides the policy from `PolicyInputs`. `fixed`: the policy the config fixes (None: auto); `interval`: the
    forced W or k (None: chosen). `decide(inputs)` at a window boundary returns the decision in force (the current
    one again unless another candidate beats it by HYSTERESIS)."""

    def __init__(self, fixed: str | None, window: int | None, dense_interval: int | None, why: str = ""):
        self.fixed, self.window, self.dense_interval = fixed, window, dense_interval
        self.why = why or "set in the config"  # why the policy is fixed
        self.current: PolicyDecision | None = None
        self.switches = 0

    def decide(self, x: PolicyInputs) -> PolicyDecision:
        sp = sparse_candidate(replace(x, sparse_window=self.window or x.sparse_window))
        de = dense_candidate(x, self.dense_interval)
        cands = (sp, de)
        pred = {f"{c.policy} {'W' if c.policy == 'sparse' else 'k'}={c.interval}": c.predicted_ettr for c in cands}
        if self.fixed is not None:
            pick = sp if self.fixed == "sparse" else de
            d = PolicyDecision(pick.policy, pick.interval, pred, self.why, cands, x, forced=True)
            self.current = d
            return d
        best = max(cands, key=lambda c: (c.predicted_ettr, c.policy == "dense"))  # a tie: the simpler policy
        other = de if best is sp else sp
        cur = self.current
        if cur is not None and best.policy != cur.policy:
            mine = sp if cur.policy == "sparse" else de
            if best.predicted_ettr < mine.predicted_ettr + HYSTERESIS:  # not enough better to switch
                best, other = mine, best
        reason = _reason(best, other, x)
        d = PolicyDecision(best.policy, best.interval, pred, reason, cands, x)
        if cur is not None and cur.policy != d.policy:
            self.switches += 1
        self.current = d
        return d


def _reason(best: Candidate, other: Candidate, x: PolicyInputs) -> str:
    dense = best if best.policy == "dense" else other
    hides = dense.stall_s <= 0.05 * x.step_s
    why = (
        "a dense copy hides behind a step"
        if hides
        else f"a dense copy adds {dense.stall_s / x.step_s:.2f} steps at each snapshot"
    )
    return (
        f"predicted ETTR {best.predicted_ettr:.3f} vs {other.policy} {other.predicted_ettr:.3f}: {why}, "
        f"MTBF {x.mtbf_s:.0f} s"
    )
