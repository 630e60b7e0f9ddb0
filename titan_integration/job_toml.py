"""``--config job.toml``: a TOML job file mapped onto TorchTitan 0.3.0's own config dataclasses.

TorchTitan 0.3.0 dropped TOML (configs are Python functions). A job file here starts from our registry's
config of its ``[model]`` family (``family_config``: every MoE family of :mod:`titan_integration.families`, the
name and flavour checked against TorchTitan's own registry) and overrides fields section by section, by the names
TorchTitan's dataclasses use (the same names the ``--section.option`` flags use)::

    dump_folder = "./outputs/job"          # or [job] dump_folder
    [model]       name = "deepseek_v3" | "qwen3" | "gpt_oss" | "kimi_k2_7" | "qwen3_5"  flavor = "tiny"  hf_assets_path
    [training]    steps = 20  local_batch_size = 4  seq_len = 64  max_norm = 1.0 ...   (TrainingConfig)
    [parallelism] data_parallel_replicate_degree = 2  expert_parallel_degree = 2 ...   (ParallelismConfig)
    [checkpoint]  enable = false  interval = 500 ...        (CheckpointManager.Config, as SparseCheckpointManager's)
    [optimizer]   name = "AdamW"  lr = 3e-3  eps = 1e-8  weight_decay = 0.1  beta1 = 0.9  beta2 = 0.95
    [lr_scheduler] warmup_steps = 1  decay_ratio = 0.8 ...                             (LRSchedulersContainer.Config)
    [metrics] [debug] [compile] [comm] [dataloader] [profiler] [validator]              (their dataclasses)
    [activation_checkpoint] mode = "none" | "full" | "selective"
    [sparse_checkpoint]  see titan_integration.sparse_config (``--sparse_checkpoint.KEY VALUE`` flags override it,
                         see titan_integration.sparse_cli)

Any unknown section or key is a :class:`JobConfigError` naming it and the valid keys. The result is a
``SparseTrainer.Config``, so ``config.build()`` gives a :class:`titan_integration.sparse_trainer.SparseTrainer`.

For TorchTitan's ConfigManager (so later ``--section.option`` flags still apply), :func:`from_toml` is a
config function reading the path from ``$TORCHMOE_TITAN_JOB``; ``titan_integration.train`` sets it up.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path
from typing import Any

from titan_integration.sparse_cli import env_overrides, merged
from titan_integration.sparse_config import JobConfigError, SparseCheckpointSection

__all__ = ["read_job", "load_job", "from_toml", "JOB_ENV", "SECTIONS"]

JOB_ENV = "TORCHMOE_TITAN_JOB"
TOP_LEVEL_KEYS = ("dump_folder", "hf_assets_path")
# Sections that map 1:1 onto a dataclass-valued field of Trainer.Config.
DATACLASS_SECTIONS = (
    "training",
    "parallelism",
    "checkpoint",
    "lr_scheduler",
    "metrics",
    "debug",
    "compile",
    "comm",
    "dataloader",
    "profiler",
    "validator",
)
SPECIAL_SECTIONS = ("job", "model", "optimizer", "activation_checkpoint", "sparse_checkpoint")
SECTIONS = DATACLASS_SECTIONS + SPECIAL_SECTIONS
OPTIMIZER_KEYS = ("name", "lr", "eps", "weight_decay", "beta1", "beta2", "implementation")
MODEL_KEYS = ("name", "flavor", "hf_assets_path")
JOB_KEYS = ("dump_folder", "description")


def read_job(path: str | os.PathLike) -> dict[str, Any]:
    """Parse the TOML file; syntax errors become one-line JobConfigErrors."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise JobConfigError(f"job file {str(p)!r} not found; fix: pass an existing --config FILE.toml") from None
    except tomllib.TOMLDecodeError as exc:
        raise JobConfigError(f"{p}: invalid TOML ({exc}); fix: correct the syntax at that line") from None


def check_sections(job: dict[str, Any]) -> None:
    for key, val in job.items():
        if isinstance(val, dict):
            if key not in SECTIONS:
                raise JobConfigError(
                    f"unknown section [{key}]; fix: use one of " + ", ".join(f"[{s}]" for s in SECTIONS)
                )
        elif key not in TOP_LEVEL_KEYS:
            raise JobConfigError(
                f"unknown top-level key '{key}'; fix: use one of {', '.join(TOP_LEVEL_KEYS)} or put it in its section"
            )


def sparse_section(job: dict[str, Any]) -> SparseCheckpointSection:
    """The file's [sparse_checkpoint] with the launcher's ``--sparse_checkpoint.KEY VALUE`` flags over it."""
    table = job.get("sparse_checkpoint", {})
    cli = env_overrides(os.environ)
    if cli and isinstance(table, dict):
        table = merged(table, cli)
    return SparseCheckpointSection.from_table(table)


def _type_ok(cur: Any, val: Any) -> bool:
    if cur is None:
        return True
    if isinstance(cur, bool):
        return isinstance(val, bool)
    if isinstance(cur, int):
        return isinstance(val, int) and not isinstance(val, bool)
    if isinstance(cur, float):
        return isinstance(val, (int, float)) and not isinstance(val, bool)
    if isinstance(cur, str):
        return isinstance(val, str)
    if isinstance(cur, (list, tuple)):
        return isinstance(val, list)
    if isinstance(cur, dict):
        return isinstance(val, dict)
    return True


def _apply(obj: Any, table: dict[str, Any], where: str) -> None:
    names = [f.name for f in dataclasses.fields(obj) if not f.name.startswith("_")]
    for key, val in table.items():
        if key not in names:
            raise JobConfigError(f"[{where}] unknown key '{key}'; fix: use one of {', '.join(names)}")
        cur = getattr(obj, key)
        if dataclasses.is_dataclass(cur) and isinstance(val, dict):
            _apply(cur, val, f"{where}.{key}")
            continue
        if not _type_ok(cur, val):
            raise JobConfigError(f"[{where}] {key} = {val!r}: expected {type(cur).__name__}; fix: e.g. {key} = {cur!r}")
        setattr(obj, key, tuple(val) if isinstance(cur, tuple) else val)


def _model_table(job: dict[str, Any]) -> tuple[str, str | None]:
    """The [model] family and flavour, checked against TorchTitan's own registry before anything is built."""
    from titan_integration import families

    table = job.get("model", {})
    for key in table:
        if key not in MODEL_KEYS:
            raise JobConfigError(f"[model] unknown key '{key}'; fix: use one of {', '.join(MODEL_KEYS)}")
    name = table.get("name", "deepseek_v3")
    if not isinstance(name, str):
        raise JobConfigError(f'[model] name = {name!r}: expected a string; fix: e.g. name = "deepseek_v3"')
    families.family(name)  # an unknown family: one line listing them
    flavor = table.get("flavor")
    if flavor is not None:
        valid = families.flavors(name)  # imports the family (a missing dependency: one line)
        if flavor not in valid:
            raise JobConfigError(
                f"[model] flavor = {flavor!r} is not a {name} flavour; fix: use one of {', '.join(valid)}"
            )
    return name, flavor


def _apply_optimizer(config, table: dict[str, Any]) -> None:
    for key in table:
        if key not in OPTIMIZER_KEYS:
            raise JobConfigError(f"[optimizer] unknown key '{key}'; fix: use one of {', '.join(OPTIMIZER_KEYS)}")
    groups = config.optimizer.param_groups
    if "implementation" in table:
        config.optimizer.implementation = table["implementation"]
    for g in groups:
        if "name" in table:
            g.optimizer_name = table["name"]
        kw = dict(g.optimizer_kwargs)
        for key in ("lr", "eps", "weight_decay"):
            if key in table:
                kw[key] = float(table[key])
        if "beta1" in table or "beta2" in table:
            b1, b2 = kw.get("betas", (0.9, 0.999))
            kw["betas"] = (float(table.get("beta1", b1)), float(table.get("beta2", b2)))
        g.optimizer_kwargs = kw


def _apply_ac(config, table: dict[str, Any]) -> None:
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    for key in table:
        if key != "mode":
            raise JobConfigError(f"[activation_checkpoint] unknown key '{key}'; fix: use mode")
    modes = {"none": None, "full": FullAC.Config, "selective": SelectiveAC.Config}
    mode = table.get("mode", "none")
    if mode not in modes:
        raise JobConfigError(f"[activation_checkpoint] mode = {mode!r}; fix: use one of {', '.join(modes)}")
    config.activation_checkpoint = None if modes[mode] is None else modes[mode]()


def load_job(path: str | os.PathLike, job: dict[str, Any] | None = None):
    """The ``SparseTrainer.Config`` for a job file (TorchTitan must be importable: call after CPU mode)."""
    from torchtitan.config import derive

    from titan_integration.checkpoint_manager import SparseCheckpointManager
    from titan_integration.config_registry import family_config
    from titan_integration.sparse_trainer import SparseTrainer

    job = read_job(path) if job is None else job
    check_sections(job)
    sparse = sparse_section(job)
    name, flavor = _model_table(job)
    base = family_config(name, flavor)  # the family's loss, tokenizer, data set and CPU settings
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    fields["checkpoint"] = derive(base.checkpoint, SparseCheckpointManager.Config)  # TorchTitan's, plus ours
    config = SparseTrainer.Config(**fields, sparse_checkpoint=sparse)
    for key in TOP_LEVEL_KEYS:
        if key in job:
            if not isinstance(job[key], str):
                raise JobConfigError(f'{key} = {job[key]!r}: expected a string; fix: {key} = "..."')
            setattr(config, key, job[key])
    if "job" in job:
        for key, _val in job["job"].items():
            if key not in JOB_KEYS:
                raise JobConfigError(f"[job] unknown key '{key}'; fix: use one of {', '.join(JOB_KEYS)}")
        if "dump_folder" in job["job"]:
            config.dump_folder = job["job"]["dump_folder"]
    if "hf_assets_path" in job.get("model", {}):
        config.hf_assets_path = job["model"]["hf_assets_path"]
    if "optimizer" in job:
        _apply_optimizer(config, job["optimizer"])
    if "activation_checkpoint" in job:
        _apply_ac(config, job["activation_checkpoint"])
    for section in DATACLASS_SECTIONS:
        if section in job:
            _apply(getattr(config, section), job[section], section)
    return config


def from_toml():
    """Config function for TorchTitan's ConfigManager: the job file named by ``$TORCHMOE_TITAN_JOB``."""
    path = os.environ.get(JOB_ENV)
    if not path:
        raise JobConfigError(f"${JOB_ENV} is not set; fix: run `python -m titan_integration.train --config job.toml`")
    return load_job(path)
