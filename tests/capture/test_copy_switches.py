"""The copy path's fix switches under real torchrun (docs/gpu.md, "The fix switches"): a real SIGKILL half-way
through a slot copy, then recovery, ends torch.equal to the run that never failed with every switch on (the
default suite) and with each alone (`matrix`); and the device-loss pricing of auto W is agreed across ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchmoe_harness.launch import compare, run_torchrun, torchrun

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast

RUN = {"steps": 12, "dtype": "fp32"}
ALL_ON = {"copy_chunk_bytes": 64, "reads_on_copy_stream": True, "copy_phase": "backward", "device_staging": True}
CASES = {
    "all_on": ALL_ON,
    "reads_on_training_stream": {"reads_on_copy_stream": False},
    "copy_in_backward": {"copy_phase": "backward"},
    "device_staging": {"device_staging": True},
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=[] if c == "all_on" else [pytest.mark.matrix]) for c in CASES])
def test_kill_in_the_slot_copy_recovers_exactly_with_the_switches(tmp_path, reference, case):
    host = {"root": str(tmp_path / "shm"), "run_id": "t"}
    spec = {"run": RUN, "checkpoint": {"window": 3, **CASES[case]}, "host_tier": host, "resume": True, "timeout_s": 20}
    (tmp_path / "faults").mkdir()
    ref = reference(2, RUN)
    run = run_torchrun(
        2,
        spec,
        tmp_path / "run",
        timeout=58,
        max_restarts=2,
        extra_env={
            "TORCHMOE_FAULT": "kill:point=snapshot_copy:rank=1:step=8",
            "TORCHMOE_FAULT_STATE": str(tmp_path / "faults"),
        },
    )
    assert run.log.count("event=fault_injected") == 1, run.log[-3000:]
    rec = run.report["recoveries"]
    assert rec and rec[-1]["attempt"] >= 1 and not rec[-1].get("cold_start"), rec
    cmp = compare(run, ref)
    assert cmp.bit_exact and cmp.compared_losses > 0, cmp.mismatches[:10]
    path = run.report["checkpoint"]["copy_path"]  # the switches really ran (the restarted attempt's figures)
    assert path["reads_on_copy_stream"] == CASES[case].get("reads_on_copy_stream", True) and path["reads"] > 0, path
    assert (path["issued_by_backward_hook"] > 0) == (CASES[case].get("copy_phase") == "backward"), path
    staged = (path["device_staging"] or {}).get("staged_copies", 0)
    assert (staged > 0) == CASES[case].get("device_staging", False), path


def test_auto_window_priced_by_device_loss_is_agreed_across_ranks(tmp_path):
    """Rank 1's copies cost 4x rank 0's (synthetic measurements): each rank proposes its own W, and both plan the
    same one, the larger, from the one unconditional MAX agreement per window start."""
    torchrun(2, [str(Path(__file__).parent / "calibration_probe.py"), str(tmp_path)], tmp_path / "log", 55)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    planned = [[w for w, _ in g] for g in got]
    assert planned[0] == planned[1], got
    own0, own1 = got[0][-1][1], got[1][-1][1]
    assert own1 > own0 and planned[0][-1] == max(own0, own1), got
