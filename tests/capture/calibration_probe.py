"""Each rank of a gloo job prices auto W by its own device loss (synthetic: rank r's copies cost (1 + 3r) x rank
0's) and plans 4 windows; writes (W planned, this rank's own proposal) per window to OUT/rank<r>.json.
Used by test_copy_switches.py: the W every rank plans is the same, the largest proposal."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from torchmoe_ckpt import init_process_group
from torchmoe_ckpt.config import SparseConfig
from torchmoe_ckpt.model.operators import discover_operators
from torchmoe_ckpt.model.optim_state import attach_optimizer_state
from torchmoe_ckpt.planning.calibration import CALIBRATION_STEPS, WARMUP_STEPS
from torchmoe_ckpt.planning.schedule import choose_window
from torchmoe_ckpt.planning.window_planner import WindowPlanner
from torchmoe_ckpt.runtime.agreement import reduce_float
from torchmoe_harness.bench_copy_job import EXPERTS, LAYERS, _Net

init_process_group("gloo")
rank = dist.get_rank()
model = _Net()
ops = discover_operators(model)
attach_optimizer_state(model, ops, torch.optim.AdamW(model.parameters()))
agree = lambda v, op, g=None: reduce_float(v, op, g)  # noqa: E731
cfg = SparseConfig(bandwidth_bytes_per_s=1e12)
pl = WindowPlanner(cfg, ops, torch.float32, None, agree, False, rank, device_loss=True)
zero = torch.zeros(LAYERS, EXPERTS, dtype=torch.float64)
for _ in range(WARMUP_STEPS + CALIBRATION_STEPS):
    pl.observe_step(0.1, zero, zero, 0)
order, (full, comp) = pl.operator_order(), pl.op_sizes()
dense = sum(full.values())
out = []
for _ in range(4):
    for _ in range(3):  # a dense-sized copy adds 1% (rank 0) or 4%, 7%, ... of the step
        pl.observe_step(0.1 * (1 + 0.01 * (1 + 3 * rank)), zero, zero, dense)
    plan, budget = pl.plan()
    out.append((plan.window, choose_window(order, full, comp, budget)))
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(out))
dist.destroy_process_group()
