"""Failure matrix under real torchrun: a real SIGKILL at each named point of training and checkpointing
(torchmoe_ckpt/runtime/faults.py); two ranks at once; a failure while recovery is running. Every job must end with
every tensor and every loss `torch.equal` to the run that never failed. The session prints a summary (conftest)."""

import pytest

from torchmoe_harness.launch import compare, run_torchrun

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast

RUN = {"steps": 12, "dtype": "fp32"}

PEERS = {"ranks_per_node": 1, "replicas": 1}  # two emulated nodes, one copy of each window on the other
STORE = {"object_store": "file"}
CASES = {  # name: (TORCHMOE_FAULT, host-tier extras, torchrun restarts it causes)
    # training thread: as the forward starts, as backward starts, inside optimizer.step after the update
    "forward": ("kill:point=forward:rank=0:step=8", {}, 1),
    "backward": ("kill:point=backward:rank=1:step=8", {}, 1),
    "optimizer": ("kill:point=optimizer:rank=0:step=8", {}, 1),
    # background threads: snapshot copy half-way, host-tier slot written, window written but no manifest yet,
    # peer push in flight, object-store upload before its manifest
    "snapshot_copy": ("kill:point=snapshot_copy:rank=1:step=8", {}, 1),
    "persist": ("kill:point=persist:rank=0:step=8", {}, 1),
    "manifest": ("kill:point=manifest:rank=1:step=8", {}, 1),
    "replication": ("kill:point=replication:rank=0:step=8", PEERS, 1),
    "upload": ("kill:point=upload:rank=1:step=8", STORE, 1),
    # several failures: both ranks at once; a second failure while the restarted job replays its window
    "two_ranks_at_once": ("kill:point=forward:rank=0:step=8;kill:point=forward:rank=1:step=8", {}, 1),
    "during_recovery": ("kill:point=optimizer:rank=0:step=8;kill:point=recovery:rank=1", {}, 2),
}


# Four kill points between the two the default suite covers (forward, snapshot_copy) are in the `matrix` set.
MATRIX_ONLY = ("backward", "optimizer", "persist", "manifest", "replication")


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=[pytest.mark.matrix] if c in MATRIX_ONLY else []) for c in CASES]
)
def test_fault_matrix(tmp_path, reference, fault_summary, case):
    faults, extra, restarts = CASES[case]
    host = {"root": str(tmp_path / "shm"), "run_id": "t", **{k: v for k, v in extra.items() if k != "object_store"}}
    if extra.get("object_store"):
        host["object_store"] = {"uri": f"file://{tmp_path / 'store'}"}
    spec = {"run": RUN, "checkpoint": {"window": 3}, "host_tier": host, "resume": True, "timeout_s": 20}
    (tmp_path / "faults").mkdir()
    n_faults = faults.count("kill:")
    ref = reference(2, RUN)
    try:
        run = run_torchrun(
            2,
            spec,
            tmp_path / "run",
            timeout=58,
            max_restarts=restarts + 1,
            extra_env={"TORCHMOE_FAULT": faults, "TORCHMOE_FAULT_STATE": str(tmp_path / "faults")},
        )
    except RuntimeError:
        fault_summary(case, n_faults, "failed loudly")
        raise
    fired = run.log.count("event=fault_injected")
    cmp = compare(run, ref)  # the final attempt's losses and the final state
    fault_summary(case, fired, "recovered exactly" if cmp.bit_exact else "silently wrong")
    assert fired == n_faults, run.log[-3000:]
    rec = run.report["recoveries"]
    assert rec and rec[-1]["attempt"] >= restarts and not rec[-1].get("cold_start"), rec
    assert cmp.bit_exact and cmp.compared_losses > 0, cmp.mismatches[:10]
