"""Sparse checkpointing for a stock TorchTitan run, switched on by TorchTitan's own ``--override.imports``.

    torchrun --nproc_per_node 2 -m titan_integration.train --module titan_integration.config_registry \\
        --config deepseek_v3_tiny \\
        --override.imports 'titan_integration.overrides.sparse_checkpoint={"window": 3, "root": "/dev/shm/x"}'

(``python -m torchtitan.train`` with the same flags works where TorchTitan itself runs, i.e. with CUDA and
triton; on CPU its entry point fails at ``import triton`` before any of our code runs, so use our launcher.)

The JSON object holds ``[sparse_checkpoint]`` keys (see :mod:`titan_integration.sparse_config`); ``enable``
defaults to true here. Through our launcher, ``--sparse_checkpoint.KEY VALUE`` flags are merged into it (and the
entry is added when absent: :mod:`titan_integration.sparse_cli`); the launcher checks the section before
TorchTitan is imported. TorchTitan applies the override inside ``Trainer.__init__`` before it builds the
checkpointer: the factory swaps ``CheckpointManager.Config`` for :class:`OverrideCheckpointManager.Config` (a
:class:`SparseCheckpointManager` that carries the section), and that manager turns the (stock) Trainer into a
:class:`SparseTrainer` as it is built (:func:`adopt`).

Restarts: every process group must be keyed by torchrun attempt, or a restarted worker reads the previous
attempt's store keys (:mod:`torchmoe_ckpt.runtime.distributed`). TorchTitan sets up its process group *before* it
imports override modules, so the keying is installed earlier: by our launcher before TorchTitan is imported,
and by :mod:`titan_integration.config_registry` when ConfigManager imports it. With neither (stock
``torchtitan.train`` and a TorchTitan model registry) this module keys every group created after it (ours,
TorchTitan's later ones) and says on rank 0 how to make the default group safe too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Annotated, Any

import torch
import tyro
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.config import derive, override
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from titan_integration import restart_timing
from titan_integration.checkpoint_manager import SparseCheckpointManager
from titan_integration.sparse_config import SparseCheckpointSection
from titan_integration.sparse_trainer import SparseTrainer
from torchmoe_ckpt.runtime.distributed import key_groups_by_attempt

TARGET = f"{__name__}.sparse_checkpoint"

# Imported by TorchTitan's apply_overrides inside Trainer.__init__ (right after its init_distributed), on every
# rank at the same point.
if torch.distributed.is_initialized():
    restart_timing.mark("pg_ready")
if key_groups_by_attempt() and os.environ.get("RANK", "0") == "0":
    logger.warning(
        "torchmoe: TorchTitan set up its process group before torchmoe could give it a store of its "
        "rendezvous round; groups created from now on are keyed, but a restart can still read the previous "
        "round's keys in TorchTitan's init_distributed (Gloo connectFullMesh failed / a hang); fix: "
        "launch with python -m titan_integration.train, or --module titan_integration.config_registry,"
        " or set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun"
    )


def adopt(trainer: Trainer, section: SparseCheckpointSection) -> None:
    """Turn a stock ``Trainer`` that is still being built into a SparseTrainer; ``train()`` runs ours afterwards.

    Why a class swap: on this entry point TorchTitan, not we, picked the Trainer class (``config.build()`` in
    ``torchtitan.train.main``, before any override module is imported), and an override cannot replace the root
    config (``apply_overrides``: "cannot be replaced in place"); the first object of ours that sees the trainer is
    the checkpoint manager it builds from the overridden config. SparseTrainer adds methods and attributes only
    (same instance layout), so the swap is safe; it happens here and nowhere else."""
    if isinstance(trainer, SparseTrainer):
        if trainer.config.sparse_checkpoint.enable:
            raise ValueError(
                "sparse checkpointing is configured twice ([sparse_checkpoint] in the job file and "
                "--override.imports); fix: keep one of them"
            )
        trainer.config.sparse_checkpoint = section  # SparseTrainer.__init__ reads it once the manager is built
        return
    if type(trainer) is not Trainer:
        raise TypeError(
            f"--override.imports sparse checkpointing needs TorchTitan's own Trainer, got "
            f"{type(trainer).__name__}; fix: use titan_integration.train --config job.toml instead"
        )
    trainer.__class__ = SparseTrainer
    trainer.init_sparse(section, check=False)  # its checkpointer is the OverrideCheckpointManager being built


class OverrideCheckpointManager(SparseCheckpointManager):
    """The checkpoint manager ``--override.imports`` puts into a stock Trainer: ours, plus the section it came with,
    and the trainer that builds it becomes a SparseTrainer (:func:`adopt`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(SparseCheckpointManager.Config):
        sparse: Annotated[SparseCheckpointSection | None, tyro.conf.Suppress] = field(default=None)
        """The override entry's [sparse_checkpoint] settings (with a job file they live on
        ``SparseTrainer.Config.sparse_checkpoint`` instead)."""

    def __init__(self, config: Config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        if config.sparse is not None and config.sparse.enable:
            adopt(self.trainer, config.sparse)


def section_from_kwargs(kwargs: dict[str, Any]) -> SparseCheckpointSection:
    """The section an override entry's JSON describes (raises JobConfigError, one line, naming the fix)."""
    return SparseCheckpointSection.from_table({"enable": True, **kwargs}, section="override sparse_checkpoint")


@override(
    target=CheckpointManager.Config,
    description="torchmoe-ckpt: sparse per-iteration MoE checkpointing with bit-exact recovery",
)
def sparse_checkpoint(cfg: CheckpointManager.Config, **kwargs: Any) -> OverrideCheckpointManager.Config:
    return derive(cfg, OverrideCheckpointManager.Config, sparse=section_from_kwargs(kwargs))
