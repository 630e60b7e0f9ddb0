"""A host dies and a new one joins: two real torchrun agents (`--nnodes 2`, c10d rendezvous on localhost), one
rank each, each with a host directory of its own (what /dev/shm is on two machines). Rank R freezes itself in
iteration 8 (a deterministic point); the test then kills its whole host with SIGKILL (agent, worker and the
worker's children at once), and starts a new agent with an empty host directory, as a replacement machine
would join. The survivor's agent restarts its worker (restart count 1), the new one starts at restart count 0;
both resume, and the final state of every rank and every loss are `torch.equal` to a run that never failed.

`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (torch's opt-out) where the case needs it: with torchrun's default
shared store, a host that joins at a non-zero node rank while node rank 0 survives never gets the store address
inside torchrun (torch 2.13), whatever the workers do (torchmoe_ckpt/distributed.py). The rank-0 case runs on
the default shared store: the survivor is renumbered to rank 0 and the two agents' restart counts differ, which
the per-round store makes work.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchmoe_harness.launch import RunResult, compare, load_result
from torchmoe_harness.nodes import Cluster, process_state

RUN = {"steps": 12, "dtype": "fp32"}
OPT_OUT = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
CASES = ("host replaced, peer copy", "host replaced, object store", "rank-0 host replaced, shared store")


def _spec(root: Path, replicas: int, store: str | None, freeze_rank: int | None) -> dict:
    host = {"root": str(root), "run_id": "t", "replicas": replicas}
    if store:
        host["object_store"] = {"uri": store}
    spec = {"run": RUN, "checkpoint": {"window": 3}, "resume": True, "host_tier": host, "timeout_s": 60}
    if freeze_rank is not None:
        spec["failures"] = [{"step": 8, "phase": "freeze", "rank": freeze_rank}]
    return spec


def _program(out: Path, name: str, spec: dict) -> list[str]:
    path = out / f"spec-{name}.json"
    path.write_text(json.dumps(spec, indent=1))
    return ["-m", "torchmoe_harness.worker", "--spec", str(path), "--out", str(out)]


def replace_host(tmp: Path, lost_rank: int, replicas: int, store: str | None, env: dict, summary) -> RunResult:
    """Run the job on two hosts, lose the host of `lost_rank` in iteration 8, join a new one; returns the
    result (every rank's state and losses, rank 0's report, the agents' logs). A job that fails is counted
    as "failed loudly" in the fault summary (`summary`: the fixture and the case)."""
    try:
        return _replace_host(tmp, lost_rank, replicas, store, env)
    except (RuntimeError, AssertionError):
        summary[0](summary[1], 1, "failed loudly")
        raise


def _replace_host(tmp: Path, lost_rank: int, replicas: int, store: str | None, env: dict) -> RunResult:
    out = tmp / "run"
    with Cluster(out, nnodes=2, env=env) as cluster:
        hosts = [
            cluster.start(i, _program(out, f"host{i}", _spec(tmp / f"host{i}", replicas, store, lost_rank)), 1)
            for i in (0, 1)
        ]
        found: list = []

        def frozen() -> bool:  # which host runs `lost_rank` is c10d's choice: the one whose worker stopped
            found[:] = [h for h in hosts if any(process_state(p) == "T" for p in h.workers())]
            return bool(found)

        hosts[0].wait_for(frozen, 60, "a frozen worker on either host")
        lost = found[0]
        lost.kill()
        survivor = hosts[1 - hosts.index(lost)]
        new = cluster.start(2, _program(out, "new-host", _spec(tmp / "new-host", replicas, store, None)), 1)
        codes = survivor.wait(120), new.wait(60)
        logs = [n.log() for n in cluster.nodes]
    assert codes == (0, 0), f"exit codes {codes}:\n" + "\n".join(lg[-3000:] for lg in logs)
    return load_result(out, 2, "\n".join(logs))


def exact(run, reference, fault_summary, case: str) -> None:
    """The final attempt's losses and the final state of every rank against the fault-free run; counted in
    the fault summary (a fresh start where a window existed is data lost)."""
    rec = run.report["recoveries"][0]
    cmp = compare(run, reference(2, RUN))
    outcome = "data lost" if rec.get("cold_start") else "recovered exactly" if cmp.bit_exact else "silently wrong"
    fault_summary(case, 1, outcome)
    assert outcome == "recovered exactly", (rec, cmp.mismatches[:10])


def test_host_replaced_recovers_exactly_from_the_peer_copy(tmp_path, reference, fault_summary):
    """replicas = 1: the new host's rank pulls its window from the copy its peer holds."""
    reference(2, RUN)
    run = replace_host(tmp_path, 1, replicas=1, store=None, env=OPT_OUT, summary=(fault_summary, CASES[0]))
    rec = run.report["recoveries"][0]
    assert rec["attempt"] == 1, rec  # rank 0 (the survivor) restarted once
    assert set(rec.get("pulled_from_peers", {})) == {"1"}, rec  # the new host's rank got its window from a peer
    exact(run, reference, fault_summary, CASES[0])


def test_host_replaced_without_replicas_recovers_from_the_store(tmp_path, reference, fault_summary):
    """replicas = 0 and an object store: the new host's rank downloads its window."""
    reference(2, RUN)
    store = f"file://{tmp_path / 'store'}"
    run = replace_host(tmp_path, 1, replicas=0, store=store, env=OPT_OUT, summary=(fault_summary, CASES[1]))
    assert run.report["recoveries"][0].get("source") == "object store", run.report["recoveries"]
    exact(run, reference, fault_summary, CASES[1])


def test_rank0_host_lost_on_the_shared_store_recovers_from_the_store(tmp_path, reference, fault_summary):
    """torchrun's default shared store: the host of rank 0 dies, the survivor becomes rank 0 (restart count 1)
    and the new host rank 1 (restart count 0). Both meet in one process group and recover from the store."""
    reference(2, RUN)
    store = f"file://{tmp_path / 'store'}"
    run = replace_host(tmp_path, 0, replicas=0, store=store, env={}, summary=(fault_summary, CASES[2]))
    assert run.report["recoveries"][0].get("source") == "object store", run.report["recoveries"]
    # multi-host without torch's opt-out: rank 0 says once per attempt what torch cannot do here
    assert "event=rendezvous_note" in run.log and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in run.log
    exact(run, reference, fault_summary, CASES[2])


@pytest.fixture(autouse=True)
def _no_leftover_processes(tmp_path):
    yield
    from torchmoe_harness.launch import processes_mentioning

    assert not processes_mentioning(str(tmp_path)), "a host's process outlived the test"
