"""Operator granularity follows the optimizer: how finely a grouped expert tensor may be cut into operators.

An MoE layer whose experts are one `[E, ...]` tensor per weight (TorchTitan, transformers 5.x) is cut along dim 0,
one operator per expert, when its optimizer updates the experts' rows independently (AdamW, SGD; Muon and
DistMuon on a batch of matrices). When the update couples elements across that cut -- Adafactor's step size is the
RMS of the whole tensor, Muon orthogonalises a 2-D `[E, F]` tensor as one matrix -- a frozen expert's placeholder
state would enter the active experts' update in replay. Then the layer's experts become ONE operator: every
grouped tensor of that MoE block (w1, w2, w3 and the expert biases, which share the cut) whole. The router, the
dense blocks and the other layers keep their own operators, so the window stays sparse across layers.
"""

from __future__ import annotations

from torch import nn

from .moe_structure import MoEBlock
from .update_rules import cut_couples, optimizer_list, rule_of

__all__ = ["coupled_experts"]


def coupled_experts(model: nn.Module, moes: list[MoEBlock], optimizer) -> dict[str, str]:
    """MoE block path -> why its experts must be one operator (the optimizer, what couples, the tensor), for each
    block with a grouped tensor whose optimizer couples elements across the expert cut (dim 0). Empty without an
    optimizer (one operator per expert)."""
    if optimizer is None:
        return {}
    owner = {id(p): o for o in optimizer_list(optimizer) for g in o.param_groups for p in g["params"]}
    params = dict(model.named_parameters())
    out: dict[str, str] = {}
    for moe in moes:
        for fqn in moe.grouped:  # list experts (per-expert modules) are never cut
            p = params.get(fqn)
            opt = owner.get(id(p)) if p is not None and p.requires_grad else None
            if opt is None or p is None:
                continue  # a buffer, a frozen parameter (held by value) or one check_optimizers refuses later
            rule = rule_of(opt)
            if cut_couples(rule, p.dim(), (0,)):
                out[moe.path] = f"{type(opt).__name__} {rule.why} ({fqn} {tuple(p.shape)})"
                break
    return out
