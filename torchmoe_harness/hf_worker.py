"""torchrun entry point: a tiny Hugging Face MoE model of any model type, sharded with FSDP2, trained through
the public `torchmoe_ckpt.Checkpointer` (the own-loop front door) with windows in host memory. Writes each
rank's final state (every entry of the model, optimizer and scheduler state dicts, local shards) and losses
for `selftest --model hf:<type>`.

    torchrun --nproc_per_node N -m torchmoe_harness.hf_worker --spec spec.json --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._pytree import keystr, tree_flatten_with_path

import torchmoe_ckpt as tmc
from torchmoe_harness.hf_models import build_hf_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def shard(model: nn.Module, dtype: torch.dtype) -> None:
    """FSDP2 as a user would apply it: each repeated block (the elements of the longest ModuleList), then
    the root; bf16 compute with fp32 master weights and fp32 gradient reduction."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    blocks = max(lists, key=len) if lists else []
    kw = (
        {}
        if dtype == torch.float32
        else {"mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)}
    )
    for b in blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)


def flat_state(tree) -> dict[str, torch.Tensor]:
    """Every tensor and number of a nested state dict, by path (DTensors as this rank's local shard)."""
    out = {}
    for path, v in tree_flatten_with_path(tree)[0]:
        if v is None or isinstance(v, str):
            continue
        if isinstance(v, DTensor):
            v = v.to_local()
        out[keystr(path)] = v.detach().clone() if torch.is_tensor(v) else torch.tensor(v, dtype=torch.float64)
    return out


def run(spec: dict, out: Path) -> dict:
    rank, world = tmc.init_process_group(timeout_s=spec.get("timeout_s", 60))
    torch.manual_seed(spec.get("seed", 0))
    m = spec["model"]
    model = build_hf_model(
        m["type"],
        layers=m.get("layers", 2),
        hidden=m.get("hidden", 32),
        experts=m.get("experts", 4),
        top_k=m.get("top_k", 2),
        vocab=m.get("vocab", 128),
        seed=spec.get("seed", 0),
    )
    vocab = model.config.get_text_config().vocab_size
    dtype = DTYPES[spec.get("dtype", "fp32")]
    shard(model, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    seed, batch, seq = spec.get("seed", 0), spec.get("batch", 2), spec.get("seq", 16)

    def batch_for(step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1000 + rank)
        return torch.randint(0, vocab, (batch, seq + 1), generator=g)

    def forward_backward(tokens: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss

    tiers = tmc.TierConfig(root=spec["host_root"], run_id=spec["run_id"])
    cfg = tmc.CheckpointConfig(tiers=tiers, window=tmc.SparseConfig(window=spec.get("window")), max_grad_norm=0.5)
    losses: dict[int, torch.Tensor] = {}
    data = f"synthetic tokens, seed {seed}"  # with the process seed (torch.manual_seed above): the run identity
    with tmc.Checkpointer(model, optimizer, forward_backward, scheduler, cfg, data_identity=data) as ckpt:
        start = ckpt.resume()
        for step in range(start + 1, spec["steps"] + 1):
            losses[step] = ckpt.step(batch_for(step))
        experts = [
            sum(len(o.experts) for o in ckpt.ops if o.kind == "expert" and o.layer == layer)  # merged ones too
            for layer in sorted({o.layer for o in ckpt.ops if o.kind == "expert"})
        ]
        stats = ckpt.stats()
    state = flat_state({"model": model.state_dict(), "optim": optimizer.state_dict(), "sched": scheduler.state_dict()})
    torch.save({"state": state, "losses": losses}, out / f"rank{rank}.pt")
    rec = stats.get("recovery") or {}
    return {
        "model_type": m["type"],
        "model_class": type(model).__name__,
        "experts_per_moe_layer": experts,
        "operators": len(ckpt.ops),
        "started_at_step": start,
        "windows_committed": stats.get("windows_committed"),
        "recovery": {
            k: rec.get(k)
            for k in ("window", "start_step", "recovered_step", "replayed_iterations", "source", "seconds")
        }
        if rec.get("window")
        else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    spec, out = json.loads(Path(args.spec).read_text()), Path(args.out)
    report = run(spec, out)
    dist.barrier()
    if dist.get_rank() == 0:
        (out / "report.json").write_text(json.dumps(report, indent=1))
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's C++ threads occasionally abort at interpreter exit, after the results are written


if __name__ == "__main__":
    main()
