"""A frozen rank on TorchTitan's path ends the attempt within `[sparse_checkpoint] hang_timeout_s`, in a
training step and in the recovery (the tiers, the agreement, the replay: watched since issue 28; a freeze
there cost ~150 s before, gloo's timeout plus torchrun's grace).

One job (the job-file SparseTrainer, 2 ranks, hang_timeout_s = 5) under torchrun --max-restarts 2: rank 1
SIGSTOPs itself at the start of iteration 4 (attempt 0), and half-way through the replay in attempt 1. Rank 0
ends each attempt through the watchdog (`event=hang`), the stop guard kills the stopped rank on torchrun's
SIGTERM, and attempt 2 recovers; every rank's final state and every loss after the recovery are `torch.equal`
to the fault-free run of tests/titan_glue/test_titan_restarts.py.

Named to sort after test_titan_restarts.py, whose first test trains that fault-free run: computed here, it took
this test past the suite's 60 s limit (17 s of reference + 44 s of three attempts).
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torchtitan")

# Its fault-free run (shared, computed once per session) and its `env` fixture.
from test_titan_restarts import STEPS, WINDOW, _reference, env  # noqa: F401

from titan_integration import recovery_demo

pytestmark = pytest.mark.titan  # starts TorchTitan: not in make test-fast

FAULTS = "freeze:point=forward:rank=1:step=4:attempt=0;freeze:point=recovery:rank=1:step=1:attempt=1"


def test_frozen_rank_in_training_and_in_recovery_ends_the_attempt(tmp_path, tmp_path_factory, env, fault_summary):  # noqa: F811
    reference = _reference(tmp_path_factory, env)
    d = tmp_path / "run"
    job = recovery_demo.write_job(d, steps=STEPS, window=WINDOW, host_dir=d / "host", hang_timeout_s=5)
    rc, out = recovery_demo.torchrun(d, env, job, nproc=2, fault=FAULTS, timeout=110, max_restarts=2)
    if rc != 0:
        fault_summary("TorchTitan: frozen rank in training, then in recovery", 2, "failed loudly")
    assert rc == 0, out[-6000:]
    hangs = re.findall(r"event=hang rank=(\d+) op=\"?([\w ]+?)\"? waited_s=\S+ timeout_s=(\S+)", out)
    events = [
        ln for ln in out.splitlines() if re.search(r"event=(hang|exit|fault_injected|collective_error)|exitcode", ln)
    ]
    assert ("0", "train_step 4", "5.0") in hangs and ("0", "recovery", "5.0") in hangs, "\n".join(events)
    ranks = recovery_demo.compare(reference, d, 2)
    exact = all(r.exact and r.attempt == 2 and r.recovery is not None for r in ranks)
    fault_summary(
        "TorchTitan: frozen rank in training, then in recovery", 2, "recovered exactly" if exact else "silently wrong"
    )
    assert exact, [(r.rank, r.attempt, r.differing[:4], r.losses_equal) for r in ranks]
