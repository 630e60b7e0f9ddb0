"""The copy path's fix switches (docs/gpu.md, "The fix switches"), each on the CPU where its code path runs:
`reads_on_copy_stream` (the same values as the training-stream path), `copy_phase="backward"` (issued from the
next backward, exact through a failure and a recovery), `device_staging` (accounting, refusal, exact), and the
device-loss pricing of auto W (calibration.py: the rule on synthetic measurements, and in the checkpointer)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from support.tiny_moe import Net, assert_same, batch_for, train  # tests/ is on sys.path under pytest

import torchmoe_ckpt as tmc
from torchmoe_ckpt.capture.device_staging import HEADROOM, DeviceStaging, staging_fits
from torchmoe_ckpt.capture.snapshot import StateAccess
from torchmoe_ckpt.planning.calibration import (
    CALIBRATION_STEPS,
    WARMUP_STEPS,
    DeviceLoss,
    cost_per_byte,
    overhead_budget,
)
from torchmoe_ckpt.planning.schedule import choose_window
from torchmoe_ckpt.runtime.deferred_reads import HostReads
from torchmoe_ckpt.runtime.device_copy import CopyStream, host_copy


def _records(ckpt) -> dict:
    return {s: r for w in (ckpt.sparse.committed,) for s, r in w.log.records.items()}


def test_config_defaults_and_one_line_refusals():
    cfg = tmc.SparseConfig()
    assert (cfg.reads_on_copy_stream, cfg.copy_phase, cfg.device_staging) == (True, "after_update", False)
    assert cfg.max_step_overhead == 0.02 and cfg.copy_chunk_bytes is None
    with pytest.raises(tmc.ConfigError, match="copy_phase 'forward' is not one of after_update, backward"):
        tmc.SparseConfig(copy_phase="forward")  # pyright: ignore[reportArgumentType]
    with pytest.raises(tmc.ConfigError, match="SparseConfig.device_staging must be true or false, got 1"):
        tmc.SparseConfig(device_staging=1)  # pyright: ignore[reportArgumentType]
    with pytest.raises(tmc.ConfigError, match="reads_on_copy_stream must be true or false"):
        tmc.SparseConfig(reads_on_copy_stream="yes")  # pyright: ignore[reportArgumentType]
    for bad in (0, 1.5, "2%"):
        with pytest.raises(tmc.ConfigError, match=r"max_step_overhead must be a share of the step in \(0, 1\]"):
            tmc.SparseConfig(max_step_overhead=bad)  # pyright: ignore[reportArgumentType]


def test_reads_on_the_copy_stream_equal_the_training_stream_path_and_are_own_copies():
    tree = {"tokens": torch.arange(12).view(3, 4), "x": (torch.tensor(2.5), 3, None), "h": [{"m": torch.ones(2)}]}
    on, off = HostReads(CopyStream("cpu"), True), HostReads(CopyStream("cpu"), False)
    got, ref = on.copy(tree, clone_cpu=True), off.copy(tree, clone_cpu=True)
    assert torch.equal(got["tokens"], ref["tokens"]) and torch.equal(got["x"][0], ref["x"][0])
    assert got["x"][1:] == (3, None) and torch.equal(got["h"][0]["m"], host_copy(tree)["h"][0]["m"])
    passed = on.copy(tree)  # without clone_cpu a host tensor is passed on as it is, as host_copy does
    assert passed["tokens"] is not tree["tokens"] and passed["tokens"].data_ptr() == tree["tokens"].data_ptr()
    tree["tokens"].add_(100)  # the caller reuses its buffer: the clone_cpu read is a copy of its own
    assert int(got["tokens"].max()) == 11 and on.landed() is None and on.reads == off.reads + 3 == 6
    assert on.copy(None) is None and on.copy((1, "a")) == (1, "a")


def test_records_and_counts_through_the_copy_stream_equal_the_training_stream_ones():
    """The whole checkpointer with reads_on_copy_stream on and off: every replay record (batch, loss, gradient
    norm, hyper-parameters) and the routed-token popularity torch.equal, and training unchanged."""
    on = train(8, reads_on_copy_stream=True)
    off = train(8, reads_on_copy_stream=False)
    assert_same(on, off)
    ra, rb = _records(on[4]), _records(off[4])
    assert ra.keys() == rb.keys() and len(ra) == 2
    for s in ra:
        for f in ("tokens", "grad_norm", "loss"):
            assert torch.equal(getattr(ra[s], f), getattr(rb[s], f)), (s, f)
        pairs = [(x[k], y[k]) for x, y in zip(ra[s].hyper, rb[s].hyper) for k in x]
        assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in pairs) and pairs
    assert torch.equal(on[4].sparse.planner.tracker.score, off[4].sparse.planner.tracker.score)
    assert on[4].final_stats["copy_path"]["reads"] > 0 and on[4].final_stats["copy_path"]["reads_on_copy_stream"]


def test_copy_in_the_backward_is_issued_by_the_hook_and_recovers_exactly(tmp_path):
    """copy_phase="backward": each slot's copy waits for the next iteration's backward (issued by the hook), still
    holds the post-update state of its own iteration: a run stopped after 7 and resumed from another
    initialisation ends torch.equal to one that never failed, as does the whole run."""
    ref = train(10)
    whole = train(10, copy_phase="backward")
    assert_same(ref, whole)
    tiers = tmc.TierConfig(root=str(tmp_path), run_id="backward")
    first = train(10, tiers=tiers, stop_after=7, copy_phase="backward")
    path = first[4].final_stats["copy_path"]
    assert path["copy_phase"] == "backward" and path["issued_by_backward_hook"] >= 5, path
    got = train(10, init_seed=123, tiers=tiers, copy_phase="backward")
    assert got[4].resumed.recovered_step == 6
    assert_same(ref, got)
    for s, loss in got[3].items():
        assert torch.equal(loss, ref[3][s]), s


def test_a_deferred_copy_without_a_backward_is_issued_by_the_next_wait_and_discarded_when_state_is_lost():
    model = Net(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    from torchmoe_ckpt.sparse_checkpointer import SparseCheckpointer

    ck = SparseCheckpointer(model, opt, torch.float32, tmc.SparseConfig(window=2, copy_phase="backward"))
    model(batch_for(1)).sum().backward()
    opt.step()
    cur_plan, _ = ck.planner.plan()
    slot = ck.slots.slots_for(cur_plan)[0]
    want = {k: v.clone() for k, v in model.state_dict().items()}
    ck.engine.capture(slot, 1)
    assert not slot.done.is_set()  # deferred: nothing copied before a backward or a wait
    ck.engine.wait_done()  # no backward came: the wait issues it
    assert slot.complete and ck.engine.issued_by_hook == 0
    for it in slot.items:
        if it.role in ("master", "compute") and it.piece.fqn in want:
            assert torch.equal(it.buffer, want[it.piece.fqn][it.piece.local_slices].to(it.buffer.dtype)), it.key
    ck.engine.capture(slot, 2)
    ck.engine.discard_deferred()  # the state was lost before a backward: the slot is torn, never filled
    assert slot.done.is_set() and not slot.complete
    with pytest.raises(RuntimeError, match="deferred and never issued"):
        ck.engine.wait_done()
    ck.stop()


def test_device_staging_is_counted_in_host_memory_and_recovers_exactly(tmp_path):
    """On a CPU the staging buffer is host memory: counted (stats host_memory part "device_staging", the copy
    path's held bytes), every slot staged, and the recovery torch.equal."""
    ref = train(10)
    tiers = tmc.TierConfig(root=str(tmp_path), run_id="staged")
    first = train(10, tiers=tiers, stop_after=7, device_staging=True, copy_chunk_bytes=256)
    st = first[4].final_stats
    staging = st["copy_path"]["device_staging"]
    assert staging["held_bytes"] > 0 and staging["staged_copies"] >= 6 and staging["windows_refused"] == 0, staging
    assert st["host_memory"]["parts"]["device_staging"] == staging["held_bytes"]
    assert staging["held_bytes"] >= first[4].final_stats["max_slot_bytes"]
    got = train(10, init_seed=123, tiers=tiers, device_staging=True)
    assert got[4].resumed.recovered_step == 6
    assert_same(ref, got)


def test_device_staging_refused_in_one_line_when_impossible_and_skipped_per_window_when_it_does_not_fit():
    model = Net(0)
    opt = torch.optim.AdamW(model.parameters())
    fb = lambda b: b  # noqa: E731
    # A limit below even the smallest slot: asked for and impossible, refused at construction with the fix.
    with pytest.raises(
        tmc.ConfigError,
        match=r"device_staging=True needs a staging buffer of at least .*"
        r"set SparseConfig.device_staging = False or raise host_memory_limit",
    ):
        tmc.Checkpointer(
            model,
            opt,
            fb,
            config=tmc.CheckpointConfig(window=tmc.SparseConfig(window=2, device_staging=True, host_memory_limit=4096)),
        ).resume()
    # The CUDA rule on synthetic figures: what it holds plus what is free, with the headroom to spare.
    assert staging_fits(2 << 30, free=3 << 30, held=0, headroom=HEADROOM)
    assert not staging_fits(2 << 30, free=2 << 30, held=0, headroom=HEADROOM)
    assert staging_fits(2 << 30, free=1 << 30, held=2 << 30, headroom=HEADROOM)
    # A window whose slot does not fit is copied directly, counted, said once per change.
    room = {"ok": False}
    stg = DeviceStaging(torch.device("cpu"), room=lambda n: room["ok"])
    assert not stg.admit(1000, 3) and not stg.admit(1000, 4) and stg.target == 0
    assert stg.windows_refused == 2 and "device staging skipped from window 3" in (stg.last_refusal or "")
    room["ok"] = True
    assert stg.admit(1000, 5) and stg.target == 1000 and stg.last_refusal is None and stg.windows_staged == 1
    views = stg.views([torch.empty(3, dtype=torch.bfloat16), torch.empty(2, 5)])
    assert [v.shape for v in views] == [(3,), (2, 5)] and views[0].dtype == torch.bfloat16 and stg.held == 1000


def test_state_key_follows_replaced_storage():
    """The faster state key still sees every replaced tensor (a reload must never leave a view on old storage)."""
    model = Net(0)
    opt = torch.optim.AdamW(model.parameters())
    model(batch_for(1)).sum().backward()
    opt.step()
    acc = StateAccess(model, opt)
    k0 = acc.state_key()
    assert k0 == acc.state_key() and len(k0) == len(list(model.parameters())) * 4
    p0 = next(model.parameters())
    opt.state[p0]["exp_avg"] = opt.state[p0]["exp_avg"].clone()  # a replaced optimizer state tensor
    k1 = acc.state_key()
    assert k1 != k0
    p = next(model.parameters())
    p.data = p.data.clone()  # same Parameter, new storage
    assert acc.state_key() != k1


# ---- auto W priced by what the device loses (planning/calibration.py) -------------------------------------------


def test_the_rule_on_synthetic_measurements():
    assert cost_per_byte(0.1, [(0.1, 0)]) is None  # no step with a copy in flight
    # +10 ms for 1 GB in flight on a 100 ms step: 1e-11 s per byte
    assert math.isclose(cost_per_byte(0.100, [(0.108, int(1e9)), (0.112, int(1e9)), (0.3, 0)]), 1e-11)
    assert cost_per_byte(0.1, [(0.09, 10)]) == 0.0  # faster than the base: no measurable cost
    # 2% of 100 ms at 1e-11 s/byte: 200 MB per slot
    assert math.isclose(overhead_budget(0.1, 1e-11, 0.02), 2e8) and overhead_budget(0.1, 0.0, 0.02) == math.inf
    dl = DeviceLoss(target=0.02)
    for _ in range(WARMUP_STEPS):
        dl.observe(5.0, 0)  # a slow first step is not a sample
    assert dl.calibrating
    assert CALIBRATION_STEPS >= 8  # +-4 ms of host timing on an 80 ms step needs many steps to price 2%
    for i in range(CALIBRATION_STEPS):
        dl.observe(0.3 if i == 1 else 0.1, 0)  # one slow step (a GC pause): the median does not move
    assert not dl.calibrating and math.isclose(dl.base_s or 0, 0.1)
    assert dl.budget() is None  # no copy measured yet: the caller's prior
    for _ in range(4):
        dl.observe(0.110, int(1e9))  # +10% with 1 GB slots: past the target
    assert math.isclose(dl.budget() or 0, 2e8) and dl.replans == 1 and math.isclose(dl.overhead or 0, 0.1)
    for _ in range(4):
        dl.observe(0.1005, int(2e8))  # smaller slots: +0.5%, within the target; c = 2.5e-12, smoothed
    assert math.isclose(dl.budget() or 0, 0.02 * 0.1 / (0.5 * 1e-11 + 0.5 * 2.5e-12)) and dl.replans == 1
    assert dl.clipped_windows == 0 and dl.stats()["clipped_windows"] == 0


def test_a_window_faster_than_the_base_step_is_clipped_and_said(caplog):
    """c < 0 is noise: clipped at 0 (no measurable cost), counted in stats and said once per run of clips."""
    dl = DeviceLoss(target=0.02)
    for _ in range(WARMUP_STEPS + CALIBRATION_STEPS):
        dl.observe(0.1, 0)
    with caplog.at_level(logging.INFO, logger="torchmoe_ckpt"):
        for window in range(3):
            for _ in range(4):
                dl.observe(0.099 if window < 2 else 0.1, int(1e9))  # two windows 1% faster than T0, then equal
            assert dl.budget() == math.inf
    assert dl.clipped_windows == 2 and dl.stats()["clipped_windows"] == 2 and dl.s_per_byte == 0.0
    said = [r.getMessage() for r in caplog.records if "clipped at 0" in r.getMessage()]
    assert len(said) == 1 and "-1.0%" in said[0] and "1 window(s) clipped" in said[0]


def test_the_planner_picks_the_smallest_window_within_the_target_and_replans_on_drift():
    from torchmoe_ckpt.model.optim_state import attach_optimizer_state
    from torchmoe_ckpt.planning.window_planner import WindowPlanner

    model = Net(0)
    ops = tmc.discover_operators(model)
    attach_optimizer_state(model, ops, torch.optim.AdamW(model.parameters()))
    cfg = tmc.SparseConfig(bandwidth_bytes_per_s=1e12)  # the bandwidth bound far away: the rule decides
    pl = WindowPlanner(cfg, ops, torch.float32, None, lambda v, op, g=None: v, False, 0, device_loss=True)
    assert pl.device_loss is not None and pl.calibrating
    zero = torch.zeros(2, 4, dtype=torch.float64)
    for _ in range(WARMUP_STEPS + CALIBRATION_STEPS):
        pl.observe_step(0.1, zero, zero, 0)
    assert not pl.calibrating
    order, (full, comp) = pl.operator_order(), pl.op_sizes()
    dense = sum(full.values())
    first, _ = pl.plan()  # no copy measured: the prior share (CUDA_OVERLAP of a step's bandwidth: all fits)
    # Each step copies a slot of the dense size and costs +10%: c = 0.01 / dense per byte.
    for _ in range(3):
        pl.observe_step(0.11, zero, zero, dense)
    pl.plan()  # W is agreed during the window before the one it sizes (window_planner._agreed_w): one behind
    plan, budget = pl.plan()
    assert math.isclose(budget, 0.02 * 0.1 / (0.01 / dense))  # a fifth of the dense state per slot
    assert plan.window == choose_window(order, full, comp, budget) > first.window
    assert all(s.bytes <= budget for s in plan.slots) or not plan.fits
    w_before = plan.window
    for _ in range(3):  # drift: the same slots now cost 5x as much (smoothed: 3x)
        pl.observe_step(0.1 + 0.05 * plan.worst_slot_bytes / dense, zero, zero, plan.worst_slot_bytes)
    pl.plan()
    again, budget2 = pl.plan()
    assert math.isclose(budget2, budget / 3) and pl.device_loss.replans == 2  # past the target: re-priced
    assert again.window == choose_window(order, full, comp, budget2, w_before) >= w_before

    # the explicit overlap overrides the rule; a forced W has nothing to price
    def on_cuda(**kw):
        return WindowPlanner(tmc.SparseConfig(**kw), ops, torch.float32, None, None, False, 0, cuda=True).device_loss

    assert on_cuda(overlap=0.5) is None and on_cuda(window=2) is None and on_cuda() is not None


def test_the_checkpointer_calibrates_without_copies_then_checkpoints_every_iteration():
    """With the device-loss pricing on (as on CUDA), the first steps run without a copy (the base step time),
    then a window starts and every iteration is captured; training itself unchanged."""
    from torchmoe_ckpt.planning.calibration import DeviceLoss as DL

    steps = WARMUP_STEPS + CALIBRATION_STEPS + 4
    ref = train(steps)
    model = Net(0)
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    from torch.nn import functional as F

    def fb(tokens):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss

    cfg = tmc.CheckpointConfig(window=tmc.SparseConfig(bandwidth_bytes_per_s=1e9), max_grad_norm=0.5, router_top_k=2)
    ckpt = tmc.Checkpointer(model, opt, fb, sched, cfg)
    ckpt.resume()
    ckpt.sparse.planner.device_loss = DL(target=0.02)  # what a CUDA run gets (overlap None)
    for step in range(1, steps + 1):
        ckpt.step(batch_for(step))
    st, windows = ckpt.stats(), ckpt.sparse.counters.windows  # (stats() shows the last 5 windows)
    ckpt.close()
    # Step 1: the calibration's one dense snapshot (a recovery point from the first iteration on); its copy runs
    # during step 2, which is no base sample; steps 3..calib + 1 run without a copy; step calib + 1's own copy
    # runs during the next step: captured every iteration from calib + 1 on.
    calib = WARMUP_STEPS + CALIBRATION_STEPS + 1
    assert (windows[0].start, windows[0].W) == (1, 1)
    assert windows[1].start == calib
    assert st["slots_captured"] == 1 + steps - calib + 1
    assert st["copy_path"]["device_loss"]["base_step_s"] > 0
    assert st["copy_path"]["device_loss"]["calibration_steps"] == CALIBRATION_STEPS
    assert isinstance(st["copy_path"]["device_loss"]["clipped_windows"], int)
    assert_same(ref, (model, opt, sched))
