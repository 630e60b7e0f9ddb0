"""Expert parallelism in the harness (RunConfig.expert_parallel): experts owned whole by one rank, tokens sent
to them by all_to_all, never all-gathered by FSDP2. Recovery under EP is bit-exact (torch.equal on every
parameter, optimizer state, buffer, LR and loss) against a fault-free EP run: in-process failures at every
slot position and a torn copy, a real kill -9 under torchrun resumed from the host tier (DCP), and a dense
export loaded back. EP changes the reduction order, so its reference is an EP run, never an FSDP2 one.

Run as a script under torchrun, this file is also the probe of the layout test (what each rank sees)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from torchmoe_harness.launch import compare, run_torchrun, torchrun

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast

STEPS = 16
RUN = {"steps": STEPS, "expert_parallel": True, "model": {"num_experts": 4}}


def ep(dtype: str, **extra) -> dict:
    return dict(RUN, dtype=dtype, **extra)


@pytest.mark.parametrize("dtype,optimizer", [("fp32", "single"), ("bf16", "single"), ("fp32", "fused")])
def test_ep_failures_at_every_slot_position_recover_bit_exactly(dtype, optimizer, tmp_path, reference):
    """Fused AdamW (the MoE-regime bench's optimizer) replays exactly too: one kernel, same order every time."""
    ref = reference(2, ep(dtype, optimizer=optimizer))
    # as in test_recovery: the in-flight window met at every slot position (6: 2, 7: 0, 11: 1), then a torn copy
    failures = [
        {"step": 6, "phase": "update"},
        {"step": 7, "phase": "update"},
        {"step": 11, "phase": "update"},
        {"step": 15, "phase": "copy"},
    ]
    run = run_torchrun(
        2, {"run": ep(dtype, optimizer=optimizer), "checkpoint": {"window": 3}, "failures": failures}, tmp_path / "f"
    )
    recs = run.report["recoveries"]
    assert [r["failed_at"] for r in recs] == [6, 7, 11, 16], recs  # the torn copy of 15 surfaces in 16
    assert [r["recovered_step"] for r in recs] == [3, 6, 9, 12], recs
    assert {r["slot_position"] for r in recs} == {0, 1, 2}, recs
    assert all(not r.get("cold_start") and r["replayed_iterations"] == 2 for r in recs), recs
    cmp = compare(ref, run)
    assert cmp.bit_exact, cmp.mismatches[:10]
    assert cmp.compared_losses == 2 * STEPS
    assert any("inner_experts.w1_EFD/exp_avg" in k for k in ref.states[0]), "expert optimizer state not compared"


def test_ep_kill_9_under_torchrun_resumes_from_the_host_tier_bit_exactly(tmp_path, reference):
    """A real SIGKILL of rank 1; torchrun restarts both workers, which read the window back through DCP."""
    ref = reference(2, ep("bf16"))
    s = {
        "run": ep("bf16"),
        "checkpoint": {"window": 3},
        "failures": [{"step": 10, "phase": "kill", "rank": 1, "at": "forward", "settled": True}],
        "host_tier": {"root": str(tmp_path / "shm"), "run_id": "ep"},
        "resume": True,
        "timeout_s": 20,
    }
    run = run_torchrun(2, s, tmp_path / "run", max_restarts=2, timeout=55)
    rec = run.report["recoveries"]
    assert len(rec) == 1 and rec[0]["attempt"] >= 1 and rec[0]["source"] == "host", rec
    assert rec[0]["recovered_step"] == 6 and rec[0]["replayed_iterations"] == 2, rec
    cmp = compare(run, ref)  # the restarted workers' losses are those of iterations 7..16
    assert cmp.bit_exact and cmp.compared_losses == 2 * (STEPS - 6), cmp.mismatches[:10]


def test_ep_dense_export_loads_back_exactly(tmp_path):
    """A dense DCP export (the dcp_async baseline's path) of EP DTensors, loaded into another init at step 6,
    continues exactly like the run that wrote it."""
    exports = tmp_path / "exports"
    a = run_torchrun(2, {"run": ep("fp32"), "dense_export": {"uri": f"file://{exports}", "every": 6}}, tmp_path / "a")
    b = run_torchrun(
        2, {"run": ep("fp32"), "init_seed": 991, "initial_load": {"uri": f"file://{exports}/step-6"}}, tmp_path / "b"
    )
    assert b.report["initial_load"]["step"] == 6 and sorted(b.losses[0]) == list(range(7, STEPS + 1))
    cmp = compare(a, b, loss_steps_from=7)
    assert cmp.bit_exact and cmp.compared_losses == 2 * (STEPS - 6), cmp.mismatches[:10]


def test_ep_experts_are_rank_local_dtensors_outside_fsdp(tmp_path):
    out = tmp_path / "probe"
    out.mkdir()
    torchrun(2, [__file__, str(out)], out / "torchrun.log", timeout=55)
    for r in range(2):
        got = json.loads((out / f"rank{r}.json").read_text())
        assert got["experts"] == 6 and got["fsdp_managed_experts"] == 0 and got["fsdp_params"] > 0, got
        assert got["local_experts"] == [4] and got["placements"] == ["S(0)"], got
        assert got["seen_in_forward"] == [4], got  # inside forward too: the 4 own experts, never all 8
        assert got["storage_kept"], "an expert weight was replaced (gathered/resharded) during a step"
        assert got["grad_placements"] == ["S(0)"], got
        assert got["refused"].startswith("expert_parallel needs num_experts (3) divisible"), got
        # EP only moves tokens: the same model as FSDP2 up to the reduction order (not an exactness claim)
        assert max(abs(a - b) for a, b in zip(got["ep_losses"], got["fsdp_losses"])) < 1e-4, got


def test_ep_refuses_hsdp_up_front():
    from torchmoe_harness.trainer import RunConfig

    with pytest.raises(ValueError, match="expert_parallel supports plain FSDP2 only"):
        RunConfig(expert_parallel=True, hsdp=2)


def _probe(out: Path) -> None:
    """Per rank: how the expert weights are laid out and whether FSDP2 manages any of them."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from torchmoe_ckpt.runtime.distributed import init_process_group
    from torchmoe_harness.parallel import EXPERT_PARAM_NAMES
    from torchmoe_harness.trainer import RunConfig, Trainer
    from torchmoe_harness.worker import leave

    init_process_group("gloo")
    model = {"num_experts": 8, "n_layers": 2}
    t = Trainer(RunConfig(expert_parallel=True, steps=3, model=model))
    experts = [p for n, p in t.model.named_parameters() if n.rsplit(".", 1)[-1] in EXPERT_PARAM_NAMES]
    fsdp = [
        fp
        for m in t.model.modules()
        if hasattr(m, "_get_fsdp_state")
        for g in [m._get_fsdp_state()._fsdp_param_group]
        if g is not None
        for fp in g.fsdp_params
    ]
    managed = {id(fp.sharded_param) for fp in fsdp}
    ptrs = [p.to_local().data_ptr() for p in experts]
    seen = set()  # what the expert module holds when it runs (FSDP2 swaps in unsharded parameters there)
    for mod in t.model.modules():
        if hasattr(mod, "w1_EFD"):
            mod.register_forward_pre_hook(
                lambda m, _: seen.add(m.w1_EFD.to_local().shape[0] if isinstance(m.w1_EFD, DTensor) else -1)
            )
    ep_losses = [t.train_step().loss.item() for _ in range(3)]
    res = {
        "experts": len(experts),
        "fsdp_managed_experts": sum(id(p) in managed for p in experts),
        "fsdp_params": len(fsdp),
        "seen_in_forward": sorted(seen),
        "local_experts": sorted({p.to_local().shape[0] for p in experts}),
        "placements": sorted({str(p.placements[0]) for p in experts if isinstance(p, DTensor)}),
        "storage_kept": ptrs == [p.to_local().data_ptr() for p in experts],
        "ep_losses": ep_losses,
    }
    fsdp_t = Trainer(RunConfig(steps=3, model=model))
    res["fsdp_losses"] = [fsdp_t.train_step().loss.item() for _ in range(3)]
    # a forward/backward without the step (which clears the gradients): the expert gradients stay sharded
    t.model(t.stream.batch(9, t.rank)[:, :-1]).float().sum().backward()
    res["grad_placements"] = sorted({str(p.grad.placements[0]) for p in experts})
    try:
        Trainer(RunConfig(expert_parallel=True, model={"num_experts": 3}))
        res["refused"] = ""
    except ValueError as exc:
        res["refused"] = str(exc)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(res))
    dist.barrier()
    leave()


if __name__ == "__main__":
    _probe(Path(sys.argv[1]))
