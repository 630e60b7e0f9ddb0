"""The Python each slot copy job costs, copies skipped (docs/gpu.md, "The fix switches": less Python per copy job).

A micro-benchmark of the checkpointer's own Python around a slot copy, on the CPU: a 4-layer MoE of 16 experts
(~330 tensors with AdamW state, the size of the GPU check's model in tensors, not in bytes) under the own-loop
`Checkpointer`, W = 4, with `SnapshotEngine.skip_copies` on, so the figures are the Python path alone (the
training thread's `capture`, and the copy thread's job, timed with `time.thread_time`). Prints JSON:

    python -m torchmoe_harness.bench_copy_job [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import torchmoe_ckpt as tmc

DIM, HID, EXPERTS, LAYERS, VOCAB = 8, 8, 16, 4, 16
# No reorder (a stable routing, as in steady state): a reorder re-assembles the slots, which is not per job.
SPARSE = tmc.SparseConfig(window=4, reorder_change=1.0, reorder_fraction=1.0)


class _Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, HID), nn.Linear(HID, DIM)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class _MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(_Expert() for _ in range(EXPERTS))

    def forward(self, x):
        w, idx = self.router(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for e, ex in enumerate(self.experts):  # every expert runs (dense): the benchmark times the checkpointer
            out = out + (w * (idx == e)).sum(-1, keepdim=True) * ex(x)
        return out


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(DIM), "moe": _MoE()}) for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = x + b["moe"](b["norm"](x))
        return self.head(x)


def run(steps: int, sparse: tmc.SparseConfig | None = None) -> dict:
    """Per copy job: the training thread's `capture` (wall and thread CPU) and the copy thread's job (thread CPU),
    medians in microseconds over `steps` iterations after 8 warm-up ones."""
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def fb(tokens):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss

    ckpt = tmc.Checkpointer(model, opt, fb, config=tmc.CheckpointConfig(window=sparse or SPARSE, router_top_k=2))
    ckpt.resume()
    engine = ckpt.sparse.engine
    engine.skip_copies = True
    capture, wall, cpu = engine.capture, [], []

    def timed(slot, step):
        t0, c0 = time.perf_counter(), time.thread_time()
        capture(slot, step)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)

    engine.capture = timed
    job_cpu: list[float] = []
    seen = 0
    for step in range(1, steps + 9):
        ckpt.step(torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(step)))
        engine.wait_done()
        if engine.copy_totals["copies"] != seen and engine.last_copy is not None:
            seen = engine.copy_totals["copies"]
            job_cpu.append(engine.last_copy[2])
    tensors = len(list(model.parameters())) * 3
    ckpt.close()

    def med(xs):
        return round(statistics.median(xs[8:]) * 1e6, 1)

    return {
        "tensors": tensors,
        "steps": steps,
        "capture_wall_us": med(wall),
        "capture_cpu_us": med(cpu),
        "copy_job_cpu_us": med(job_cpu),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(json.dumps(run(args.steps), indent=2))


if __name__ == "__main__":
    main()
