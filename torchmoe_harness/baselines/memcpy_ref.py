"""The copy roofline under training: after every update, one plain memcpy of as many bytes as a dense snapshot
of this rank, on a background thread, between two preallocated contiguous buffers (no model state, no
per-tensor calls). Its copy-thread CPU per byte is what any host copy costs on this machine while training
runs beside it (memory bandwidth and caches are shared with compute); an idle memcpy is faster. It
checkpoints nothing: it exists so the bench can tell copy-path overhead from the machine's contention."""

from __future__ import annotations

import threading
import time

import torch

from torchmoe_ckpt.model.operators import discover_operators
from torchmoe_harness.baselines.common import HostCopyBaseline, Timer


class _Engine:
    """One job at a time on one thread; copy_totals as SnapshotEngine keeps them (the bench reads those)."""

    def __init__(self, nbytes: int):
        self.src = torch.ones(nbytes, dtype=torch.uint8)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)  # both touched: no first-touch faults in a timed copy
        self.copy_totals = {"copies": 0, "bytes": 0, "wall_s": 0.0, "cpu_s": 0.0}
        self._go, self._done = threading.Event(), threading.Event()
        self._done.set()
        self._stop = False
        threading.Thread(target=self._run, name="tmoe-memcpy-ref", daemon=True).start()

    def start(self) -> None:
        self._done.clear()
        self._go.set()

    def wait(self) -> None:
        self._done.wait()

    wait_done = wait  # a host copy: queued and done are the same

    def shutdown(self) -> None:
        self._stop = True
        self._go.set()

    def _run(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            if self._stop:
                return
            t0, c0 = time.perf_counter(), time.thread_time()
            self.dst.copy_(self.src)
            tot = self.copy_totals
            tot["copies"] += 1
            tot["bytes"] += self.src.numel()
            tot["wall_s"] += time.perf_counter() - t0
            tot["cpu_s"] += time.thread_time() - c0
            self._done.set()


class MemcpyRef(HostCopyBaseline):
    exact = False  # nothing to recover from

    def __init__(self, trainer):
        nbytes = sum(o.full_bytes() for o in discover_operators(trainer.model))
        self.engine = _Engine(nbytes)
        self.wait = Timer()
        self.pending = None
        self.checkpoints = 0
        self.nbytes = nbytes

    def before_update(self) -> None:
        self._wait_for_copy()

    def after_step(self, trainer, res) -> None:
        self.before_update()
        self.engine.start()
        self.checkpoints += 1

    def close(self) -> None:
        self.engine.wait()
        self.engine.shutdown()

    def stats(self) -> dict:
        return {"checkpoints": self.checkpoints, "interval": 1, "bytes_per_checkpoint": self.nbytes}
