"""The optimizer setups the harness, the tests and the bench run: one name -> optimizers + LR schedulers.

adamw         AdamW on everything (the default; fp32 states)
amsgrad       AdamW(amsgrad=True): a third moment, max_exp_avg_sq
adamw-bf16    AdamW whose states are bf16 (made before the first step, as TorchTitan's
              "fused_opt_states_bf16" does; on CPU torch's AdamW needs bf16 parameters for that, so there the
              whole model is bf16: `needs_bf16_params`)
sgd           SGD(momentum=0.9, nesterov=True): one momentum buffer
muon-adamw    torch.optim.Muon on the 2-D hidden matrices (attention, routers, 2-D grouped expert tensors such as
              gpt-oss's expert biases [E, F], whose layer's experts then become one operator),
              AdamW on the rest (embeddings, output head, norms, grouped 3-D expert tensors): the recipe of
              recent large MoE runs (Moonlight, Kimi K2)
adafactor-adamw  torch.optim.Adafactor (factored second moment) on everything but the grouped expert tensors,
              AdamW on those (so every expert stays its own operator)
adafactor     torch.optim.Adafactor on everything, the grouped expert tensors too: its step size is the RMS of a
              whole tensor, so each MoE layer's experts become one operator (torchmoe_ckpt/model/granularity.py)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

KINDS = ("adamw", "amsgrad", "adamw-bf16", "sgd", "muon-adamw", "adafactor-adamw", "adafactor")


def needs_bf16_params(kind: str) -> bool:
    """On CPU, torch's AdamW keeps bf16 moments only for bf16 parameters (its CPU kernels take one dtype)."""
    return kind == "adamw-bf16"


def _grouped(name: str, p: torch.Tensor) -> bool:
    return p.dim() >= 3  # grouped [E, ...] expert tensors


def _head(name: str) -> bool:
    return any(k in name for k in ("embed", "lm_head", "tok_embeddings", "output", "head"))


def build_optimizers(
    kind: str, model: nn.Module, lr: float, weight_decay: float = 0.1, lr_factor: Callable[[int], float] | None = None
) -> tuple[list[torch.optim.Optimizer], list]:
    """(optimizers, one LambdaLR per optimizer) for `kind` over `model`'s trainable parameters."""
    if kind not in KINDS:
        raise ValueError(f"optimizer {kind!r}: use one of {', '.join(KINDS)}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    if kind in ("adamw", "amsgrad", "adamw-bf16"):
        opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, amsgrad=kind == "amsgrad")
        if kind == "adamw-bf16":
            for p in params:  # created before the first step, in bf16 (what TorchTitan's bf16-state hook makes)
                opt.state[p].update(
                    step=torch.tensor(0.0),
                    exp_avg=torch.zeros_like(p, dtype=torch.bfloat16),
                    exp_avg_sq=torch.zeros_like(p, dtype=torch.bfloat16),
                )
        opts = [opt]
    elif kind == "sgd":
        opts = [torch.optim.SGD(params, lr=lr * 10, momentum=0.9, nesterov=True, weight_decay=weight_decay)]
    elif kind == "muon-adamw":
        mats = [p for n, p in named if p.dim() == 2 and not _head(n)]
        rest = [p for n, p in named if not (p.dim() == 2 and not _head(n))]
        opts = [
            torch.optim.Muon(mats, lr=lr * 5, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(rest, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay),
        ]
    elif kind == "adafactor":
        opts = [torch.optim.Adafactor(params, lr=lr * 3, weight_decay=weight_decay)]
    else:
        fact = [p for n, p in named if not _grouped(n, p)]
        grouped = [p for n, p in named if _grouped(n, p)]
        opts = [torch.optim.Adafactor(fact, lr=lr * 3, weight_decay=weight_decay)]
        if grouped:
            opts.append(torch.optim.AdamW(grouped, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay))
    factor = lr_factor or (lambda s: 1.0)
    return opts, [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in opts]
