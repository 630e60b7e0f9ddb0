"""Dense export: periodic `dcp.async_save` of the whole state in TorchTitan's layout. It must not perturb
training, a fresh job started from it continues bit-exactly, and stock `dcp.load` reads it without our code."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchmoe_harness.launch import compare, run_torchrun

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast

RUN = {"steps": 12, "dtype": "fp32"}


def test_dense_export_restart_is_exact_and_stock_dcp_reads_it(tmp_path):
    exports = tmp_path / "exports"
    a = run_torchrun(
        2, {"run": RUN, "dense_export": {"uri": f"file://{exports}", "every": 6, "keep": 2}}, tmp_path / "a"
    )
    stats = a.report["dense_export"]
    assert stats["exports"] == 2 and stats["latest"].endswith("step-12"), stats
    assert sorted(p.name for p in exports.iterdir()) == ["step-12", "step-6"]  # keep=2

    # A new job from the step-6 export, with a different initialisation, continues exactly as `a` did (while
    # `a` was writing that export in the background: so the export did not perturb training either).
    # It checkpoints with windows as usual and, finding none at start, says it cold-starts from the export.
    b = run_torchrun(
        2,
        {
            "run": RUN,
            "init_seed": 991,
            "initial_load": {"uri": f"file://{exports}/step-6"},
            "checkpoint": {"window": 3},
            "host_tier": {"root": str(tmp_path / "shm"), "run_id": "b"},
            "resume": True,
        },
        tmp_path / "b",
    )
    assert b.report["initial_load"]["step"] == 6
    assert b.report["recoveries"][0]["cold_start"] == f"dense export file://{exports}/step-6 (step 6)"
    assert sorted(b.losses[0]) == [7, 8, 9, 10, 11, 12]
    cmp = compare(a, b, loss_steps_from=7)
    assert cmp.bit_exact, cmp.mismatches[:10]

    # Stock dcp.load, one process, no process group: model tensors sit at the top level under their FQNs.
    path = str(exports / "step-12")
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    names = [k for k in md if k.startswith("layers.1.moe.") or k == "tok_embeddings.weight"]
    sd = {k: torch.empty(md[k].size, dtype=md[k].properties.dtype) for k in names}
    sd["torchmoe_train_state"] = {"step": torch.tensor(0)}
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    assert int(sd.pop("torchmoe_train_state")["step"]) == 12
    assert "layers.1.moe.router.gate.weight" in sd and any(k.endswith(".w1_EFD") for k in sd), sorted(sd)
    for k, full in sd.items():  # FSDP2 Shard(0): the full tensor is the ranks' shards in rank order
        if f"buffer/{k}" in a.states[0]:  # buffers are replicated
            assert torch.equal(a.states[0][f"buffer/{k}"], full), k
        else:
            assert torch.equal(torch.cat([a.states[r][f"param/{k}"] for r in range(2)]), full), k


def test_an_export_of_another_model_or_a_torn_one_is_refused_clearly(tmp_path, one_rank_group):
    import pytest

    from torchmoe_ckpt.dcp.dense_export import export_dense, load_dense
    from torchmoe_harness.trainer import RunConfig, Trainer

    t = Trainer(RunConfig(steps=2))
    t.train_step()
    export_dense(t.model, t.optimizer, str(tmp_path / "step-1"), 1)
    other = Trainer(RunConfig(steps=2, model={"num_experts": 6}))
    before = {k: v.clone() for k, v in other.export_state().items()}
    with pytest.raises(ValueError, match="does not fit this model"):
        load_dense(other.model, other.optimizer, str(tmp_path / "step-1"))
    (tmp_path / "step-1" / ".metadata").unlink()  # an export whose commit never happened
    with pytest.raises(FileNotFoundError, match="not a complete dense export"):
        load_dense(t.model, t.optimizer, str(tmp_path / "step-1"))
    after = other.export_state()  # the refused load changed nothing it could not finish
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("param/"))


# ---- TorchTitan: the export is a complete TorchTitan checkpoint ------------------------------------------------
# Two items, one torchrun job each (the exporting run is cached for the second): every test stays < 60 s.
TITAN_STEPS, TITAN_EXPORT_AT = 8, 4
_TITAN_RUN: dict = {}


def _titan_exporting_run(tmp_path_factory) -> tuple:
    """A TorchTitan job (job file, sparse checkpointing on) that writes a dense export at step 4 of 8."""
    if "a" not in _TITAN_RUN:
        from titan_integration import recovery_demo

        a = tmp_path_factory.mktemp("titan-export")
        job = recovery_demo.write_job(
            a,
            steps=TITAN_STEPS,
            window=2,
            host_dir=a / "host",
            extra_sparse=(f'dense_export_uri = "file://{a / "dense"}"\ndense_export_every = {TITAN_EXPORT_AT}'),
        )
        rc, out = recovery_demo.torchrun(a, recovery_demo.child_env(), job, nproc=2, timeout=55)
        assert rc == 0, out[-5000:]
        _TITAN_RUN["a"] = (a / "dense" / f"step-{TITAN_EXPORT_AT}", out)
    return _TITAN_RUN["a"]


def _printed_losses(out: str) -> dict[int, str]:
    """Rank 0's printed step/loss pairs (TorchTitan's metric logger), as printed."""
    import re

    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    return {int(s): loss for s, loss in re.findall(r"\[default0\].*step:\s+(\d+)\s+loss:\s+([-\d.]+)", plain)}


@pytest.mark.titan  # TorchTitan's own Trainer writes the export
def test_torchtitan_dense_export_holds_every_entry_torchtitan_saves(tmp_path_factory):
    """train_state, dataloader (each rank's dp_rank_N) and lr_scheduler beside the model and optimizer: what
    TorchTitan's CheckpointManager saves and a full resume loads."""
    import pytest

    pytest.importorskip("torchtitan")
    export, _ = _titan_exporting_run(tmp_path_factory)
    keys = set(dcp.FileSystemReader(str(export)).read_metadata().state_dict_metadata)
    for key in (
        "train_state.step",
        "train_state.ntokens_seen",
        "dataloader.dp_rank_0",
        "dataloader.dp_rank_1",
        "lr_scheduler.last_epoch",
        "torchmoe_train_state.step",
        "tok_embeddings.weight",
    ):
        assert key in keys, (key, sorted(k for k in keys if not k.startswith(("layers.", "optimizer."))))
    assert any(k.startswith("optimizer.state.") for k in keys)


@pytest.mark.titan  # TorchTitan's own Trainer writes the export
def test_torchtitan_full_resume_from_a_dense_export_with_its_own_flags(tmp_path, tmp_path_factory):
    """Stock TorchTitan resumes from the export with its own flags (`--checkpoint.initial_load_path DIR
    --checkpoint.no-initial_load_model_only`, no exclusions) -- model, optimizer, LR schedule, step and
    data-loader position -- and trains on with the same losses as the exporting run."""
    import pytest

    pytest.importorskip("torchtitan")
    from titan_integration import recovery_demo

    export, out_a = _titan_exporting_run(tmp_path_factory)
    args = [
        "--module",
        "titan_integration.config_registry",
        "--config",
        "deepseek_v3_tiny",
        "--dump_folder",
        str(tmp_path / "dump"),
        "--training.steps",
        str(TITAN_STEPS),
        "--debug.seed",
        "7",
        "--debug.deterministic",
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(export),
        "--checkpoint.no-initial_load_model_only",
    ]
    rc, out_b = recovery_demo.torchrun(tmp_path, recovery_demo.child_env(), None, nproc=2, train_args=args, timeout=55)
    assert rc == 0 and "Missing key" not in out_b, out_b[-5000:]
    assert f"Loading the checkpoint from {export}" in out_b, out_b[-5000:]
    la, lb = _printed_losses(out_a), _printed_losses(out_b)
    assert sorted(lb) == list(range(TITAN_EXPORT_AT + 1, TITAN_STEPS + 1)), lb  # resumed at step 5
    assert all(lb[s] == la[s] for s in lb), (la, lb)  # same losses as the exporting run from there on
