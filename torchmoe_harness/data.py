"""A seeded, deterministic token stream. Batch (step, dp_rank) is a pure function of the seed, so a
replayed iteration sees exactly the tokens it saw the first time, at any restart."""

from __future__ import annotations

import torch


class TokenStream:
    def __init__(self, vocab_size: int, seq_len: int, batch_size: int, seed: int = 0, zipf_a: float = 1.2):
        self.vocab_size, self.seq_len, self.batch_size, self.seed = vocab_size, seq_len, batch_size, seed
        g = torch.Generator().manual_seed(seed * 7919 + 17)
        # A fixed "grammar": each token has a likely successor, so the model can learn something.
        self.successor = torch.randperm(vocab_size, generator=g)
        ranks = torch.arange(1, vocab_size + 1, dtype=torch.float64)
        self.zipf = (ranks**-zipf_a) / (ranks**-zipf_a).sum()  # skewed token frequencies -> skewed routing

    def batch(self, step: int, dp_rank: int) -> torch.Tensor:
        """Tokens [batch_size, seq_len + 1] for iteration `step` on data-parallel rank `dp_rank`."""
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 4099 + dp_rank)
        b, s = self.batch_size, self.seq_len + 1
        fresh = torch.multinomial(self.zipf, b * s, replacement=True, generator=g).view(b, s)
        follow = torch.rand(b, s, generator=g) < 0.7
        out = fresh.clone()
        for t in range(1, s):
            out[:, t] = torch.where(follow[:, t], self.successor[out[:, t - 1]], fresh[:, t])
        return out
