"""The parts of the GPU training path that run on a CPU too: RNG capture over generators (the CUDA ones have the same
API), replay records that carry them, the step counter on the optimizer's device, the up-front "exact" check for a
CUDA model, host copies, the copy engine's CPU fallback, and routed-token counts applied at window starts exactly
as if applied per iteration. (docs/gpu.md lists what only the GPU check covers.)"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from support.tiny_moe import TOP_K, Net, batch_for  # tests/ is on sys.path under pytest

import torchmoe_ckpt as tmc
from torchmoe_ckpt.config import SparseConfig
from torchmoe_ckpt.core.errors import ConfigError, UnusableCheckpointError
from torchmoe_ckpt.core.records import IterationRecord
from torchmoe_ckpt.planning.popularity import PopularityTracker
from torchmoe_ckpt.recovery import rng
from torchmoe_ckpt.recovery.replay_check import check_replay_check
from torchmoe_ckpt.recovery.replay_log import Replay
from torchmoe_ckpt.recovery.sparse_to_dense import init_optimizer_state
from torchmoe_ckpt.runtime.device_copy import CopyStream, host_copy
from torchmoe_ckpt.sparse_checkpointer import PlanningGroups, SparseCheckpointer
from torchmoe_harness.trainer import RunConfig, Trainer


def test_capture_and_restore_every_generator():
    """The device generators go through the same loop as this CPU one: state read, set back, same numbers."""
    gens = {"extra": torch.Generator().manual_seed(7)}
    cpu, dev = rng.capture(gens)
    first = (torch.rand(4), torch.rand(4, generator=gens["extra"]))
    rng.restore(cpu, dev, gens)
    again = (torch.rand(4), torch.rand(4, generator=gens["extra"]))
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert set(dev) == {"extra"}


class NoisyNet(Net):
    """test_capture's MoE, with noise on its logits drawn from a generator of its own (as a GPU model's dropout
    draws from the CUDA generator: a state outside torch's CPU generator that a replay must draw again)."""

    def __init__(self, seed: int, gen: torch.Generator):
        super().__init__(seed)
        self.gen = gen

    def forward(self, tokens):
        logits = super().forward(tokens)
        return logits + 0.1 * torch.randn(logits.shape, generator=self.gen)


def noisy_run(steps, gen_seed, tracked, tiers=None, stop_after=None, seed=0):
    gen = torch.Generator().manual_seed(gen_seed)
    if tracked:
        tmc.track_generator("noise", gen)
    try:
        model = NoisyNet(seed, gen)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def fb(tokens):
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            return loss

        cfg = tmc.CheckpointConfig(
            tiers=tiers, window=tmc.SparseConfig(window=3), max_grad_norm=0.5, router_top_k=TOP_K
        )
        losses, ckpt = {}, tmc.Checkpointer(model, opt, fb, None, cfg, seed=0)  # `seed` varies the init only
        for step in range(ckpt.resume() + 1, steps + 1):
            losses[step] = ckpt.step(batch_for(step))
            if step == stop_after:
                break
        ckpt.close()
        return model, losses, ckpt
    finally:
        tmc.untrack_generator("noise")


def test_a_generator_outside_torchs_cpu_one_is_logged_through_the_host_tier_and_replayed_exactly(tmp_path):
    """End to end on CPU, the path a CUDA generator takes: captured per iteration, stored in the window's replay
    records, loaded back and restored before each replayed forward. Untracked, the same recovery is refused."""
    ref = noisy_run(10, gen_seed=1, tracked=True)
    tiers = tmc.TierConfig(root=str(tmp_path), run_id="noise")
    noisy_run(10, gen_seed=1, tracked=True, tiers=tiers, stop_after=7)
    model, losses, ckpt = noisy_run(10, gen_seed=99, tracked=True, tiers=tiers, seed=123)  # a new process's state
    assert ckpt.resumed.recovered_step == 6 and ckpt.resumed.report["exact"] is True
    assert ckpt.sparse.committed.log.get(8).device_rng.keys() == {"noise"}
    for (k, a), (_, b) in zip(ref[0].state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), k
    assert sorted(losses) == list(range(7, 11)) and all(torch.equal(losses[s], ref[1][s]) for s in losses)
    tiers = tmc.TierConfig(root=str(tmp_path), run_id="untracked")
    noisy_run(10, gen_seed=1, tracked=False, tiers=tiers, stop_after=7)
    with pytest.raises(UnusableCheckpointError, match="ReplayDivergence"):
        noisy_run(10, gen_seed=99, tracked=False, tiers=tiers, seed=123)


def test_a_cpu_run_logs_the_cpu_state_alone_and_a_missing_generator_is_refused():
    if not torch.cuda.is_available():
        assert rng.device_generators() == {} and rng.capture()[1] is None
    cpu, dev = rng.capture({"cuda": torch.Generator()})  # as a GPU run logs it
    with pytest.raises(rng.RngMismatch, match="generator 'cuda'.*recover on the kind of device that wrote it"):
        rng.restore(cpu, dev, {})


def test_replay_records_carry_the_device_generators_and_cpu_records_are_unchanged():
    base = dict(step=3, tokens=torch.arange(6), grad_norm=torch.tensor(1.5), lr=1e-3, loss=torch.tensor(2.0))
    cpu, dev = rng.capture({"cuda": torch.Generator().manual_seed(3)})
    rec = IterationRecord(**base, rng_state=cpu, device_rng=dev)
    buf = io.BytesIO()
    torch.save(rec.to_dict(), buf)
    buf.seek(0)
    back = IterationRecord.from_dict(torch.load(buf, weights_only=True, map_location="cpu"))
    assert torch.equal(back.device_rng["cuda"], dev["cuda"]) and Replay.of(back).device_rng.keys() == {"cuda"}
    plain = IterationRecord(**base, rng_state=cpu)
    assert "device_rng" not in plain.to_dict() and Replay.of(plain).device_rng is None


def test_step_counters_are_created_where_the_optimizer_keeps_them():
    """Fused and capturable AdamW keep `step` on the parameter's device (a GPU); the others on the CPU. A meta
    parameter stands in for a device one: the same code path, no GPU needed."""
    p = torch.nn.Parameter(torch.empty(3, device="meta"))
    for kwargs, device in (({"capturable": True}, "meta"), ({}, "cpu"), ({"foreach": True}, "cpu")):
        opt = torch.optim.AdamW([p], **kwargs)
        init_optimizer_state(opt)
        assert opt.state[p]["step"].device.type == device and opt.state[p]["step"].dtype == torch.float32, kwargs
    q = torch.nn.Parameter(torch.ones(3))
    mine, theirs = (
        torch.optim.AdamW([q], fused=True),
        torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], fused=True),
    )
    init_optimizer_state(mine)
    for p2 in theirs.param_groups[0]["params"]:
        p2.grad = torch.ones(3)
    theirs.step()  # torch's own lazy init, then one step
    ref = next(iter(theirs.state.values()))["step"]
    assert mine.state[q]["step"].device == ref.device and mine.state[q]["step"].dtype == ref.dtype


def test_exact_on_a_cuda_model_needs_deterministic_kernels(monkeypatch):
    """Checked from the flags alone (no GPU touched), so it runs here as it runs on a GPU."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        with pytest.raises(ConfigError) as err:
            check_replay_check("exact", torch.device("cuda", 0))
        msg = str(err.value)
        assert "\n" not in msg and "torch.use_deterministic_algorithms(True)" in msg
        assert "CUBLAS_WORKSPACE_CONFIG=:4096:8" in msg and "replay_check='tolerant'" in msg
        torch.use_deterministic_algorithms(True)
        with pytest.raises(ConfigError, match=r"\(CUBLAS_WORKSPACE_CONFIG is not set\)"):
            check_replay_check("exact", "cuda")
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        check_replay_check("exact", "cuda")  # both set: accepted
        torch.use_deterministic_algorithms(False)
        check_replay_check("tolerant", "cuda")  # tolerant needs neither
        check_replay_check("exact", "cpu")  # CPU kernels are deterministic
    finally:
        torch.use_deterministic_algorithms(was)


def test_host_copies_and_the_cpu_copy_stream():
    t = torch.arange(4.0)
    same, cloned = host_copy({"a": t, "n": 3}), host_copy([t], clone_cpu=True)
    assert same["a"].data_ptr() == t.data_ptr() and same["n"] == 3  # CPU: the tensor itself (detached), no copy
    assert cloned[0].data_ptr() != t.data_ptr() and torch.equal(cloned[0], t)
    cs = CopyStream("cpu")
    assert not cs.cuda and cs.mark_ready() is None
    cs.bind_thread()
    with cs.context():
        start = cs.begin(None)
        end = cs.end()
    cs.order_after(end)
    assert cs.finish(start, end) >= 0.0


def test_counts_applied_at_window_starts_equal_counts_applied_per_iteration(one_rank_group):
    """The decayed policy is order-sensitive: equal scores mean every iteration's counts were applied, in order."""
    t = Trainer(RunConfig(steps=8))
    ck = SparseCheckpointer(
        t.model,
        t.optimizer,
        t.compute_dtype,
        SparseConfig(window=3, popularity="decayed"),
        groups=PlanningGroups(sum_counts=True),
    ).attach(t)
    ref = PopularityTracker(*ck.planner.tracker.shape, policy="decayed", decay=ck.cfg.decay)
    # windows start at steps 1, 4 and 7; each start queues the counts since the last one for the host (a
    # non-blocking copy on CUDA) and applies the ones queued at the start before: at step 7, iterations 1..4
    for step in range(1, 8):
        res = t.train_step()
        ck.after_step(res)
        if step <= 4:
            ref.update(res.expert_counts, res.expert_probs)
    ck.close()
    assert len(ck.planner.pending_counts) == 0 and torch.equal(ck.planner.tracker.score, ref.score)
    assert ref.score.sum() > 0


def test_default_copy_budget_is_smaller_on_cuda():
    """SparseConfig.overlap=None prices a slot at a whole iteration on a CPU and at CUDA_OVERLAP of one on CUDA
    (an H200 step slowed by 19-53% once a slot's copy took 62-72% of it); a given overlap is used as given."""
    from torchmoe_ckpt.config import CUDA_OVERLAP
    from torchmoe_ckpt.model.operators import discover_operators
    from torchmoe_ckpt.planning.window_planner import WindowPlanner

    ops = discover_operators(Net(0))
    plan = lambda cfg, cuda: WindowPlanner(cfg, ops, torch.float32, None, None, False, 0, cuda=cuda)  # noqa: E731
    assert plan(SparseConfig(), False).overlap == 1.0
    assert plan(SparseConfig(), True).overlap == CUDA_OVERLAP == 0.4
    assert plan(SparseConfig(overlap=0.7), True).overlap == 0.7
    with pytest.raises(ConfigError, match="overlap must be a finite number > 0"):
        SparseConfig(overlap=0)
