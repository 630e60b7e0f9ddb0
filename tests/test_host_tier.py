"""Host-memory tier: slots written through DCP by a background thread, read back for recovery; torn or
corrupt copies are detected and never loaded; stock dcp.load reads a slot."""
import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchmoe_ckpt.harness.launch import compare, run_torchrun


def spec(root, failures, steps=14, dtype="bf16", hsdp=1):
    return {"run": {"steps": steps, "hsdp": hsdp, "dtype": dtype}, "checkpoint": {"window": 3},
            "failures": failures, "host_tier": {"root": str(root), "run_id": "t"}}


def test_recovery_reads_the_window_back_from_the_host_tier(tmp_path, reference):
    ref = reference(2, {"steps": 14, "dtype": "bf16"})
    run = run_torchrun(2, spec(tmp_path / "shm", [{"step": 9, "phase": "update"}]), tmp_path / "run")
    rec = run.report["recoveries"][0]
    assert rec["source"] == "host" and not rec.get("cold_start") and rec["replayed_iterations"] == 2
    assert run.report["checkpoint"]["host_tier"]["windows_persisted"] >= 1
    cmp = compare(ref, run)
    assert cmp.bit_exact, cmp.mismatches[:10]
    # retention: only the newest committed window (and the one in flight) stay on the tier
    windows = sorted(p.name for p in (tmp_path / "shm" / "t").iterdir())
    assert 1 <= len(windows) <= 2, windows


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_corrupt_or_torn_copy_is_reported_and_never_loaded(tmp_path, how, reference):
    ref = reference(2, {"steps": 12, "dtype": "fp32"})
    run = run_torchrun(2, spec(tmp_path / "shm", [{"step": 9, "phase": "update", "corrupt": how}], steps=12,
                               dtype="fp32"), tmp_path / "run")
    rec = run.report["recoveries"][0]
    assert rec["corrupted"].startswith(how)
    bad = list(rec["unusable_copies"].values())
    assert bad and ("corrupt" in bad[0] if how == "flip" else "torn" in bad[0])
    # Rank 0 cannot use its copy, so no window is readable by every rank: nothing corrupt is loaded, the run
    # starts over from the deterministic initialisation and still ends exact.
    assert rec["cold_start"] is True
    cmp = compare(ref, run)
    assert cmp.bit_exact, cmp.mismatches[:10]


def test_stock_dcp_load_reads_a_slot(tmp_path, one_rank_group):
    from torchmoe_ckpt.checkpointer import SparseCheckpointer, SparseConfig
    from torchmoe_ckpt.dcp.host_tier import HostTier, slot_rank_dir
    from torchmoe_ckpt.harness.trainer import RunConfig, Trainer
    t = Trainer(RunConfig(steps=4))
    tier = HostTier(tmp_path, "run", 0, 1)
    ck = SparseCheckpointer(t.model, t.optimizer, t.compute_dtype, SparseConfig(window=3), host_tier=tier).attach(t)
    for _ in range(4):
        ck.after_step(t.train_step())
    ck.close()
    ck.tier_writer.flush()
    assert tier.window_ids() == [0] and tier.verify(0) == []
    win = tier.load_window(0, ck.op_by_name, t.compute_dtype)
    assert [s.step for s in win.slots] == [1, 2, 3]
    for mine, back in zip(ck.committed.slots, win.slots):
        for a, b in zip(mine.items, back.items):
            assert a.key == b.key and torch.equal(a.buffer, b.buffer)
    # A plain DCP load of slot 2 (the last one: full state of the last operators) into full-size tensors.
    last = win.slots[-1]
    item = next(i for i in last.items if i.role == "master")
    full = torch.zeros(item.piece.global_shape)
    dcp.load({item.key: full}, checkpoint_id=slot_rank_dir(tier.window_dir(0), 2, 0), no_dist=True)
    region = full[tuple(slice(o, o + s) for o, s in zip(item.piece.global_offset, item.piece.shape))]
    assert torch.equal(region, item.buffer)
    ck.engine.shutdown()
    ck.tier_writer.shutdown()
    # inspect/verify: exit 0 while every byte verifies, 1 once a data file is damaged
    from torchmoe_ckpt.cli import main
    assert main(["verify", str(tmp_path / "run")]) == 0
    assert main(["inspect", str(tmp_path / "run")]) == 0
    data = next((tmp_path / "run").glob("window-000000/slot-01/rank-00000/*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x01
    data.write_bytes(bytes(raw))
    assert main(["verify", str(tmp_path / "run")]) == 1
    assert main(["inspect", str(tmp_path / "nowhere")]) == 2  # one clear error line, not a traceback
