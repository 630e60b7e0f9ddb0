"""The dense policy and a switch between policies mid-run, recovered in place (1-rank gloo group; the state lost
as the bench's failures lose it, every tensor NaN) and torch.equal to a run that never failed, losses included:
a dense snapshot every k iterations is a W = 1 window (nothing replayed, the iterations since trained again);
across a forced switch the last committed window or snapshot of the old policy stays the recovery point until
the first of the new policy commits, so a failure on either side of the switch recovers exactly."""

from __future__ import annotations

import torch

from torchmoe_ckpt.config import SparseConfig
from torchmoe_ckpt.planning.calibration import CALIBRATION_STEPS, WARMUP_STEPS
from torchmoe_ckpt.sparse_checkpointer import SparseCheckpointer
from torchmoe_harness.baselines.common import lose_state
from torchmoe_harness.trainer import RunConfig, Trainer

RUN = {"steps": 14, "model": {"num_experts": 4}}


def _train(trainer, ck, upto: int, losses: dict, draws: dict | None = None) -> None:
    while trainer.step < upto:
        if draws is not None:  # the loop draws from torch's generator before each step (a user's dropout mask)
            draws[trainer.step + 1] = torch.rand(())
        res = trainer.train_step()
        losses[res.step] = res.loss
        if ck is not None:
            ck.after_step(res)


def _reference(steps: int, draws: dict | None = None) -> tuple[dict, dict]:
    ref, losses = Trainer(RunConfig(**RUN)), {}
    _train(ref, None, steps, losses, draws)
    return ref.export_state(), losses


def _fail(ck, tr, expect_step: int, expect_replayed: int) -> None:
    """Iteration tr.step + 1 fails before its update (the copy in flight done, as the trainer's hook waits)."""
    ck.before_update()
    lose_state(tr)
    rep = ck.recover_in_memory(tr)
    assert rep is not None and (rep.recovered_step, rep.replayed_iterations) == (expect_step, expect_replayed), rep
    assert tr.step == expect_step


def _assert_same(tr, ref_state, losses, ref_losses, steps: int) -> None:
    a = tr.export_state()
    assert a.keys() == ref_state.keys()
    bad = [k for k in a if not torch.equal(a[k], ref_state[k])]
    assert not bad, bad[:5]
    assert all(torch.equal(losses[s], ref_losses[s]) for s in range(1, steps + 1))


def test_dense_policy_recovers_from_its_snapshot_exactly(one_rank_group):
    """Also the random state: nothing is replayed after a dense snapshot, so the generator comes back as iteration 7
    left it (the snapshot's record), and the loop's draws before 8.. are the never-failed run's."""
    ref_draws: dict = {}
    ref_state, ref_losses = _reference(12, ref_draws)
    tr = Trainer(RunConfig(**RUN))
    ck = SparseCheckpointer(tr.model, tr.optimizer, tr.compute_dtype, SparseConfig(policy="dense", dense_interval=3))
    ck.attach(tr)
    losses: dict = {}
    draws: dict = {}
    _train(tr, ck, 8, losses, draws)  # snapshots after 1, 4, 7
    _fail(ck, tr, 7, 0)
    draws = {}
    _train(tr, ck, 12, losses, draws)
    ck.close()
    assert sorted(draws) == [8, 9, 10, 11, 12] and all(torch.equal(draws[s], ref_draws[s]) for s in draws)
    assert [(w.start, w.W) for w in ck.counters.windows] == [(1, 1), (4, 1), (7, 1), (10, 1)]
    pol = ck.stats()["policy"]
    assert pol["policy"] == "dense" and pol["interval_or_W"] == 3 and pol["forced"]
    _assert_same(tr, ref_state, losses, ref_losses, 12)


def test_sparse_to_dense_switch_recovers_on_each_side(one_rank_group):
    """Windows of W = 3 ([1-3], [4-6]); the switch to dense k = 2 is forced in iteration 5: window [4-6] completes
    first. Iteration 7 fails before the first snapshot: recovered from window [4-6] (replayed). Then snapshots
    after 7 and 9; iteration 10 fails: recovered from the snapshot of 9 (nothing replayed)."""
    ref_state, ref_losses = _reference(12)
    tr = Trainer(RunConfig(**RUN))
    ck = SparseCheckpointer(tr.model, tr.optimizer, tr.compute_dtype, SparseConfig(window=3)).attach(tr)
    losses: dict = {}
    _train(tr, ck, 5, losses)
    ck.force_policy("dense", 2)
    _train(tr, ck, 6, losses)
    assert ck.current is not None and ck.current.plan.window == 3  # the window in force completes first
    _fail(ck, tr, 6, 2)  # before the new policy's first snapshot: the sparse window is the recovery point
    _train(tr, ck, 9, losses)
    _fail(ck, tr, 9, 0)  # after: the snapshot of 9
    _train(tr, ck, 12, losses)
    ck.close()
    starts = [(w.start, w.W) for w in ck.counters.windows]
    assert starts == [(1, 3), (4, 3), (7, 1), (9, 1), (11, 1)], starts
    assert ck.stats()["policy"]["switches"] and ck.stats()["policy"]["policy"] == "dense"
    _assert_same(tr, ref_state, losses, ref_losses, 12)


def test_dense_to_sparse_switch_recovers_on_each_side(one_rank_group):
    """Snapshots every 2 (after 1, 3, 5); the switch to windows of W = 3 is forced after 5: window [6-8] starts at
    the next iteration. Iteration 8 fails before it commits: recovered from the snapshot of 5 (the iterations
    since trained again). Windows [6-8], [9-11]; iteration 12 fails: recovered from [9-11] (replayed)."""
    ref_state, ref_losses = _reference(14)
    tr = Trainer(RunConfig(**RUN))
    cfg = SparseConfig(policy="auto", dense_interval=2)
    ck = SparseCheckpointer(tr.model, tr.optimizer, tr.compute_dtype, cfg).attach(tr)
    losses: dict = {}
    _train(tr, ck, 5, losses)
    ck.cfg.window = 3  # the W the sparse policy will use
    ck.force_policy("sparse")
    _train(tr, ck, 7, losses)
    _fail(ck, tr, 5, 0)  # window [6-8] not committed: the snapshot of 5 is the recovery point
    _train(tr, ck, 11, losses)
    _fail(ck, tr, 11, 2)
    _train(tr, ck, 14, losses)
    ck.close()
    starts = [(w.start, w.W) for w in ck.counters.windows]
    assert starts == [(1, 1), (3, 1), (5, 1), (6, 3), (6, 3), (9, 3), (12, 3)], starts
    assert ck.stats()["policy"]["policy"] == "sparse"
    _assert_same(tr, ref_state, losses, ref_losses, 14)


END = WARMUP_STEPS + CALIBRATION_STEPS + 8


def test_auto_decides_after_calibration_and_says_why(one_rank_group):
    """policy "auto" (the default): one dense snapshot at the first iteration, then the step without copies is
    measured (nothing captured); a failure then recovers exactly from that snapshot (not from scratch). Then the
    policy is decided, priced by that snapshot's measured copy, and shown in stats() with each candidate's
    predicted ETTR and the reason; a failure after that recovers exactly from whichever it chose."""
    ref_state, ref_losses = _reference(END)
    tr = Trainer(RunConfig(**RUN))
    ck = SparseCheckpointer(tr.model, tr.optimizer, tr.compute_dtype, SparseConfig()).attach(tr)
    throttle = ck.dense_bytes / 0.05  # a slow host link (as the bench emulates it): a dense copy takes 50 ms
    ck.engine.throttle_bytes_per_s = throttle
    losses: dict = {}
    _train(tr, ck, 4, losses)
    pol = ck.stats()["policy"]
    assert pol["reason"] == "not decided yet (calibrating)"
    assert [(w.start, w.W) for w in ck.counters.windows] == [(1, 1)]
    _fail(ck, tr, 1, 0)  # iteration 5 fails during the calibration: the first iteration's snapshot recovers it
    assert ck.planner.cost.copies >= 1  # the snapshot's copy was measured: the decision is priced by it
    _train(tr, ck, WARMUP_STEPS + CALIBRATION_STEPS + 6, losses)
    pol = ck.stats()["policy"]
    assert pol["policy"] in ("sparse", "dense") and not pol["forced"] and pol["base_step_s"] > 0
    assert {k.split()[0] for k in pol["predicted_ettr"]} == {"sparse", "dense"}, pol
    assert pol["reason"].startswith("predicted ETTR") and pol["inputs"]["dense_bytes"] == ck.dense_bytes
    # priced by the copies measured on that link, not by the idle probe (a memcpy, ~20x faster here)
    assert pol["inputs"]["copy_s_per_byte"] >= 1.0 / throttle
    # after the snapshot, the calibration steps capture nothing: the policy is decided after them. Base samples:
    # iterations 3 and 4 (2 ran beside the snapshot's copy), then 2..7 again after the recovery: 8 in all
    assert CALIBRATION_STEPS == 8 and ck.counters.windows[1].start == 7
    ck.before_update()
    lose_state(tr)
    rep = ck.recover_in_memory(tr)
    assert rep is not None and rep.recovered_step >= 7  # from what the decision chose
    _train(tr, ck, END, losses)
    ck.close()
    _assert_same(tr, ref_state, losses, ref_losses, END)
