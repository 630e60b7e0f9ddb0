"""A host dies and a new one joins: two real torchrun agents (`--nnodes 2`, c10d rendezvous on localhost), one
rank each, each with a host directory of its own (what /dev/shm is on two machines). Rank R freezes itself in
iteration 8 (a deterministic point); the test then kills its whole host with SIGKILL (agent, worker and the
worker's children at once), and starts a new agent with an empty host directory, as a replacement machine
would join. The survivor's agent restarts its worker (restart count 1), the new one starts at restart count 0;
both resume, and the final state of every rank and every loss are `torch.equal` to a run that never failed.

`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (torch's opt-out) where the case needs it: with torchrun's default
shared store, a host that joins at a non-zero node rank while node rank 0 survives never gets the store address
inside torchrun (torch 2.13), whatever the workers do (torchmoe_ckpt/runtime/distributed.py). The rank-0 case runs on
the default shared store: the survivor is renumbered to rank 0 and the two agents' restart counts differ, which
the per-round store makes work.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from torchmoe_harness.launch import RunResult, compare, load_result
from torchmoe_harness.nodes import Cluster, process_state

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast

RUN = {"steps": 12, "dtype": "fp32"}
OPT_OUT = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
CASES = (
    "host replaced, peer copy",
    "host replaced, object store",
    "rank-0 host replaced, shared store",
    "rank-0 host replaced, ranks renumbered, peer copies",
)


def _spec(root: Path, replicas: int, store: str | None, freeze_rank: int | None, extra: dict | None = None) -> dict:
    """`extra`: more host-tier settings, and "window" (W, default 3)."""
    extra = dict(extra or {})
    window = extra.pop("window", 3)
    host = {"root": str(root), "run_id": "t", "replicas": replicas, **extra}
    if store:
        host["object_store"] = {"uri": store}
    spec = {"run": RUN, "checkpoint": {"window": window}, "resume": True, "host_tier": host, "timeout_s": 60}
    if freeze_rank is not None:  # settled: its windows on the peers first (replication is asynchronous)
        spec["failures"] = [{"step": 8, "phase": "freeze", "rank": freeze_rank, "settled": replicas > 0}]
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


@dataclass
class Replacement:
    codes: tuple[int, int]  # exit codes of the survivor's agent and the new host's
    logs: list[str]
    out: Path
    survivor_root: Path
    before: dict[str, bytes]  # the survivor's window files once its first worker was gone


def window_files(root: Path) -> dict[str, bytes]:
    """Every file of every window under a host root (all node directories, the run's and peer copies)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("window-*/**/*")) if p.is_file()}


def run_replacement(
    tmp: Path,
    lost_rank: int,
    replicas: int,
    store: str | None,
    env: dict,
    new_restarts: int = 1,
    extra: dict | None = None,
):
    """Two hosts train; the host of `lost_rank` freezes in iteration 8 and is killed whole; a new host with an
    empty directory joins (torchrun --max-restarts `new_restarts`). `extra`: more settings (`_spec`)."""
    out = tmp / "run"
    with Cluster(out, nnodes=2, env=env) as cluster:
        hosts = [
            cluster.start(i, _program(out, f"host{i}", _spec(tmp / f"host{i}", replicas, store, lost_rank, extra)), 1)
            for i in (0, 1)
        ]
        found: list = []

        def frozen() -> bool:  # which host runs `lost_rank` is c10d's choice: the one whose worker stopped
            found[:] = [h for h in hosts if any(process_state(p) == "T" for p in h.workers())]
            return bool(found)

        hosts[0].wait_for(frozen, 60, "a frozen worker on either host")
        lost = found[0]
        survivor = hosts[1 - hosts.index(lost)]
        first = survivor.workers()
        lost.kill()
        survivor.wait_for(lambda: all(process_state(p) in (None, "Z") for p in first), 60, "its worker's exit")
        root = tmp / f"host{hosts.index(survivor)}"
        before = window_files(root)  # the new attempt only reads until it has recovered (or refused)
        spec = _spec(tmp / "new-host", replicas, store, None, extra)
        new = cluster.start(2, _program(out, "new-host", spec), new_restarts)
        codes = survivor.wait(120), new.wait(60)
        logs = [n.log() for n in cluster.nodes]
    return Replacement(codes, logs, out, root, before)


def _replace_host(tmp: Path, lost_rank: int, replicas: int, store: str | None, env: dict) -> RunResult:
    got = run_replacement(tmp, lost_rank, replicas, store, env)
    assert got.codes == (0, 0), f"exit codes {got.codes}:\n" + "\n".join(lg[-3000:] for lg in got.logs)
    return load_result(got.out, 2, "\n".join(got.logs))


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


def test_rank0_host_replaced_ranks_renumbered_recovers_from_the_copies_where_they_are(
    tmp_path, reference, fault_summary
):
    """replicas = 1, no store: the host of rank 0 dies; the survivor becomes rank 0 and writes node-0 now, but
    its copies sit in node-1 of its root (its own part as rank 1, and the peer copy of rank 0's part). It
    takes rank 0's part from there and sends rank 1's to the new host; exact. The old directory is removed
    after the recovery (a newer leftover must not mix with the windows the new numbering writes)."""
    reference(2, RUN)
    run = replace_host(tmp_path, 0, replicas=1, store=None, env={}, summary=(fault_summary, CASES[3]))
    rec = run.report["recoveries"][0]
    assert rec.get("source") == "peer 0" or rec.get("source") == "host", rec  # not the store: there is none
    assert rec.get("pulled_from_peers") == {"1": 0}, rec  # rank 1 (the new host) got its part from rank 0
    assert rec.get("orphans_removed"), rec
    exact(run, reference, fault_summary, CASES[3])


def test_host_replaced_without_any_copy_is_refused_and_the_survivors_windows_untouched(tmp_path, fault_summary):
    """replicas = 0, no object store: rank 1's part of every window is gone with its host. Rank 0 still holds
    its part, so starting over would overwrite it (the outside trial: "nothing to recover, a new run starts").
    Every rank refuses in one line; the survivor's windows are byte for byte what they were."""
    got = run_replacement(tmp_path, 1, replicas=0, store=None, env=OPT_OUT, new_restarts=0)
    log = "\n".join(got.logs)
    refused = [ln for ln in log.splitlines() if "event=refused" in ln]
    after = window_files(got.survivor_root)
    ok = bool(refused) and got.before and after == got.before and not (got.out / "rank0.pt").exists()
    fault_summary("host replaced, no copy anywhere", 1, "refused with one line" if ok else "data lost")
    assert got.codes[0] != 0 and got.codes[1] != 0, got.codes
    assert refused and "cannot resume" in refused[0] and "rank(s) 1 have no copy" in refused[0], log[-3000:]
    fresh = [ln for ln in log.splitlines() if "event=cold_start" in ln or "event=no_window" in ln]
    assert all("attempt=0" in ln for ln in fresh) and "event=cold_start" not in got.logs[-1], fresh  # only the first
    assert got.before and after == got.before, sorted(set(after) ^ set(got.before))[:10]


def test_rank0_host_lost_without_any_copy_renumbered_survivor_refuses_like_its_mirror(tmp_path, fault_summary):
    """replicas = 0, no object store, the host of rank 0 lost: torchrun renumbers the survivor as rank 0 (node 0),
    while its windows sit in its node-1 directory as rank 1's part. Rank 0's part is gone with its host, so this
    is the mirror of the case above and gets the same answer: every rank refuses in one line, naming rank 0 this
    time; never a new run (the outside trial: "nothing to recover, a new run starts", then training from step 0
    over its own windows). The survivor's windows are byte for byte what they were."""
    got = run_replacement(tmp_path, 0, replicas=0, store=None, env={}, new_restarts=0)
    log = "\n".join(got.logs)
    refused = [ln for ln in log.splitlines() if "event=refused" in ln]
    after = window_files(got.survivor_root)
    ok = bool(refused) and got.before and after == got.before and not (got.out / "rank0.pt").exists()
    fault_summary(
        "rank-0 host lost, no copy anywhere, survivor renumbered", 1, "refused with one line" if ok else "data lost"
    )
    assert any(k.startswith("node-1/") for k in got.before), sorted(got.before)[:5]  # the survivor was node 1
    assert got.codes[0] != 0 and got.codes[1] != 0, got.codes
    assert refused and "cannot resume" in refused[0] and "rank(s) 0 have no copy" in refused[0], log[-3000:]
    assert "rank(s) 1 have their part only on another host, under an older node numbering" in refused[0], refused[0]
    fresh = [ln for ln in log.splitlines() if "event=cold_start" in ln or "event=no_window" in ln]
    assert all("attempt=0" in ln for ln in fresh) and "event=cold_start" not in got.logs[-1], fresh  # only the first
    assert got.before and after == got.before, sorted(set(after) ^ set(got.before))[:10]


@pytest.fixture(autouse=True)
def _no_leftover_processes(tmp_path):
    yield
    from torchmoe_harness.launch import processes_mentioning

    assert not processes_mentioning(str(tmp_path)), "a host's process outlived the test"
