"""Per-iteration record of what exact replay needs.

Frozen operators compute no trustworthy weight gradients during replay, so the global gradient norm used
for clipping cannot be recomputed: it is logged. The batch, RNG state and LR are logged too, and the loss
is kept so that every replayed iteration is checked bit-for-bit against the original.

Replay applies the *logged* learning rates (every param group), not the schedule's: a run extended with more
steps or a changed schedule has another schedule now, but the iterations being replayed used the old one."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves


@dataclass
class IterationRecord:
    step: int
    tokens: object  # the batch this rank trained on: a tensor or any pytree of tensors
    grad_norm: torch.Tensor  # global gradient norm before clipping (fp32 scalar)
    lr: float  # learning rate applied in this step
    loss: torch.Tensor  # this rank's loss, to verify the replay
    rng_state: torch.Tensor  # CPU RNG state at the start of the step
    loss_scale: float = 1.0  # no dynamic loss scaling in fp32/bf16 training; kept for fp16 users
    lrs: tuple[float, ...] | None = None  # every param group's LR in this step (None: all groups used `lr`)

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in tree_leaves((self.tokens, self.grad_norm, self.loss, self.rng_state))
            if torch.is_tensor(t)
        )

    def to_dict(self) -> dict:
        return {
            "step": self.step,
            "tokens": self.tokens,
            "grad_norm": self.grad_norm,
            "lr": self.lr,
            "loss": self.loss,
            "rng_state": self.rng_state,
            "loss_scale": self.loss_scale,
            "lrs": None if self.lrs is None else list(self.lrs),
        }

    @staticmethod
    def from_dict(d: dict) -> IterationRecord:
        d = dict(d)
        if d.get("lrs") is not None:
            d["lrs"] = tuple(d["lrs"])
        return IterationRecord(**d)


@dataclass
class Replay:
    """What a trainer must reuse, instead of recompute, when it replays an iteration."""

    tokens: object
    grad_norm: torch.Tensor
    rng_state: torch.Tensor
    lrs: tuple[float, ...] = ()  # the LR of each param group in the original iteration
    # Operators FROZEN in this replayed iteration (their full state comes in a later slot): a trainer may skip
    # their weight gradients; whatever their slices receive is overwritten by that slot (sparse_to_dense.py).
    frozen: frozenset[str] = frozenset()

    @staticmethod
    def of(rec: IterationRecord) -> Replay:
        return Replay(rec.tokens, rec.grad_norm, rec.rng_state, rec.lrs if rec.lrs is not None else (rec.lr,))

    def apply_lrs(self, optimizer: torch.optim.Optimizer) -> None:
        """Set every param group's LR to the logged one (call right before `optimizer.step()`)."""
        lrs = self.lrs if len(self.lrs) == len(optimizer.param_groups) else self.lrs[:1] * len(optimizer.param_groups)
        for group, lr in zip(optimizer.param_groups, lrs):
            if torch.is_tensor(group["lr"]):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr


class ReplayLog:
    """Records of consecutive iterations, owned by one checkpoint window."""

    def __init__(self) -> None:
        self.records: dict[int, IterationRecord] = {}

    def add(self, rec: IterationRecord) -> None:
        self.records[rec.step] = rec

    def get(self, step: int) -> IterationRecord:
        try:
            return self.records[step]
        except KeyError:
            raise KeyError(f"no replay record for iteration {step}; logged: {sorted(self.records)}") from None

    def has(self, steps: range) -> bool:
        return all(s in self.records for s in steps)

    def nbytes(self) -> int:
        return sum(r.nbytes() for r in self.records.values())

    def __len__(self) -> int:
        return len(self.records)
