"""Which optimizer couples what: each optimizer class's `UpdateRule` (how its update couples the elements of a
parameter, and the state its lazy init creates). Operator discovery reads the coupling to choose how finely a
grouped expert tensor may be cut (model/granularity.py); optim_state.py reads it to check and build the slots.

Couplings: "element" (Adam, AdamW, SGD: any cut replays exactly), "matrix" (Muon, DistMuon: each matrix of the
last two dims as a whole, so a cut along a batch dim is fine), "tensor" (Adafactor: the whole parameter, e.g. its
RMS), "global" (the update mixes different parameters: only replayable when they all lie in one operator).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.optim.optimizer import _get_scalar_dtype

from ..core.errors import UncapturedStateError

__all__ = ["COUPLINGS", "UpdateRule", "register_update_rule", "rule_of", "optimizer_list", "cut_couples"]

COUPLINGS = ("element", "matrix", "tensor", "global")


@dataclass(frozen=True)
class UpdateRule:
    """How an optimizer's update couples elements, and the state its lazy init creates for a parameter."""

    coupling: str  # one of COUPLINGS
    init: Callable[[dict, torch.Tensor, torch.dtype | None], dict[str, torch.Tensor]]  # (group, param, dtype)
    why: str = ""  # what couples, in words: shown where operators are merged and in refusals
    check: Callable[[dict], str | None] | None = None  # a group setting replay cannot reproduce -> why


_RULES: dict[type, UpdateRule] = {}


def register_update_rule(cls: type, rule: UpdateRule) -> None:
    """Declare the update rule of an optimizer class (TorchTitan's DistMuon is registered by its glue)."""
    if rule.coupling not in COUPLINGS:
        raise ValueError(f"coupling {rule.coupling!r}: use one of {', '.join(map(repr, COUPLINGS))}")
    _RULES[cls] = rule


def cut_couples(rule: UpdateRule, ndim: int, dims) -> bool:
    """True when `rule`'s update couples elements across a cut of an `ndim`-dim parameter along `dims`: replay
    would then mix a frozen part's placeholder values into the active part's update."""
    if rule.coupling == "element":
        return False
    if rule.coupling == "matrix":
        return any(d >= ndim - 2 for d in dims)  # inside a matrix (the last two dims), not along a batch dim
    return True


def _zeros(p: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return torch.zeros_like(p, memory_format=torch.preserve_format, dtype=dtype)


def _adam_init(group: dict, p: torch.Tensor, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    # torch.optim.Adam/AdamW._init_group, value for value (the step lives on the device when fused/capturable).
    fused = group.get("fused")
    st = {
        "step": torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused), device=p.device)
        if group.get("capturable") or fused
        else torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu"),
        "exp_avg": _zeros(p, dtype),
        "exp_avg_sq": _zeros(p, dtype),
    }
    if group.get("amsgrad"):
        st["max_exp_avg_sq"] = _zeros(p, dtype)
    return st


def _sgd_init(group: dict, p: torch.Tensor, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    # SGD starts its buffer as a copy of the first gradient; with dampening 0, zeros give the same value.
    return {"momentum_buffer": _zeros(p, dtype)} if group["momentum"] != 0 else {}


def _sgd_check(group: dict) -> str | None:
    if group["momentum"] != 0 and group["dampening"] != 0:
        return (
            f"SGD(dampening={group['dampening']}) starts its momentum from a parameter's first gradient, not from "
            "zeros, so a parameter without a gradient yet has no state a slot can hold: use dampening=0"
        )
    return None


def _adafactor_init(group: dict, p: torch.Tensor, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    # torch.optim.Adafactor._init_group: factored second moment over the last two dims, a vector's in full.
    st = {"step": torch.tensor(0.0, dtype=_get_scalar_dtype())}
    if p.dim() > 1:
        st["row_var"] = p.new_zeros((*p.shape[:-1], 1), dtype=dtype or p.dtype)
        st["col_var"] = p.new_zeros((*p.shape[:-2], 1, p.shape[-1]), dtype=dtype or p.dtype)
    else:
        st["variance"] = _zeros(p, dtype)
    return st


for _cls in (torch.optim.Adam, torch.optim.AdamW):
    register_update_rule(_cls, UpdateRule("element", _adam_init))
register_update_rule(torch.optim.SGD, UpdateRule("element", _sgd_init, check=_sgd_check))
# torch.optim.Muon takes 2-D parameters only (it refuses a 3-D one at construction): a grouped [E, F, D] expert
# tensor never reaches it, a 2-D [E, F] one (gpt-oss's expert biases) is one matrix over every expert.
register_update_rule(
    torch.optim.Muon,
    UpdateRule(
        "matrix",
        lambda g, p, dt: {"momentum_buffer": _zeros(p, dt)},
        "orthogonalises each 2-D parameter as a whole (Newton-Schulz)",
    ),
)
# torch.optim.Adafactor's step size is max(eps2, RMS(parameter)) x rho and its update is divided by max(1, RMS of
# the update / d): both over the whole parameter.
register_update_rule(
    torch.optim.Adafactor,
    UpdateRule("tensor", _adafactor_init, "scales each update by the RMS of the whole parameter and of the update"),
)


def known_optimizers() -> str:
    return ", ".join(sorted(c.__name__ for c in _RULES))


def rule_of(opt: torch.optim.Optimizer) -> UpdateRule:
    """The update rule of `opt`'s class (or of the stock class it derives from without replacing `step`)."""
    if isinstance(opt, torch.optim.LBFGS):
        raise UncapturedStateError(
            "optimizer LBFGS keeps one state for all its parameters and steps through a closure that re-runs the "
            f"model, so neither per-operator slots nor replay can hold it: use one of {known_optimizers()}"
        )
    cls = next((c for c in type(opt).__mro__ if c in _RULES), None)
    if cls is not None and inspect.unwrap(type(opt).step) is inspect.unwrap(cls.step):  # not a new update rule
        return _RULES[cls]
    raise UncapturedStateError(
        f"optimizer {type(opt).__name__} has an update rule the checkpointer does not know, so it cannot tell "
        f"whether replay with frozen operators is exact (an update that couples elements across operators, or state "
        f"shared by parameters, would come back wrong): use one of {known_optimizers()}, or declare it with "
        "register_update_rule"
    )


def optimizer_list(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind `optimizer`: one, a list/tuple, or a container with `.optimizers`."""
    if isinstance(optimizer, (list, tuple)):
        return [o for x in optimizer for o in optimizer_list(x)]
    inner = getattr(optimizer, "optimizers", None)
    return list(inner) if inner is not None else [optimizer]
