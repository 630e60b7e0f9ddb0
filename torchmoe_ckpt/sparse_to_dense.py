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
Adam is elementwise, so ACTIVE slices are untouched by what happens to their frozen neighbours.

Each replayed iteration also tells the trainer which operators are FROZEN in it (`Replay.frozen`): a trainer may
skip their weight gradients (MoEvement's frozen execution: forward and input gradients only), since whatever
their slices receive is overwritten by a later slot. The harness does for expert slices (model.expert_mlp);
a trainer that ignores the set replays exactly as before.

The report splits the recovery's time into phases (`RecoveryReport.phases`, the status line and the
checkpointer's stats): rebuild (optimizer state allocated for in-place loads), load (slot bytes copied into the
live tensors) and replay; `recover` adds find (the window located, checked, fetched from a tier) and the
checkpointer redo (iterations after the recovered step trained again).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Protocol

import torch

from . import faults
from .errors import TorchmoeError
from .replay_log import IterationRecord, Replay
from .schedule import SlotPlan
from .snapshot import ROLES_FULL, Slot, StateAccess, restore_slot

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
    load_seconds: float = 0.0  # slot bytes copied into the live tensors
    rebuild_seconds: float = 0.0  # optimizer state allocated so that slots load in place
    # seconds per phase: rebuild, load, replay here; `recover` adds find, the checkpointer redo (status.PHASES)
    phases: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW state for every trainable parameter (zeros, step 0: what AdamW's lazy init creates), so
    slots can be loaded into it in place, and so a parameter that got no gradient yet (an expert no token
    reached) still has state a slot can copy. FROZEN slices keep placeholder values until their operator
    becomes ACTIVE."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue  # never updated, so no state (and no empty entry in state_dict)
            st = optimizer.state[p]
            if "exp_avg" not in st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def load_window_slot(slot, access: StateAccess) -> int:
    """ACTIVE-on-this-slot operators get their full state; later operators get compute weights."""
    return restore_slot(slot, access, roles=ROLES_FULL + ("step", "compute", "buffer"))


def sparse_to_dense(trainer: Replayable, window) -> RecoveryReport:
    """Run the conversion for `window` (a committed `Window`) on a freshly built trainer."""
    if not window.committed:
        raise ValueError(f"window {window.id} is not committed (slots missing or torn); use an older one")
    seq = list(zip(window.slots, window.plan.slots))
    return replay_slots(trainer, seq, window.start_step, window.log.get, window.id, f"window {window.id}")


def replay_slots(
    trainer: Replayable,
    seq: list[tuple[Slot, SlotPlan]],
    t0: int,
    record: Callable[[int], IterationRecord],
    window_id: int,
    label: str,
) -> RecoveryReport:
    """The conversion over consecutive slots (slot j holds the state after iteration t0 + j, with its plan's
    active and frozen sets): a committed window's W slots, or a sliding suffix across two windows. Load slot
    0; for each next slot replay its iteration with the operators not yet active FROZEN, then load it: full
    state for the operators it activates, compute weights for those still frozen, nothing for those already
    active (what it holds of them equals what the replay produced). `record(step)`: the replay record of an
    iteration. Ends with every operator active at iteration t0 + len(seq) - 1."""
    t_start = time.perf_counter()
    access = StateAccess(trainer.model, trainer.optimizer)
    init_optimizer_state(trainer.optimizer)
    rebuild_s = time.perf_counter() - t_start
    everyone = set(seq[0][1].active) | set(seq[0][1].frozen)
    active: set[str] = set()
    trainer.set_step(t0)
    nbytes, load_s, replay_s, n = 0, 0.0, 0.0, len(seq)
    for i, (slot, plan) in enumerate(seq):
        if i:
            rec = record(t0 + i)
            r0 = time.perf_counter()
            # still FROZEN in this iteration: the operators whose full state comes in a later slot
            res = trainer.train_step(replace(Replay.of(rec), frozen=frozenset(everyone - active)))
            replay_s += time.perf_counter() - r0
            if not torch.equal(res.loss, rec.loss):
                raise ReplayDivergence(
                    f"replay of iteration {t0 + i} ({label}, replay {i} of {n - 1}) gave loss "
                    f"{res.loss.item()!r}, the original run logged {rec.loss.item()!r}. Likely causes (most usual "
                    "first): randomness outside torch's CPU generator (random.random(), numpy or an RNG of your "
                    "own inside forward), state the checkpoint does not capture (a non-persistent buffer or a "
                    "Python attribute that changes during training), a non-deterministic kernel or a different "
                    "thread count, or a model/data/world size other than the run that wrote the window. The "
                    "window is not loaded"
                )
        l0 = time.perf_counter()
        if active:  # a sliding slot also holds operators active already: leave them as the replay made them
            slot = Slot(slot.index, slot.active, slot.frozen, [it for it in slot.items if it.op not in active])
        nbytes += load_window_slot(slot, access)
        load_s += time.perf_counter() - l0
        active |= set(plan.active)
        if i:
            faults.point("recovery")
    if active != everyone:
        raise ValueError(f"{label}: its slots activate {len(active)} of {len(everyone)} operators; not a window")
    trainer.set_step(t0 + n - 1)
    phases = {"rebuild": rebuild_s, "load": load_s, "replay": replay_s}
    rep = RecoveryReport(
        window_id, n, t0, t0 + n - 1, n - 1, nbytes, time.perf_counter() - t_start, replay_s, load_s, rebuild_s, phases
    )
    log.debug("recovered %s", rep.to_dict())
    return rep
