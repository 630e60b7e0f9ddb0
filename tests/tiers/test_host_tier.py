"""Host-memory tier: slots written through DCP by a background thread, read back for recovery; torn or
corrupt copies are detected and never loaded; stock dcp.load reads a slot."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchmoe_harness.launch import compare, run_torchrun

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast


def spec(root, failures, steps=14, dtype="bf16", hsdp=1):
    return {
        "run": {"steps": steps, "hsdp": hsdp, "dtype": dtype},
        "checkpoint": {"window": 3},
        "failures": failures,
        "host_tier": {"root": str(root), "run_id": "t"},
    }


@pytest.mark.matrix  # the kill -9 test below recovers from the host tier too
def test_recovery_reads_the_window_back_from_the_host_tier(tmp_path, reference):
    ref = reference(2, {"steps": 14, "dtype": "bf16"})
    run = run_torchrun(2, spec(tmp_path / "shm", [{"step": 9, "phase": "update"}]), tmp_path / "run")
    rec = run.report["recoveries"][0]
    assert rec["source"] == "host" and not rec.get("cold_start") and rec["replayed_iterations"] == 2
    assert run.report["checkpoint"]["host_tier"]["windows_persisted"] >= 1
    cmp = compare(ref, run)
    assert cmp.bit_exact, cmp.mismatches[:10]
    # retention: the newest window every rank has persisted, the one being persisted, the one in flight
    # (the run directory also holds the run lock, LOCK.json and .LOCK.mutex, and the slot files, .slots)
    windows = sorted(p.name for p in (tmp_path / "shm" / "node-0" / "t").glob("window-*"))
    assert 1 <= len(windows) <= 3, windows


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_corrupt_or_torn_copy_is_reported_and_never_loaded(tmp_path, how, reference):
    ref = reference(2, {"steps": 12, "dtype": "fp32"})
    run = run_torchrun(
        2,
        spec(tmp_path / "shm", [{"step": 9, "phase": "update", "corrupt": how}], steps=12, dtype="fp32"),
        tmp_path / "run",
    )
    rec = run.report["recoveries"][0]
    assert rec["corrupted"].startswith(how)
    bad = list(rec["unusable_copies"].values())
    assert bad and ("corrupt" in bad[0] if how == "flip" else "torn" in bad[0])
    # Rank 0 cannot use its copy of the newest window, so the ranks agree on an older window every rank can
    # read (or, with none left, start over from the deterministic initialisation): nothing corrupt is loaded.
    corrupted_window = int(rec["corrupted"].rsplit(" ", 1)[1])
    assert rec.get("cold_start") or rec["window_id"] < corrupted_window, rec
    cmp = compare(ref, run)
    assert cmp.bit_exact, cmp.mismatches[:10]


def test_stock_dcp_load_reads_a_slot(tmp_path, one_rank_group):
    from torchmoe_ckpt.config import SparseConfig
    from torchmoe_ckpt.dcp.raw_storage import RawReader
    from torchmoe_ckpt.persist.build_tiers import Tiers
    from torchmoe_ckpt.sparse_checkpointer import RunContext, SparseCheckpointer
    from torchmoe_ckpt.tiers.host_tier import HostTier
    from torchmoe_harness.trainer import RunConfig, Trainer

    t = Trainer(RunConfig(steps=4))
    tier = HostTier(tmp_path, "run", 0, 1)
    ck = SparseCheckpointer(
        t.model, t.optimizer, t.compute_dtype, SparseConfig(window=3), RunContext(tiers=Tiers(tier, None, None))
    ).attach(t)
    for _ in range(4):
        ck.after_step(t.train_step())
    ck.flush()
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
    # (the slot is raw bytes: stock dcp.load and DefaultLoadPlanner, with our reader)
    dcp.load({item.key: full}, storage_reader=RawReader(tier.slot_dir(0, 2)), no_dist=True)
    region = full[tuple(slice(o, o + s) for o, s in zip(item.piece.global_offset, item.piece.shape))]
    assert torch.equal(region, item.buffer)
    ck.close()
    # inspect/verify: exit 0 while every byte verifies, 1 once a data file is damaged
    from torchmoe_ckpt.ops.cli import main

    assert main(["verify", str(tmp_path / "run")]) == 0
    assert main(["inspect", str(tmp_path / "run")]) == 0
    data = next((tmp_path / "run").glob("window-000000/slot-01/rank-00000/*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x01
    data.write_bytes(bytes(raw))
    assert main(["verify", str(tmp_path / "run")]) == 1
    assert main(["inspect", str(tmp_path / "nowhere")]) == 2  # one clear error line, not a traceback


def test_kill_9_under_torchrun_restarts_and_recovers_from_the_host_tier(tmp_path, reference):
    """A real SIGKILL of rank 1 mid-iteration; torchrun restarts all workers; they agree on the newest window
    in the host tier, convert it to dense and finish training exactly like the run that never failed."""
    ref = reference(2, {"steps": 14, "dtype": "bf16"})
    s = spec(tmp_path / "shm", [{"step": 10, "phase": "kill", "rank": 1, "at": "forward", "settled": True}])
    s["resume"] = True
    s["timeout_s"] = 20  # a restart whose rendezvous goes wrong fails fast and torchrun tries again
    run = run_torchrun(2, s, tmp_path / "run", max_restarts=2, timeout=55)
    rec = run.report["recoveries"]
    assert len(rec) == 1 and rec[0]["attempt"] >= 1 and rec[0]["source"] == "host", rec
    assert rec[0]["recovered_step"] == 6 and rec[0]["replayed_iterations"] == 2
    assert "SIGKILL" in run.log or "Signals.SIGKILL" in run.log or "-9" in run.log
    cmp = compare(run, ref)  # the restarted workers' losses are those of iterations 7..14
    assert cmp.bit_exact and cmp.compared_losses == 2 * 8, cmp.mismatches[:10]
