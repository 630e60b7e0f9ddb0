"""Shared pieces of the baselines: a fresh trainer after a failure, and restoring host copies into it."""

from __future__ import annotations

import time

import torch

from torchmoe_ckpt.snapshot import ROLES_FULL, StateAccess, restore_slot
from torchmoe_ckpt.sparse_to_dense import init_optimizer_state
from torchmoe_harness.trainer import Trainer

FULL_ROLES = ROLES_FULL + ("step", "buffer")


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
        trainer.before_update.append(self.before_update)
        return self

    def _wait_for_copy(self) -> bool:
        """Wait for the copy in flight; True if a pending snapshot has just become complete."""
        t0 = time.perf_counter()
        self.engine.wait()
        self.wait.add(t0)
        return self.pending is not None and self.pending[0].complete


def rng_state() -> torch.Tensor:
    return torch.get_rng_state().clone()
