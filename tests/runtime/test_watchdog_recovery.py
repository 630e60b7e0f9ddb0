"""The watchdog covers recovery: a rank frozen (SIGSTOP) half-way through the replay of a restarted job
makes the others exit through the watchdog (op "recovery") within its timeout, torchrun restarts every
worker, and the next recovery completes and ends `torch.equal` to the run that never failed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.events import find

from torchmoe_ckpt.runtime.watchdog import read_events
from torchmoe_harness.launch import compare, load_result, processes_mentioning, torchrun

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast

PROBE = str(Path(__file__).with_name("recovery_watch_probe.py"))
TIMEOUT_S = 3.0


def test_rank_frozen_during_replay_is_caught_by_the_watchdog(tmp_path, reference, fault_summary):
    ref = reference(2, {"steps": 12, "dtype": "fp32"})
    out = tmp_path / "run"
    out.mkdir()
    spec = {
        "run": {"steps": 12, "dtype": "fp32"},
        "checkpoint": {"window": 3},
        "host_tier": {"root": str(tmp_path / "shm"), "run_id": "watched"},
        "watchdog_timeout_s": TIMEOUT_S,
        "watchdog_events": str(tmp_path / "events.jsonl"),
        "timeout_s": 60,
    }  # gloo would wait this long for the frozen rank; the watchdog must not
    (out / "spec.json").write_text(json.dumps(spec))
    # attempt 0: rank 0 dies in iteration 8 (window 1, steps 4..6, is the newest committed one);
    # attempt 1: rank 1 freezes half-way through replaying it; attempt 2 recovers.
    faults = "kill:point=forward:rank=0:step=8:attempt=0;freeze:point=recovery:rank=1:attempt=1"
    log = torchrun(
        2,
        [PROBE, "--spec", str(out / "spec.json"), "--out", str(out)],
        out / "torchrun.log",
        timeout=58,
        extra_env={"TORCHMOE_FAULT": faults},
        max_restarts=2,
    )
    events = read_events(spec["watchdog_events"])
    hangs = [e for e in events if e["event"] == "hang"]
    assert hangs and all(e["op"] == "recovery" and e["rank"] == 0 for e in hangs), events
    assert hangs[0]["waited_s"] < TIMEOUT_S + 2, hangs  # the watchdog, not gloo's 60 s, ended the wait
    assert find(log, "fault_injected", action="freeze", point="recovery", rank=1), log[-3000:]
    run = load_result(out, 2, log)
    assert run.report["attempt"] == 2 and run.report["recovered_step"] == 6, run.report
    cmp = compare(run, ref)  # the last attempt's losses are those of iterations 7..12
    exact = cmp.bit_exact and cmp.compared_losses == 2 * 6
    fault_summary("frozen_during_recovery", 2, "recovered exactly" if exact else "silently wrong")
    assert exact, cmp.mismatches[:10]
    assert not processes_mentioning(str(out)), "a stopped worker outlived the job"
