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
from .errors import TorchmoeError
from .optim_state import init_optimizer_state  # also imported from here by callers
from .replay_log import Replay
from .snapshot import StateAccess, restore_slot

log = logging.getLogger("torchmoe_ckpt.sparse_to_dense")


class ReplayDivergence(TorchmoeError, RuntimeError):
    """A replayed iteration did not reproduce the logged loss, so the rebuilt state would not be the run's."""


class ReplayedStep(Protocol):
    loss: torch.Tensor  # this rank's loss of the replayed iteration, compared bit for bit


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

    def to_dict(self) -> dict:
        return asdict(self)


def load_window_slot(slot, access: StateAccess) -> int:
    """ACTIVE-on-this-slot operators get their full state; later operators get compute weights."""
    return restore_slot(slot, access)


def sparse_to_dense(trainer: Replayable, window) -> RecoveryReport:
    """Run the conversion for `window` (a committed `Window`) on a freshly built trainer."""
    t_start = time.perf_counter()
    if not window.committed:
        raise ValueError(f"window {window.id} is not committed (slots missing or torn); use an older one")
    access = StateAccess(trainer.model, trainer.optimizer)
    init_optimizer_state(trainer.optimizer)
    t0, w = window.start_step, window.plan.window
    trainer.set_step(t0)
    nbytes = load_window_slot(window.slots[0], access)
    replay_s = 0.0
    for i in range(1, w):
        rec = window.log.get(t0 + i)
        r0 = time.perf_counter()
        res = trainer.train_step(Replay.of(rec))
        replay_s += time.perf_counter() - r0
        if not torch.equal(res.loss, rec.loss):
            raise ReplayDivergence(
                f"replay of iteration {t0 + i} (window {window.id}, replay {i} of {w - 1}) gave loss "
                f"{res.loss.item()!r}, the original run logged {rec.loss.item()!r}. Likely causes (most usual "
                "first): randomness outside torch's CPU generator (random.random(), numpy or an RNG of your own "
                "inside forward), state the checkpoint does not capture (a non-persistent buffer or a Python "
                "attribute that changes during training), a non-deterministic kernel or a different thread count, "
                "or a model/data/world size other than the run that wrote the window. The window is not loaded"
            )
        nbytes += load_window_slot(window.slots[i], access)
        faults.point("recovery")
    trainer.set_step(t0 + w - 1)
    rep = RecoveryReport(window.id, w, t0, t0 + w - 1, w - 1, nbytes, time.perf_counter() - t_start, replay_s)
    log.debug("recovered %s", rep.to_dict())
    return rep
