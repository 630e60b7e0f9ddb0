"""torchrun entry for tests/model/test_optimizers_kill9.py: the own loop of examples/own_loop.py (Hugging Face
Mixtral, FSDP2, a crash with `kill -9`, resume) with another optimizer setup (torchmoe_harness.optimizers): SGD,
AdamW with amsgrad or bf16 states, Muon + AdamW as two optimizers, Adafactor + AdamW, Adafactor alone.
`--model gpt_oss` trains Hugging Face gpt-oss instead (grouped experts with 2-D [E, F] expert biases).
`--parallel ddp` runs DistributedDataParallel instead of FSDP2 (torch's Adafactor cannot step FSDP2's DTensor
parameters: an in-place square of a partial norm, refused by DTensor in torch 2.13). Writes every tensor of this
rank's final state (model, each optimizer's and scheduler's state dict, local shards) and its losses."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from transformers import GptOssConfig, GptOssForCausalLM, MixtralConfig, MixtralForCausalLM

import torchmoe_ckpt as tmc
from torchmoe_harness.hf_worker import flat_state
from torchmoe_harness.optimizers import KINDS, build_optimizers, needs_bf16_params


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--optimizer", choices=KINDS, required=True)
    ap.add_argument("--parallel", choices=("fsdp", "ddp"), default="fsdp")
    ap.add_argument("--model", choices=("mixtral", "gpt_oss"), default="mixtral")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--host-dir", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(format="%(message)s")
    logging.getLogger("torchmoe_ckpt").setLevel(logging.INFO)

    rank, _world = tmc.init_process_group()
    torch.manual_seed(0)
    sizes = dict(
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
    if args.model == "gpt_oss":
        cfg = GptOssConfig(**sizes, head_dim=16, layer_types=["full_attention"] * 2)
        model = GptOssForCausalLM(cfg)
    else:
        cfg = MixtralConfig(**sizes)
        model = MixtralForCausalLM(cfg)
    if needs_bf16_params(args.optimizer):
        model = model.to(torch.bfloat16)
    if args.parallel == "fsdp":
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        inner = model
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
        inner = model.module
    optimizers, schedulers = build_optimizers(args.optimizer, model, lr=3e-3, lr_factor=lambda s: min(1.0, (s + 1) / 5))

    def batch_for(step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(step * 1000 + rank)
        return torch.randint(0, cfg.vocab_size, (2, 17), generator=g)

    def forward_backward(tokens: torch.Tensor) -> torch.Tensor:
        logits = model(tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss

    losses = {}
    config = tmc.CheckpointConfig(
        tiers=tmc.TierConfig(root=args.host_dir, run_id=args.run_id),
        window=tmc.SparseConfig(window=3),
        max_grad_norm=1.0,
    )
    with tmc.Checkpointer(model, optimizers, forward_backward, schedulers, config) as ckpt:
        for step in range(ckpt.resume() + 1, args.steps + 1):
            losses[step] = ckpt.step(batch_for(step))
            if rank == 0:
                print(f"step {step} loss {losses[step].item():.6f}", flush=True)
    state = flat_state(
        {
            "model": inner.state_dict(),
            "optim": [o.state_dict() for o in optimizers],
            "sched": [{k: v for k, v in s.state_dict().items() if k != "lr_lambdas"} for s in schedulers],
        }
    )
    torch.save({"state": state, "losses": losses}, Path(os.environ["OWN_LOOP_OUT"]) / f"rank{rank}.pt")
    sys.stdout.flush()
    os._exit(0)  # skip gloo teardown (its threads occasionally abort at exit after the results are written)


if __name__ == "__main__":
    main(sys.argv[1:])
