"""One writer per run: a second job on the same run id and directory fails at start with one line naming
the holder and the fix; a restart of the same job (torchrun, same launch) and a job started after the holder
is gone take the lock over and say so. Real torchrun jobs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.events import find

from torchmoe_ckpt.ownership import run_lock
from torchmoe_harness.launch import processes_mentioning, torchrun

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast

PROBE = str(Path(__file__).with_name("run_lock_probe.py"))


def _cmd(root: Path, hold_s: float, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "--max-restarts=1",
        PROBE,
        str(root),
        "same-run",
        str(hold_s),
        *extra,
    ]


def test_a_second_job_on_the_same_run_fails_at_start_with_one_line(tmp_path):
    root = tmp_path / "shm"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    first = subprocess.Popen(
        _cmd(root, 30), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        lock = root / "node-0" / "same-run" / run_lock.LOCK_NAME
        deadline = time.monotonic() + 40
        while not lock.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        holder = json.loads(lock.read_text())
        assert holder["pid"] != os.getpid() and holder["torchrun_run_id"], holder
        with pytest.raises(RuntimeError) as err:  # the second job: refused, torchrun exits non-zero
            torchrun(2, [PROBE, str(root), "same-run", "0"], tmp_path / "second.log", timeout=50)
        lines = [ln for ln in err.value.args[0].splitlines() if "is in use by another job" in ln]
        assert lines, err.value.args[0][-2000:]
        line = lines[-1]
        assert f"pid {holder['pid']}" in line and holder["torchrun_run_id"] in line and "run_id" in line, line
        assert not find((tmp_path / "second.log").read_text(), "holding")  # it never got to write anything
        assert json.loads(lock.read_text()) == holder  # the first job still holds its run
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)  # torchrun stops its workers (each leads its own process group)
        try:
            first.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            for pid in processes_mentioning(str(root)):
                os.kill(pid, signal.SIGKILL)
            first.kill()
            first.communicate()


def test_a_restart_of_the_same_job_and_a_later_job_take_the_lock_over(tmp_path):
    root = tmp_path / "shm"
    log = torchrun(2, [PROBE, str(root), "same-run", "0", "die"], tmp_path / "first.log", timeout=50, max_restarts=1)
    assert find(log, "run_lock_takeover", reason="restart") and find(log, "holding", rank=0, attempt=1), log[-3000:]
    log = torchrun(2, [PROBE, str(root), "same-run", "0"], tmp_path / "later.log", timeout=50)
    assert find(log, "run_lock_takeover", reason="stale"), log[-3000:]  # the first job is gone
    assert find(log, "holding", rank=1, attempt=0), log[-3000:]


def test_unit_a_live_holder_on_this_host_is_refused_and_a_dead_one_is_stale(tmp_path):
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        (tmp_path / run_lock.LOCK_NAME).write_text(
            json.dumps(
                dict(run_lock.this_job(), job="other", pid=sleeper.pid, pid_start=run_lock._pid_start(sleeper.pid))
            )
        )
        with pytest.raises(run_lock.RunLockedError, match=f"pid {sleeper.pid}"):
            run_lock.acquire(tmp_path, leader=True)
        with pytest.raises(run_lock.RunLockedError):  # the other local ranks refuse as well
            run_lock.acquire(tmp_path, leader=False, wait_s=1)
    finally:
        sleeper.kill()
        sleeper.wait()
    got = run_lock.acquire(tmp_path, leader=True)  # its process is gone: stale, taken over
    assert got["pid"] == os.getpid() and got["job"] == run_lock.this_job()["job"]


def test_racing_takeovers_of_a_stale_lock_leave_one_writer(tmp_path, fault_summary):
    """4 processes take over the same stale lock at once (a barrier per trial), 100 times: every trial ends
    with exactly one writer, the others refused. Without the mutex around judge-and-write, 2 writers won in
    7 of 100 trials on the 2-core machine (the outside trial: 2-4 winners in 72 of 100)."""
    probe = Path(__file__).with_name("lock_race_probe.py")
    out = subprocess.run(
        [sys.executable, str(probe), str(tmp_path / "race"), "100", "4"],
        capture_output=True,
        text=True,
        timeout=55,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    winners = {k: got["wins"].count(k) for k in set(got["wins"])}
    fault_summary(
        "stale lock taken over by 4 racers x 100",
        100,
        "refused with one line" if winners == {1: 100} else "silently wrong",
    )
    assert winners == {1: 100} and got["exit_codes"] == [0, 0, 0, 0], (winners, got)
