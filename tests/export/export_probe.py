"""A 2-rank own loop (FSDP2, gloo) on a tiny transformers MoE model for tests/export/test_export_hf_ranks.py: windows of
W = 3 on the host tier; after every step rank 0 saves the gathered full state dict and the training model's logits
on a fixed batch (every rank runs the forward: FSDP2 gathers), so the test can compare an export with them."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import torchmoe_ckpt as tmc
from torchmoe_harness.hf_models import build_hf_model


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-type", default="mixtral")
    ap.add_argument("--host-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=7)
    args = ap.parse_args(argv)
    rank, _ = tmc.init_process_group()
    torch.manual_seed(0)
    model = build_hf_model(args.model_type, seed=0)
    model.config.to_json_file(str(Path(args.out) / "config.json"))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(123))

    def forward_backward(tokens: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(tokens[:, :-1]).logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss

    cfg = tmc.CheckpointConfig(
        tiers=tmc.TierConfig(root=args.host_dir, run_id="ranks"), window=tmc.SparseConfig(window=3), max_grad_norm=1.0
    )
    states, logits = {}, {}
    with tmc.Checkpointer(model, optimizer, forward_backward, None, cfg) as ck:
        for step in range(ck.resume() + 1, args.steps + 1):
            g = torch.Generator().manual_seed(step * 1000 + rank)
            ck.step(torch.randint(0, 128, (2, 9), generator=g))
            full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
            states[step] = {k: v.detach().clone() for k, v in full.items()}
            model.eval()
            with torch.no_grad():
                logits[step] = model(batch).logits.clone()
            model.train()
    if rank == 0:
        torch.save({"states": states, "logits": logits, "batch": batch}, Path(args.out) / "reference.pt")
    sys.stdout.flush()
    os._exit(0)  # skip gloo teardown (as tests/api/user_loop.py)


if __name__ == "__main__":
    main(sys.argv[1:])
