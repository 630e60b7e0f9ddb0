"""Sparse checkpointing for a stock TorchTitan run, switched on by TorchTitan's own ``--override.imports``.

    torchrun --nproc_per_node 2 -m titan_integration.train --module titan_integration.config_registry \\
        --config deepseek_v3_tiny \\
        --override.imports 'titan_integration.overrides.sparse_checkpoint={"window": 3, "host_dir": "/dev/shm/x"}'

(``python -m torchtitan.train`` with the same flags works where TorchTitan itself runs, i.e. with CUDA and
triton; on CPU its entry point fails at ``import triton`` before any of our code runs, so use our launcher.)

The JSON object holds ``[sparse_checkpoint]`` keys (see :mod:`titan_integration.sparse_config`); ``enable``
defaults to true here. Through our launcher, ``--sparse_checkpoint.KEY VALUE`` flags are merged into it (and the
entry is added when absent: :mod:`titan_integration.sparse_cli`); the launcher checks the section before
TorchTitan is imported. TorchTitan applies the override inside ``Trainer.__init__`` before it builds the
checkpointer: the factory swaps ``CheckpointManager.Config`` for :class:`SparseCheckpointManager.Config`, and
that manager turns the (stock) Trainer into a :class:`SparseTrainer` as it is built. Caveat: the gloo
rendezvous keyed by torchrun attempt (``SparseTrainer.init_distributed``) is not in effect on this path,
because TorchTitan sets up the process group before any override runs.
"""
from __future__ import annotations

from typing import Any

from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.config import derive, override

from titan_integration.checkpoint_manager import SparseCheckpointManager
from titan_integration.sparse_config import SparseCheckpointSection

TARGET = f"{__name__}.sparse_checkpoint"


def section_from_kwargs(kwargs: dict[str, Any]) -> SparseCheckpointSection:
    """The section an override entry's JSON describes (raises JobConfigError, one line, naming the fix)."""
    return SparseCheckpointSection.from_table({"enable": True, **kwargs}, section="override sparse_checkpoint")


@override(target=CheckpointManager.Config,
          description="torchmoe-ckpt: sparse per-iteration MoE checkpointing with bit-exact recovery")
def sparse_checkpoint(cfg: CheckpointManager.Config, **kwargs: Any) -> SparseCheckpointManager.Config:
    return derive(cfg, SparseCheckpointManager.Config, sparse=section_from_kwargs(kwargs))
