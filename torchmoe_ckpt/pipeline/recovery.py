"""Localized recovery for pipeline stages (MoEvement section 3.4 and Appendix A).

A pure plan from what every stage reports after a failure (healthy or not, its committed windows, its boundary
log). Failed stages form contiguous segments; each loads the newest window common to its stages and replays to
the healthy stages' iteration, its border inputs taken from the neighbours' logs, while healthy stages wait.
Global recovery (every stage rolls back to a common window) when no stage is healthy, healthy stages stopped at
different iterations, a segment has no common window, or a border log misses an iteration
(`event=pp_recovery mode=global reason=...`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import cast

import torch

from ..recovery.replay_log import Replay
from ..recovery.sparse_to_dense import sparse_to_dense
from .boundary_log import LogReader
from .stage_io import Logged, Peer, StageIO, StageReplayable

log = logging.getLogger("torchmoe_ckpt.pipeline_recovery")


@dataclass
class StageStatus:
    stage: int
    healthy: bool  # its live state after iteration `step` survived
    step: int | None  # healthy: iterations completed
    windows: dict[int, int]  # committed window id -> start step, verified on its host tier


@dataclass
class Segment:
    first: int
    last: int
    window_id: int
    start_step: int
    up: int | None  # the border stage whose forward log feeds `first` (None: pipeline start)
    down: int | None  # the border stage whose backward log feeds `last` (None: pipeline end)

    @property
    def stages(self) -> list[int]:
        return list(range(self.first, self.last + 1))


@dataclass
class RecoveryPlan:
    mode: str  # none | local | global | cold
    target_step: int | None = None
    segments: list[Segment] = field(default_factory=list)
    window_id: int | None = None  # global: the window every stage rolls back to
    reason: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    def segment_of(self, stage: int) -> Segment | None:
        return next((s for s in self.segments if s.first <= stage <= s.last), None)


def contiguous_runs(stages: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for s in sorted(stages):
        if runs and runs[-1][1] == s - 1:
            runs[-1] = (runs[-1][0], s)
        else:
            runs.append((s, s))
    return runs


def _common_windows(members: list[StageStatus]) -> list[int]:
    held = set.intersection(*(set(s.windows) for s in members))
    return [w for w in held if len({s.windows[w] for s in members}) == 1]


def plan_recovery(statuses: list[StageStatus], log_dirs: list, microbatches: int) -> RecoveryPlan:
    """Decide who replays what: the failed stages alone ("local", from their neighbours' boundary logs), every
    stage ("global", from the newest window common to all), "cold" (start over) or "none".

    Args:
        statuses: every stage's report (healthy, iterations completed, committed windows), indexed by stage.
        log_dirs: `log_dirs[s]` is stage s's boundary-log directory (readable here).
        microbatches: micro-batches per iteration (a border log must hold every one of them).

    Returns:
        The plan; its `reason` says in words why it is not "local" when it is not.
    """
    n = len(statuses)
    failed = [s.stage for s in statuses if not s.healthy]
    if not failed:
        return RecoveryPlan("none", target_step=statuses[0].step)
    healthy_steps = {cast(int, s.step) for s in statuses if s.healthy}  # a healthy stage's step is set

    def global_plan(reason: str) -> RecoveryPlan:
        common = _common_windows(statuses)
        if not common:
            return RecoveryPlan("cold", reason=f"{reason}; and no window common to all stages: start over")
        return RecoveryPlan("global", window_id=max(common), reason=reason)

    if not healthy_steps:
        return global_plan("no live neighbour: every stage failed")
    if len(healthy_steps) > 1:
        return global_plan(f"healthy stages stopped at different iterations {sorted(healthy_steps)}")
    target = healthy_steps.pop()
    segments = []
    for a, b in contiguous_runs(failed):
        members = statuses[a : b + 1]
        usable = [w for w in _common_windows(members) if members[0].windows[w] < target]
        if not usable:
            return global_plan(f"stages {a}..{b} have no committed window in common before iteration {target}")
        wid = max(usable)
        t0 = members[0].windows[wid]
        up = a - 1 if a > 0 else None
        down = b + 1 if b < n - 1 else None
        its = range(t0 + 1, target + 1)
        for border, direction, word in ((up, "fwd", "forward"), (down, "bwd", "backward")):
            if border is not None and not LogReader(log_dirs[border]).has(its, microbatches, direction):
                why = (
                    f"stage {border}'s {word} log misses an iteration of {t0 + 1}..{target} (log bound hit or log lost)"
                )
                return global_plan(why)
        segments.append(Segment(a, b, wid, t0, up, down))
    return RecoveryPlan(
        "local",
        target_step=target,
        segments=segments,
        reason=f"stages {failed} failed; segments {[(s.first, s.last) for s in segments]}",
    )


def segment_io(trainer: StageReplayable, seg: Segment, log_dirs: list) -> StageIO:
    """Inside the segment: live neighbours; at its borders: the border stages' logs."""
    s = trainer.stage

    def side(n: int, inside: bool, border: int | None, direction: str) -> Peer | Logged | None:
        if not 0 <= n < trainer.n_stages:
            return None
        return Peer(trainer.ranks[n]) if inside else Logged(LogReader(log_dirs[border]), direction)  # pyright: ignore[reportCallIssue, reportArgumentType]  (outside: a border stage)

    up = side(s - 1, s - 1 >= seg.first, seg.up, "fwd")
    down = side(s + 1, s + 1 <= seg.last, seg.down, "bwd")
    border = seg.up if seg.up is not None else seg.down  # a segment has a live neighbour on one side at least
    return StageIO(up, down, meta=LogReader(log_dirs[border]))  # pyright: ignore[reportCallIssue, reportArgumentType]


def recover_in_segment(trainer: StageReplayable, window, seg: Segment, target: int, log_dirs: list) -> dict:
    """Recover one failed stage inside its segment. Phase 1: sparse-to-dense over the window; phase 2: replay to
    the healthy stages' iteration, boundary tensors from live neighbours inside the segment and from the border
    stages' logs at its edges.

    Args:
        trainer: this stage's trainer.
        window: the segment's window (`Segment.window_id`), loaded.
        seg: this stage's segment of the plan (`RecoveryPlan.segment_of`).
        target: the healthy stages' iteration (`RecoveryPlan.target_step`).
        log_dirs: every stage's boundary-log directory.

    Returns:
        The recovery report (sparse_to_dense's, plus mode, segment, iterations replayed and seconds).
    """
    t_start = time.perf_counter()
    trainer.replay_io = segment_io(trainer, seg, log_dirs)
    if trainer.log is not None:
        trainer.log.clear()  # this stage's own log went down with it; what it replays is logged again
    rep = sparse_to_dense(trainer, window).to_dict()
    meta = trainer.replay_io.meta
    assert meta is not None  # segment_io always gives the border's log
    for t in range(trainer.step + 1, target + 1):
        rec = meta.meta(t)
        # No operator here draws random numbers; the state is passed only to keep the replay contract.
        trainer.train_step(Replay(trainer.batch(t), rec["grad_norm"], torch.get_rng_state()))
    trainer.replay_io = None
    rep.update(
        mode="local",
        segment=[seg.first, seg.last],
        phase2_iterations=target - window.start_step - window.plan.window + 1,
        replayed_total=trainer.replayed_iterations,
        recovered_step=trainer.step,
        seconds=time.perf_counter() - t_start,
    )
    log.info(
        f"event=pp_stage_recovered stage={trainer.stage} segment={seg.first}..{seg.last} window={window.id} "
        f"t0={window.start_step} target={target} replayed={trainer.replayed_iterations} seconds={rep['seconds']:.3f}"
    )
    return rep


def recover_global(trainer: StageReplayable, window) -> dict:
    """Every stage rolls back to `window` and replays it jointly, live, like training (collective over the
    pipeline: every stage calls it).

    Args:
        trainer: this stage's trainer.
        window: the window every stage rolls back to (`RecoveryPlan.window_id`), loaded.

    Returns:
        The recovery report (sparse_to_dense's, plus mode, iterations replayed and seconds).
    """
    t_start = time.perf_counter()
    io = trainer.live_io
    trainer.replay_io = StageIO(io.up, io.down, meta=None, reduce_loss=True)
    if trainer.log is not None:
        trainer.log.drop_from(window.start_step + 1)
    rep = sparse_to_dense(trainer, window).to_dict()
    trainer.replay_io = None
    rep.update(mode="global", replayed_total=trainer.replayed_iterations, seconds=time.perf_counter() - t_start)
    return rep
