"""Shared pieces of the baselines: a fresh trainer after a failure, restoring host copies into it, and the RNG
state (CPU and GPU generators) a snapshot is taken with."""

from __future__ import annotations

import time

import torch

from torchmoe_ckpt import rng
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
        trainer.before_update.append(self.before_update)
        return self

    def _wait_for_copy(self, until_done: bool = False) -> bool:
        """Before an update: wait until the copy in flight no longer needs its sources (on a GPU, on the device);
        `until_done` (before the next snapshot replaces the pending one): until it is on the host. True if a
        pending snapshot is complete."""
        t0 = time.perf_counter()
        self.engine.wait_done() if until_done else self.engine.wait()
        self.wait.add(t0)
        return self.pending is not None and self.pending[0].complete


def rng_state() -> tuple[torch.Tensor, dict | None]:
    """The CPU and device generators' states now (torchmoe_ckpt.rng), for `restore_rng` after a recovery."""
    cpu, device = rng.capture()
    return cpu.clone(), device


def restore_rng(state: tuple[torch.Tensor, dict | None]) -> None:
    rng.restore(*state)
