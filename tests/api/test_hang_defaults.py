"""A frozen rank ends the attempt within the configured timeout with the own loop's default settings: the
hang watchdog is on in every `Checkpointer` with more than one rank (CheckpointConfig.hang_timeout_s for a
step, hang_start_timeout_s for resume() and the first step), no watchdog code in the loop.

One job of examples/own_loop.py (HF Mixtral, FSDP2, 2 ranks) under torchrun --max-restarts 2, the timeouts
set to 4 s through the example's flags: rank 1 SIGSTOPs itself in iteration 8 (attempt 0); rank 0's
watchdog ends it (`event=hang op="step 8"`), the stop guard kills the stopped rank on torchrun's SIGTERM,
and torchrun restarts. In attempt 1 rank 1 SIGSTOPs itself half-way through the replay; rank 0 ends the
attempt in resume() (`op=resume`). Attempt 2 recovers, and every tensor and every loss after it is
`torch.equal` to a run that never failed. Without the watchdog each freeze costs gloo's 120 s timeout plus
torchrun's 30 s grace (measured by the outside trial: 163 s in training, 120 s in recovery).
"""

from __future__ import annotations

import pytest
import torch
import transformers  # noqa: F401  (make setup installs it: a missing one fails here, not skips)
from support.events import find
from test_own_loop import run_example  # tests/api is on sys.path under pytest

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast

TIMEOUT = "4"
FAULTS = "freeze:point=forward:rank=1:step=8:attempt=0;freeze:point=recovery:rank=1:attempt=1"


def test_frozen_rank_in_training_and_in_recovery_ends_the_attempt(tmp_path, fault_summary):
    ref, _ = run_example(tmp_path / "ref", 12, "ref")
    try:
        got, log = run_example(
            tmp_path / "hang",
            12,
            "hang",
            fault=FAULTS,
            max_restarts=2,
            extra=("--hang-timeout-s", TIMEOUT, "--hang-start-timeout-s", TIMEOUT),
        )
    except RuntimeError:
        fault_summary("own loop: frozen rank in training, then in recovery", 2, "failed loudly")
        raise
    hangs = [(e["rank"], e["op"], e["timeout_s"]) for e in find(log, "hang") if "waited_s" in e.fields]
    # rank 0 (the healthy one) ended both attempts through its watchdog, at the configured bound
    assert ("0", "step 8", "4.0") in hangs and ("0", "resume", "4.0") in hangs, (hangs, log[-3000:])
    assert find(log, "recovered", exact="true"), log[-3000:]
    exact = True
    for r in range(2):
        a, b = ref[r]["state"], got[r]["state"]
        exact &= a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
        after = sorted(got[r]["losses"])
        exact &= bool(after) and after[-1] == 12
        exact &= all(torch.equal(ref[r]["losses"][s], got[r]["losses"][s]) for s in after)
    fault_summary(
        "own loop: frozen rank in training, then in recovery", 2, "recovered exactly" if exact else "silently wrong"
    )
    assert exact
