"""Sliding windows through the host tier (SparseConfig.sliding): a real kill -9 in the middle of a window, under
torchrun; the restarted workers recover from the newest W consecutive slots on the host tier -- the last
committed window's and the ones written of the window being filled, which has no manifest yet -- to exactly the
iteration before the one the kill interrupted, and finish training torch.equal to a run that never failed.

The kill comes from the fault injection at the persist point (after a slot and the window's progress are on the
host tier), in the first slot persisted once iteration 11 has begun: slot 10's, the second of window 10-12."""

from __future__ import annotations

import re

import pytest

from torchmoe_harness.launch import compare, run_torchrun

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast

STEPS = 14


def test_kill_mid_window_recovers_to_the_iteration_before_the_failure(tmp_path, reference):
    ref = reference(2, {"steps": STEPS, "dtype": "bf16"})
    spec = {
        "run": {"steps": STEPS, "dtype": "bf16"},
        "checkpoint": {"window": 3, "sliding": True},
        "host_tier": {"root": str(tmp_path / "shm"), "run_id": "sliding"},
        "resume": True,
        "timeout_s": 20,
    }
    env = {"TORCHMOE_FAULT": "kill:point=persist:rank=1:step=11", "TORCHMOE_FAULT_STATE": str(tmp_path / "faults")}
    run = run_torchrun(2, spec, tmp_path / "run", max_restarts=2, timeout=55, extra_env=env)
    fired = re.search(r"event=fault_injected action=kill point=persist rank=1 iteration=(\d+)", run.log)
    assert fired, run.log[-3000:]
    failed = int(fired.group(1))  # the iteration the kill interrupted
    rec = run.report["recoveries"]
    assert len(rec) == 1 and rec[0]["attempt"] >= 1 and rec[0]["source"] == "host", rec
    # windows 1-3, 4-6, 7-9 committed; 10-12 had slot 10 (and the progress) on the host tier: nothing redone
    assert rec[0]["recovered_step"] == failed - 1 == 10, rec
    assert rec[0]["window_id"] == 3 and rec[0]["replayed_iterations"] == 2, rec
    cmp = compare(run, ref)  # the restarted workers' losses are those of iterations 11..14
    assert cmp.bit_exact and cmp.compared_losses == 2 * (STEPS - 10), cmp.mismatches[:10]


def test_without_sliding_the_same_kill_loses_the_window_being_filled(tmp_path, reference):
    """The control: the same kill with standard plans recovers to the last committed window (iteration 9) and
    redoes 10 -- what the sliding window saves."""
    ref = reference(2, {"steps": STEPS, "dtype": "bf16"})
    spec = {
        "run": {"steps": STEPS, "dtype": "bf16"},
        "checkpoint": {"window": 3},
        "host_tier": {"root": str(tmp_path / "shm"), "run_id": "standard"},
        "resume": True,
        "timeout_s": 20,
    }
    env = {"TORCHMOE_FAULT": "kill:point=persist:rank=1:step=11", "TORCHMOE_FAULT_STATE": str(tmp_path / "faults")}
    run = run_torchrun(2, spec, tmp_path / "run", max_restarts=2, timeout=55, extra_env=env)
    rec = run.report["recoveries"]
    assert len(rec) == 1 and rec[0]["recovered_step"] == 9 and rec[0]["window_id"] == 2, rec
    cmp = compare(run, ref)
    assert cmp.bit_exact, cmp.mismatches[:10]
