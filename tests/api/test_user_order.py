"""The run identity and the store lease, tried the way users write their loop (user_loop.py: examples/own_loop.py
with the package imported at the top, torch seeded after it, no `data_identity`), under real torchrun.

1. a window of a run with another seed, copied next to ours: rejected with its reason, `verify` names it, and
   recovery ends exact from our own newest window;
2. a relaunch with another seed (seeded after the import, or before it): refused in one line, nothing touched;
   a run that never seeds torch still resumes after a kill -9;
3. two jobs one after the other on one object-store prefix: the second (another seed) is refused, the first
   then resumes its own window from the store, exactly;
4. plain `torchrun --nproc_per_node 2` (rendezvous id "none") with an object store: one job, one lease; it trains
   and a kill -9 restart takes its own lease back;
5. a rank frozen during recovery with a short process-group timeout: the attempt ends within that timeout (the
   library's groups inherit it; a failed collective is no verdict on a window), not the 300 s start watchdog.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401  (make setup installs it: a missing one fails here, not skips)
from support.events import find

from torchmoe_ckpt.ops.inspection import verify_location
from torchmoe_harness.launch import torchrun

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast

WORKER = str(Path(__file__).with_name("user_loop.py"))
RUN = "user-run"  # the same run id for every job here: what separates the runs is their identity


def launch(
    out: Path,
    host: Path,
    *args: str,
    env: dict | None = None,
    max_restarts: int = 0,
    standalone: bool = True,
    timeout: float = 45.0,
) -> tuple[list[dict], str]:
    """One job of user_loop.py on 2 ranks; (every rank's final state and losses, the log). Raises on failure."""
    out.mkdir(parents=True, exist_ok=True)
    log = torchrun(
        2,
        [WORKER, "--run-id", RUN, "--host-dir", str(host), *args],
        out / "torchrun.log",
        timeout,
        {"USER_LOOP_OUT": str(out), "TORCHMOE_FAULT": "", **(env or {})},
        max_restarts,
        standalone=standalone,
    )
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)], log


def refused(out: Path, host: Path, *args: str, env: dict | None = None) -> str:
    """A job that must refuse to start: its log (the refusal is checked by the caller)."""
    with pytest.raises(RuntimeError) as err:
        launch(out, host, *args, env=env, timeout=40.0)
    return str(err.value)


def assert_exact(ref: list[dict], got: list[dict], trained_from: int | None = None) -> None:
    """Every tensor of model, optimizer and scheduler state, and every loss trained after the restart (None: the
    relaunch only recovered, it trained nothing)."""
    compared = 0
    for r in range(2):
        a, b = ref[r]["state"], got[r]["state"]
        assert a.keys() == b.keys()
        assert any(k.startswith("['optim']['state']") for k in a), "optimizer state not compared"
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"rank {r}: {k} differs"
            compared += 1
        steps = sorted(got[r]["losses"])
        assert (steps[0] if steps else None) == trained_from, steps
        for s in steps:
            assert torch.equal(ref[r]["losses"][s], got[r]["losses"][s]), f"rank {r}: loss at step {s}"
    assert compared > 40


def digest(root: Path) -> dict[str, str]:
    """Every window file's hash; the run lock and the store lease say who runs now, not what a window holds."""
    files = [p for p in root.rglob("*") if p.is_file() and p.name not in ("LOCK.json", "LEASE.json")]
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def one_line_refusal(log: str, reason: str) -> str:
    lines = [ln for ln in log.splitlines() if "IdentityMismatch" in ln and reason in ln]
    assert lines, log[-3000:]
    assert "new run id" in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def seed0_run(tmp_path_factory) -> tuple[list[dict], Path]:
    """Seed 0, 9 iterations, never failed: its final state (the reference) and its host directory (windows 1 and
    2 committed), as a relaunch finds it."""
    base = tmp_path_factory.mktemp("seed0")
    states, log = launch(base, base / "shm", "--steps", "9")
    assert "identity_seed=0" in log, log[-2000:]  # seeded after `import torchmoe_ckpt`: recorded all the same
    return states, base / "shm"


def test_window_of_another_seed_copied_in_is_rejected_and_named(tmp_path, seed0_run, fault_summary):
    ref, ours = seed0_run
    host = tmp_path / "shm"
    shutil.copytree(ours, host)
    other = tmp_path / "other"
    launch(other, other / "shm", "--steps", "12", "--seed", "1")  # same run id, model and data code; seed 1
    foreign = other / "shm" / "node-0" / RUN / "window-000003"
    shutil.copytree(foreign, host / "node-0" / RUN / foreign.name)  # newer than ours (window 2)

    ok, info = verify_location(str(host / "node-0" / RUN))
    problems = " ".join(info["problems"])
    assert not ok and "3" in problems, info["problems"]

    got, log = launch(tmp_path / "resume", host, "--steps", "9")  # recovers step 9, trains nothing more
    assert "seed 1 != 0" in log, log[-3000:]
    assert find(log, "recovered", window=2), log[-3000:]
    try:
        assert_exact(ref, got)
    except AssertionError:
        fault_summary("user order: window of another seed copied in", 1, "silently wrong")
        raise
    fault_summary("user order: window of another seed copied in", 1, "recovered exactly")


@pytest.mark.parametrize("order", ["seed after import", "seed before import"])
def test_relaunch_with_another_seed_is_refused(tmp_path, seed0_run, order, fault_summary):
    host = tmp_path / "shm"
    if order == "seed after import":
        shutil.copytree(seed0_run[1], host)
        env0, env1, args1 = None, None, ("--seed", "1")
    else:  # torch.manual_seed before `import torchmoe_ckpt`
        env0, env1, args1 = {"USER_LOOP_SEED_FIRST": "0"}, {"USER_LOOP_SEED_FIRST": "1"}, ()
        _, log = launch(tmp_path / "first", host, "--steps", "6", env=env0)
        assert "identity_seed=0" in log, log[-2000:]
    before = digest(host)
    log = refused(tmp_path / "relaunch", host, "--steps", "9", *args1, env=env1)
    line = one_line_refusal(log, "seed 0 != 1")
    assert digest(host) == before, "the refused relaunch changed the windows"
    fault_summary(f"user order: relaunch with another seed ({order})", 1, "refused with one line")
    assert "step 1 loss" not in log, line  # nothing trained


def test_unseeded_run_resumes_after_kill(tmp_path, fault_summary):
    """torch's random default seed differs in every process: it is not part of the identity, so the restarted
    workers (new seeds) resume their own windows."""
    got, log = launch(
        tmp_path / "run",
        tmp_path / "shm",
        "--steps",
        "8",
        "--no-seed",
        env={"TORCHMOE_FAULT": "kill:point=optimizer:rank=1:step=5"},
        max_restarts=1,
    )
    assert find(log, "fault_injected") and find(log, "recovered", window=0), log[-3000:]
    assert "identity_seed=None" in log, log[-2000:]
    assert sorted(got[0]["losses"]) == [4, 5, 6, 7, 8]
    fault_summary("user order: unseeded run, kill -9", 1, "recovered exactly")


@pytest.fixture(scope="module")
def store_job_a(tmp_path_factory) -> tuple[list[dict], Path]:
    """Job A (seed 0, 9 iterations) with a file:// object store: its final state and the store. Shared by the two
    tests below, run in this order (one test did all three jobs: 22-31 s, too close to the limit on a slow CI)."""
    base = tmp_path_factory.mktemp("store-a")
    ref, _ = launch(base / "a", base / "a-shm", "--steps", "9", "--store-uri", f"file://{base / 'store'}")
    listed = sorted(p.name for p in (base / "store" / RUN).iterdir())
    assert "window-000002" in listed, listed
    return ref, base / "store"


def test_a_second_job_on_the_same_store_prefix_is_refused(tmp_path, store_job_a, fault_summary):
    """Job B, seed 1, on a fresh node (empty host memory): the store holds only A's windows; refused in one line,
    A's windows byte for byte what they were."""
    _, store = store_job_a
    before = digest(store)
    log = refused(tmp_path / "b", tmp_path / "b-shm", "--steps", "9", "--seed", "1", "--store-uri", f"file://{store}")
    one_line_refusal(log, "seed 0 != 1")
    assert digest(store) == before, "B changed A's windows"
    fault_summary("user order: second job on a shared store prefix, another seed", 1, "refused with one line")


def test_the_first_job_comes_back_from_the_shared_store_prefix(tmp_path, store_job_a, fault_summary):
    """Job A again (after B's refusal above, in file order), its host memory gone: its own newest window from the
    store, exactly."""
    ref, store = store_job_a
    got, log = launch(tmp_path / "a2", tmp_path / "a2-shm", "--steps", "9", "--store-uri", f"file://{store}")
    assert find(log, "recovered", window=2, source="object store"), log[-3000:]
    assert_exact(ref, got)
    fault_summary("user order: first job back from the shared store prefix", 1, "recovered exactly")


def test_plain_torchrun_with_an_object_store_is_one_job(tmp_path, fault_summary):
    """`torchrun --nproc_per_node 2 --master-port P`: rendezvous id "none", so the lease is keyed by rank 0's
    torchrun agent, shared over the library's group: rank 1 does not take rank 0's lease for another job's, and a
    restart after kill -9 (same agent) takes it back at once."""
    got, log = launch(
        tmp_path / "run",
        tmp_path / "shm",
        "--steps",
        "8",
        "--store-uri",
        f"file://{tmp_path / 'store'}",
        env={"TORCHMOE_FAULT": "kill:point=optimizer:rank=0:step=5"},
        max_restarts=1,
        standalone=False,
    )
    assert "StoreLeasedError" not in log and "written by another job" not in log, log[-3000:]
    assert find(log, "recovered", window=0), log[-3000:]
    assert sorted(got[1]["losses"]) == [4, 5, 6, 7, 8]
    fault_summary("user order: plain torchrun, object store, kill -9", 1, "recovered exactly")


PG_TIMEOUT_S = 6.0
MARGIN_S = 8.0  # the load and replay before the freeze, and the exit


def test_frozen_rank_in_recovery_ends_within_the_process_group_timeout(tmp_path, fault_summary):
    """Attempt 0: rank 0 dies in iteration 5. Attempt 1: rank 1 freezes (SIGSTOP) in the replay; rank 0's
    collectives end at the job's process-group timeout (6 s), and its recovery ends there, not at the start
    watchdog's 300 s default."""
    faults = "kill:point=forward:rank=0:step=5:attempt=0;freeze:point=recovery:rank=1:attempt=1"
    with pytest.raises(RuntimeError) as err:  # max_restarts=1: attempt 1 is the last one
        launch(
            tmp_path / "run",
            tmp_path / "shm",
            "--steps",
            "8",
            "--pg-timeout-s",
            str(PG_TIMEOUT_S),
            env={"TORCHMOE_FAULT": faults},
            max_restarts=1,
            timeout=50.0,
        )
    log = str(err.value) + (tmp_path / "run" / "torchrun.log").read_text()
    assert find(log, "fault_injected", action="freeze", point="recovery", rank=1), log[-3000:]
    ended = re.search(r"event=(collective_error|hang) rank=0 op=\"?resume\"? waited_s=([\d.]+)", log)
    assert ended, log[-3000:]
    waited = float(ended.group(2))
    bounded = waited <= PG_TIMEOUT_S + MARGIN_S
    outcome = "ended within its timeout" if bounded else "failed loudly"
    fault_summary("user order: rank frozen in recovery, 6 s process-group timeout", 2, outcome)
    assert bounded, f"recovery waited {waited} s for the frozen rank (process-group timeout {PG_TIMEOUT_S} s)"
