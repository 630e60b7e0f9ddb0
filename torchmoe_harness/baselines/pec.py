"""PEC / MoC-System (Partial Experts Checkpoint): every checkpoint saves all non-expert state and K experts
per MoE layer, chosen
  sequential  round-robin, interleaved across layers: layer l saves experts (c*K + l*K + k) mod E
  load-aware  the K experts of each layer with the most tokens since their last save (Algorithm 1 of PEC)
Dynamic-K: after each recovery, while the aggregated PLT (tokens lost / expert tokens processed so far)
exceeds `plt_limit`, K doubles, up to all experts (MoC then degenerates to dense checkpointing)."""

from __future__ import annotations

from torchmoe_harness.baselines.partial import PartialExperts


class Pec(PartialExperts):
    def __init__(
        self,
        trainer,
        k: int = 1,
        every: int = 1,
        selection: str = "sequential",
        dynamic_k: bool = True,
        plt_limit: float = 0.05,
    ):
        super().__init__(trainer, every)
        if selection not in ("sequential", "load-aware"):
            raise ValueError(f"selection must be sequential or load-aware, got {selection!r}")
        self.k, self.selection, self.dynamic_k, self.plt_limit = min(k, self.n_experts), selection, dynamic_k, plt_limit
        self.k_history = [self.k]

    def select(self) -> list[tuple[int, int]]:
        e, k, c = self.n_experts, self.k, self.checkpoints
        out = []
        for layer in range(self.n_layers):
            if self.selection == "sequential":
                picks = sorted({(c * k + layer * k + j) % e for j in range(k)})
            else:
                picks = sorted(self.unsaved[layer].argsort(descending=True, stable=True)[:k].tolist())
            out += [(layer, x) for x in picks]
        return out

    def on_recovered(self) -> None:
        if not self.dynamic_k:
            return
        while (
            self.tokens_processed
            and self.tokens_lost / self.tokens_processed > self.plt_limit
            and self.k < self.n_experts
        ):
            self.k = min(2 * self.k, self.n_experts)
            self.k_history.append(self.k)

    def stats(self) -> dict:
        return dict(super().stats(), k=self.k, k_history=self.k_history, selection=self.selection)
