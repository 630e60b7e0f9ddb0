"""A tiny MoE transformer laid out like TorchTitan 0.3.0's deepseek_v3 MoE.

Names match TorchTitan so the same operator discovery serves both: grouped experts
`layers.{i}.moe.routed_experts.inner_experts.{w1_EFD,w2_EDF,w3_EFD}` ([E, hidden, dim], [E, dim, hidden],
[E, hidden, dim]), router `layers.{i}.moe.router.gate`, buffers `layers.{i}.moe.expert_bias_E` and
`layers.{i}.moe.tokens_per_expert_E`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class TinyMoEConfig:
    vocab_size: int = 256
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 2
    num_experts: int = 4
    top_k: int = 2
    expert_hidden: int = 48
    max_seq_len: int = 64
    load_balance_coeff: float | None = 1e-3
    # Initial routing-bias tilt towards low-numbered experts, so routing is skewed (popular vs rare experts).
    routing_skew: float = 2.0

    def validate(self) -> None:
        if self.top_k > self.num_experts or self.top_k < 1:
            raise ValueError(f"top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")


class Attention(nn.Module):
    def __init__(self, cfg: TinyMoEConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.n_heads

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, h, d // h).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(self.wq(x)), split(self.wk(x)), split(self.wv(x)), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, d))


class GroupedExperts(nn.Module):
    """Experts stored as grouped tensors with the expert index first, as in TorchTitan."""

    def __init__(self, cfg: TinyMoEConfig):
        super().__init__()
        e, f, d = cfg.num_experts, cfg.expert_hidden, cfg.dim
        self.num_experts = e
        self.w1_EFD = nn.Parameter(torch.empty(e, f, d))
        self.w2_EDF = nn.Parameter(torch.empty(e, d, f))
        self.w3_EFD = nn.Parameter(torch.empty(e, f, d))
        # Expert parallelism (parallel.apply_expert_parallel) sets this: the weights are then rank-local DTensor
        # shards and the tokens travel to the rank that owns their expert.
        self.dispatch = None
        # Experts (global indices) FROZEN in a replayed iteration (Trainer.train_step sets it from Replay.frozen):
        # their weight gradients are not computed.
        self.frozen: frozenset[int] = frozenset()

    def forward(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if self.dispatch is not None:
            return self.dispatch(self, x_sorted, counts)
        return expert_mlp(x_sorted, counts, self.w1_EFD, self.w2_EDF, self.w3_EFD, self.frozen)


def expert_mlp(
    x_sorted: torch.Tensor,
    counts: list[int],
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    frozen: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """SwiGLU of each expert e on its `counts[e]` consecutive rows of `x_sorted`. Experts in `frozen` (indices
    into these tensors) run forward and pass input gradients back but compute no weight gradient (MoEvement's
    frozen execution in replay: the slices they would update are overwritten by a later slot). Exact for the
    others: each expert's matmuls are its own, so an active expert's gradient is computed as in training and
    the frozen slices of the grouped gradient are zeros instead of values nobody keeps. When every expert of
    the tensors is frozen they run as in training: the grouped tensor must still get a gradient (FSDP2 reduces
    a group's gradients in one flat layout, which a missing one would change, and with it the summation
    order)."""
    # A per-expert loop (TorchTitan's for-loop path): deterministic on CPU, no grouped-mm kernel needed.
    # unbind, not w[e]: the backward of E selects zero-fills E full-size gradients (unbind's stacks one), the
    # step's largest cost once the experts stop moving; the gradient values are the same.
    w1, w2, w3 = w1.unbind(0), w2.unbind(0), w3.unbind(0)
    skip = frozen if len(frozen.intersection(range(len(counts)))) < len(counts) else frozenset()
    outs, start = [], 0
    for e, n in enumerate(counts):
        xe = x_sorted[start : start + n]
        start += n
        a, b, c = (w1[e], w2[e], w3[e]) if e not in skip else (w1[e].detach(), w2[e].detach(), w3[e].detach())
        h = F.silu(xe @ a.transpose(0, 1)) * (xe @ c.transpose(0, 1))
        outs.append(h @ b.transpose(0, 1))
    return torch.cat(outs, dim=0)


class RoutedExperts(nn.Module):
    def __init__(self, cfg: TinyMoEConfig):
        super().__init__()
        self.inner_experts = GroupedExperts(cfg)


class Router(nn.Module):
    def __init__(self, cfg: TinyMoEConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.gate = nn.Linear(cfg.dim, cfg.num_experts, bias=False)

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None):
        scores = torch.sigmoid(self.gate(x).float())
        choice = scores if expert_bias is None else scores + expert_bias
        _, ids = torch.topk(choice, k=self.top_k, dim=-1)
        top = scores.gather(-1, ids)
        top = top / (top.sum(-1, keepdim=True) + 1e-20)
        return top, ids, scores


class MoE(nn.Module):
    def __init__(self, cfg: TinyMoEConfig):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.router = Router(cfg)
        self.routed_experts = RoutedExperts(cfg)
        self.load_balance_coeff = cfg.load_balance_coeff
        # Buffers, as in TorchTitan: the bias is updated outside autograd, before each optimizer step.
        self.register_buffer("expert_bias_E", torch.zeros(cfg.num_experts) if cfg.load_balance_coeff else None)
        self.register_buffer("tokens_per_expert_E", torch.zeros(cfg.num_experts))
        # Summed gating probability per expert, for the "soft" popularity policy.
        self.register_buffer("router_prob_E", torch.zeros(cfg.num_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        xt = x.reshape(-1, d)
        top, ids, scores = self.router(xt, self.expert_bias_E)
        flat_ids = ids.reshape(-1)
        counts = torch.bincount(flat_ids, minlength=self.num_experts)
        with torch.no_grad():
            self.tokens_per_expert_E.add_(counts.to(self.tokens_per_expert_E.dtype))
            self.router_prob_E.add_(scores.detach().sum(0))
        order = torch.argsort(flat_ids, stable=True)
        token_of = order // ids.shape[1]
        routed = xt[token_of]
        out_sorted = self.routed_experts.inner_experts(routed, counts.tolist())
        weighted = out_sorted * top.reshape(-1)[order].unsqueeze(-1).to(out_sorted.dtype)
        out = torch.zeros_like(xt).index_add_(0, token_of, weighted.to(xt.dtype))
        return out.view(b, s, d)


class Block(nn.Module):
    def __init__(self, cfg: TinyMoEConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=1e-6)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=1e-6)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.moe(self.ffn_norm(x))


class TinyMoE(nn.Module):
    def __init__(self, cfg: TinyMoEConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=1e-6)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))

    def moe_layers(self) -> list[MoE]:
        return [blk.moe for blk in self.layers.values()]

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init from `seed`, independent of world size (done before sharding)."""
        g = torch.Generator().manual_seed(seed)
        for _name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # norm weights
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
        e = self.cfg.num_experts
        for moe in self.moe_layers():
            if moe.expert_bias_E is not None:
                # Skewed routing from the start: low-numbered experts are favoured, high-numbered ones rare.
                moe.expert_bias_E.copy_(torch.linspace(0.1, -0.1, e) * self.cfg.routing_skew)
            moe.tokens_per_expert_E.zero_()
