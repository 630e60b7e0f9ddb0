"""Our TorchTitan 0.3.0 config registry: ``--module titan_integration.config_registry --config NAME``.

TorchTitan's ``ConfigManager`` imports a fully qualified ``--module`` and calls the function
named by ``--config`` to get a ``Trainer.Config``; remaining ``--section.option`` flags override
it. Configs here:

* ``deepseek_v3_tiny``: the real DeepSeek-V3 model code (MLA attention, dense first layer, MoE
  layers with ``GroupedExperts``, a top-k softmax router with ``expert_bias`` load balancing
  and a shared expert) at toy size, so one training step on 2 CPU ranks takes well under a
  second. Derived from TorchTitan's ``deepseek_v3_debugmodel``; the model flavour is
  registered in TorchTitan's own table as ``deepseek_v3`` flavour ``"tiny"``.
* ``deepseek_v3_tiny_ep2``: the same with expert parallel degree 2 (run with 2 or 4 ranks).

Every config here points at the offline assets from :mod:`titan_integration.assets` by absolute
path (generated on first use, so it works from any CWD) and already carries the CPU-mode
settings from :func:`titan_integration.cpu_mode.apply_cpu_config` when CUDA is unavailable.
The dump folder defaults to ``./outputs/titan`` (override with ``--dump_folder``).
"""

from __future__ import annotations

import torch
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import DebugConfig, ParallelismConfig, TrainingConfig
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets import text_datasets as _text_datasets
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models import deepseek_v3 as _dsv3
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.trainer import Trainer

from titan_integration import families
from titan_integration.assets import ensure_assets
from titan_integration.cpu_mode import apply_cpu_config, cpu_mode_enabled
from torchmoe_ckpt.runtime.distributed import key_rendezvous_by_attempt

__all__ = [
    "family_config",
    "deepseek_v3_tiny",
    "deepseek_v3_tiny_ep2",
    "deepseek_v3_debug",
    "qwen3_debug",
    "gpt_oss_debug",
    "kimi_k2_7_debug",
    "qwen3_5_debug",
    "TINY",
    "DEFAULT_CONFIG",
    "DATASET_NAME",
]

DEFAULT_CONFIG = "deepseek_v3_tiny"
DATASET_NAME = "torchmoe_tiny"
FLAVOR = "tiny"

TINY = families.DEEPSEEK_TINY  # the tiny DeepSeek-V3's sizes (docs/torchtitan-cpu-mode.md)


def _load_tiny_dataset(path: str):
    """Load our generated JSONL in memory (no HF cache writes, no hub, identical on every rank)."""
    import json

    from datasets import Dataset

    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return Dataset.from_list(rows)


def _register() -> None:
    # Register the flavour in TorchTitan's own table so model_registry("tiny") and logs name it.
    families.register_tiny_flavors("deepseek_v3", _dsv3)
    # Our own dataset entry; the path is filled in with an absolute path by the config function.
    _text_datasets.DATASETS.setdefault(
        DATASET_NAME,
        DatasetConfig(
            path="",  # always overridden via dataloader.dataset_path
            loader=_load_tiny_dataset,
            sample_processor=lambda sample: sample["text"],
        ),
    )


_register()
# ConfigManager imports this module before the Trainer exists, so also on TorchTitan's stock entry point
# (python -m torchtitan.train --module titan_integration.config_registry) every process group gets a store of
# its rendezvous round (torchmoe_ckpt.runtime.distributed: why a restart fails without it).
key_rendezvous_by_attempt()


def family_config(name: str, flavor: str | None = None) -> Trainer.Config:
    """Any MoE family of TorchTitan 0.3.0 (:mod:`titan_integration.families`) on our offline assets: its own model
    code at ``flavor`` (default: the family's CPU flavour, ``tiny``), the decoder's
    cross-entropy loss, our byte-level tokenizer and tiny text data set, AdamW, seq 64 x batch 4, seed 42.

    The multimodal families (Kimi K2.5, Qwen3.5) train their text tower on text here; their vision tower is built,
    sharded and checkpointed like any other module, and gets no gradient (text batches carry no pixels)."""
    fam = families.family(name)
    assets = ensure_assets()
    cpu = cpu_mode_enabled() or not torch.cuda.is_available()
    model_spec = families.model_spec(name, flavor or fam.flavor, cpu=cpu)
    config = Trainer.Config(
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec)),
        ),
        hf_assets_path=str(assets.tokenizer_dir),
        dump_folder="./outputs/titan",
        metrics=MetricsProcessor.Config(log_freq=1),
        model_spec=model_spec,
        dataloader=HuggingFaceTextDataLoader.Config(dataset=DATASET_NAME, dataset_path=str(assets.dataset_file)),
        optimizer=default_adamw(lr=3e-3),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=1, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.1
        ),
        training=TrainingConfig(local_batch_size=TINY["local_batch_size"], seq_len=TINY["seq_len"], steps=10),
        parallelism=ParallelismConfig(expert_parallel_degree=1),
        checkpoint=CheckpointManager.Config(interval=10, last_save_model_only=False),
        # No activation checkpointing: activations are tiny, and recompute only costs time.
        activation_checkpoint=None,
        # Fixed seed: identical initial weights and losses across runs (see tests).
        debug=DebugConfig(seed=42),
    )
    if cpu:
        apply_cpu_config(config)
        config.training.mixed_precision_param = fam.cpu_param_dtype
    return config


def deepseek_v3_tiny() -> Trainer.Config:
    """Tiny DeepSeek-V3 MoE (3 layers, dim 64, 8 experts top-2, seq 64): sub-second steps on CPU."""
    return family_config("deepseek_v3")


def deepseek_v3_debug() -> Trainer.Config:
    """The same as ``deepseek_v3_tiny``: every family has a ``<family>_debug`` config."""
    return family_config("deepseek_v3")


def qwen3_debug() -> Trainer.Config:
    """Qwen3-MoE (QK-norm GQA attention, 8 experts top-2, no shared expert), tiny: 2 layers, dim 64."""
    return family_config("qwen3")


def gpt_oss_debug() -> Trainer.Config:
    """gpt-oss (attention sinks, sliding-window layers, expert and router biases), tiny: 2 layers, dim 64."""
    return family_config("gpt_oss")


def kimi_k2_7_debug() -> Trainer.Config:
    """Kimi K2.5 (MLA, a dense first layer, 2 shared experts, a MoonViT vision tower), tiny: 3 layers, dim 64;
    AdamW (its registry's DistMuon needs the spmd_types backend, which CPU mode cannot use)."""
    return family_config("kimi_k2_7")


def qwen3_5_debug() -> Trainer.Config:
    """Qwen3.5 MoE (Gated DeltaNet and gated attention layers, 8 experts top-2 with a shared expert, a vision
    tower), tiny: 2 layers, dim 64. On a CPU its Gated DeltaNet ops are titan_integration.fla_cpu's references."""
    return family_config("qwen3_5")


def deepseek_v3_tiny_ep2() -> Trainer.Config:
    """``deepseek_v3_tiny`` with expert parallel degree 2 (experts split across 2 ranks)."""
    config = deepseek_v3_tiny()
    config.parallelism.expert_parallel_degree = 2
    return config
