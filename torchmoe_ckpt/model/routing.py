"""Routed-token counts gathered by the library: forward hooks on each MoE layer's router.

Counts come from the expert indices the router returns (an integer tensor), else from top-k of its `[..., E]`
output (k given, read from the module or model config, else 1 with a warning). Probabilities: the output
normalised when non-negative, else its softmax; columns past E are dropped. Eval-mode forwards and
activation-checkpoint recomputation are skipped. `take()` returns this rank's counts; the caller all-reduces.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..core.operator import Operator
from .operators import moe_order

__all__ = ["RouterCounter", "TOP_K_KEYS"]

log = logging.getLogger(__name__)

# Where families keep the number of experts per token (module attributes and config fields).
TOP_K_KEYS = (
    "num_experts_per_tok",
    "top_k",
    "moe_topk",
    "moe_k",
    "num_experts_per_token",
    "top_k_experts",
    "moe_top_k",
    "topk",
    "k",
)


def _k_of(objs, keys=TOP_K_KEYS) -> int | None:
    """The first positive int among `keys` of `objs` (modules, or a model's configs without "topk"/"k")."""
    for c in objs:
        for key in keys:
            v = getattr(c, key, None) if c is not None else None
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


@dataclass
class _Layer:
    row: int
    experts: int
    k: int | None
    warned: bool = False


class RouterCounter:
    """Per-MoE-layer routed-token counts and summed probabilities, [L, E] in `expert_grid` layer order, counted by
    forward hooks on the routers (training forwards only; no host sync). The popularity order is built from them.

    Args:
        model: the model; a hook goes on each MoE layer's router module.
        ops: its operators (`discover_operators`): which MoE layers and routers exist, and their order.
        top_k: experts per token, for routers whose output carries scores but no expert indices: one for every
            layer, or one per MoE layer. None: read from the router, its MoE or the model's config (else top-1,
            warned once).

    Raises:
        ValueError: `top_k` is a sequence whose length is not the number of MoE layers.
    """

    def __init__(self, model: nn.Module, ops: list[Operator], top_k: int | Sequence[int] | None = None):
        order = moe_order(ops)
        # Experts per MoE layer, not operators: a merged operator holds all of its layer's.
        experts = {m: sum(len(o.experts) for o in ops if o.kind == "expert" and o.moe == m) for m in order}
        routers = {o.moe: o for o in ops if o.kind == "router"}
        self.counts = torch.zeros(len(order), max(experts.values(), default=0), dtype=torch.float64)
        self.probs = torch.zeros_like(self.counts)
        self.unhooked: list[str] = []
        self._hooks = []
        modules = dict(model.named_modules())
        given = [top_k] * len(order) if top_k is None or isinstance(top_k, int) else list(top_k)
        if len(given) != len(order):
            raise ValueError(f"top_k has {len(given)} entries for {len(order)} MoE layers")
        cfg = getattr(model, "config", None)
        cfg_k = _k_of((cfg, getattr(cfg, "text_config", None), getattr(cfg, "ffn_config", None)), TOP_K_KEYS[:-2])
        for row, moe in enumerate(order):
            router = routers.get(moe)
            if router is None or not router.modules:
                self.unhooked.append(moe)  # a router with no module of its own: nothing to hook, counts stay 0
                continue
            module = modules[router.modules[0]]
            k = given[row] or _k_of((module, modules.get(moe, module))) or cfg_k
            self._hooks.append(module.register_forward_hook(self._hook(_Layer(row, experts[moe], k))))
        if self.unhooked:
            log.warning(
                f"routed-token counts unavailable (no router module) for MoE layers {self.unhooked}: their experts "
                "are ordered as equally popular"
            )

    def _hook(self, layer: _Layer):
        def hook(module: nn.Module, args, output) -> None:
            task = getattr(torch._C, "_current_graph_task_id", None)  # set while autograd runs a backward pass
            if not module.training or (task is not None and task() != -1):
                return  # evaluation, or activation checkpointing recomputing the forward in backward
            with torch.no_grad():
                self._count(layer, [t.to_local() if isinstance(t, DTensor) else t for t in _tensors(output)])

        return hook

    def _count(self, layer: _Layer, outs: list[torch.Tensor]) -> None:
        e = layer.experts
        scores = [t for t in outs if t.is_floating_point() and t.dim() >= 2 and t.shape[-1] >= e]
        scores.sort(key=lambda t: t.shape[-1] != e)  # exactly E columns first, then E + extra experts
        width = scores[0].shape[-1] if scores else e

        def chosen(t: torch.Tensor) -> bool:  # selected experts, [..., k] (a 1-D int output is not a choice)
            return not t.is_floating_point() and t.dtype != torch.bool and t.dim() >= 2 and 1 <= t.shape[-1] <= width

        ids = next(filter(chosen, outs), None)
        score = scores[0].reshape(-1, scores[0].shape[-1]).float() if scores else None
        if ids is None:
            if score is None:
                return
            if layer.k is None and not layer.warned:
                layer.warned = True
                log.warning(
                    f"router of MoE layer {layer.row} returns no expert indices and no top-k is known: "
                    "counting its top-1 expert (pass RouterCounter(top_k=...))"
                )
            ids = score.topk(min(layer.k or 1, score.shape[-1]), dim=-1).indices
        # Ids outside [0, E) (dropped tokens, zero experts) go to a spare bin; scatter_add: no host sync.
        ids = ids.reshape(-1).long()
        ids = torch.where((ids >= 0) & (ids < e), ids, e)
        counts = torch.zeros(e + 1, dtype=torch.float64, device=ids.device).scatter_add_(
            0, ids, torch.ones_like(ids, dtype=torch.float64)
        )[:e]
        if self.counts.device != counts.device:  # accumulate where the router runs: no host sync per layer
            self.counts, self.probs = self.counts.to(counts.device), self.probs.to(counts.device)
        self.counts[layer.row, :e] += counts
        if score is not None:  # chosen on the device (no host sync): scores as they are, or logits' softmax
            total = score.sum(-1, keepdim=True)
            is_prob = (score >= 0).all() & (total > 0).all()
            p = torch.where(is_prob, score / total.clamp_min(1e-30), score.softmax(-1))
            self.probs[layer.row, :e] += p[:, :e].sum(0).to(self.probs)

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(counts, probs) since the last take, [MoE layers, experts] float64 on this rank; then reset."""
        counts, probs = self.counts.clone(), self.probs.clone()
        self.counts.zero_()
        self.probs.zero_()
        return counts, probs

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
