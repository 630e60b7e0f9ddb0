"""Real nodes on one machine (torchmoe_harness/cluster.py): each node a network, mount, PID and UTS namespace
with its own address on a private bridge, its own tmpfs /dev/shm (the host tier's root) and its own /proc; one
torchrun agent per node, the c10d store (and moto) in namespaces of their own. Every fault ends exact
(`torch.equal` on every tensor and loss against the fault-free run), in a one-line refusal, or in a bounded
timeout; `ip netns list` shows nothing of the test afterwards.

The fault-free reference is the one-host run of the `reference` fixture; that a fault-free run over the cluster's
topology is the same bit for bit is checked by the throttled-link test (and unthrottled in the matrix).
A fault at a known point: rank R stops itself (SIGSTOP) in iteration f ("freeze"); the test finds the stopped
worker in a node's PID namespace, applies the fault to that node, and lets the worker go on (SIGCONT) where the
fault is not the node's death.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchmoe_harness.cluster import Cluster, ClusterNode, netns_of_run, why_unavailable
from torchmoe_harness.launch import children_of, compare, load_result, processes_mentioning
from torchmoe_harness.nodes import process_state

REASON = why_unavailable()
pytestmark = [pytest.mark.torchrun, pytest.mark.skipif(REASON is not None, reason=f"no namespaces here: {REASON}")]

RUN = {"steps": 12, "dtype": "fp32"}
ROOT = "/dev/shm/tmoe"  # each node's own tmpfs


def _spec(
    replicas: int = 1, failure: dict | None = None, store: dict | None = None, timeout_s: int = 20, watchdog_s=None
) -> dict:
    host = {"root": ROOT, "run_id": "t", "replicas": replicas}
    if store:
        host["object_store"] = store
    spec = {"run": RUN, "checkpoint": {"window": 3}, "resume": True, "host_tier": host, "timeout_s": timeout_s}
    if failure:
        spec["failures"] = [failure]
    if watchdog_s:
        spec["watchdog_timeout_s"] = watchdog_s
    return spec


def _program(out: Path, name: str, spec: dict) -> list[str]:
    path = out / f"spec-{name}.json"
    path.write_text(json.dumps(spec, indent=1))
    return ["-m", "torchmoe_harness.worker", "--spec", str(path), "--out", str(out)]


def _frozen(c: Cluster, timeout: float = 40) -> tuple[ClusterNode, int]:
    """The node whose worker stopped itself, and that worker's pid (which node runs a rank is c10d's choice)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for node in c.live_nodes:
            for pid in node.pids():
                if process_state(pid) in ("T", "t"):
                    return node, pid
            if node.agent is not None and node.agent.poll() is not None:
                raise AssertionError(f"node {node.index} ended ({node.agent.returncode}):\n{node.log()[-3000:]}")
        time.sleep(0.1)
    tails = "\n".join(n.log()[-2000:] for n in c.nodes)
    raise AssertionError(f"no stopped worker within {timeout:.0f} s:\n{tails}")


def _workers(node: ClusterNode) -> list[int]:
    """Host pids of the worker processes of the node's newest agent (nsenter -> torchrun -> workers)."""
    return [w for a in children_of(node.agent.pid) for w in children_of(a)]


def _logs(c: Cluster) -> str:
    return "\n".join(n.log() for n in c.nodes)


def _windows(node: ClusterNode) -> dict[str, bytes]:
    root = node.path(ROOT)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("window-*/**/*")) if p.is_file()}


def _exact(out: Path, reference, fault_summary, case: str, log: str) -> dict:
    run = load_result(out, 2, log)
    cmp = compare(run, reference(2, RUN))
    recs = run.report.get("recoveries", [])
    cold = any(r.get("cold_start") and r.get("attempt", 0) > 0 for r in recs)
    outcome = "data lost" if cold else "recovered exactly" if cmp.bit_exact else "silently wrong"
    fault_summary(case, 1, outcome)
    assert outcome == "recovered exactly", (recs, cmp.mismatches[:10])
    return run.report


@pytest.fixture
def cluster(tmp_path):
    """Cluster(...) factory; after the test no namespace, link or process of it is left."""
    made: list[Cluster] = []

    def make(**kw) -> Cluster:
        c = Cluster(out=tmp_path / f"cluster{len(made)}", **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()
    for c in made:
        assert netns_of_run(c.tag) == [], netns_of_run(c.tag)
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert f" {c._link}" not in links, "a link of the run (bridge, veth) outlived the test"
    assert not processes_mentioning(str(tmp_path)), "a node's process outlived the test"


@pytest.mark.parametrize(
    "rate", ["40mbit", pytest.param("4mbit", marks=pytest.mark.matrix), pytest.param(None, marks=pytest.mark.matrix)]
)
def test_throttled_link_fault_free_is_exact(tmp_path, cluster, reference, fault_summary, rate):
    """Every node's link limited with tc tbf (both directions): training, the peer tier's replication and the
    result are the one-host fault-free run's, bit for bit."""
    reference(2, RUN)
    out = tmp_path / "run"
    out.mkdir()
    c = cluster(nodes=2, link_rate=rate)
    if rate:
        qdisc = subprocess.run(["tc", "qdisc", "show", "dev", c.nodes[0].port], capture_output=True, text=True)
        assert "tbf" in qdisc.stdout and rate.replace("mbit", "Mbit") in qdisc.stdout, qdisc.stdout
    for n in c.nodes:
        c.start(n, _program(out, "job", _spec(1)))
    codes = c.wait(60)
    assert codes == [0, 0], (codes, _logs(c)[-4000:])
    log = _logs(c)
    report = _exact(out, reference, fault_summary, f"cluster: link {rate or 'unlimited'}", log)
    peers = report["checkpoint"]["peers"]
    assert peers["windows_replicated"] >= 3, peers
    # the replication lag and each link's rate, in stats() and in the status lines (tiers/peer_lag.py)
    assert peers["lag_windows"] <= peers["lag_windows_max"] and "peer_durable" in peers, peers
    sent = [link for link in peers["links"] if link["direction"] == "to"]
    assert sent and all(link["bytes"] > 0 and link["bytes_per_s"] > 0 for link in sent), peers["links"]
    lines = [x for x in report["status_lines"] if x.startswith("window ")]
    assert lines and all(" peers 1/1 lag " in x and "/s)" in x for x in lines), report["status_lines"]


def test_node_lost_replacement_at_a_new_address_recovers_exactly_from_the_peer(
    tmp_path, cluster, reference, fault_summary
):
    """replicas = 1: node B dies whole in iteration 8 (PID namespace killed, its /dev/shm gone); a replacement
    joins at a new address with an empty /dev/shm; its rank pulls its window from the survivor's peer copy."""
    reference(2, RUN)
    out = tmp_path / "run"
    out.mkdir()
    freeze = {"step": 8, "phase": "freeze", "rank": 1, "settled": True}
    c = cluster(nodes=2)
    for n in c.nodes:
        c.start(n, _program(out, "job", _spec(1, freeze)), max_restarts=1)
    lost, _ = _frozen(c)
    survivor = next(n for n in c.live_nodes if n is not lost)
    old_ip = lost.ip
    c.lose(lost)
    assert lost.pids() == [] and not Path(f"/proc/{lost.init_pid}").exists()
    new = c.add_node()
    assert new.ip != old_ip and not new.path(ROOT).exists()  # a new address, empty RAM
    c.start(new, _program(out, "new", _spec(1)), max_restarts=1)
    codes = c.wait(90, [survivor.agent, new.agent])
    assert codes == [0, 0], (codes, _logs(c)[-4000:])
    report = _exact(out, reference, fault_summary, "cluster: node lost, replacement at a new address", _logs(c))
    rec = report["recoveries"][0]
    assert rec.get("pulled_from_peers"), rec  # the new node's rank got its window from the peer copy


def test_no_copy_anywhere_after_node_loss_is_refused_in_one_line_and_nothing_overwritten(
    tmp_path, cluster, fault_summary
):
    """replicas = 0, no store: the lost node's part of every window is gone. Every rank refuses in one line;
    the survivor's windows (in its own /dev/shm) are byte for byte what they were."""
    out = tmp_path / "run"
    out.mkdir()
    c = cluster(nodes=2)
    for n in c.nodes:
        c.start(n, _program(out, "job", _spec(0, {"step": 8, "phase": "freeze", "rank": 1})), max_restarts=1)
    lost, _ = _frozen(c)
    survivor = next(n for n in c.live_nodes if n is not lost)
    c.lose(lost)
    first = _workers(survivor)
    end = time.monotonic() + 40  # the survivor's worker ends (its peer's sockets closed with the node)
    while any(process_state(p) not in (None, "Z") for p in first):
        assert time.monotonic() < end, "the survivor's first worker did not end"
        time.sleep(0.1)
    before = _windows(survivor)
    new = c.add_node()
    c.start(new, _program(out, "new", _spec(0)), max_restarts=0)
    codes = c.wait(90, [survivor.agent, new.agent])
    log = _logs(c)
    refused = [ln for ln in log.splitlines() if "event=refused" in ln]
    after = _windows(survivor)
    ok = bool(refused) and bool(before) and after == before and not (out / "rank0.pt").exists()
    fault_summary("cluster: node lost, no copy anywhere", 1, "refused with one line" if ok else "data lost")
    assert codes[0] != 0 and codes[1] != 0, codes
    assert refused and "cannot resume" in refused[0], log[-3000:]
    assert before and after == before, sorted(set(after) ^ set(before))[:10]


def test_short_blackhole_the_job_goes_on_exactly(tmp_path, cluster, reference, fault_summary):
    """Node B's bridge port is down for 3 s in iteration 6 (packets dropped: no reset, no error); the
    collectives wait (process-group timeout 20 s) and the job goes on without a restart, exact."""
    reference(2, RUN)
    out = tmp_path / "run"
    out.mkdir()
    c = cluster(nodes=2)
    for n in c.nodes:
        c.start(n, _program(out, "job", _spec(1, {"step": 6, "phase": "freeze", "rank": 1})))
    node, pid = _frozen(c)
    c.blackhole(node, 3)
    os.kill(pid, signal.SIGCONT)
    t0 = time.monotonic()
    codes = c.wait(60)
    assert codes == [0, 0], (codes, _logs(c)[-4000:])
    assert time.monotonic() - t0 > 2.5  # it did wait for the link
    report = _exact(out, reference, fault_summary, "cluster: 3 s blackhole", _logs(c))
    assert report["recoveries"] == [] or not any(r.get("attempt") for r in report["recoveries"]), report


# two jobs, a timeout and a relaunch: 26 s on the quiet 2-core machine with the reference cached (36 s alone),
# 96 s when the machine ran 4 other suites
def test_long_blackhole_ends_the_job_and_a_relaunch_is_exact(tmp_path, cluster, reference, fault_summary):
    """Node B's bridge port stays down past the process-group timeout (8 s): the job ends within its timeouts
    (no hang); after healing, a relaunch on the same run id (new agents, the nodes' /dev/shm kept) takes the
    dead job's run locks over as stale (each node's own /proc) and is exact."""
    reference(2, RUN)
    out = tmp_path / "run"
    out.mkdir()
    c = cluster(nodes=2, read_timeout_s=5)
    spec = _spec(1, {"step": 8, "phase": "freeze", "rank": 1, "settled": True}, timeout_s=8, watchdog_s=6)
    for n in c.nodes:
        c.start(n, _program(out, "job", spec))
    node, pid = _frozen(c)
    c.blackhole(node)
    os.kill(pid, signal.SIGCONT)
    t0 = time.monotonic()
    healthy = next(n for n in c.live_nodes if n is not node)
    try:  # the healthy side ends by its timeouts; the cut-off node's worker by its watchdog (exit 124)
        codes = c.wait(40, [healthy.agent])
        end = time.monotonic() + 20
        while "event=hang rank=1" not in node.log() and time.monotonic() < end:
            time.sleep(0.2)
        assert "event=hang rank=1" in node.log(), node.log()[-3000:]
    except (RuntimeError, AssertionError):
        fault_summary("cluster: long blackhole", 1, "failed loudly")
        raise
    ended = time.monotonic() - t0
    print(f"the job ended {ended:.1f} s into the blackhole")
    assert codes[0] != 0, codes
    c.heal(node)  # its agent then leaves the rendezvous (its store calls had nowhere to go)
    assert c.wait(30, [node.agent])[0] != 0
    fault_summary("cluster: long blackhole", 1, "ended within its timeout")
    for n in c.live_nodes:
        c.start(n, _program(out, "relaunch", _spec(1, timeout_s=20)), rdzv_id="relaunch")
    codes = c.wait(60)
    assert codes == [0, 0], (codes, ended, _logs(c)[-4000:])
    log = _logs(c)
    assert "reason=stale" in log, log[-3000:]  # the dead job's lock: its pid gone from the node's own /proc
    report = _exact(out, reference, fault_summary, "cluster: relaunch after a long blackhole", log)
    assert report["recoveries"][0].get("recovered_step", 0) >= 6, report["recoveries"]


@pytest.mark.parametrize(
    "then_recover",
    [False, pytest.param(True, marks=pytest.mark.matrix)],
    ids=["catch-up", "catch-up-then-recover-from-store"],
)
def test_object_store_cut_off_from_one_node_catches_up_and_recovery_never_mixes(
    tmp_path, cluster, reference, fault_summary, then_recover
):
    """S3 (moto) in its own namespace; replicas = 0. Node B loses its route to the store for 4 s from iteration
    5, its open connections to the store aborted (cut_store: an upload in flight would otherwise stall and
    succeed, as one did in a CI run); its uploads fail and retry, node A's go on. The job ends exact and B's
    windows catch up before it exits. Matrix: then both nodes die (all host memory gone) and two new nodes recover
    from the store alone: a complete window of one step on every rank, exact (a durable copy of one rank never
    meets a stale one of the other)."""
    reference(2, RUN)
    out = tmp_path / "run"
    out.mkdir()
    c = cluster(nodes=2, object_store=True)
    store = c.object_store
    for n in c.nodes:
        c.start(n, _program(out, "job", _spec(0, {"step": 5, "phase": "freeze", "rank": 1}, store)))
    node, pid = _frozen(c)
    c.cut_store(node, 4)
    os.kill(pid, signal.SIGCONT)
    codes = c.wait(60)
    assert codes == [0, 0], (codes, _logs(c)[-4000:])
    _exact(out, reference, fault_summary, "cluster: object store cut off one node", _logs(c))
    log = _logs(c)  # the cut-off rank's uploads failed, then its windows caught up (the newest one included)
    assert "event=tier_unhealthy tier=object store rank=1" in log, log[-3000:]
    assert "event=tier_recovered tier=object store rank=1" in log, log[-3000:]
    if not then_recover:
        return
    for n in list(c.live_nodes):
        c.lose(n)
    again = tmp_path / "again"
    again.mkdir()
    for _ in range(2):
        c.start(c.add_node(), _program(again, "again", _spec(0, store=store)), rdzv_id="again")
    codes = c.wait(60)
    assert codes == [0, 0], (codes, _logs(c)[-4000:])
    report = _exact(again, reference, fault_summary, "cluster: recovery from the store after the cut", _logs(c))
    rec = report["recoveries"][0]
    assert rec.get("source") == "object store", rec


def _node_of_stopped_worker(out: Path, up: subprocess.Popen, timeout: float = 40) -> int:
    """The index of the node whose worker (of the job writing to `out`) stopped itself, found from outside the
    tool (which node runs a rank is c10d's choice): the worker's network namespace is `<run>-node<i>`."""
    end = time.monotonic() + timeout
    while True:
        stopped = [p for p in processes_mentioning(str(out)) if process_state(p) in ("T", "t")]
        if stopped:
            break
        assert up.poll() is None and time.monotonic() < end, "no worker stopped itself"
        time.sleep(0.1)
    ns = subprocess.run(["ip", "netns", "identify", str(stopped[0])], capture_output=True, text=True).stdout
    return int(ns.strip().rsplit("node", 1)[1])


def test_the_command_line_tool_rehearses_a_node_loss(tmp_path, reference, fault_summary):
    """What docs/failure-recovery.md tells users to type: `python -m torchmoe_harness.cluster up ... -- program` in
    one shell; `status`, `lose N` and `add` from another. Rank 1 stops itself at the start of iteration 9 (a fault
    fired once per job: TORCHMOE_FAULT_STATE), its node is lost whole, a replacement joins at a new address with an
    empty /dev/shm and runs the same program, its rank pulling its window from the survivor's peer copy; `up` exits
    0 when the job ends, the result is exact and nothing of the run is left. (The same loss through the Cluster
    API, checking the lost node's processes and address directly: the `matrix` case above.)"""
    reference(2, RUN)
    out = tmp_path / "run"
    out.mkdir()
    program = _program(out, "job", _spec(1))
    env = dict(
        os.environ, TORCHMOE_FAULT="freeze:point=forward:rank=1:step=9", TORCHMOE_FAULT_STATE=str(tmp_path / "faults")
    )

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "torchmoe_harness.cluster", *args], capture_output=True, text=True, timeout=30
        )

    up = subprocess.Popen(
        [sys.executable, "-m", "torchmoe_harness.cluster", "up", "--nodes", "2", "--max-restarts", "2", "--", *program],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    tag = d = None
    try:
        first = up.stdout.readline()  # "cluster <tag>: 2 node(s) on ..., dir <dir>"
        assert first.startswith("cluster "), first
        tag, d = first.split()[1].rstrip(":"), first.rsplit("dir ", 1)[1].strip()
        node = _node_of_stopped_worker(out, up)
        status = cli("status", "--dir", d)
        assert status.returncode == 0 and status.stdout.count("agent running") == 2, status
        lost = cli("lose", str(node), "--dir", d)
        old_ip = re.search(rf"node {node} \((\S+)\) lost", lost.stdout)
        assert lost.returncode == 0 and old_ip, lost
        added = cli("add", "--dir", d)
        new_ip = re.search(r"added at (\S+)", added.stdout)
        assert added.returncode == 0 and new_ip and new_ip[1] != old_ip[1], (added, old_ip[1])  # a new address
        rest, _ = up.communicate(timeout=40)  # within the test's 60 s: the finally below still tears it down
    finally:
        if up.poll() is None:
            up.terminate()  # SIGTERM: `up` tears the cluster down
            up.wait(30)
    assert d is not None
    log = "\n".join(p.read_text() for p in sorted(Path(d).glob("node*-agent*.log")))
    shutil.rmtree(d, ignore_errors=True)  # the tool keeps its logs for users; the test has read them
    ended = "job ended: agent exit codes [0, 0]" in rest and "torn down" in rest
    assert up.returncode == 0 and ended, rest + log[-3000:]
    assert netns_of_run(tag) == [] and not processes_mentioning(str(out))
    report = _exact(out, reference, fault_summary, "cluster CLI: node lost, replacement added", log)
    assert any(r.get("pulled_from_peers") for r in report["recoveries"]), report["recoveries"]
