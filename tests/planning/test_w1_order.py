"""A W = 1 plan (a dense snapshot, or sparse windows of one slot) keeps one operator order while the popularity
order changes: its one slot holds every operator, so a reorder changes nothing in it, and a new order would
rebuild its slot files, their mapping and layout at every reorder (the W = 1 snapshot cost ~2x a plain dense
snapshot in the policy sweep before)."""

from __future__ import annotations

from torchmoe_ckpt.capture.slot_pool import signature
from torchmoe_ckpt.config import SparseConfig
from torchmoe_ckpt.sparse_checkpointer import SparseCheckpointer
from torchmoe_harness.trainer import RunConfig, Trainer


def _plans(cfg: SparseConfig, steps: int = 14):
    tr = Trainer(RunConfig(steps=steps, model={"num_experts": 4}))
    ck = SparseCheckpointer(tr.model, tr.optimizer, tr.compute_dtype, cfg).attach(tr)
    plans = []
    for name in ("plan", "dense_plan"):
        inner = getattr(ck.planner, name)

        def seen(inner=inner):
            plan, budget = inner()
            plans.append(plan)
            return plan, budget

        setattr(ck.planner, name, seen)
    for _ in range(steps):
        ck.after_step(tr.train_step())
    ck.close()
    return ck, plans


def test_w1_plans_keep_one_order_across_reorders(one_rank_group):
    # every change of the routed-token shares reorders (thresholds 0): the popularity order moves
    ck, plans = _plans(SparseConfig(window=1, policy="sparse", reorder_change=0.0, reorder_fraction=0.0))
    assert ck.planner.reorders > 0 and len(plans) == 14
    assert len({signature(p) for p in plans}) == 1


def test_dense_plans_keep_one_order_across_reorders(one_rank_group):
    ck, plans = _plans(SparseConfig(policy="dense", dense_interval=1, reorder_change=0.0, reorder_fraction=0.0))
    assert ck.planner.reorders > 0 and len(plans) == 14
    assert len({signature(p) for p in plans}) == 1


def test_windows_of_more_slots_still_follow_the_popularity_order(one_rank_group):
    # the control: W = 2 plans do take the reordered operators (their order decides what each slot holds)
    ck, plans = _plans(SparseConfig(window=2, policy="sparse", reorder_change=0.0, reorder_fraction=0.0))
    assert ck.planner.reorders > 0 and len({signature(p) for p in plans}) > 1
