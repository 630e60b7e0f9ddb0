"""The tiny hand-written MoE and the own-loop run the in-process tests share: experts in an nn.ModuleList, a linear
router, buffers no name rule knows (one changes the loss), trained through `tmc.Checkpointer` (`train`), and the
exact comparison of two runs' model, optimizer and scheduler state (`assert_same`). Used by
tests/model/test_capture.py, tests/capture/test_host_memory.py, tests/capture/test_copy_path_switches.py,
tests/recovery/test_replay_check.py and tests/recovery/test_gpu_paths.py (tests/ is on sys.path under pytest)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import torchmoe_ckpt as tmc

VOCAB, DIM, HID, EXPERTS, TOP_K = 32, 16, 24, 4, 2


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, HID), nn.Linear(HID, DIM)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class ListMoE(nn.Module):
    """A hand-written MoE: one nn.Linear MLP per expert in an nn.ModuleList, a linear router."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        w, idx = probs.topk(TOP_K, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            hit = idx == e
            rows = hit.any(-1)
            if rows.any():
                out[rows] += (w * hit).sum(-1, keepdim=True)[rows] * expert(x[rows])
        return out


class Net(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(DIM), "moe": ListMoE()}) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)
        # Buffers no name rule knows: one changes the loss, one does not (it would come back silently wrong).
        self.register_buffer("temperature", torch.ones(()))
        self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.int64))

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = x + b["moe"](b["norm"](x))
        logits = self.head(x) / self.temperature.clone()  # updated in place below
        with torch.no_grad():
            self.temperature.mul_(1.01)
            self.tokens_seen.add_(tokens.numel())
        return logits


def batch_for(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(step))


def forward_backward(model: nn.Module):
    """The own loop's step function for `model`: next-token cross entropy, then its backward pass."""

    def fb(tokens: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss

    return fb


def train(steps: int, init_seed: int = 0, tiers=None, lam=None, stop_after: int | None = None, chunk=None, **sparse):
    """Train to `steps` (optionally stopping early, as if killed after `stop_after`); returns (model, opt,
    sched, losses, ckpt). `init_seed`: other initial weights for a restarted attempt; the run's seed (part of
    its identity) is 0 either way. `sparse`: more SparseConfig fields; `ckpt.final_stats`: stats() before close."""
    model = Net(init_seed)
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam or (lambda s: min(1.0, (s + 1) / 3)))

    window = tmc.SparseConfig(**{"window": 3, "copy_chunk_bytes": chunk, **sparse})
    cfg = tmc.CheckpointConfig(tiers=tiers, window=window, max_grad_norm=0.5, router_top_k=TOP_K)
    losses = {}
    ckpt = tmc.Checkpointer(model, opt, forward_backward(model), sched, cfg)
    for step in range(ckpt.resume() + 1, steps + 1):
        losses[step] = ckpt.step(batch_for(step))
        if step == stop_after:
            break
    ckpt.final_stats = ckpt.stats()  # pyright: ignore[reportAttributeAccessIssue]  (the test's own note)
    ckpt.close()
    return model, opt, sched, losses, ckpt


def assert_same(a, b):
    ma, oa, sa = a[:3]
    mb, ob, sb = b[:3]
    for (k, x), (k2, y) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert k == k2 and x.dtype == y.dtype and torch.equal(x, y), k
    for p, q in zip(ma.parameters(), mb.parameters()):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(oa.state[p][key], ob.state[q][key]), key
    assert [g["lr"] for g in oa.param_groups] == [g["lr"] for g in ob.param_groups]
    da, db = sa.state_dict(), sb.state_dict()
    da.pop("lr_lambdas"), db.pop("lr_lambdas")  # functions are not state
    assert da == db
