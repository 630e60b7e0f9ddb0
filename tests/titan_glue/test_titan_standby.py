"""A restarted TorchTitan worker handed over to its rank's pre-imported standby (TORCHMOE_STANDBY=1,
titan_integration/standby.py): a real kill -9 of rank 1 under torchrun; the restarted workers run in forked
children of the first attempt's standbys (no new imports), recover from the host tier and end torch.equal to
a fault-free run, every loss after the recovery bit for bit; the standbys leave when the job is over."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

from titan_integration import recovery_demo  # cheap: neither imports torchtitan

pytestmark = pytest.mark.titan  # starts TorchTitan: not in make test-fast

STEPS, WINDOW, KILL_STEP = 8, 3, 6
_REFERENCE: list[Path] = []


def _run(d: Path, env: dict[str, str], fault: str | None = None) -> str:
    job = recovery_demo.write_job(d, steps=STEPS, window=WINDOW, host_dir=d / "host")
    rc, out = recovery_demo.torchrun(d, env, job, nproc=2, fault=fault, timeout=55)
    assert rc == 0, out[-5000:]
    return out


def _reference(tmp_path_factory, env) -> Path:
    if not _REFERENCE:
        d = tmp_path_factory.mktemp("ref-standby")
        _run(d, env)
        _REFERENCE.append(d)
    return _REFERENCE[0]


def test_fault_free_reference_with_standby_on(tmp_path_factory, env):
    """With the standby on and no failure nothing changes: one attempt, every loss there."""
    d = _reference(tmp_path_factory, dict(env, TORCHMOE_STANDBY="1"))
    for rank in range(2):
        _state, run = recovery_demo.load_rank(d, rank)
        assert run["attempt"] == 0 and sorted(map(int, run["loss_bits"])) == list(range(1, STEPS + 1))


def test_kill9_restart_runs_in_the_standby_and_recovers_bit_exact(tmp_path, tmp_path_factory, env):
    reference = _reference(tmp_path_factory, dict(env, TORCHMOE_STANDBY="1"))
    d = tmp_path / "kill"
    out = _run(d, dict(env, TORCHMOE_STANDBY="1"), fault=f"kill:point=backward:rank=1:step={KILL_STEP}")
    assert f"event=fault_injected action=kill point=backward rank=1 iteration={KILL_STEP} attempt=0" in out
    standbys = []
    for rank in range(2):
        first = json.loads((d / "export" / f"restart-timing-rank-{rank}-attempt-0.json").read_text())
        again = json.loads((d / "export" / f"restart-timing-rank-{rank}-attempt-1.json").read_text())
        assert first["standby"]["standby_pid"] and not first["standby"]["in_standby"], first["standby"]
        assert again["standby"]["in_standby"], "the restarted worker was not handed over to its standby"
        standbys.append(first["standby"]["standby_pid"])
    for r in recovery_demo.compare(reference, d, 2):
        assert r.attempt == 1 and r.recovery is not None and r.recovery["source"] == "host", r.recovery
        assert not r.differing, f"rank {r.rank}: {r.differing[:4]}"
        assert r.losses_compared == list(range(r.recovery["recovered_step"] + 1, STEPS + 1)) and r.losses_equal
    # the standbys watch the torchrun agent once a second: gone soon after the job
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in standbys) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in standbys), "a standby outlived its job"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
