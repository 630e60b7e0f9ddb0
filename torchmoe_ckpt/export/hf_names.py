"""Names for `export_hf`: the target model's tensors (a transformers model built on the meta device: the names and
shapes the folder must hold) and the name maps from the training model's names to them (the model's own names, or
TorchTitan's state-dict adapters)."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..core.errors import ConfigError

__all__ = ["NameMap", "WRAPPER_PREFIXES", "default_name_map", "target_model", "titan_name_map"]

# A name map: (training name, tensor) -> {HF name: tensor}. Planned once with meta tensors, then applied to the
# real ones; an empty result leaves the tensor out (the completeness check then names what the target misses).
NameMap = Callable[[str, torch.Tensor], Mapping[str, torch.Tensor]]
WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "module.")


def default_name_map(fqn: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The training model's own name, without the prefixes of torch.compile, activation checkpointing, DDP."""
    changed = True
    while changed:
        changed = False
        for p in WRAPPER_PREFIXES:
            if fqn.startswith(p) or f".{p}" in fqn:
                fqn, changed = fqn.replace(f".{p}", ".").removeprefix(p), True
    return {fqn: t}


def titan_name_map(adapter: Any) -> NameMap:
    """A TorchTitan state-dict adapter's `to_hf` as a name map (applied to one tensor at a time). Its names are the
    Hub checkpoints' (one tensor per expert): the export checks against transformers' checkpoint names. An adapter
    whose `to_hf` needs several tensors at once (it fuses them: Kimi K2.5's vision qkv, Qwen3.5's gate_up) fails
    in one line."""

    def name_map(fqn: str, t: torch.Tensor) -> Mapping[str, torch.Tensor]:
        try:
            return adapter.to_hf({fqn: t})
        except (KeyError, IndexError, ValueError, RuntimeError) as exc:
            raise ConfigError(
                f"{type(adapter).__name__}.to_hf cannot map {fqn} on its own ({type(exc).__name__}: {exc}): it fuses "
                "several tensors into one, which a per-tensor name map cannot export"
            ) from None

    name_map.checkpoint_names = True  # type: ignore[attr-defined]
    return name_map


def target_model(model: Any, checkpoint_names: bool = False):
    """(config, {HF name: shape} in state-dict order, class name) of the target: a transformers model, a config,
    a config.json (or the folder holding one) or a model type. Built on the meta device (no memory).
    checkpoint_names: the names and shapes `save_pretrained` writes (transformers' weight conversions reverted, on
    the meta tensors), not the module's."""
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

    cls: type[PreTrainedModel] | None = None  # None: the causal LM of the config's model type
    if isinstance(model, PreTrainedModel):
        cls, config = type(model), model.config
    elif isinstance(model, PretrainedConfig):
        config = model
    elif isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if path.is_dir():
            path = path / "config.json"
        if path.is_file():
            config = AutoConfig.from_pretrained(str(path))
        elif str(model).endswith(".json") or os.sep in str(model):
            raise ConfigError(f"{model}: no such config.json (give the run's transformers config.json or its folder)")
        else:
            try:
                config = AutoConfig.for_model(str(model))
            except ValueError:
                raise ConfigError(
                    f"{model!r} is neither a config.json nor a transformers model type: give the config.json the "
                    "run's model was built from (--model-config path/config.json)"
                ) from None
    else:
        raise ConfigError(f"model must be a transformers model, config, config.json or model type, got {type(model)}")
    config = copy.deepcopy(config)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config) if cls is None else cls(config)
    sd = meta.state_dict()
    all_params = {n for n, _ in meta.named_parameters(remove_duplicate=False)}
    kept = {n for n, _ in meta.named_parameters()}  # tied parameters once (as save_pretrained writes them)
    sd = {n: t for n, t in sd.items() if n in kept or n not in all_params}
    if checkpoint_names:
        from transformers.core_model_loading import revert_weight_conversion

        sd = revert_weight_conversion(meta, sd)
    return config, {n: tuple(t.shape) for n, t in sd.items()}, type(meta).__name__
