"""Expert popularity from routed-token counts, and the rule that decides when to re-sort the operators.

MoEvement checkpoints rarely used experts first (ascending popularity): popular experts then stay FROZEN
longer during recovery, where they cost only forward and input-gradient work. Policies (paper App. B):
  hard      cumulative routed-token counts
  soft      cumulative gating probabilities
  decayed   EMA of per-iteration counts: A(t) = decay * A(t-1) + (1 - decay) * counts
  capacity  cumulative counts / expert capacity (heterogeneous experts)
"""
from __future__ import annotations

import torch

POLICIES = ("hard", "soft", "decayed", "capacity")


class PopularityTracker:
    def __init__(self, num_layers: int, num_experts: int, policy: str = "hard", decay: float = 0.9,
                 capacity: torch.Tensor | None = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown popularity policy {policy!r}; use one of {', '.join(POLICIES)}")
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        if policy == "capacity":
            if capacity is None:
                raise ValueError("popularity policy 'capacity' needs the experts' capacity ([layers, experts])")
            if tuple(capacity.shape) != (num_layers, num_experts) or bool((capacity <= 0).any()):
                raise ValueError(f"capacity must be positive with shape {(num_layers, num_experts)}, "
                                 f"got {tuple(capacity.shape)}")
        self.shape = (num_layers, num_experts)
        self.policy, self.decay = policy, decay
        self.capacity = None if capacity is None else capacity.to(torch.float64)
        self.score = torch.zeros(self.shape, dtype=torch.float64)

    def update(self, counts: torch.Tensor, probs: torch.Tensor | None = None) -> None:
        """One iteration's routed-token counts [L, E] (already summed over ranks), and summed gating
        probabilities [L, E] for the soft policy."""
        if tuple(counts.shape) != self.shape:
            raise ValueError(f"counts must have shape {self.shape}, got {tuple(counts.shape)}")
        counts = counts.to(torch.float64)
        if self.policy == "hard":
            self.score += counts
        elif self.policy == "soft":
            if probs is None or tuple(probs.shape) != self.shape:
                raise ValueError(f"policy 'soft' needs gating probabilities of shape {self.shape}")
            self.score += probs.to(torch.float64)
        elif self.policy == "decayed":
            self.score.mul_(self.decay).add_((1.0 - self.decay) * counts)
        else:
            self.score += counts / self.capacity

    def scores(self) -> torch.Tensor:
        return self.score.clone()

    def frequencies(self) -> torch.Tensor:
        """Per-layer share of the score (each row sums to 1; uniform while nothing was routed)."""
        total = self.score.sum(dim=1, keepdim=True)
        uniform = torch.full_like(self.score, 1.0 / self.shape[1])
        return torch.where(total > 0, self.score / total.clamp(min=1e-300), uniform)

    def state_dict(self) -> dict:
        return {"policy": self.policy, "decay": self.decay, "score": self.score.clone()}

    def load_state_dict(self, sd: dict) -> None:
        if sd["policy"] != self.policy or tuple(sd["score"].shape) != self.shape:
            raise ValueError(f"popularity state is for policy {sd['policy']!r} shape {tuple(sd['score'].shape)}, "
                             f"this tracker is {self.policy!r} {self.shape}")
        self.decay = sd["decay"]
        self.score = sd["score"].clone().to(torch.float64)


def reorder_needed(old_freq: torch.Tensor | None, new_freq: torch.Tensor, change: float = 0.10,
                   fraction: float = 0.25) -> bool:
    """True iff the relative frequency change |new - old| / old exceeds `change` (strictly) for at least
    `fraction` of all experts. A zero old frequency counts as an infinite change if the new one is not zero."""
    if old_freq is None:
        return True
    old, new = old_freq.to(torch.float64), new_freq.to(torch.float64)
    diff = (new - old).abs()
    rel = torch.where(old > 0, diff / old.clamp(min=1e-300),
                      torch.where(new > 0, torch.full_like(new, float("inf")), torch.zeros_like(new)))
    # A change equal to the threshold up to float rounding (0.275 vs 0.25 is 10.000000000000009%) is not "over".
    changed = int((rel > change * (1 + 1e-9)).sum())
    return changed >= fraction * rel.numel()


def order_experts(scores: torch.Tensor) -> list[tuple[int, int]]:
    """(layer, expert) in ascending popularity; ties by (layer, expert), so every rank gets the same order."""
    n_layers, n_experts = scores.shape
    vals = scores.tolist()
    return sorted(((l, e) for l in range(n_layers) for e in range(n_experts)), key=lambda le: (vals[le[0]][le[1]], le))
