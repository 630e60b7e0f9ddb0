"""What one TorchTitan iteration leaves for the sparse checkpointer and how recovery replays it: the batch
packed into one int64 tensor for the replay log, the per-step result that `SparseCheckpointer.after_step` and
recovery read, a `torch.optim.Optimizer`-like view over TorchTitan's OptimizersContainer, and
:class:`TitanReplayable`, the `torchmoe_ckpt.recovery.sparse_to_dense.Replayable` over a SparseTrainer (duck-typed: the
trainer's `sparse_step`, `set_lr_step`, `step`, `_losses`, `_lrs`; no import of the trainer module, which
imports this one)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchmoe_ckpt.model.optim_state import Optimizers

__all__ = ["BATCH_KEYS", "OptimizerView", "TitanReplayable", "TitanStepResult", "pack_batches", "unpack_batches"]


# ---- batch packing for the replay log -----------------------------------------------------------------
# The text data loader yields ({"input": [B,S] int64, "positions": [B,S] int64}, labels [B,S] int64). The replay
# log holds one tensor per iteration: [microbatches, 1 + len(BATCH_KEYS), B, S] int64 = input, positions, labels.
BATCH_KEYS = ("input", "positions")


def pack_batches(groups: list[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> torch.Tensor:
    rows = []
    for input_dict, labels in groups:
        keys = tuple(k for k in BATCH_KEYS if k in input_dict)
        if set(input_dict) != set(keys) or keys[:1] != ("input",):
            raise NotImplementedError(
                f"replay logs {BATCH_KEYS} and labels; this data loader yields {sorted(input_dict)}"
            )
        parts = [input_dict[k] for k in keys] + [labels]
        if any(t.dtype != torch.int64 or t.shape != labels.shape for t in parts):
            raise NotImplementedError("replay logs int64 [B, S] batch tensors only")
        rows.append(torch.stack(parts))
    return torch.stack(rows)


def unpack_batches(tokens: torch.Tensor) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    keys = BATCH_KEYS[: tokens.shape[1] - 1]
    return [({k: mb[i].clone() for i, k in enumerate(keys)}, mb[-1].clone()) for mb in tokens]


# ---- per-step result (what SparseCheckpointer.after_step and recovery read) ----------------------------
@dataclass
class TitanStepResult:
    step: int
    loss: torch.Tensor  # this rank's loss contribution (local sum / global valid tokens), fp32, on the device
    grad_norm: torch.Tensor  # global norm before clipping, on the device
    lr: float  # the first param group's LR (TorchTitan's metric)
    tokens: torch.Tensor  # [microbatches, 2, B, S]: input and labels, the batch this rank trained on
    rng_state: torch.Tensor
    expert_counts: torch.Tensor  # [moe layers, experts], this rank's (the checkpointer sums them over the ranks)
    expert_probs: torch.Tensor  # TorchTitan keeps no router-probability sums: the counts again
    seconds: float = 0.0
    device_rng: dict | None = None  # GPU generators' states (torchmoe_ckpt.recovery.rng)
    replayed_grad_norm: torch.Tensor | None = None  # replay only: the replayed gradients' norm (for the check)
    lrs: tuple[float, ...] = ()  # every param group's LR, of every optimizer (DistMuon's and AdamW's differ)
    hyper: tuple[dict, ...] = ()  # every param group's other hyper-parameters (replay_log.group_hyper)


class OptimizerView(Optimizers):
    """One ``torch.optim.Optimizer``-like view over TorchTitan's OptimizersContainer (state + param_groups of all
    inner optimizers, e.g. DistMuon's and AdamW's), which is what the core's StateAccess, init_optimizer_state and
    replay read; stepping it steps the container (its pre-hooks, the expert-bias update, run)."""

    def __init__(self, container):
        super().__init__(list(container), step_with=container)
        self.container = container


class TitanReplayable:
    """``torchmoe_ckpt.recovery.sparse_to_dense.Replayable`` over a SparseTrainer: replays TorchTitan iterations."""

    def __init__(self, trainer):  # a SparseTrainer
        self.trainer = trainer
        self.model = trainer.model
        self.optimizer = OptimizerView(trainer.optimizers)

    def set_step(self, step: int) -> None:
        tr = self.trainer
        tr.step = step
        tr.set_lr_step(step)
        tokens_per_step = (
            tr.config.training.local_batch_size * tr.config.training.seq_len * tr.gradient_accumulation_steps
        )
        tr.ntokens_seen = step * tokens_per_step

    def train_step(self, replay=None):
        tr = self.trainer
        tr.step += 1
        res = tr.sparse_step(replay=replay)
        tr._losses[res.step], tr._lrs[res.step] = res.loss, res.lr  # compared with the fault-free run too
        return res
