"""Pipeline-parallel stage I/O with boundary logging: where a stage's boundary tensors come from and go to, the
explicit GPipe/1F1B action order, and what localized recovery needs from a stage trainer (`StageReplayable`).

An explicit schedule (stock schedules: `pipeline_stock.py`) lets a replay run one stage, or a run of stages, with
inputs from the neighbours' logs (`Logged`) instead of live sends (`Peer`), doing bit-for-bit the original
arithmetic. Both schedules run forwards and backwards in micro-batch order, so they give identical results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from ..recovery.sparse_to_dense import Replayable
from .boundary_log import BoundaryLog, LogReader

SCHEDULES = ("gpipe", "1f1b")


def actions(schedule: str, stage: int, stages: int, mbs: int) -> list[tuple[str, int]]:
    """[("F", mb) | ("B", mb)] in execution order for this stage."""
    if schedule == "gpipe":
        return [("F", m) for m in range(mbs)] + [("B", m) for m in range(mbs)]
    warm = min(stages - stage - 1, mbs)
    out = [("F", m) for m in range(warm)]
    for i in range(mbs - warm):  # steady state: one forward, one backward
        out += [("F", warm + i), ("B", i)]
    return out + [("B", m) for m in range(mbs - warm, mbs)]


class Peer:
    """A live neighbour rank: gloo point-to-point. Sends are asynchronous (waited at the end of the iteration),
    receives block: with action lists ordered by their data dependencies this cannot deadlock."""

    def __init__(self, rank: int):
        self.rank = rank
        self.pending: list = []

    def send(self, t: torch.Tensor, tag: int) -> None:
        self.pending.append(dist.isend(t.contiguous(), self.rank, tag=tag))

    def recv(self, shape, dtype, tag: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype)
        dist.recv(buf, self.rank, tag=tag)
        return buf

    def finish(self) -> None:
        for w in self.pending:
            w.wait()
        self.pending.clear()


class Logged:
    """A neighbour that is not running: its log stands in for its sends; what we would send it is only logged."""

    def __init__(self, reader: LogReader, direction: str):
        self.reader, self.direction = reader, direction

    def fetch(self, it: int, mb: int) -> torch.Tensor:
        return self.reader.get(it, mb, self.direction)


def boundary_tag(it: int, mb: int, backward: bool) -> int:
    """The gloo tag of one boundary tensor: unique per (iteration mod 4096, micro-batch, direction)."""
    return ((it % 4096) * 4096 + mb) * 2 + int(backward)


@dataclass
class StageIO:
    """Upstream/downstream of one stage for one run mode. up/down: Peer, Logged or None (pipeline end)."""

    up: Peer | Logged | None
    down: Peer | Logged | None
    meta: LogReader | None = None  # replay: where the global grad norm / loss of iterations come from
    reduce_loss: bool = False  # replay by every stage at once (global recovery): all-reduce the loss


class StageReplayable(Replayable, Protocol):
    """What localized pipeline recovery needs from one stage's trainer, on top of `Replayable`."""

    stage: int  # this stage's index, 0..n_stages-1
    n_stages: int
    ranks: list[int]  # the rank of every stage
    step: int  # iterations completed
    log: BoundaryLog | None  # what this stage sends, logged (None: no logging)
    live_io: StageIO  # the live neighbours, as in training
    replay_io: StageIO | None  # set by recovery while this stage replays, None otherwise
    replayed_iterations: int  # recomputation counter

    def batch(self, step: int) -> torch.Tensor: ...
