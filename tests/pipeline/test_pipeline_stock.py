"""Boundary logging on torch.distributed.pipelining's stock schedules (ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B) under torchrun/gloo: every activation and gradient a stage sent is in its log,
tagged (iteration, micro-batch, direction), and `torch.equal` to what the receiving stage got."""

import pytest
import torch

from torchmoe_ckpt.pipeline.boundary_log import LogReader
from torchmoe_harness.launch import launch

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast

RUN = {"model": {"n_layers": 4}, "batch_size": 4}
M, STEPS = 2, 2


@pytest.mark.parametrize("schedule,per_rank", [("gpipe", 1), ("1f1b", 1), ("interleaved1f1b", 2)])
def test_stock_schedule_logs_what_was_sent(tmp_path, schedule, per_rank):
    spec = {
        "run": RUN,
        "schedule": schedule,
        "stages_per_rank": per_rank,
        "microbatches": M,
        "steps": STEPS,
        "log_root": str(tmp_path / "shm"),
        "timeout_s": 30,
    }
    out = tmp_path / "run"
    launch(2, spec, out, timeout=55, module="torchmoe_harness.pipeline_stock_worker")
    n = 2 * per_rank
    got = {s: torch.load(out / f"received-{s}.pt", weights_only=True) for s in range(n)}
    checked = 0
    for s in range(n):
        log = LogReader(tmp_path / "shm" / f"stage-{s}")
        order = [(it, mb) for it in range(1, STEPS + 1) for mb in range(M)]  # each stage runs mbs in order
        if s < n - 1:  # activations s sent == what s+1 received
            assert len(got[s + 1]["inputs"]) == len(order) and got[s + 1]["extra_inputs"] <= 1
            for k, (it, mb) in enumerate(order):
                assert torch.equal(log.get(it, mb, "fwd"), got[s + 1]["inputs"][k]), (s, it, mb)
                checked += 1
        if s > 0:  # gradients s sent == the output gradients s-1 received
            assert len(got[s - 1]["grads"]) == len(order)
            for k, (it, mb) in enumerate(order):
                assert torch.equal(log.get(it, mb, "bwd"), got[s - 1]["grads"][k]), (s, it, mb)
                checked += 1
    assert checked == 2 * (n - 1) * STEPS * M
