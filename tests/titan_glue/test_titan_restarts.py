"""Repeated ``kill -9`` on both TorchTitan entry points, under one ``torchrun --max-restarts 3`` (issue 17).

Every kill is a real SIGKILL from the library's fault injection (``TORCHMOE_FAULT``, one fault per torchrun
attempt through ``attempt=N``), each at another rank, iteration and phase: before a backward, after an update,
half-way through the recovery's replay, and between a window's data and its manifest (a torn commit). The
final model, optimizer state, buffers, LR and step of every rank, and every loss after the last recovery, are
``torch.equal`` to one fault-free run, shared by both entry points (the stock Trainer with the
``--override.imports`` factory and the job-file SparseTrainer train identically:
tests/titan_glue/test_titan_sparse.py).

Without a store of its own for every rendezvous round, the second or third attempt reads the previous
attempt's store keys and dies in ``Gloo connectFullMesh`` or hangs (torchmoe_ckpt/runtime/distributed.py): each
attempt here starts a new default group, device meshes and our own gloo groups, so these runs cover it.

Time: a TorchTitan restart on this 2-core machine costs 5.5 s when it is idle and 15-25 s while other jobs
run, three quarters of it imports of torch and TorchTitan (the breakdown each restart logs, checked below).
The 3 kills the issue asks for (four attempts) took 30-37 s here and ran past their 55 s limit on a slow CI
run (2026-11-28); 2 kills took 25-32 s here, too close to it. So every case here is ``matrix`` (``make
test-all``; tests/matrix_moves.py names what covers them in ``make test``: every family's two kills, restarted
in the launcher's standby with the breakdown checked, TorchTitan's own restart after a kill under EP, and the
per-round rendezvous store on a real TCPStore).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

from titan_integration import recovery_demo  # cheap: does not import torchtitan

pytestmark = pytest.mark.titan  # starts TorchTitan: not in make test-fast

# W = 2 and 6 steps: every attempt replays and trains as little as a kill-recover-kill plan allows (a restart
# costs 4-20 s of imports here; each replayed or trained iteration 0.1-0.7 s more).
STEPS, WINDOW = 6, 2
OVERRIDE = "titan_integration.overrides.sparse_checkpoint"
# One fault per attempt; a different rank, iteration and phase each time. Window 0 (iterations 1-2) commits
# during iteration 3, window 1 (3-4) during iteration 5.
OVERRIDE_KILLS = [
    "kill:point=backward:rank=1:step=4:attempt=0",  # before a backward, window 0 committed
    "kill:point=recovery:rank=0:step=1:attempt=1",  # inside the replay of window 0
    "kill:point=optimizer:rank=1:step=5:attempt=2",
]  # after the update of iteration 5
JOB_KILLS = [
    "kill:point=forward:rank=0:step=4:attempt=0",  # at the start of iteration 4
    "kill:point=manifest:rank=1:step=4:attempt=1",  # window 1's data written, its manifest not
    "kill:point=recovery:rank=1:step=1:attempt=2",
]  # inside the replay
_REFERENCE: dict[str, Path] = {}


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    e = recovery_demo.child_env()
    e["TORCHMOE_TITAN_ASSETS"] = str(tmp_path_factory.mktemp("titan-assets"))
    return e


def _job_run(d: Path, env: dict[str, str], faults: list[str], timeout: float) -> str:
    job = recovery_demo.write_job(d, steps=STEPS, window=WINDOW, host_dir=d / "host")
    rc, out = recovery_demo.torchrun(
        d, env, job, nproc=2, fault=";".join(faults) or None, timeout=timeout, max_restarts=3
    )
    assert rc == 0, out[-6000:]
    return out


def _override_run(d: Path, env: dict[str, str], faults: list[str], timeout: float) -> str:
    """TorchTitan's stock Trainer from the registry config; sparse checkpointing only through the override."""
    d.mkdir(parents=True, exist_ok=True)
    kwargs = {"window": WINDOW, "host_dir": str(d / "host"), "fault_timeout_s": 60, "run_id": "restarts"}
    args = [
        "--module",
        "titan_integration.config_registry",
        "--config",
        "deepseek_v3_tiny",
        "--training.steps",
        str(STEPS),
        "--debug.seed",
        "7",
        "--debug.deterministic",
        "--dump_folder",
        str(d / "dump"),
        "--override.imports",
        f"{OVERRIDE}={json.dumps(kwargs)}",
    ]
    rc, out = recovery_demo.torchrun(
        d, env, None, nproc=2, fault=";".join(faults), train_args=args, timeout=timeout, max_restarts=3
    )
    assert rc == 0, out[-6000:]
    return out


def _reference(tmp_path_factory, env) -> Path:
    if "ref" not in _REFERENCE:
        d = tmp_path_factory.mktemp("restarts-ref")
        _job_run(d, env, [], timeout=55)
        _REFERENCE["ref"] = d
    return _REFERENCE["ref"]


def _check(reference: Path, d: Path, out: str, faults: list[str]) -> None:
    """Each fault fired once, in its own attempt; every rank ends in the last attempt, recovered, exact."""
    fired = re.findall(r"event=fault_injected action=kill point=(\w+) rank=(\d) iteration=\d+ attempt=(\d)", out)
    want = [(f.split(":")[1].split("=")[1], f.split("rank=")[1][0], f.split("attempt=")[1]) for f in faults]
    assert fired == want, (fired, out[-4000:])
    assert "connectFullMesh" not in out, out[-4000:]
    kills = len(faults)
    for r in recovery_demo.compare(reference, d, 2):
        rec = r.recovery
        assert r.attempt == kills, f"rank {r.rank} ended in attempt {r.attempt}, not {kills}"
        assert rec is not None and rec["source"] == "host" and 1 <= rec["recovered_step"] < STEPS, rec
        assert not r.differing, f"rank {r.rank}: {len(r.differing)} tensors differ, e.g. {r.differing[:4]}"
        assert r.losses_compared == list(range(rec["recovered_step"] + 1, STEPS + 1)) and r.losses_equal
        assert r.exact
        # the breakdown of the last restart (titan_integration/restart_timing.py)
        timing = json.loads((d / "export" / f"restart-timing-rank-{r.rank}-attempt-{kills}.json").read_text())
        phases = ("imports", "process_group", "model_build", "recovery", "first_step")
        assert all(timing[p] is not None and timing[p] >= 0 for p in phases), timing
        if r.rank == 0:  # rank 0 reads the kill's time: the total runs from the kill
            assert timing["from"] == "kill" and timing["agent_restart"] >= 0, timing
            assert timing["total"] >= sum(timing[p] for p in phases), timing
    # rank 0, once per restart that got to train (one killed during its recovery did not)
    trained = kills - sum(":point=recovery:" in f for f in faults[1:])
    assert out.count("event=restart_timing attempt=") == trained, out[-3000:]
    assert f"event=restart_timing attempt={kills} " in out, out[-3000:]


def test_fault_free_reference_run(tmp_path_factory, env):
    """The reference of every test below, its own item (each item runs at most one torchrun job)."""
    d = _reference(tmp_path_factory, env)
    for rank in range(2):
        _, run = recovery_demo.load_rank(d, rank)
        assert run["attempt"] == 0 and run["recovery"] is None
        assert sorted(map(int, run["loss_bits"])) == list(range(1, STEPS + 1))


@pytest.mark.parametrize("kills", [pytest.param(3, marks=pytest.mark.matrix), 2])
@pytest.mark.parametrize("entry", ["override_imports", "job_file"])
def test_survives_repeated_kills(tmp_path, tmp_path_factory, env, entry, kills):
    reference = _reference(tmp_path_factory, env)
    launch, plan = {"override_imports": (_override_run, OVERRIDE_KILLS), "job_file": (_job_run, JOB_KILLS)}[entry]
    faults = plan[:kills]
    out = launch(tmp_path / "run", env, faults, timeout=55)  # inside the suite's 60 s per test
    _check(reference, tmp_path / "run", out, faults)


# The root cause (stale keys in torchrun's shared store) is tested on a real TCPStore in
# tests/runtime/test_rendezvous.py.
