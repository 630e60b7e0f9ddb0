"""The replay check on REAL non-determinism: a model whose loss reduces a large tensor, trained with one intra-op
thread and recovered with two (torch splits a large float reduction over its threads, so the partial sums and
the rounding differ: the losses really change in their last bits, checked below). "exact" refuses the recovery
in one line; "tolerant" recovers, says it is approximate and reports its deviation; a window replayed with
another data order's batches is refused in both modes. In-process, single rank, own-loop Checkpointer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.tiny_moe import DIM, TOP_K, ListMoE  # tests/ is on sys.path under pytest
from torch import nn

import torchmoe_ckpt as tmc
from torchmoe_ckpt.checkpointer import _Replay
from torchmoe_ckpt.core.errors import UnusableCheckpointError
from torchmoe_ckpt.ops.status import recovery_line
from torchmoe_ckpt.recovery.replay_check import DEFAULT_TOLERANCE
from torchmoe_ckpt.recovery.sparse_to_dense import ReplayDivergence, sparse_to_dense

VOCAB = 50257  # GPT-2's vocabulary: an 804k-element embedding, not a power of two
W = 6  # one window, steps 1..6: five replayed iterations, each a fair chance to round differently
L2 = 6.4e-5  # L2 penalty of the embedding, in the loss: ~50 of ~60, in the same binade as the loss


class Net(nn.Module):
    """A tiny MoE LM with a large vocabulary (an 804k-element embedding table)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.moe = ListMoE()  # test_capture.py's hand-written MoE
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        return self.head(x + self.moe(x))


def loss_of(model: Net, tokens: torch.Tensor) -> torch.Tensor:
    """Cross entropy plus the embedding's L2 penalty: one reduction over 804k elements, which torch splits over its
    intra-op threads; being the larger part of the loss, its last bit is the loss's last bit."""
    ce = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    return ce + L2 * model.embed.weight.pow(2).sum()


def batches(data_seed: int):
    return lambda step: torch.randint(
        0, VOCAB, (4, 9), generator=torch.Generator().manual_seed(step + 1000 * data_seed)
    )


def train(steps, threads, seed=0, tiers=None, stop_after=None, check="exact", data_seed=0):
    """Train to `steps` with `threads` intra-op threads (recovering first when `tiers` hold a window); returns
    (model, optimizer, losses, checkpointer)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = Net(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def fb(tokens):
            loss = loss_of(model, tokens)
            loss.backward()
            return loss

        cfg = tmc.CheckpointConfig(
            tiers=tiers, window=tmc.SparseConfig(window=W), max_grad_norm=1.0, router_top_k=TOP_K, replay_check=check
        )
        losses, batch_for = {}, batches(data_seed)
        ckpt = tmc.Checkpointer(model, opt, fb, None, cfg, seed=0)  # the run's seed: `seed` varies the init only
        for step in range(ckpt.resume() + 1, steps + 1):
            losses[step] = ckpt.step(batch_for(step))
            if step == stop_after:
                break
        ckpt.close()
        return model, opt, losses, ckpt
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_thread_run(tmp_path_factory):
    """Where the killed runs keep their windows, and a reference run with one thread."""
    root = tmp_path_factory.mktemp("replay-check")
    ref = train(10, threads=1)
    return root, ref


def killed_after_7(root, run_id):
    """A one-thread run "killed" after iteration 7: one committed window (steps 1..6) to recover from."""
    tiers = tmc.TierConfig(root=str(root), run_id=run_id)
    train(10, threads=1, tiers=tiers, stop_after=7)
    return tiers


def test_the_thread_count_really_changes_the_losses(one_thread_run):
    _, ref = one_thread_run
    two = train(8, threads=2)
    assert any(not torch.equal(ref[2][s], two[2][s]) for s in range(1, 9)), "no real non-determinism on this machine"


def test_exact_refuses_a_replay_under_another_thread_count_in_one_line(one_thread_run):
    root, _ = one_thread_run
    tiers = killed_after_7(root, "exact")
    with pytest.raises(UnusableCheckpointError) as err:
        train(10, threads=2, seed=123, tiers=tiers, check="exact")
    text = str(err.value)
    assert "ReplayDivergence" in text and "not bit for bit" in text and "replay_check='tolerant'" in text
    reasons = [ln for ln in text.splitlines() if "not bit for bit" in ln]
    assert len(reasons) == 1 and reasons[0].lstrip().startswith("window 0:")  # the one window, in one line


def test_tolerant_recovers_under_another_thread_count_and_says_it_is_approximate(one_thread_run):
    root, ref = one_thread_run
    tiers = killed_after_7(root, "tolerant")
    model, opt, losses, ckpt = train(10, threads=2, seed=123, tiers=tiers, check="tolerant")
    rep = ckpt.resumed.report
    # exact False: the premise of the exact test above (this replay really deviates) holds
    assert rep["recovered_step"] == 6 and rep["replay_check"] == "tolerant" and rep["exact"] is False
    assert 0 < max(rep["max_loss_deviation"], rep["max_grad_norm_deviation"]) <= DEFAULT_TOLERANCE
    assert rep["grad_norms_compared"] == W - 1 and rep["replay_tolerance"] == DEFAULT_TOLERANCE
    line = recovery_line(rep)
    assert "APPROXIMATE" in line and f"{rep['max_loss_deviation']:.3g}" in line and "bit for bit" not in line
    # approximate, not arbitrary: the recovered run follows the reference closely
    for s in range(8, 11):
        assert abs(float(losses[s]) - float(ref[2][s])) <= 1e-3 * abs(float(ref[2][s]))


def test_tolerant_stays_exact_when_the_replay_is(one_thread_run):
    root, ref = one_thread_run
    tiers = killed_after_7(root, "tolerant-same")
    model, opt, losses, ckpt = train(10, threads=1, seed=123, tiers=tiers, check="tolerant")
    assert ckpt.resumed.report["exact"] is True and "bit for bit" in recovery_line(ckpt.resumed.report)
    for (k, a), (_, b) in zip(ref[0].state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), k
    for s, loss in losses.items():
        assert torch.equal(loss, ref[2][s]), s


@pytest.mark.parametrize("check", ["exact", "tolerant"])
def test_a_window_replayed_with_another_data_orders_batches_is_refused_in_both_modes(check, tmp_path):
    """The window's slots are this run's, its replay log holds the batches of another data order (what a window of
    a run on other data, mixed into this one, would replay): the first replayed loss is far outside any bound."""
    _, _, _, ck = train(7, threads=1)
    window = ck.sparse.committed
    foreign = batches(data_seed=1)
    for step, rec in window.log.records.items():
        rec.tokens = foreign(step)
    fresh = train(0, threads=1, seed=123, check=check)[3]
    with pytest.raises(ReplayDivergence) as err:
        sparse_to_dense(_Replay(fresh), window, fresh.config.replay_policy())
    assert "\n" not in str(err.value)
    if check == "tolerant":
        assert "exceeds replay_tolerance" in str(err.value)


def test_replay_check_config_is_validated_in_one_line():
    with pytest.raises(tmc.ConfigError, match="replay_check 'sometimes'"):
        tmc.CheckpointConfig(replay_check="sometimes")
    for bad in (0, 1.5, "1e-4", True):
        with pytest.raises(tmc.ConfigError, match="replay_tolerance"):
            tmc.CheckpointConfig(replay_check="tolerant", replay_tolerance=bad)
