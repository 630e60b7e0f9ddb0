"""The recovery sequence, written once: find the newest window every rank can get from the tiers (host
memory, then peers, then the object store), verify it, and convert it to the dense state by replay.

The harness, TorchTitan's trainer and the own-loop `Checkpointer` all call `recover`.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .dcp.tiers import Tiers, recover_from_tiers
from .operators import Operator
from .recovery import Replayable, sparse_to_dense
from .window import Window

log = logging.getLogger("torchmoe_ckpt.resume")

__all__ = ["ResumeResult", "recover"]


@dataclass
class ResumeResult:
    window: Window | None          # the window recovered from (the checkpointer's fallback until the next commits)
    recovered_step: int | None     # iterations completed after recovery; None = no window anywhere
    report: dict = field(default_factory=dict)

    @property
    def recovered(self) -> bool:
        return self.window is not None


def recover(trainer: Replayable, tiers: Tiers, ops: dict[str, Operator], compute_dtype: torch.dtype,
            rank: int = 0, before_replay: Callable[[Window], None] | None = None) -> ResumeResult:
    """Collective. Loads the newest usable window into `trainer` (freshly built) and replays it; with no
    window on any tier returns `recovered_step=None` and leaves the trainer untouched. `before_replay` is
    called with the fetched window before anything is loaded into the trainer."""
    t0 = time.perf_counter()
    window, found = recover_from_tiers(tiers.host, tiers.replicator, ops, compute_dtype, store=tiers.store)
    fetch_s = time.perf_counter() - t0
    if window is None:
        if rank == 0:
            log.info("event=no_window run_dir=%s: nothing to recover, a new run starts", tiers.host.dir)
        return ResumeResult(None, None, dict(found, fetch_seconds=fetch_s))
    if before_replay is not None:
        before_replay(window)
    rep = sparse_to_dense(trainer, window)
    report = dict(rep.to_dict(), **found, fetch_seconds=fetch_s, total_seconds=time.perf_counter() - t0)
    if rank == 0:
        log.info("event=recovered window=%d source=%s steps=%d..%d replayed=%d bytes=%d seconds=%.3f: every replayed "
                 "loss matched the original run bit for bit", window.id, found.get("source"), rep.start_step,
                 rep.recovered_step, rep.replayed_iterations, rep.bytes_loaded, report["total_seconds"])
    return ResumeResult(window, rep.recovered_step, report)
