"""Host bytes per parameter the checkpointer holds, by part (torchmoe_ckpt/capture/host_memory.py's account), measured
on CPU at a forced W for an fp32 and a bf16 compute dtype, two emulated nodes (one rank each), the host tier alone and
with one peer copy (replicas = 1) and a local object store on /dev/shm; for the CPU allocator (shared-memory slot
files) and the CUDA one (`host_buffers="arena"`: an arena per slot set, the host tier's files beside it; unpinned
here, so measured on CPU too). Also the construction figure (the worst case the limit is checked against).

    torchrun --standalone --nproc_per_node 2 -m torchmoe_harness.bench_host_memory --out host_memory.json

Sampled each iteration: `total` is the largest total, `per_param` its parts then, `part_max_per_param` each part's
own largest value (parts peak at different times: a window's files move from arriving to held to spare).
Divided by this rank's parameters (its FSDP shards). Sizes, not timings: the machine's load does not change them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import uuid
from pathlib import Path

import torch

from torchmoe_ckpt import init_process_group
from torchmoe_ckpt.config import SparseConfig
from torchmoe_ckpt.persist.build_tiers import build_tiers
from torchmoe_ckpt.sparse_checkpointer import RunContext, SparseCheckpointer
from torchmoe_harness.scenario import run_identity
from torchmoe_harness.trainer import RunConfig, Trainer

MODEL = {"vocab_size": 1024, "dim": 256, "n_layers": 4, "n_heads": 4, "num_experts": 16, "expert_hidden": 256}


def measure(dtype: str, allocator: str, window: int, steps: int, root: Path, tiers: str) -> dict:
    trainer = Trainer(RunConfig(model=MODEL, steps=steps, dtype=dtype, batch_size=2, seq_len=32))
    host = {"root": str(root / "host"), "run_id": f"{dtype}-{allocator}-{tiers}", "ranks_per_node": 1}
    if tiers == "all":
        host.update(replicas=1, object_store={"uri": f"file://{root}/store", "keep": 2})
    opened = build_tiers(host, trainer.rank, trainer.world, trainer.cfg.hsdp)
    # no limit in effect, but the construction figure computed; "arena": the CUDA allocator, unpinned here
    limit_probe = SparseConfig(
        window=window, host_memory_limit=1 << 50, host_buffers=allocator.replace("files", "auto")
    )
    ck = SparseCheckpointer(
        trainer.model,
        trainer.optimizer,
        trainer.compute_dtype,
        limit_probe,
        RunContext(tiers=opened, identity=run_identity(trainer, host)),
    ).attach(trainer)
    at_peak: dict[str, int] = {}
    part_max: dict[str, int] = {}
    total = 0
    for _ in range(steps):
        ck.after_step(trainer.train_step())
        acct = ck.memory.account()
        if acct["total"] > total:
            total, at_peak = acct["total"], dict(acct["parts"])
        for k, v in acct["parts"].items():
            part_max[k] = max(part_max.get(k, 0), v)
    ck.close(upload_timeout_s=30.0)
    params = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in trainer.model.parameters())
    need = ck.memory.need or {}
    return {
        "dtype": dtype,
        "allocator": allocator,
        "tiers": tiers,
        "window": window,
        "params_this_rank": params,
        "window_bytes": ck.counters.windows[-1].mean_slot_bytes * window,
        "total_bytes": total,
        "parts_at_peak_bytes": at_peak,
        "per_param": {k: round(v / params, 2) for k, v in at_peak.items() if v},
        "part_max_per_param": {k: round(v / params, 2) for k, v in part_max.items() if v},
        "total_per_param": round(total / params, 2),
        "figure_per_param": {k: round(v / params, 2) for k, v in (need.get("parts") or {}).items() if v},
        "figure_total_per_param": round((need.get("total") or 0) / params, 2),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="host_memory.json")
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args(argv)
    rank, _world = init_process_group()
    root = Path("/dev/shm") / f"torchmoe-ckpt-bench-memory-{uuid.uuid4().hex[:8]}"
    root_list = [str(root)]
    torch.distributed.broadcast_object_list(root_list, src=0)
    root = Path(root_list[0])
    rows = []
    try:
        for tiers in ("host", "all"):
            for dtype in ("fp32", "bf16"):
                for allocator in ("files", "arena"):
                    rows.append(measure(dtype, allocator, args.window, args.steps, root, tiers))
                    torch.distributed.barrier()
    finally:
        torch.distributed.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    if rank == 0:
        Path(args.out).write_text(json.dumps(rows, indent=1))
        for r in rows:
            print(r["tiers"], r["dtype"], r["allocator"], "total", r["total_per_param"], "B/param", r["per_param"])
            print("   figure", r["figure_total_per_param"], r["figure_per_param"])


if __name__ == "__main__":
    main()
