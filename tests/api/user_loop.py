"""examples/own_loop.py as a user writes it, for tests/api/test_user_order.py: the package imported at the
top, torch seeded after `tmc.init_process_group()`, then the `Checkpointer`; no `data_identity` (users rarely
name one). Nothing of the library or the harness is imported before the seed, so the run identity must find the
seed whatever the import order. Variants a user writes too:

    --seed N                 torch.manual_seed(N) after init_process_group (the example's order)
    --no-seed                never seeds torch (torch's random default seed)
    USER_LOOP_SEED_FIRST=N   torch.manual_seed(N) before `import torchmoe_ckpt`
    --store-uri URI          an object store tier too (plain torchrun needs no rendezvous id)
    --pg-timeout-s S         the job's process-group timeout (tmc.init_process_group(timeout_s=S))

At the end every tensor of this rank's training state and its losses go to $USER_LOOP_OUT/rank<R>.pt.
"""

from __future__ import annotations

import os

import torch

if os.environ.get("USER_LOOP_SEED_FIRST"):  # a user who seeds before importing anything else
    torch.manual_seed(int(os.environ["USER_LOOP_SEED_FIRST"]))

import argparse
import logging
import sys
from pathlib import Path

import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from transformers import MixtralConfig, MixtralForCausalLM

import torchmoe_ckpt as tmc


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--run-id", default=None)
    ap.add_argument("--host-dir", required=True)
    ap.add_argument("--window", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-seed", action="store_true")
    ap.add_argument("--store-uri", default=None)
    ap.add_argument("--pg-timeout-s", type=float, default=120.0)
    args = ap.parse_args(argv)
    logging.basicConfig(format="%(message)s")
    logging.getLogger("torchmoe_ckpt").setLevel(logging.INFO)

    rank, world = tmc.init_process_group(timeout_s=args.pg_timeout_s)
    seeded_before_identity = "torchmoe_ckpt.model.identity" not in sys.modules
    if not args.no_seed and not os.environ.get("USER_LOOP_SEED_FIRST"):
        torch.manual_seed(args.seed)
    cfg = MixtralConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    model = MixtralForCausalLM(cfg)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))

    def batch_for(step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1000 + rank)
        return torch.randint(0, cfg.vocab_size, (2, 17), generator=g)

    def forward_backward(tokens: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(tokens[:, :-1]).logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss

    store = tmc.ObjectStoreConfig(uri=args.store_uri) if args.store_uri else None
    config = tmc.CheckpointConfig(
        tiers=tmc.TierConfig(root=args.host_dir, run_id=args.run_id, object_store=store),
        window=tmc.SparseConfig(window=args.window),
        max_grad_norm=1.0,
    )
    losses = {}
    with tmc.Checkpointer(model, optimizer, forward_backward, scheduler, config) as ckpt:
        for step in range(ckpt.resume() + 1, args.steps + 1):
            losses[step] = ckpt.step(batch_for(step))
            if rank == 0:
                print(f"step {step} loss {losses[step].item():.6f}", flush=True)
        seed_part = ckpt.identity.parts.get("seed") if ckpt.identity is not None else None
    if rank == 0:
        print(f"user_loop: seeded_before_identity_import={seeded_before_identity} identity_seed={seed_part}")
    from torchmoe_harness.hf_worker import flat_state  # only now: nothing of the harness before the seed

    state = flat_state({"model": model.state_dict(), "optim": optimizer.state_dict(), "sched": scheduler.state_dict()})
    torch.save({"state": state, "losses": losses}, Path(os.environ["USER_LOOP_OUT"]) / f"rank{rank}.pt")
    sys.stdout.flush()
    os._exit(0)  # skip gloo teardown (its threads occasionally abort at exit after the results are written)


if __name__ == "__main__":
    main(sys.argv[1:])
