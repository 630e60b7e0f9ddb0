"""examples/own_loop.py -- a plain FSDP2 loop on Hugging Face Mixtral plus the checkpointing lines -- recovers
bit-exactly after a real kill -9 under torchrun --max-restarts 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401  (make setup installs it: a missing one fails here, not skips)
from support.events import find

from torchmoe_harness.launch import torchrun

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "own_loop.py"


def run_example(
    out: Path,
    steps: int,
    run_id: str,
    fault: str | None = None,
    max_restarts: int = 0,
    timeout: float = 55.0,
    host: Path | None = None,
    extra: tuple = (),
    window: tuple = ("--window", "3"),
) -> tuple[list[dict], str]:
    out.mkdir(parents=True, exist_ok=True)
    env = {"OWN_LOOP_OUT": str(out), "TORCHMOE_FAULT": fault or ""}
    log = torchrun(
        2,
        [
            str(ROOT / "tests" / "api" / "own_loop_probe.py"),
            "--steps",
            str(steps),
            "--run-id",
            run_id,
            "--host-dir",
            str(host or out / "shm"),
            *window,
            *extra,
        ],
        out / "torchrun.log",
        timeout,
        env,
        max_restarts,
    )
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)], log


def test_example_checkpointing_code_is_at_most_15_lines():
    lines = [ln for ln in EXAMPLE.read_text().splitlines() if "# ckpt" in ln and not ln.lstrip().startswith("#")]
    assert 0 < len(lines) <= 15, lines


_REFERENCES: dict[int, list[dict]] = {}  # steps -> the never-failed run (checkpointing leaves training untouched)


def reference(tmp_path_factory, steps: int = 12) -> list[dict]:
    """The never-failed run of `steps`, run once per session: the kill tests of every policy compare with it."""
    if steps not in _REFERENCES:
        _REFERENCES[steps], _ = run_example(tmp_path_factory.mktemp("ref"), steps, "ref")
    return _REFERENCES[steps]


def test_never_failed_reference_run(tmp_path_factory):
    """Its own item, so that no kill test below runs two torchrun jobs (each stays within the 60 s per test)."""
    ref = reference(tmp_path_factory)
    assert all(sorted(r["losses"]) == list(range(1, 13)) for r in ref)


def test_own_loop_kill9_recovers_bit_exact(tmp_path, tmp_path_factory):
    ref = reference(tmp_path_factory)
    got, log = run_example(tmp_path / "kill", 12, "kill", fault="kill:point=optimizer:rank=1:step=8", max_restarts=1)
    assert find(log, "fault_injected") and find(log, "recovered", exact="true"), log[-3000:]
    compared = 0
    for r in range(2):
        a, b = ref[r]["state"], got[r]["state"]
        assert a.keys() == b.keys()
        assert any(k.startswith("['optim']['state']") for k in a), "optimizer state not compared"
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"rank {r}: {k} differs"
            compared += 1
        # losses of the iterations trained after the restart (the kill hit iteration 8: 7 at most survived)
        after = sorted(got[r]["losses"])
        assert after and after[0] <= 8 and after[-1] == 12
        for s in after:
            assert torch.equal(ref[r]["losses"][s], got[r]["losses"][s]), f"rank {r}: loss at step {s}"
    assert compared > 40


def test_own_loop_kill9_under_the_dense_policy_recovers_bit_exact(tmp_path, tmp_path_factory):
    """policy="dense", a snapshot every 3 iterations (steps 1, 4, 7, 10): killed in iteration 9, the restart loads
    the snapshot of 7 (a W = 1 window: nothing replayed) and the loop trains 8.. again, exactly. The reference is
    the test above's (training does not depend on the policy): one torchrun job here."""
    ref = reference(tmp_path_factory)
    dense = ("--policy", "dense", "--dense-interval", "3")
    got, log = run_example(
        tmp_path / "kill", 12, "kill", fault="kill:point=optimizer:rank=1:step=9", max_restarts=1, window=dense
    )
    assert find(log, "fault_injected") and find(log, "recovered"), log[-3000:]
    assert "policy dense k=3" in log, log[-3000:]  # the status line of each committed snapshot
    for r in range(2):
        a, b = ref[r]["state"], got[r]["state"]
        assert a.keys() == b.keys() and any(k.startswith("['optim']['state']") for k in a)
        bad = [k for k in a if not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))]
        assert not bad, f"rank {r}: {bad[:5]}"
        after = sorted(got[r]["losses"])
        assert after == list(range(8, 13)), after  # recovered at the snapshot of 7: 8.. trained again
        for s in after:
            assert torch.equal(ref[r]["losses"][s], got[r]["losses"][s]), f"rank {r}: loss at step {s}"


def _flip(data: Path) -> None:
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))


def _window_files(run: Path) -> dict:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.glob("window-*/**/*")) if p.is_file()}


def test_every_window_corrupt_refuses_on_every_rank_unless_restart_is_opted_in(tmp_path):
    """The outsider's repro: one byte flipped in each window's slot data file (rank 0's copies only: rank 1's
    are fine, and must refuse too, not start over alone). Refused with the reasons, nothing touched; with
    --on-unusable-checkpoint restart the run starts over from step 1 as before."""
    host, run = tmp_path / "shm", tmp_path / "shm" / "node-0" / "c"
    run_example(tmp_path / "first", 9, "c", host=host)
    windows = sorted(run.glob("window-*"))
    assert len(windows) == 2, windows
    for w in windows:
        _flip(w / "slot-00" / "rank-00000" / "__0_0.distcp")
    before = _window_files(run)
    with pytest.raises(RuntimeError) as exc:
        run_example(tmp_path / "refused", 12, "c", host=host)
    log = (tmp_path / "refused" / "torchrun.log").read_text()
    assert log.count("UnusableCheckpointError") >= 2, log[-4000:]  # every rank refuses: none hangs, none restarts
    assert "window 2: rank 0: slot-00/rank-00000/__0_0.distcp" in log and "window 1: rank 0:" in log, log[-4000:]
    assert "new run id" in log and "on_unusable_checkpoint='restart'" in log, log[-4000:]
    assert "step 1 loss" not in log and not (tmp_path / "refused" / "rank0.pt").exists(), str(exc.value)[-2000:]
    assert _window_files(run) == before  # nothing deleted or overwritten
    got, log = run_example(tmp_path / "restart", 12, "c", host=host, extra=("--on-unusable-checkpoint", "restart"))
    restarted = find(log, "no_usable_window")
    assert restarted and "a new run starts from step 0" in restarted[0].prose, log[-3000:]
    assert sorted(got[0]["losses"]) == list(range(1, 13))


def test_a_corrupt_copy_on_another_rank_is_warned_and_listed_by_rank_0(tmp_path):
    """Rank 1's copy of the newest window is corrupt: rank 1 says so at WARNING, and rank 0's recovery line
    lists that window as rejected (gathered with the agreement, no extra collective)."""
    host, run = tmp_path / "shm", tmp_path / "shm" / "node-0" / "c"
    run_example(tmp_path / "first", 9, "c", host=host)
    _flip(run / "window-000002" / "slot-01" / "rank-00001" / "__0_0.distcp")
    got, log = run_example(tmp_path / "second", 12, "c", host=host)
    warned = find(log, "unusable_copy", rank=1, window=2)
    assert warned and "slot-01/rank-00001/__0_0.distcp" in warned[0].prose, log[-3000:]
    assert "(corrupt)" in warned[0].prose, log[-3000:]  # the reason: prose of the event
    recovered = find(log, "recovered")
    assert recovered and recovered[0].fields["window"] == "1" and recovered[0]["rejected"] == "[2]", log[-3000:]
    assert sorted(got[0]["losses"]) == [7, 8, 9, 10, 11, 12]
