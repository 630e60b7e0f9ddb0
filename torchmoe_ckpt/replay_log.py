"""Per-iteration record of what exact replay needs.

Frozen operators compute no trustworthy weight gradients during replay, so the global gradient norm used
for clipping cannot be recomputed: it is logged. The batch, RNG state and LR are logged too, and the loss
is kept so that every replayed iteration is checked bit-for-bit against the original."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class IterationRecord:
    step: int
    tokens: torch.Tensor       # the batch (token ids) this rank trained on
    grad_norm: torch.Tensor    # global gradient norm before clipping (fp32 scalar)
    lr: float                  # learning rate applied in this step
    loss: torch.Tensor         # this rank's loss, to verify the replay
    rng_state: torch.Tensor    # CPU RNG state at the start of the step
    loss_scale: float = 1.0    # no dynamic loss scaling in fp32/bf16 training; kept for fp16 users

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tokens, self.grad_norm, self.loss, self.rng_state))

    def to_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens, "grad_norm": self.grad_norm, "lr": self.lr,
                "loss": self.loss, "rng_state": self.rng_state, "loss_scale": self.loss_scale}

    @staticmethod
    def from_dict(d: dict) -> "IterationRecord":
        return IterationRecord(**d)


@dataclass
class Replay:
    """What a trainer must reuse, instead of recompute, when it replays an iteration."""
    tokens: torch.Tensor
    grad_norm: torch.Tensor
    rng_state: torch.Tensor

    @staticmethod
    def of(rec: IterationRecord) -> "Replay":
        return Replay(rec.tokens, rec.grad_norm, rec.rng_state)


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
