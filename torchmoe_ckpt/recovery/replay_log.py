"""Per-iteration record of what exact replay needs: the global gradient norm (frozen operators cannot recompute
it), the batch, RNG states (rng.py), every param group's LR and hyper-parameters, and the loss to check the
replay against. Replay applies the *logged* hyper-parameters, not the schedule's (a changed schedule applies only
to new iterations). On a GPU the host tensors are filled by asynchronous copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.records import IterationRecord
from ..model.optim_state import optimizer_list
from . import rng

# Group entries that are not hyper-parameters of the update (or never change): not logged.
_NOT_HYPER = frozenset(
    {"params", "param_names", "lr", "initial_lr", "foreach", "fused", "capturable", "differentiable"}
)


def group_hyper(param_groups: list[dict]) -> tuple[dict, ...]:
    """Every group's numeric hyper-parameters other than the LR (momentum, betas, eps, ...), in group order."""
    out = []
    for g in param_groups:
        h = {}
        for k, v in g.items():
            if k in _NOT_HYPER:
                continue
            if torch.is_tensor(v) and v.numel() == 1:
                h[k] = v.detach().clone()  # a copy on its device: no host sync on the training thread
            elif isinstance(v, (bool, int, float)):
                h[k] = v
            elif isinstance(v, (tuple, list)) and v and all(isinstance(x, (bool, int, float)) for x in v):
                h[k] = list(v)
        out.append(h)
    return tuple(out)


@dataclass
class Replay:
    """What a trainer must reuse, instead of recompute, when it replays an iteration."""

    tokens: object
    grad_norm: torch.Tensor
    rng_state: torch.Tensor
    lrs: tuple[float, ...] = ()  # the LR of each param group in the original iteration
    device_rng: dict | None = None  # device generators' states (rng.py)
    hyper: tuple[dict, ...] = ()  # each param group's other hyper-parameters in the original iteration
    # Operators FROZEN in this replayed iteration (their full state comes in a later slot): a trainer may skip
    # their weight gradients; whatever their slices receive is overwritten by that slot (sparse_to_dense.py).
    frozen: frozenset[str] = frozenset()

    @staticmethod
    def of(rec: IterationRecord) -> Replay:
        lrs = rec.lrs if rec.lrs is not None else (rec.lr,)
        return Replay(rec.tokens, rec.grad_norm, rec.rng_state, lrs, device_rng=rec.device_rng, hyper=rec.hyper or ())

    def restore_rng(self) -> None:
        """Every generator back to where the original iteration started (call before its forward)."""
        rng.restore(self.rng_state, self.device_rng)

    def apply_lrs(self, optimizer) -> None:
        """Set every param group's LR and hyper-parameters (all optimizers' groups, in order) to the logged ones,
        right before the optimizer step. No LRs logged: the groups keep what the schedule set."""
        groups = [g for o in optimizer_list(optimizer) for g in o.param_groups]
        if not self.lrs:  # none logged (re-executing iterations the schedule still gives): the schedule's LRs
            return
        if len(self.lrs) != len(groups):  # one LR for several groups (Muon's and AdamW's differ): not guessed
            raise ValueError(
                f"the replay record holds {len(self.lrs)} learning rate(s) for {len(groups)} param groups: record "
                "every group's LR, of every optimizer in order (IterationRecord.lrs)"
            )
        for group, lr in zip(groups, self.lrs):
            _set(group, "lr", lr)
        if len(self.hyper) == len(groups):
            for group, hyper in zip(groups, self.hyper):
                for k, v in hyper.items():
                    _set(group, k, v)


def _set(group: dict, key: str, value) -> None:
    cur = group.get(key)
    if torch.is_tensor(cur):
        cur.fill_(value)
    elif isinstance(cur, tuple):
        group[key] = tuple(value)
    else:
        group[key] = value
