"""Sparse-to-dense conversion: rebuild the exact dense training state from one committed window.

Load slot 0: its active operators get their full state (they are ACTIVE from now on), the others get slot
0's compute weights (FROZEN). Replay iteration t0+1 with the logged batch, RNG state and gradient norm;
ACTIVE operators take their optimizer step exactly as in the original run. Load slot 1: more operators
become ACTIVE, the still-FROZEN ones get slot 1's compute weights. ... After slot W-1 is loaded every
operator holds its exact state at iteration t0+W-1: W-1 replayed iterations in all.

Why it is bit-exact: during replay every forward uses, for every operator, exactly the weights of the
original iteration (replayed or loaded), so activations, losses and all gradients are identical. Weight
gradients are still computed for FROZEN operators and reduced in the unchanged FSDP layout (changing the
reduce-scatter layout changes the summation order with >= 3 ranks). Their optimizer update is computed on
the whole grouped tensor too, but it lands only on FROZEN slices, which the next slot overwrites ("masked"):
that is exact for updates that do not couple elements across operators, which `optim_state` checks per
optimizer up front (Adam/AdamW/SGD are elementwise; Muon couples whole matrices, Adafactor whole tensors, so
tensors cut into several operators are refused for them).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Protocol

import torch

from . import faults
from .optim_state import init_optimizer_state  # also imported from here by callers
from .replay_check import ReplayComparison, ReplayDivergence, ReplayPolicy
from .replay_log import Replay
from .snapshot import StateAccess, restore_slot

log = logging.getLogger("torchmoe_ckpt.sparse_to_dense")

__all__ = [
    "RecoveryReport",
    "ReplayDivergence",
    "Replayable",
    "ReplayedStep",
    "init_optimizer_state",
    "load_window_slot",
    "sparse_to_dense",
]


class ReplayedStep(Protocol):
    loss: torch.Tensor  # this rank's loss of the replayed iteration, compared with the logged one (replay_check.py)
    # optional: `replayed_grad_norm`, the global norm of the replayed gradients (compared with the logged norm)


class Replayable(Protocol):
    """What recovery needs from a trainer. The own-loop `Checkpointer` implements it for any model; the
    harness Trainer and TorchTitan's `SparseTrainer` (through `TitanReplayable`) implement it for theirs.

    `set_step(n)`: put the iteration counter and the LR schedule where n completed iterations leave them.
    `train_step(replay)`: run one iteration exactly as training does, except that it takes the batch, the RNG
    state, the global gradient norm (for clipping) and every param group's LR from `replay` instead of
    computing them, and it captures no checkpoint. It returns an object with this rank's `loss`."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def set_step(self, step: int) -> None: ...
    def train_step(self, replay: Replay | None = None) -> ReplayedStep: ...


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

    def to_dict(self) -> dict:
        return asdict(self)


def load_window_slot(slot, access: StateAccess) -> int:
    """ACTIVE-on-this-slot operators get their full state; later operators get compute weights."""
    return restore_slot(slot, access)


def sparse_to_dense(trainer: Replayable, window, replay_check: ReplayPolicy | None = None) -> RecoveryReport:
    """Run the conversion for `window` (a committed `Window`) on a freshly built trainer; every replayed iteration
    is checked per `replay_check` (default: exact)."""
    t_start = time.perf_counter()
    if not window.committed:
        raise ValueError(f"window {window.id} is not committed (slots missing or torn); use an older one")
    access = StateAccess(trainer.model, trainer.optimizer)
    init_optimizer_state(trainer.optimizer)
    t0, w = window.start_step, window.plan.window
    trainer.set_step(t0)
    nbytes = load_window_slot(window.slots[0], access)
    replay_s = 0.0
    check = ReplayComparison(replay_check)
    for i in range(1, w):
        rec = window.log.get(t0 + i)
        r0 = time.perf_counter()
        res = trainer.train_step(Replay.of(rec))
        replay_s += time.perf_counter() - r0
        check.check(f"iteration {t0 + i} (window {window.id}, replay {i} of {w - 1})", res, rec)
        nbytes += load_window_slot(window.slots[i], access)
        faults.point("recovery")
    trainer.set_step(t0 + w - 1)
    rep = RecoveryReport(
        window.id, w, t0, t0 + w - 1, w - 1, nbytes, time.perf_counter() - t_start, replay_s, **check.report()
    )
    log.debug("recovered %s", rep.to_dict())
    return rep
