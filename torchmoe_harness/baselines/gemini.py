"""Gemini-style in-memory checkpointing: every k iterations, a dense snapshot of this rank's whole state
(fp32 master weights, AdamW moments and steps, buffers) into host memory, copied off the training thread
by the same SnapshotEngine our slots use. Two host buffers alternate, so the newest *complete* snapshot
survives while the next one is being copied. (Gemini also pushes the snapshot to a peer's CPU memory;
not done here: the peer copy's cost is our replication path's, measured separately as sparse_W4_tiers.)
Recovery loads the newest complete snapshot into a fresh trainer: exact, everything after it is redone."""

from __future__ import annotations

import time

from torchmoe_ckpt.operators import discover_operators
from torchmoe_ckpt.snapshot import SnapshotEngine, StateAccess, build_slot
from torchmoe_harness.baselines.common import HostCopyBaseline, Timer, restored_trainer, rng_state


class HostDense(HostCopyBaseline):
    exact = True

    def __init__(self, trainer, every: int = 1):
        self.every = every
        ops = discover_operators(trainer.model)
        names = tuple(o.name for o in ops)
        self.engine = SnapshotEngine(StateAccess(trainer.model, trainer.optimizer))  # on the model's device
        pin = self.engine.use_cuda  # pinned host buffers on a GPU, as our slots: the same copy path, a fair price
        by_name = {o.name: o for o in ops}
        self.buffers = [build_slot(i, names, (), by_name, trainer.compute_dtype, pin_memory=pin) for i in (0, 1)]
        self.latest = None  # (slot, step, rng) of the newest complete snapshot
        self.pending = None
        self.wait = Timer()
        self.checkpoints = 0

    def before_update(self, until_done: bool = False) -> None:
        if self._wait_for_copy(until_done):
            self.latest, self.pending = self.pending, None

    def after_step(self, trainer, res) -> None:
        if trainer.step % self.every:
            return
        self.before_update(until_done=True)  # one copy in flight at a time; the finished one becomes the latest
        slot = self.buffers[self.checkpoints % 2]
        t0 = time.perf_counter()
        self.engine.capture(slot, trainer.step)
        self.wait.add(t0)
        self.pending = (slot, trainer.step, rng_state())
        self.checkpoints += 1

    def recover(self, trainer, failed_at: int):
        self.engine.shutdown()
        t0 = time.perf_counter()
        if self.latest is None:
            from torchmoe_harness.baselines.dense_dcp import fresh_trainer_plain

            fresh, step = fresh_trainer_plain(trainer.cfg), 0
        else:
            slot, step, rng = self.latest
            fresh = restored_trainer(trainer, [slot], step, rng)
        self.engine = SnapshotEngine(StateAccess(fresh.model, fresh.optimizer))
        self.pending = None
        return fresh, {"recovered_step": step, "seconds": time.perf_counter() - t0}

    def close(self) -> None:
        self.before_update(until_done=True)
        self.engine.shutdown()

    def stats(self) -> dict:
        return {
            "checkpoints": self.checkpoints,
            "interval": self.every,
            "wait_seconds_total": self.wait.total,
            "wait_seconds_max": self.wait.max,
            "bytes_per_checkpoint": self.buffers[0].nbytes,
        }
