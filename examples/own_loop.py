"""Your own FSDP2 training loop on a Hugging Face MoE model (Mixtral), checkpointed every iteration.

    torchrun --nproc_per_node 2 --max-restarts 1 examples/own_loop.py --steps 20 --run-id demo

Kill any rank with `kill -9` while it trains: torchrun restarts the workers, `ckpt.resume()` rebuilds the
exact state of the last committed window from host memory and training goes on as if nothing happened.
The lines marked `# ckpt` are all the checkpointing code; the rest is a plain loop. With CUDA each rank trains
on its GPU (NCCL); `--replay-check exact` then needs deterministic kernels (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from transformers import MixtralConfig, MixtralForCausalLM

import torchmoe_ckpt as tmc  # ckpt


def main(argv: list[str] | None = None, mesh=None):
    """`mesh`: the DeviceMesh FSDP2 shards over (default: every rank, on this process's device)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--run-id", default=None, help="default: torchrun's run id (one per launch)")
    ap.add_argument("--host-dir", default="/dev/shm/torchmoe-ckpt")
    ap.add_argument("--window", type=int, default=3, help="W of the sparse windows (policy auto or sparse)")
    ap.add_argument(
        "--policy",
        choices=("auto", "sparse", "dense"),
        default="auto",
        help="dense: a dense snapshot every --dense-interval iterations instead of windows (auto: --window -> sparse)",
    )
    ap.add_argument("--dense-interval", type=int, default=None, help="dense: iterations between snapshots (auto)")
    ap.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="peers on other nodes that hold a copy of each window (1+: a lost node recovers from them)",
    )
    ap.add_argument("--seed", type=int, default=0, help="initialisation and data order (part of the run identity)")
    ap.add_argument(
        "--on-unusable-checkpoint",
        choices=("fail", "restart"),
        default="fail",
        help="windows exist but every one is rejected (corrupt, replay diverged): refuse (default) or "
        "start over from step 0, overwriting them",
    )
    ap.add_argument(
        "--hang-timeout-s",
        type=float,
        default=tmc.CheckpointConfig.hang_timeout_s,
        help="a rank blocked this long in a step (a frozen peer) ends its process, so torchrun restarts the job",
    )
    ap.add_argument(
        "--hang-start-timeout-s",
        type=float,
        default=tmc.CheckpointConfig.hang_start_timeout_s,
        help="the same for resume() and the first step after it",
    )
    ap.add_argument(
        "--replay-check",
        choices=("exact", "tolerant"),
        default="exact",
        help="recovery's replay: bit for bit (CUDA: deterministic kernels needed) or within a bound (approximate)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(format="%(message)s")
    logging.getLogger("torchmoe_ckpt").setLevel(logging.INFO)  # windows committed, recovery: one line each

    rank, world = tmc.init_process_group()  # ckpt: dist.init_process_group that survives torchrun restarts
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(args.seed)  # part of the run identity: a relaunch with another seed is refused
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
    model = MixtralForCausalLM(cfg).to(device)  # initialised on the CPU: the same weights on any device
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))

    def batch_for(step: int) -> torch.Tensor:  # the data position is the step: any rank, any attempt
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1000 + rank)
        return torch.randint(0, cfg.vocab_size, (2, 17), generator=g).to(device)

    def forward_backward(tokens: torch.Tensor) -> torch.Tensor:
        logits = model(tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss

    losses = {}
    config = tmc.CheckpointConfig(
        tiers=tmc.TierConfig(root=args.host_dir, run_id=args.run_id, replicas=args.replicas),  # ckpt
        window=tmc.SparseConfig(
            window=None if args.policy == "dense" else args.window,
            policy=args.policy,
            dense_interval=args.dense_interval,
        ),
        max_grad_norm=1.0,  # ckpt
        on_unusable_checkpoint=args.on_unusable_checkpoint,
        hang_timeout_s=args.hang_timeout_s,
        hang_start_timeout_s=args.hang_start_timeout_s,
        replay_check=args.replay_check,
    )  # ckpt
    data = f"synthetic tokens, seed {args.seed}"  # ckpt: names the data order (windows of other data are refused)
    with tmc.Checkpointer(model, optimizer, forward_backward, scheduler, config, data_identity=data) as ckpt:  # ckpt
        for step in range(ckpt.resume() + 1, args.steps + 1):  # ckpt: resume() = last completed step
            # ckpt.step = forward_backward + clip_grad_norm_ + optimizer.step + scheduler.step + zero_grad
            losses[step] = ckpt.step(batch_for(step))  # ckpt
            if rank == 0:
                print(f"step {step} loss {losses[step].item():.6f}", flush=True)
    return model, optimizer, scheduler, losses


if __name__ == "__main__":
    main()
