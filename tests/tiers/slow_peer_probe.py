"""A 2-rank own loop (Hugging Face Mixtral, FSDP2) whose ranks are nodes of their own (ranks_per_node = 1,
replicas = 1), with the peer tier's real gloo transport slowed: every push waits `--delay-s` before its bytes go
(a link far slower than training makes windows). For tests/tiers/test_peer_lag.py.

Per step it records the peer tier's lag stats (`stats()['peers']`) and the host-memory account; at the end, after
`close()` (the last window pushed in full), the final peer stats. All to $PEER_LAG_OUT/rank<R>.json."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from transformers import MixtralConfig, MixtralForCausalLM

import torchmoe_ckpt as tmc
from torchmoe_ckpt.tiers.peer_transport import GlooTransport


class SleepyTransport(GlooTransport):
    """The real gloo transport, each send held back `delay_s` first: a slow link, the bytes unchanged."""

    def __init__(self, delay_s: float):
        super().__init__()
        self.delay_s = delay_s

    def send(self, files, dst, group, meta):
        if files:  # a superseded window's header alone is not held back (no bytes to carry)
            time.sleep(self.delay_s)
        return super().send(files, dst, group, meta)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--host-dir", required=True)
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--max-lag", type=int, default=2)
    ap.add_argument("--delay-s", type=float, default=1.0)
    ap.add_argument("--memory-limit", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(format="%(message)s", stream=sys.stdout)
    logging.getLogger("torchmoe_ckpt").setLevel(logging.INFO)
    rank, _ = tmc.init_process_group(timeout_s=60)
    torch.manual_seed(0)
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
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def forward_backward(tokens: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(tokens[:, :-1]).logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss

    tiers = tmc.TierConfig(
        root=args.host_dir, run_id="lag", ranks_per_node=1, replicas=1, peer_max_lag_windows=args.max_lag
    )
    sparse = tmc.SparseConfig(window=args.window, host_memory_limit=args.memory_limit)
    config = tmc.CheckpointConfig(tiers=tiers, window=sparse, max_grad_norm=1.0)
    steps = []
    with tmc.Checkpointer(model, optimizer, forward_backward, None, config) as ckpt:
        ckpt.resume()
        assert ckpt.sparse is not None and ckpt.sparse.persist is not None and ckpt.sparse.persist.peers is not None
        persist = ckpt.sparse.persist
        persist.peers.outbox = SleepyTransport(args.delay_s)
        for step in range(1, args.steps + 1):
            g = torch.Generator().manual_seed(step * 1000 + rank)
            ckpt.step(torch.randint(0, cfg.vocab_size, (2, 17), generator=g))
            mem = ckpt.sparse.memory.account()
            steps.append({"step": step, "peers": persist.replication_stats(), "host_total": mem["total"]})
    final = persist.replication_stats()
    mem = ckpt.sparse.memory.account()
    out = {"steps": steps, "final": final, "host_peak": mem["peak"], "host_limit": mem["limit"]}
    out["status_lines"] = list(persist.status.lines)
    out["committed"] = ckpt.sparse.counters.windows_committed
    Path(os.environ["PEER_LAG_OUT"], f"rank{rank}.json").write_text(json.dumps(out, default=str))
    sys.stdout.flush()
    os._exit(0)  # skip gloo teardown (its threads occasionally abort at exit after the results are written)


if __name__ == "__main__":
    main(sys.argv[1:])
