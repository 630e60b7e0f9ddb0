"""Just-in-time checkpoint (torchmoe_ckpt/recovery/jit.py) under real torchrun, HSDP 2x2 on CPU/gloo: rank 0 is
killed (SIGKILL) or frozen (SIGSTOP) in iteration 4, before the gradient reductions (fault point "backward")
or after its optimizer update ("optimizer"). The healthy replicas save their state without collectives, the
job restarts, and it resumes from the JIT copies: every tensor and every later loss `torch.equal` to the run
that never failed, at most one iteration replayed, where the window alone would lose two."""

import os
import signal
import time
from pathlib import Path

import pytest
from support.events import find

from torchmoe_harness.launch import compare, launch, load_result, processes_mentioning, run_torchrun

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast

RUN = {"steps": 6, "dtype": "fp32", "hsdp": 2}  # world 4: replicas {0,2} hold shard 0, {1,3} shard 1
FAIL_AT = 4
WINDOW = 2  # window 0 = iterations 1..2 is the newest committed one when iteration 4 fails
WD_TIMEOUT = 6.0  # a first iteration on a loaded 2-core machine can take > 2.5 s: no false hangs


def _spec(tmp_path: Path, jit: bool = True, store: bool = True) -> dict:
    host = {"root": str(tmp_path / "shm"), "run_id": "t"}
    if store:
        host["object_store"] = {"uri": f"file://{tmp_path / 'store'}"}
    # a forced window needs no copy-bandwidth measurement at start: give one
    return {
        "run": RUN,
        "checkpoint": {"window": WINDOW, "bandwidth_bytes_per_s": 1e9},
        "host_tier": host,
        "resume": True,
        "jit": jit,
        "timeout_s": 30,
        "watchdog_timeout_s": WD_TIMEOUT,
        "watchdog_events": str(tmp_path / "wd.jsonl"),
    }


def _env(tmp_path: Path, fault: str) -> dict:
    (tmp_path / "faults").mkdir(exist_ok=True)
    return {"TORCHMOE_FAULT": fault, "TORCHMOE_FAULT_STATE": str(tmp_path / "faults")}


def _reap(out: Path) -> None:
    """Never leave a stopped worker behind, even when a test fails (the stop guard normally ends it)."""
    deadline = time.monotonic() + 2
    while (left := processes_mentioning(str(out))) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        os.kill(pid, signal.SIGKILL)


def _markers(root: Path) -> dict[int, list[int]]:
    """step -> ranks with a completion marker under `root`."""
    out: dict[int, list[int]] = {}
    for m in root.glob("**/jit/step-*/rank-*/COMPLETE.json"):
        out.setdefault(int(m.parent.parent.name[5:]), []).append(int(m.parent.name[5:]))
    return {k: sorted(v) for k, v in out.items()}


# (action, point, the step the JIT copies hold): before the reductions no rank has updated, so the copies
# hold the start of iteration 4 (step 3 completed); after rank 0's update the others finished iteration 4 too.
CASES = {
    "kill_before_reduction": ("kill", "backward", FAIL_AT - 1),
    "kill_after_reduction": ("kill", "optimizer", FAIL_AT),
    "freeze_before_reduction": ("freeze", "backward", FAIL_AT - 1),
    "freeze_after_reduction": ("freeze", "optimizer", FAIL_AT),
}


def test_fault_free_reference_hsdp2x2(reference):
    """The run every failure case compares against, as its own test item (no failure test pays for it)."""
    ref = reference(4, RUN)
    assert len(ref.states) == 4 and all(sorted(losses) == list(range(1, RUN["steps"] + 1)) for losses in ref.losses)


# kill before and freeze after the reductions by default; the other two combinations in the `matrix` set.
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=[pytest.mark.matrix] if c in ("kill_after_reduction", "freeze_before_reduction") else [])
        for c in CASES
    ],
)
def test_hsdp_failure_resumes_from_jit_copies_exactly(tmp_path, reference, fault_summary, case):
    action, point, jit_step = CASES[case]
    ref = reference(4, RUN)
    out = tmp_path / "run"
    t0 = time.monotonic()
    try:
        run = run_torchrun(
            4,
            _spec(tmp_path),
            out,
            max_restarts=1,
            timeout=58,
            extra_env=_env(tmp_path, f"{action}:point={point}:rank=0:step={FAIL_AT}"),
        )
    except RuntimeError:
        fault_summary(f"jit_{case}", 1, "failed loudly")
        raise
    finally:
        _reap(out)
    cmp = compare(run, ref)
    fault_summary(
        f"jit_{case}", run.log.count("event=fault_injected"), "recovered exactly" if cmp.bit_exact else "silently wrong"
    )
    assert run.log.count("event=fault_injected") == 1, run.log[-3000:]
    (rec,) = run.report["recoveries"]
    assert rec["attempt"] == 1 and rec["source"] == "jit", rec
    assert rec["jit_step"] == jit_step and rec["recovered_step"] == jit_step, rec
    assert rec["window_step"] == WINDOW  # what the window alone would have resumed from
    assert rec["replayed_iterations"] <= 1 and rec["failed_iteration"] - rec["jit_step"] == rec["replayed_iterations"]
    # the failed rank's shard came from its replica's copy; each healthy rank left one complete copy
    saved = _markers(tmp_path / "shm")
    assert set(saved.get(jit_step, [])) == {1, 2, 3}, saved
    assert _markers(tmp_path / "store") == saved  # the object store got the same copies, markers last
    assert cmp.bit_exact and cmp.compared_losses == 4 * (RUN["steps"] - jit_step), (
        cmp.compared_losses,
        cmp.mismatches[:10],
    )
    if action == "freeze":
        assert "event=hang" in run.log and "Unable to shutdown process" not in run.log
    print(
        f"\n{case}: resumed at step {jit_step} (window: {WINDOW}), replayed {rec['replayed_iterations']}, "
        f"{time.monotonic() - t0:.1f} s"
    )


RUN_DP = dict(RUN, hsdp=2)  # on 2 ranks: plain data-parallel replicas (mesh 2x1), one shard held twice


def _crash_then_tamper(tmp_path: Path, tamper) -> Path:
    """Job 1: kill rank 0 before the reductions of iteration 4, no restart (rank 1 saves its JIT copy and
    exits). Then `tamper` with the copy. Job 2: a new job that resumes from whatever is usable."""
    spec = dict(_spec(tmp_path, store=False), run=RUN_DP)
    with pytest.raises(RuntimeError, match="torchrun exited"):
        launch(
            2,
            spec,
            tmp_path / "crash",
            timeout=25,
            max_restarts=0,
            extra_env=_env(tmp_path, f"kill:point=backward:rank=0:step={FAIL_AT}"),
        )
    _reap(tmp_path / "crash")
    assert _markers(tmp_path / "shm") == {FAIL_AT - 1: [1]}
    tamper(next((tmp_path / "shm").glob("node-*/t/jit")) / f"step-{FAIL_AT - 1:08d}" / "rank-00001")
    out = tmp_path / "resume"
    launch(2, spec, out, timeout=25)
    return out


@pytest.mark.parametrize("how", ["no_marker", pytest.param("corrupt_state", marks=pytest.mark.matrix)])
def test_jit_copy_without_valid_marker_is_never_used(tmp_path, reference, how):
    """Two plain data-parallel replicas; rank 0 is killed, so rank 1's JIT copy is the only one. It loses its
    completion marker (never listed), or one byte of its state file flips after the marker was written
    (listed, chosen, rejected by the CRC32 check at load): either way no step has a usable copy of the
    shard, so the restart must recover from the committed window instead -- and still end exactly like the
    run that never failed."""

    def tamper(copy_dir: Path) -> None:
        if how == "no_marker":
            (copy_dir / "COMPLETE.json").unlink()
        else:
            f = copy_dir / "state.pt"
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0xFF
            f.write_bytes(bytes(data))

    ref = reference(2, RUN_DP)
    out = _crash_then_tamper(tmp_path, tamper)
    run = load_result(out, 2, (out / "torchrun.log").read_text())
    (rec,) = run.report["recoveries"]
    assert rec.get("source") == "host" and rec["recovered_step"] == WINDOW, rec
    assert not find(run.log, "jit_resumed"), run.log[-3000:]
    if how == "no_marker":
        assert find(run.log, "jit_not_used"), run.log[-3000:]
    else:
        assert "does not match its marker" in run.log, run.log[-3000:]
    assert compare(run, ref).bit_exact


def test_pure_fsdp_says_jit_is_off(tmp_path, reference):
    run_spec = dict(RUN, hsdp=1, steps=3)
    spec = dict(_spec(tmp_path, store=False), run=run_spec)
    run = run_torchrun(2, spec, tmp_path / "run", timeout=40)
    assert len(find(run.log, "jit_off", reason="no_replicas")) == 1, run.log[-2000:]
    assert run.report["jit"]["enabled"] is False
    assert compare(run, reference(2, run_spec)).bit_exact


def test_bad_jit_spec_fails_at_start(tmp_path):
    from torchmoe_harness.scenario import _check_jit

    with pytest.raises(ValueError, match="needs a 'host_tier'"):
        _check_jit({"jit": True, "watchdog_timeout_s": 5})
    with pytest.raises(ValueError, match="needs 'watchdog_timeout_s'"):
        _check_jit({"jit": True, "host_tier": {"root": str(tmp_path)}})
    assert _check_jit({}) is False
