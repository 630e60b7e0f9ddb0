"""Hung-collective watchdog: a watched region that outlives its timeout ends the process with a log line
naming rank and operation; a real SIGSTOPped peer under torchrun is detected, torchrun restarts the job,
and the workers recover from the host tier bit-exactly."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support.events import find, first

from torchmoe_ckpt.runtime.watchdog import EXIT_COLLECTIVE_ERROR, EXIT_HANG
from torchmoe_harness.launch import compare, processes_mentioning, run_torchrun

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast

ROOT = Path(__file__).resolve().parents[2]
SLACK_S = 1.5  # detection may lag the deadline by scheduling on a loaded 2-core machine, not by polling

REGIONS = textwrap.dedent("""
    import json, sys, time
    from torchmoe_ckpt.runtime.watchdog import CollectiveWatchdog
    wd = CollectiveWatchdog(float(sys.argv[1]), rank=3)
    for i, secs in enumerate(json.loads(sys.argv[2])):
        with wd.watch(f"fake all_reduce {i}"):
            time.sleep(secs)
    wd.close()
    print(json.dumps(wd.stats()))
""")

GLOO = textwrap.dedent("""
    import datetime, os, sys
    import torch, torch.distributed as dist
    from torchmoe_ckpt.runtime.watchdog import CollectiveWatchdog
    rank, gloo_s, wd_s = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    region_s = float(sys.argv[4]) if len(sys.argv) > 4 else None  # step 2's own bound (None: the watchdog's)
    # rendezvous with a long timeout (the two interpreters may start seconds apart on a loaded machine),
    # then the collectives on a group with the timeout under test
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    group = dist.new_group(timeout=datetime.timedelta(seconds=gloo_s))
    wd = CollectiveWatchdog(wd_s)
    t = torch.ones(8)
    with wd.watch("all_reduce warm-up"):
        dist.all_reduce(t, group=group)
    if rank == 1:
        os.kill(os.getpid(), 19)  # SIGSTOP: never joins the next all_reduce
    with wd.watch("all_reduce step 2", region_s):
        dist.all_reduce(t, group=group)
    sys.exit(0)
""")


def _py(code: str, *args, env=None, timeout=30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
    )


def _event(stderr: str, kind: str) -> dict:
    return first(stderr, kind).fields


def test_region_past_timeout_exits_nonzero_naming_the_op():
    t0 = time.monotonic()
    r = _py(REGIONS, 0.5, json.dumps([0.01, 30]))
    elapsed = time.monotonic() - t0
    assert r.returncode == EXIT_HANG, (r.returncode, r.stderr[-2000:])
    ev = _event(r.stderr, "hang")
    assert ev["rank"] == "3" and ev["op"] == "fake all_reduce 1", ev
    assert 0.5 <= float(ev["waited_s"]) <= 0.5 + SLACK_S, ev
    assert 'File "<string>"' in r.stderr  # every thread's Python stack follows the event line
    assert r.stdout == "" and elapsed < 15  # exited long before the 30 s region would have ended


def test_regions_within_timeout_do_not_fire():
    r = _py(REGIONS, 2.0, json.dumps([0.05, 0.3, 0.01]))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "event=" not in r.stderr
    stats = json.loads(r.stdout)
    assert stats["regions_watched"] == 3 and stats["hangs_detected"] == 0 and stats["max_region_s"] >= 0.3


def test_watchdog_off_is_a_no_op():
    from torchmoe_ckpt.runtime.watchdog import CollectiveWatchdog

    wd = CollectiveWatchdog(None)
    with wd.watch("anything"):
        pass
    assert not wd.enabled and wd._thread is None and wd.stats()["regions_watched"] == 0
    with pytest.raises(ValueError):
        CollectiveWatchdog(0)


STOPPED = textwrap.dedent("""
    import os, sys
    from torchmoe_ckpt.runtime.watchdog import start_stop_guard
    guard = start_stop_guard(5.0) if sys.argv[1] == "guard" else None
    print(guard.pid if guard else 0, flush=True)
    os.kill(os.getpid(), 19)  # SIGSTOP: from here on only SIGKILL (or SIGCONT) reaches this process
""")


@pytest.mark.parametrize("guard", [True, False])
def test_stop_guard_turns_torchruns_sigterm_into_sigkill_for_a_stopped_worker(guard):
    """torchrun stops a worker with killpg(SIGTERM) and waits 30 s before SIGKILL; a stopped process ignores
    SIGTERM (without the guard it is still there), with the guard it dies at once."""
    p = subprocess.Popen(
        [sys.executable, "-c", STOPPED, "guard" if guard else "none"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )  # like torchrun's workers
    try:
        guard_pid = int(p.stdout.readline())
        deadline = time.monotonic() + 10
        while _state(p.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _state(p.pid) == "T"
        t0 = time.monotonic()
        os.killpg(p.pid, signal.SIGTERM)
        if guard:
            assert p.wait(5) == -signal.SIGKILL and time.monotonic() - t0 < 2
        else:
            time.sleep(1)
            assert p.poll() is None and _state(p.pid) == "T"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(5)
    if guard:  # the guard leaves with its worker
        deadline = time.monotonic() + 3
        while _state(guard_pid) not in (None, "Z") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _state(guard_pid) in (None, "Z")


@pytest.mark.parametrize("who", ["watchdog", "gloo", "gloo_region_bound"])
def test_real_gloo_collective_with_a_stopped_peer(who):
    """Rank 1 SIGSTOPs itself; rank 0 blocks in all_reduce. With the watchdog shorter than gloo's timeout
    the watchdog ends it (EXIT_HANG); with gloo's shorter, gloo raises and the watched region turns the
    exception into EXIT_COLLECTIVE_ERROR. Either way rank 0 exits non-zero: torchrun would restart.
    gloo_region_bound: the region has its own bound (as `resume` has 300 s against 100 s): the line says it."""
    gloo_s, wd_s = (60, 1.5) if who == "watchdog" else (1.5, 60)
    region = ["300"] if who == "gloo_region_bound" else []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    peer = subprocess.Popen(
        [sys.executable, "-c", GLOO, "1", str(gloo_s), str(wd_s), *region],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        r = _py(GLOO, 0, gloo_s, wd_s, *region, env=env, timeout=45)
        assert _state(peer.pid) == "T"  # the peer really is stopped, not dead
    finally:
        peer.kill()  # SIGKILL ends a stopped process too
        peer.wait(10)
    if who == "watchdog":
        assert r.returncode == EXIT_HANG, (r.returncode, r.stderr[-2000:])
        ev = _event(r.stderr, "hang")
        assert ev["op"] == "all_reduce step 2" and ev["rank"] == "0"
        assert wd_s <= float(ev["waited_s"]) <= wd_s + SLACK_S, ev
        assert _event(r.stderr, "exit")["abort"] != "timed_out"  # the abort attempt is bounded anyway
    else:
        assert r.returncode == EXIT_COLLECTIVE_ERROR, (r.returncode, r.stderr[-2000:])
        ev = _event(r.stderr, "collective_error")
        assert ev["op"] == "all_reduce step 2" and "Timed out" in ev["error"], ev
        assert float(ev["timeout_s"]) == (300.0 if region else wd_s), ev  # the bound the region had


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def test_frozen_peer_under_torchrun_is_detected_restarted_and_recovered(tmp_path, reference):
    """A real SIGSTOP of rank 1 at the start of iteration 10, after its host tier has written every window
    committed so far. Rank 0 blocks in the step's first collective; its watchdog (3 s; gloo's timeout 30 s)
    logs the hang and exits 124; torchrun stops the stopped rank (SIGTERM is fatal to it) and restarts both;
    they resume from the host tier and finish exactly like the run that never failed.

    Why "forward" and "settled": frozen before the optimizer step instead, rank 1 has just committed window
    7..9 and its persist thread races the SIGSTOP (CI once saw it win: recovered step 9, not 6). Here no rank
    commits window 7..9, and window 4..6 is on both ranks' host tiers: the recovery point is known."""
    ref = reference(2, {"steps": 14, "dtype": "bf16"})
    timeout = 3.0
    out = tmp_path / "run"
    s = {
        "run": {"steps": 14, "hsdp": 1, "dtype": "bf16"},
        "checkpoint": {"window": 3},
        "failures": [{"step": 10, "phase": "freeze", "rank": 1, "at": "forward", "settled": True}],
        "host_tier": {"root": str(tmp_path / "shm"), "run_id": "t"},
        "resume": True,
        "timeout_s": 30,
        "watchdog_timeout_s": timeout,
        "watchdog_events": str(tmp_path / "wd.jsonl"),
    }
    try:
        run = run_torchrun(2, s, out, max_restarts=1, timeout=55)
    finally:
        deadline = time.monotonic() + 2  # stop guards leave within 0.5 s of their worker
        while (
            left := processes_mentioning(str(out)) + processes_mentioning("tmoe-stop-guard")
        ) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in left:
            os.kill(pid, signal.SIGKILL)  # never leave a stopped worker behind, even when the test fails
    assert not left, f"processes left behind: {[(p, _state(p)) for p in left]}"
    wd = run.report["watchdog"]
    (ev,) = wd["events"]
    assert ev["event"] == "hang" and ev["rank"] == 0 and ev["op"] == "train_step 10" and ev["attempt"] == 0, ev
    assert timeout <= ev["waited_s"] <= timeout + SLACK_S, ev
    print(
        f"\nfrozen peer detected after {ev['waited_s']:.3f} s (timeout {timeout} s); "
        f"longest healthy region after restart {wd['max_region_s']:.3f} s"
    )
    assert find(run.log, "hang", rank=0, op="train_step 10") and "(exitcode: 124)" in run.log
    # the stop guard SIGKILLed the stopped rank on torchrun's SIGTERM: no 30 s wait for its SIGKILL
    assert "Unable to shutdown process" not in run.log
    assert wd["hangs_detected"] == 0 and wd["max_region_s"] < timeout  # the restarted attempt ran clean
    rec = run.report["recoveries"]
    assert len(rec) == 1 and rec[0]["attempt"] == 1 and rec[0]["source"] == "host", rec
    assert rec[0]["recovered_step"] == 6 and rec[0]["replayed_iterations"] == 2
    cmp = compare(run, ref)  # the restarted workers' losses are those of iterations 7..14
    assert cmp.bit_exact and cmp.compared_losses == 2 * 8, cmp.mismatches[:10]
