"""Shared pieces of the baselines: a fresh trainer after a failure, restoring host copies into it, and the RNG
state (CPU and GPU generators) a snapshot is taken with."""

from __future__ import annotations

import time

import torch

from torchmoe_ckpt.capture.snapshot import ROLES_FULL, StateAccess, restore_slot
from torchmoe_ckpt.recovery import rng
from torchmoe_ckpt.recovery.sparse_to_dense import init_optimizer_state
from torchmoe_harness.trainer import Trainer

FULL_ROLES = ROLES_FULL + ("step", "buffer")


@torch.no_grad()
def lose_state(trainer: Trainer) -> None:
    """The failure, emulated in place and the same for every system: every tensor of the training state
    (parameters, buffers, optimizer state, steps included) becomes NaN, and the iteration counter, LR schedule,
    RNG and gradients are those of a freshly started process. A recovery loads into these very tensors (as a
    restarted process would into the model it built): whatever it forgets stays NaN and shows against the
    fault-free run. Model building is not part of any system's recovery (the restart section measures it)."""
    from torchmoe_harness.trainer import local

    tensors = [local(t) for t in (*trainer.model.parameters(), *trainer.model.buffers())]
    tensors += [local(v) for st in trainer.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    for t in tensors:
        t.fill_(float("nan") if t.is_floating_point() else -1)
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.set_step(0)
    torch.manual_seed(20_011)  # a new process's generator, not the run's


def fresh_trainer(old: Trainer) -> Trainer:
    """What a restarted rank has: the same config, *different* initial weights (so anything a recovery
    forgets to restore shows up against the fault-free run), optimizer state allocated for in-place loads."""
    cfg = old.cfg
    fresh = Trainer(cfg, init_seed=cfg.seed + 7777)
    init_optimizer_state(fresh.optimizer)
    return fresh


def restore_slots(trainer: Trainer, slots) -> int:
    """Copy host slots (oldest first) back into the trainer's live tensors; returns bytes."""
    access = StateAccess(trainer.model, trainer.optimizer)
    return sum(restore_slot(s, access, roles=FULL_ROLES) for s in slots)


def restored_trainer(old: Trainer, slots, step: int, rng_states: tuple) -> Trainer:
    """A fresh trainer (other initial weights) with host `slots` (oldest first) loaded, positioned at `step`,
    and the RNG state (`rng_state()`) the snapshot was taken with."""
    fresh = fresh_trainer(old)
    restore_slots(fresh, slots)
    fresh.set_step(step)
    restore_rng(rng_states)
    return fresh


class Timer:
    """Training-thread wait accounting."""

    def __init__(self):
        self.total = 0.0
        self.max = 0.0

    def add(self, t0: float) -> None:
        dt = time.perf_counter() - t0
        self.total += dt
        self.max = max(self.max, dt)


class HostCopyBaseline:
    """What the host-snapshot baselines share: a SnapshotEngine copying off the training thread, waited for
    (and timed) before the next update overwrites its sources. Subclasses set engine, wait, pending."""

    def attach(self, trainer):
        if self.before_update not in trainer.before_update:  # the same trainer again after an in-place recovery
            trainer.before_update.append(self.before_update)
        return self

    def _settle(self) -> None:
        """After the state was lost: the copy in flight (if any) is torn, its snapshot never counts."""
        try:
            self.engine.wait_done()
        except Exception:  # a torn copy's error belongs to the failure
            pass
        self.pending = None

    def _wait_for_copy(self, until_done: bool = False) -> bool:
        """Before an update: wait until the copy in flight no longer needs its sources (on a GPU, on the device);
        `until_done` (before the next snapshot replaces the pending one): until it is on the host. True if a
        pending snapshot is complete."""
        t0 = time.perf_counter()
        self.engine.wait_done() if until_done else self.engine.wait()
        self.wait.add(t0)
        return self.pending is not None and self.pending[0].complete


def rng_state() -> tuple[torch.Tensor, dict | None]:
    """The CPU and device generators' states now (torchmoe_ckpt.recovery.rng), for `restore_rng` after a recovery."""
    cpu, device = rng.capture()
    return cpu.clone(), device


def restore_rng(state: tuple[torch.Tensor, dict | None]) -> None:
    rng.restore(*state)
