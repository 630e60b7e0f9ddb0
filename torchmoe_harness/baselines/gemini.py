"""Gemini-style in-memory checkpointing: every k iterations, a dense snapshot of this rank's whole state
(fp32 master weights, AdamW moments and steps, buffers) into host memory, copied off the training thread
by the same SnapshotEngine our slots use: on a GPU into pinned buffers on a side stream, ordered after the
optimizer step by an event, the next update ordered after the copy on the device. Two host buffers alternate, so
the newest *complete* snapshot survives while the next one is being copied. (Gemini also pushes the snapshot to a
peer's CPU memory; not done here: the peer copy's cost is our replication path's, measured separately.)

The training thread never waits on the host for a snapshot to land (a fair GPU baseline: waiting would throw away
the host's lead over the device every iteration). A snapshot goes into the buffer of the one before the previous:
the device runs the copies in order and the update between them waits for the previous copy, so that buffer's
copy finished before this one starts, and the other buffer always holds a complete snapshot. Which buffer holds
the newest complete one is read at recovery, from what the copy thread has finished at that moment.
Recovery loads it into the trainer that lost its state: exact, everything after it is redone."""

from __future__ import annotations

import time

from torchmoe_ckpt.capture.snapshot import SnapshotEngine, StateAccess
from torchmoe_ckpt.core.slot import build_slot
from torchmoe_ckpt.model.operators import discover_operators
from torchmoe_ckpt.recovery.sparse_to_dense import init_optimizer_state
from torchmoe_harness.baselines.common import HostCopyBaseline, Timer, restore_rng, restore_slots, rng_state

_ALIGN = 64


def _file_alloc(shm_dir: str, index: int, names: tuple, by_name: dict, trainer):
    """An allocator for `build_slot` whose tensors are views of one file `<shm_dir>/snapshot-<rank>-<index>` mapped
    shared: the snapshot copy writes the file's pages, which outlive the process. Mapped as our slot files are
    (storage_format.mapped_files.map_file: allocated and populated before the loop, so neither system's first
    copies pay page faults the other does not)."""
    import os

    import torch

    from torchmoe_ckpt.storage_format.mapped_files import map_file

    sizes: list[int] = []

    def measure(shape, dtype):
        t = torch.empty(shape, dtype=dtype, device="meta")
        sizes.append(-(-t.numel() * t.element_size() // _ALIGN) * _ALIGN)
        return t

    build_slot(index, names, (), by_name, trainer.compute_dtype, alloc=measure)  # sizes only (meta tensors)
    rank = trainer.rank
    os.makedirs(shm_dir, exist_ok=True)
    path = os.path.join(shm_dir, f"snapshot-{rank}-{index}")
    total = max(_ALIGN, sum(sizes))
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _mm, mem = map_file(fd, total)  # the view keeps the mapping alive
    finally:
        os.close(fd)  # a mapping outlives its descriptor
    offset = [0]

    def alloc(shape, dtype):
        t = torch.empty(shape, dtype=dtype, device="meta")
        n = t.numel() * t.element_size()
        view = mem[offset[0] : offset[0] + n].view(dtype).view(shape)
        offset[0] += -(-n // _ALIGN) * _ALIGN
        return view

    return alloc


class HostDense(HostCopyBaseline):
    exact = True

    def __init__(self, trainer, every: int = 1, throttle_bytes_per_s: float | None = None, shm_dir: str | None = None):
        """`shm_dir`: each snapshot buffer is a file there (/dev/shm: the copy writes where a kill -9 leaves it, the
        durability ours has with its host tier); None: process memory, which a kill -9 takes with it (Gemini's own
        design, not durable against a process loss)."""
        self.every = every
        self.shm_dir = shm_dir
        self.throttle = throttle_bytes_per_s  # an emulated slower host link (SnapshotEngine.throttle_bytes_per_s)
        ops = discover_operators(trainer.model)
        names = tuple(o.name for o in ops)
        self.engine = self._engine(trainer)  # on the model's device
        pin = self.engine.use_cuda  # pinned host buffers on a GPU, as our slots: the same copy path, a fair price
        by_name = {o.name: o for o in ops}
        if shm_dir is None:
            self.buffers = [build_slot(i, names, (), by_name, trainer.compute_dtype, pin_memory=pin) for i in (0, 1)]
        else:
            self.buffers = [
                build_slot(
                    i, names, (), by_name, trainer.compute_dtype, alloc=_file_alloc(shm_dir, i, names, by_name, trainer)
                )
                for i in (0, 1)
            ]
        self.taken: list[tuple | None] = [None, None]  # per buffer: (step, RNG state) of the snapshot queued into it
        self.pending = None  # HostCopyBaseline's: no snapshot is promoted on the training thread
        self.wait = Timer()
        self.checkpoints = 0

    def _engine(self, trainer) -> SnapshotEngine:
        engine = SnapshotEngine(StateAccess(trainer.model, trainer.optimizer))
        engine.throttle_bytes_per_s = self.throttle
        return engine

    def before_update(self, until_done: bool = False) -> None:
        self._wait_for_copy(until_done)  # on a GPU: the update waits for the copy in flight on the device

    def after_step(self, trainer, res) -> None:
        if trainer.step % self.every:
            return
        i = self.checkpoints % 2
        t0 = time.perf_counter()
        self.engine.capture(self.buffers[i], trainer.step)  # waits only until the previous copy is queued
        self.wait.add(t0)
        self.taken[i] = (trainer.step, rng_state())
        self.checkpoints += 1

    def latest(self):
        """(slot, step, RNG state) of the newest snapshot on the host now, or None."""
        done = [
            (taken[0], slot, taken[1])
            for slot, taken in zip(self.buffers, self.taken)
            if taken is not None and slot.complete and slot.step == taken[0]
        ]
        if not done:
            return None
        step, slot, rng = max(done, key=lambda d: d[0])
        return slot, step, rng

    def recover(self, trainer, failed_at: int):
        """Load the newest complete snapshot into `trainer`, whose state was lost in place (common.lose_state);
        with none yet, a new trainer from the deterministic initialisation."""
        t0 = time.perf_counter()
        latest = self.latest()  # what is on the host at the failure (a copy still in flight is lost)
        self._settle()  # nothing may still read the live tensors the snapshot is loaded into
        if latest is None:
            from torchmoe_harness.baselines.dense_dcp import fresh_trainer_plain

            self.engine.shutdown()
            trainer, step = fresh_trainer_plain(trainer.cfg), 0
            self.engine = self._engine(trainer)
            self.taken = [None, None]
            phases = {"rebuild": time.perf_counter() - t0}
        else:
            slot, step, rng = latest
            self.taken = [t if t is not None and t[0] == step else None for t in self.taken]
            t1 = time.perf_counter()
            init_optimizer_state(trainer.optimizer)  # a no-op unless the state is gone
            t2 = time.perf_counter()
            restore_slots(trainer, [slot])
            trainer.set_step(step)
            restore_rng(rng)
            phases = {"find": t1 - t0, "rebuild": t2 - t1, "load": time.perf_counter() - t2}
        return trainer, {"recovered_step": step, "seconds": time.perf_counter() - t0, "phases": phases}

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
            "host_bytes": sum(b.nbytes for b in self.buffers),  # the two snapshot buffers (pinned on a GPU)
            "copy": dict(self.engine.copy_totals),  # this engine's copies (since its last rebuild)
            "durable": self.shm_dir is not None,  # written where a kill -9 leaves it
        }
