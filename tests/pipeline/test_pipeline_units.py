"""In-process checks of the pipeline pieces: the boundary log (copy off the training thread, byte
accounting, collection, the bound and what happens when it is hit), the schedules' action order, and
recovery planning (segments, joint/independent recovery, every global fallback and its reason)."""

import logging

import pytest
import torch
from support.events import find

from torchmoe_ckpt.pipeline.boundary_log import BoundaryLog, LogReader
from torchmoe_ckpt.pipeline.recovery import StageStatus, contiguous_runs, plan_recovery
from torchmoe_ckpt.pipeline.stage_io import actions
from torchmoe_harness.pipeline_trainer import PipelineConfig
from torchmoe_harness.trainer import RunConfig


def fill(log: BoundaryLog, its, mbs=2, shape=(2, 4)):
    sent = {}
    for it in its:
        for mb in range(mbs):
            for d in ("fwd", "bwd"):
                t = torch.randn(shape)
                log.record(it, mb, d, t)
                sent[it, mb, d] = t.clone()
        log.record_meta(it, torch.tensor(1.5 + it), torch.tensor(2.0 * it))
    log.flush()
    return sent


def test_log_roundtrip_accounting_and_collection(tmp_path):
    log = BoundaryLog(tmp_path / "s0")
    sent = fill(log, range(1, 7))
    r = LogReader(tmp_path / "s0")
    assert all(torch.equal(r.get(it, mb, d), t) for (it, mb, d), t in sent.items())
    assert torch.equal(r.meta(4)["grad_norm"], torch.tensor(5.5))
    per_it = 2 * 2 * 2 * 4 * 4 + 2 * 4  # 2 mbs x 2 directions x [2,4] fp32, + two fp32 scalars
    assert log.stats()["bytes_per_iteration"] == per_it and log.held_bytes == 6 * per_it
    assert r.has(range(1, 7), 2, "fwd") and not r.has(range(1, 8), 2, "fwd")
    assert log.collect(3) == 3 * per_it and log.held_bytes == 3 * per_it
    assert not r.has([3], 2, "bwd") and r.has(range(4, 7), 2, "bwd")
    # a restarted process of the same stage finds and accounts what its predecessor logged
    assert BoundaryLog(tmp_path / "s0").held_bytes == 3 * per_it


def test_log_bound_stops_logging_until_collection(tmp_path, caplog):
    per_it = 2 * 2 * 2 * 4 * 4 + 2 * 4
    log = BoundaryLog(tmp_path / "s1", max_bytes=int(2.5 * per_it))
    with caplog.at_level(logging.WARNING, logger="torchmoe_ckpt.pipeline_log"):
        fill(log, range(1, 6))
    assert find(caplog.text, "pp_log_overflow")
    r = LogReader(tmp_path / "s1")
    assert r.has(range(1, 3), 2, "fwd") and not r.has([3], 2, "fwd") and not r.has([5], 0, None)
    assert log.gap_from == 3 and log.held_bytes <= log.max_bytes and log.overflows == 1
    log.collect(2)  # the window that needed 1..2 is superseded: held bytes drop, logging resumes
    assert log.gap_from is None
    fill(log, [6])
    assert r.has([6], 2, "bwd")


def test_schedules_order():
    for sched in ("gpipe", "1f1b"):
        for stage in range(3):
            acts = actions(sched, stage, 3, 4)
            assert sorted(acts) == sorted([("F", m) for m in range(4)] + [("B", m) for m in range(4)])
            # forwards and backwards each in micro-batch order: gradients accumulate identically
            assert [m for k, m in acts if k == "F"] == [0, 1, 2, 3] == [m for k, m in acts if k == "B"]
            assert all(acts.index(("F", m)) < acts.index(("B", m)) for m in range(4))
    assert actions("1f1b", 0, 3, 4)[:3] == [("F", 0), ("F", 1), ("F", 2)]  # warm-up depth P - s
    assert actions("1f1b", 2, 3, 4)[:2] == [("F", 0), ("B", 0)]


def test_bad_pipeline_config_names_the_fix():
    with pytest.raises(ValueError, match="batch_size 4 must be divisible by microbatches 3"):
        PipelineConfig(stages=2, microbatches=3).validate(RunConfig(batch_size=4))
    with pytest.raises(ValueError, match="set model.n_layers >= stages"):
        PipelineConfig(stages=3).validate(RunConfig(batch_size=4))  # the default model has 2 layers
    with pytest.raises(ValueError, match="Interleaved1F1B is not supported"):
        PipelineConfig(schedule="interleaved").validate(RunConfig())


@pytest.fixture
def logs(tmp_path):
    """Four stages' logs covering iterations 1..9, and a fifth one with a gap from iteration 6."""
    dirs = [tmp_path / f"stage-{s}" for s in range(5)]
    for s, d in enumerate(dirs):
        fill(BoundaryLog(d), range(1, 6) if s == 4 else range(1, 10), shape=(1,))
    return dirs


def st(stage, healthy, step=9, windows=None):
    return StageStatus(stage, healthy, step if healthy else None, windows or {0: 1, 1: 4})


def test_plan_single_middle_failure(logs):
    plan = plan_recovery([st(0, True), st(1, False), st(2, True), st(3, True)], logs, 2)
    assert plan.mode == "local" and plan.target_step == 9
    [seg] = plan.segments
    assert (seg.first, seg.last, seg.up, seg.down, seg.window_id, seg.start_step) == (1, 1, 0, 2, 1, 4)


def test_plan_adjacent_joint_and_disjoint_independent(logs):
    plan = plan_recovery([st(0, True), st(1, False), st(2, False), st(3, True)], logs, 2)
    assert [(s.first, s.last, s.up, s.down) for s in plan.segments] == [(1, 2, 0, 3)]
    plan = plan_recovery([st(0, False), st(1, True), st(2, True), st(3, False)], logs, 2)
    assert [(s.first, s.last, s.up, s.down) for s in plan.segments] == [(0, 0, None, 1), (3, 3, 2, None)]
    assert contiguous_runs([3, 0, 1, 5]) == [(0, 1), (3, 3), (5, 5)]


def test_plan_segment_window_common_to_its_stages(logs):
    plan = plan_recovery(
        [st(0, True), st(1, False, windows={0: 1, 1: 4}), st(2, False, windows={1: 4, 2: 7}), st(3, True)], logs, 2
    )
    assert plan.segments[0].window_id == 1  # stage 2 already has window 2; stage 1 has not: the common one


def test_plan_global_fallbacks_say_why(logs):
    plan = plan_recovery([st(s, False) for s in range(4)], logs, 2)
    assert plan.mode == "global" and plan.window_id == 1 and "no live neighbour" in plan.reason
    gap = [logs[0], logs[1], logs[4], logs[3]]  # stage 2 stopped logging at iteration 6 (its bound was hit)
    plan = plan_recovery([st(0, True), st(1, True), st(2, True), st(3, False)], gap, 2)
    assert plan.mode == "global" and "stage 2's forward log misses" in plan.reason
    plan = plan_recovery([st(0, True, step=8), st(1, False), st(2, True), st(3, True)], logs, 2)
    assert plan.mode == "global" and "different iterations" in plan.reason
    plan = plan_recovery(
        [st(0, True), st(1, False, windows={0: 1}), st(2, False, windows={1: 4}), st(3, True)], logs, 2
    )
    # no window common to the segment is none common to all stages either: start over, and say so
    assert plan.mode == "cold" and "no committed window in common" in plan.reason and "start over" in plan.reason
    assert plan_recovery([st(0, True), st(1, True)], logs, 2).mode == "none"
