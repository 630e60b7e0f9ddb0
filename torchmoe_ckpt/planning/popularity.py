"""Expert popularity from routed-token counts, and the rule that decides when to re-sort the operators.

Rarely used experts are checkpointed first, so popular ones stay frozen longer in recovery. Policies (paper App.
B): hard (cumulative counts), soft (cumulative gating probabilities), decayed (EMA of counts), capacity (counts /
expert capacity). Scores are float64 on the CPU so every rank sorts identical numbers.
"""

from __future__ import annotations

import math

import torch

POLICIES = ("hard", "soft", "decayed", "capacity")

# Relative slack against a threshold: a float64 "10.000000000000009%" change is exactly 10%, not over it.
_EPS = 1e-9


def _host64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.float64)


class PopularityTracker:
    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        policy: str = "hard",
        decay: float = 0.9,
        capacity: torch.Tensor | None = None,
    ):
        if policy not in POLICIES:
            raise ValueError(f"unknown popularity policy {policy!r}; use one of {', '.join(POLICIES)}")
        if num_layers < 1 or num_experts < 1:
            raise ValueError(
                f"popularity needs at least one layer and one expert, got shape ({num_layers}, {num_experts})"
            )
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        if policy == "capacity":
            if capacity is None:
                raise ValueError(
                    "popularity policy 'capacity' needs the experts' capacity ([layers, experts] tokens per batch)"
                )
            if tuple(capacity.shape) != (num_layers, num_experts) or bool((capacity <= 0).any()):
                raise ValueError(
                    f"capacity must be positive with shape {(num_layers, num_experts)}, "
                    f"got shape {tuple(capacity.shape)}"
                )
        self.shape = (num_layers, num_experts)
        self.policy, self.decay = policy, decay
        self.capacity = None if capacity is None else _host64(capacity)
        self.score = torch.zeros(self.shape, dtype=torch.float64)

    def update(self, counts: torch.Tensor, probs: torch.Tensor | None = None) -> None:
        """One iteration's routed-token counts [L, E] (summed over ranks); `probs`: for the soft policy."""
        if tuple(counts.shape) != self.shape:
            raise ValueError(f"counts must have shape {self.shape}, got shape {tuple(counts.shape)}")
        counts = _host64(counts)
        if self.policy == "hard":
            self.score += counts
        elif self.policy == "soft":
            if probs is None or tuple(probs.shape) != self.shape:
                got = None if probs is None else tuple(probs.shape)
                raise ValueError(f"policy 'soft' needs summed gating probabilities of shape {self.shape}, got {got}")
            self.score += _host64(probs)
        elif self.policy == "decayed":
            self.score.mul_(self.decay).add_((1.0 - self.decay) * counts)
        else:
            self.score += counts / self.capacity  # pyright: ignore[reportOperatorIssue]  ("capacity" requires it)

    def scores(self) -> torch.Tensor:
        return self.score.clone()

    def frequencies(self) -> torch.Tensor:
        """Per-layer share of the score (each row sums to 1; uniform for a layer nothing was routed to)."""
        total = self.score.sum(dim=1, keepdim=True)
        uniform = torch.full_like(self.score, 1.0 / self.shape[1])
        return torch.where(total > 0, self.score / torch.where(total > 0, total, torch.ones_like(total)), uniform)

    def state_dict(self) -> dict:
        return {"policy": self.policy, "decay": self.decay, "score": self.score.clone()}

    def load_state_dict(self, sd: dict) -> None:
        if sd["policy"] != self.policy or tuple(sd["score"].shape) != self.shape:
            raise ValueError(
                f"popularity state is for policy {sd['policy']!r} shape {tuple(sd['score'].shape)}, "
                f"this tracker is {self.policy!r} shape {self.shape}"
            )
        self.decay = float(sd["decay"])
        self.score = _host64(sd["score"]).clone()


def reorder_needed(
    old_freq: torch.Tensor | None, new_freq: torch.Tensor, change: float = 0.10, fraction: float = 0.25
) -> bool:
    """True iff the relative frequency change |new - old| / old exceeds `change` (strictly) for at least
    `fraction` of all experts (all layers together). A zero old frequency counts as an infinite change if the
    new one is not zero, 0 -> 0 as none. `old_freq=None` (no order yet) always needs an order."""
    if change < 0 or not 0.0 <= fraction <= 1.0:
        raise ValueError(
            f"reorder thresholds need change >= 0 and fraction in [0, 1], got change={change}, fraction={fraction}"
        )
    if old_freq is None:
        return True
    if tuple(old_freq.shape) != tuple(new_freq.shape):
        raise ValueError(f"frequency shapes differ: old {tuple(old_freq.shape)}, new {tuple(new_freq.shape)}")
    old, new = _host64(old_freq), _host64(new_freq)
    diff = (new - old).abs()
    # Divide by the true old frequency (however tiny, even subnormal); only exact zeros are special.
    rel = torch.where(
        old > 0,
        diff / torch.where(old > 0, old, torch.ones_like(old)),
        torch.where(diff > 0, torch.full_like(new, math.inf), torch.zeros_like(new)),
    )
    changed = int((rel > change * (1 + _EPS)).sum())
    # "At least `fraction`" as a whole number of experts; the slack keeps 0.3 * 10 = 3.0000000000000004 at 3.
    need = math.ceil(fraction * rel.numel() * (1 - _EPS))
    return changed >= need


def order_experts(scores: torch.Tensor) -> list[tuple[int, int]]:
    """(layer, expert) in ascending popularity; ties by (layer, expert), so every rank gets the same order."""
    if scores.dim() != 2:
        raise ValueError(f"scores must have shape [layers, experts], got shape {tuple(scores.shape)}")
    n_layers, n_experts = scores.shape
    vals = _host64(scores).tolist()
    return sorted(
        ((layer, e) for layer in range(n_layers) for e in range(n_experts)), key=lambda le: (vals[le[0]][le[1]], le)
    )
