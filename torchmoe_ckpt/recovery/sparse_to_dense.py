"""Sparse-to-dense conversion: rebuild the exact dense training state from one committed window.

Load slot 0 (its active operators get their full state, the others its compute weights: FROZEN), replay the
next iteration with the logged batch, RNG state and gradient norm, load slot 1, ... until every operator is
active at iteration t0+W-1. Bit-exact because every forward uses exactly the original iteration's weights;
FROZEN operators' updates land only on slices the next slot overwrites, which is exact for elementwise
optimizers (`optim_state` refuses the others for split tensors). `Replay.frozen` lets a trainer skip their
weight gradients. The report splits the time into phases (rebuild, load, replay; `recover` adds more).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Protocol

import torch

from ..capture.snapshot import StateAccess, restore_slot
from ..core.plan import SlotPlan
from ..core.records import IterationRecord
from ..core.slot import Slot
from ..model.optim_state import init_optimizer_state  # also imported from here by callers
from ..runtime import faults
from . import rng
from .replay_check import ReplayComparison, ReplayDivergence, ReplayPolicy
from .replay_log import Replay

log = logging.getLogger("torchmoe_ckpt.sparse_to_dense")

__all__ = [
    "RecoveryPhases",
    "RecoveryReport",
    "ReplayDivergence",
    "Replayable",
    "ReplayedStep",
    "init_optimizer_state",
    "replay_slots",
    "sparse_to_dense",
]


class ReplayedStep(Protocol):
    loss: torch.Tensor  # this rank's loss of the replayed iteration, compared with the logged one (replay_check.py)
    # optional: `replayed_grad_norm`, the global norm of the replayed gradients (compared with the logged norm)


class Replayable(Protocol):
    """What recovery needs from a trainer. `set_step(n)`: the iteration counter and LR schedule where n completed
    iterations leave them. `train_step(replay)`: one iteration exactly as training runs it, but with the batch,
    RNG state, gradient norm and every group's LR from `replay`, capturing nothing; returns this rank's `loss`."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def set_step(self, step: int) -> None: ...
    def train_step(self, replay: Replay | None = None) -> ReplayedStep: ...


@dataclass
class RecoveryPhases:
    """Seconds per phase of one recovery, in the order they are spent (ops/status.PHASES says what each is). The
    replay sets rebuild, load and replay; `recover` and the in-memory recovery add find and safety_copy, the
    checkpointer redo once training is back. None: not part of this recovery."""

    find: float | None = None
    safety_copy: float | None = None
    rebuild: float = 0.0
    load: float = 0.0
    replay: float = 0.0
    redo: float | None = None

    def to_dict(self) -> dict[str, float]:
        """The phases present (the recovery report's JSON, the checkpointer's stats)."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class RecoveryReport:
    window_id: int
    window: int
    start_step: int  # t0: slot 0 holds the state after this iteration
    recovered_step: int  # the dense state now equals the state after this iteration
    replayed_iterations: int
    bytes_loaded: int
    seconds: float
    replay_seconds: float
    replay_check: str = "exact"  # the policy the replay was checked with (replay_check.py)
    exact: bool = True  # every replayed loss (and recomputed gradient norm) equal to the original bit for bit
    max_loss_deviation: float = 0.0  # largest relative deviation of a replayed loss (0 when exact)
    max_grad_norm_deviation: float = 0.0  # likewise for the gradient norms
    replay_tolerance: float | None = None  # the bound a tolerant replay was held to
    grad_norms_compared: int = 0  # replayed iterations whose trainer recomputed the gradient norm for the check
    load_seconds: float = 0.0  # slot bytes copied into the live tensors
    rebuild_seconds: float = 0.0  # optimizer state allocated so that slots load in place
    phases: RecoveryPhases = field(default_factory=RecoveryPhases)  # seconds per phase

    def to_dict(self) -> dict:
        return dict(asdict(self), phases=self.phases.to_dict())


def sparse_to_dense(trainer: Replayable, window, replay_check: ReplayPolicy | None = None) -> RecoveryReport:
    """Run the conversion for `window` (a committed `Window`) on a freshly built trainer; every replayed iteration
    is checked per `replay_check` (default: exact)."""
    if not window.committed:
        raise ValueError(f"window {window.id} is not committed (slots missing or torn); use an older one")
    seq = list(zip(window.slots, window.plan.slots))
    rep = replay_slots(trainer, seq, window.start_step, window.log.get, window.id, f"window {window.id}", replay_check)
    after = window.log.records.get(window.start_step + 1) if window.plan.window == 1 else None
    if after is not None:  # a dense snapshot (W = 1): the random state after its iteration (no replay restored it)
        rng.restore(after.rng_state, after.device_rng)
    return rep


def replay_slots(  # noqa: PLR0913 (a run of slots: a window and a sliding suffix hand their own parts)
    trainer: Replayable,
    seq: list[tuple[Slot, SlotPlan]],
    t0: int,
    record: Callable[[int], IterationRecord],
    window_id: int,
    label: str,
    replay_check: ReplayPolicy | None = None,
) -> RecoveryReport:
    """The conversion over consecutive slots (slot j: the state after iteration t0 + j), a committed window's or a
    sliding suffix across two windows: load slot 0, then per slot replay its iteration with the operators not yet
    active FROZEN and load it (nothing of operators already active). `record(step)`: an iteration's record."""
    t_start = time.perf_counter()
    access = StateAccess(trainer.model, trainer.optimizer)
    init_optimizer_state(trainer.optimizer)
    rebuild_s = time.perf_counter() - t_start
    everyone = set(seq[0][1].active) | set(seq[0][1].frozen)
    active: set[str] = set()
    trainer.set_step(t0)
    nbytes, load_s, replay_s, n = 0, 0.0, 0.0, len(seq)
    check = ReplayComparison(replay_check)
    for i, (slot, plan) in enumerate(seq):
        if i:
            rec = record(t0 + i)
            r0 = time.perf_counter()
            # still FROZEN in this iteration: the operators whose full state comes in a later slot
            res = trainer.train_step(replace(Replay.of(rec), frozen=frozenset(everyone - active)))
            replay_s += time.perf_counter() - r0
            check.check(f"iteration {t0 + i} ({label}, replay {i} of {n - 1})", res, rec)
        l0 = time.perf_counter()
        if active:  # a sliding slot also holds operators active already: leave them as the replay made them
            slot = Slot(slot.index, slot.active, slot.frozen, [it for it in slot.items if it.op not in active])
        nbytes += restore_slot(slot, access)  # full state of the slot's active operators, weights of the others
        load_s += time.perf_counter() - l0
        active |= set(plan.active)
        if i:
            faults.point("recovery")
    if active != everyone:
        raise ValueError(f"{label}: its slots activate {len(active)} of {len(everyone)} operators; not a window")
    trainer.set_step(t0 + n - 1)
    phases = RecoveryPhases(rebuild=rebuild_s, load=load_s, replay=replay_s)
    seconds = time.perf_counter() - t_start
    rep = RecoveryReport(window_id, n, t0, t0 + n - 1, n - 1, nbytes, seconds, replay_s, **check.report())
    rep.load_seconds, rep.rebuild_seconds, rep.phases = load_s, rebuild_s, phases
    log.debug("recovered %s", rep.to_dict())
    return rep
