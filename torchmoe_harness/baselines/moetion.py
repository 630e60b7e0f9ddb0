"""MoEtion selective expert checkpointing (Algorithm 1 of MoEtion): each checkpoint saves all non-expert
state and, within a byte budget, S_total = budget / C_expert experts, allotted to MoE layers in proportion
to their token risk R_i = sum of tokens routed since each expert's last save (floor, then the remainder to
the largest fractional parts, capped at E), and within a layer the top-S_i experts by those tokens."""

from __future__ import annotations

import math

from torchmoe_harness.baselines.partial import PartialExperts


class MoEtion(PartialExperts):
    def __init__(self, trainer, every: int = 1, budget_bytes: float | None = None, budget_fraction: float = 0.3):
        """`budget_bytes` for expert state per checkpoint, or `budget_fraction` of all experts' bytes
        (MoEtion: S typically 25-40% of E)."""
        super().__init__(trainer, every)
        total = self.expert_bytes * len(self.grid)
        self.budget = budget_bytes if budget_bytes is not None else budget_fraction * total
        self.s_total = max(1, min(len(self.grid), int(self.budget // self.expert_bytes)))

    def allocation(self) -> list[int]:
        risk = self.unsaved.sum(dim=1).tolist()
        tot = sum(risk)
        if tot <= 0:
            risk, tot = [1.0] * self.n_layers, float(self.n_layers)
        raw = [r / tot * self.s_total for r in risk]
        s = [min(self.n_experts, math.floor(x)) for x in raw]
        for i in sorted(range(self.n_layers), key=lambda i: (s[i] - raw[i], i)):  # largest remainders first
            if sum(s) >= self.s_total:
                break
            if s[i] < self.n_experts:
                s[i] += 1
        return s

    def select(self) -> list[tuple[int, int]]:
        out = []
        for layer, s in enumerate(self.allocation()):
            top = self.unsaved[layer].argsort(descending=True, stable=True)[:s].tolist()
            out += [(layer, e) for e in sorted(top)]
        return out

    def stats(self) -> dict:
        return dict(super().stats(), s_total=self.s_total, budget_bytes=self.budget)
