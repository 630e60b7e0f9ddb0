"""In-process recovery at its floor (1-rank gloo group): the checkpointer's `recover_in_memory` loads the newest
committed window into the very trainer whose state was lost (every tensor NaN, as the bench's failures do) and
ends torch.equal to a run that never failed, with its time split into phases; in replay, frozen experts
compute no weight gradient while the active ones get theirs exactly; and the copy-bandwidth probe is taken once
per process, never when the bandwidth is given or the window forced."""

from __future__ import annotations

import pytest
import torch

from torchmoe_ckpt.config import SparseConfig
from torchmoe_ckpt.ops.status import PHASES
from torchmoe_ckpt.planning import window_planner as wp
from torchmoe_ckpt.recovery.replay_log import Replay
from torchmoe_ckpt.sparse_checkpointer import SparseCheckpointer
from torchmoe_harness.baselines.common import lose_state
from torchmoe_harness.trainer import RunConfig, Trainer, local

RUN = {"steps": 12, "model": {"num_experts": 4}}


def _train(trainer, ck, upto: int, losses: dict) -> None:
    while trainer.step < upto:
        res = trainer.train_step()
        losses[res.step] = res.loss
        if ck is not None:
            ck.after_step(res)


def test_in_place_loss_recovers_exactly_with_phases(one_rank_group):
    ref = Trainer(RunConfig(**RUN))
    ref_losses: dict = {}
    _train(ref, None, 12, ref_losses)

    tr = Trainer(RunConfig(**RUN))
    ck = SparseCheckpointer(tr.model, tr.optimizer, tr.compute_dtype, SparseConfig(window=3)).attach(tr)
    losses: dict = {}
    _train(tr, ck, 8, losses)  # windows 1-3 and 4-6 committed, 7-8 captured in the third
    ck.before_update()  # iteration 9 fails before its update: the copy of 8 is done, as the trainer's hook waits
    lose_state(tr)
    assert torch.isnan(tr.export_state()["param/output.weight"]).all()
    rep = ck.recover_in_memory(tr)
    assert rep.recovered_step == 6 and rep.replayed_iterations == 2 and tr.step == 6
    phases = rep.phases.to_dict()
    assert set(PHASES) <= set(phases) and phases["replay"] > 0 and phases["load"] > 0
    _train(tr, ck, 12, losses)
    ck.close()
    stats = ck.stats()["recoveries"]
    assert len(stats) == 1 and stats[0]["redo"] > 0  # 7 and 8 trained again, timed
    a, b = tr.export_state(), ref.export_state()
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, bad[:5]
    assert all(torch.equal(losses[s], ref_losses[s]) for s in range(1, 13))


@pytest.mark.parametrize("fail_after,recovered,replayed", [(8, 8, 2), (7, 7, 2), (6, 6, 2), (2, 0, 0)])
def test_sliding_window_loses_only_the_failed_iteration(one_rank_group, fail_after, recovered, replayed):
    """Sliding plans: the state is lost after iteration `fail_after` (windows 1-3, 4-6, 7-9 with W = 3); the
    newest 3 consecutive slots, across the window boundary, bring it back to exactly that iteration (nothing
    redone), and the window being filled is continued: the run ends torch.equal to one that never failed.
    Before the first window commits (after 2) there is nothing to recover from: None, the caller starts over."""
    ref = Trainer(RunConfig(**RUN))
    ref_losses: dict = {}
    _train(ref, None, 12, ref_losses)

    tr = Trainer(RunConfig(**RUN))
    cfg = SparseConfig(window=3, sliding=True)
    ck = SparseCheckpointer(tr.model, tr.optimizer, tr.compute_dtype, cfg).attach(tr)
    losses: dict = {}
    _train(tr, ck, fail_after, losses)
    plans = [w.plan for w in (ck.committed, ck.current) if w is not None]
    assert all(p.sliding for p in plans)
    for sp in plans[0].slots:  # each slot: compute weights of every operator it does not activate
        assert set(sp.active) | set(sp.frozen) == set(plans[0].order) and not set(sp.active) & set(sp.frozen)
    ck.before_update()  # the next iteration fails before its update (the trainer's hook waited for the copy)
    lose_state(tr)
    rep = ck.recover_in_memory(tr)
    if recovered == 0:
        assert rep is None
        ck.stop()
        return
    assert (rep.recovered_step, rep.replayed_iterations, tr.step) == (recovered, replayed, recovered)
    _train(tr, ck, 12, losses)
    ck.close()
    assert ck.stats()["recoveries"][0]["redo"] == 0.0  # nothing redone
    a, b = tr.export_state(), ref.export_state()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, bad[:5]
    assert all(torch.equal(losses[s], ref_losses[s]) for s in range(1, 13))


def test_frozen_experts_get_no_weight_gradient_and_active_ones_theirs(one_rank_group):
    cfg = dict(RUN, replay_skips_frozen=True)
    a, b = Trainer(RunConfig(**cfg)), Trainer(RunConfig(**cfg))  # the same run twice, two steps in
    grads: dict[str, list] = {"a": [], "b": []}
    for key, t in (("a", a), ("b", b)):
        for _ in range(2):
            t.train_step()
        w1 = t.model.get_submodule("layers.0.moe.routed_experts.inner_experts").w1_EFD
        w1.register_post_accumulate_grad_hook(lambda p, key=key: grads[key].append(local(p.grad).detach().clone()))
    rng = torch.get_rng_state()
    full = a.train_step()  # a normal iteration: every routed expert gets a gradient
    # the same iteration replayed on the twin, with expert 1 of layer 0 frozen
    frozen = frozenset({"layers.0.moe.experts.1"})
    rep = b.train_step(Replay(full.tokens, full.grad_norm, rng, (full.lr,), frozen=frozen))
    assert torch.equal(rep.loss, full.loss)  # forward unchanged
    assert rep.replayed_grad_norm is None  # the norm of the rest is no logged figure: not offered to the check
    (g_full,), (g_rep,) = grads["a"], grads["b"]
    assert g_full[1].abs().sum() > 0, "expert 1 got no token: the test proves nothing"
    assert torch.equal(g_rep[1], torch.zeros_like(g_rep[1]))  # frozen: no weight gradient
    others = [e for e in range(g_full.shape[0]) if e != 1]
    assert torch.equal(g_rep[others], g_full[others])  # active experts: bit-identical gradients


def test_bandwidth_probe_once_per_process_and_never_when_given(one_rank_group, monkeypatch):
    calls = []
    monkeypatch.setattr(wp, "measure_copy_bandwidth", lambda: calls.append(1) or 5e9)
    monkeypatch.setattr(wp, "_PROBED", {})
    t = Trainer(RunConfig(**RUN))
    forced = SparseCheckpointer(t.model, t.optimizer, t.compute_dtype, SparseConfig(window=2)).attach(t)
    # policy "sparse": auto W (under policy "auto" the first steps calibrate the policy, capturing nothing)
    given = SparseCheckpointer(
        t.model, t.optimizer, t.compute_dtype, SparseConfig(bandwidth_bytes_per_s=1e9, policy="sparse")
    )
    auto = [
        SparseCheckpointer(t.model, t.optimizer, t.compute_dtype, SparseConfig(window=None, policy="sparse"))
        for _ in range(2)
    ]
    assert not calls  # nothing at construction: a restart's set-up costs no probe
    res = t.train_step()
    for ck in (forced, given, *auto):
        ck.after_step(res)
    assert len(calls) == 1 and auto[1].planner.bandwidth == pytest.approx(5e9)  # the second one reused the first's
    assert forced.planner.bandwidth is None and given.planner.bandwidth == 1e9
    for ck in (forced, given, *auto):
        ck.close()
