"""`export_hf`: a Hugging Face model folder (safetensors shards, their index, config.json) from slot 0 of any committed
window (slot_zero.py): the model's weights at the window's first step, with no replay.

The target is a transformers model (an instance, its config, a config.json or a model type): its state dict, built
on the meta device, is what the folder must hold. Every stored tensor goes through the name map (training name and
tensor -> HF names and tensors; default: the training model's own names, wrapper prefixes stripped), planned first on
meta tensors: the completeness check runs before a byte is read (every tensor of the target written exactly once at
its shape, nothing else; missing names listed in one line) and again on the shards written. The folder is written
into a temporary directory beside `out_dir` and renamed at the end: a failed export leaves nothing that looks
complete. Shards are written one at a time: the host memory held is at most one shard's tensors plus one stored item
(a tensor larger than the shard bound is a shard of its own); `HFExportReport` says the bound and the peak held.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.config_values import human_bytes, parse_bytes
from ..core.errors import ConfigError, TorchmoeError
from .slot_zero import SlotZero, StoredTensor

# A name map: (training name, tensor) -> {HF name: tensor}. Planned once with meta tensors, then applied to the
# real ones; an empty result leaves the tensor out (the completeness check then names what the target misses).
NameMap = Callable[[str, torch.Tensor], Mapping[str, torch.Tensor]]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "module.")
INDEX_FILE = "model.safetensors.index.json"


class IncompleteExportError(TorchmoeError, ValueError):
    """The export would not write every tensor of the target model exactly once at its shape (a dropped expert, a
    name map that misses or duplicates a name, a window that lacks part of a tensor): nothing is written."""


@dataclass(frozen=True)
class HFExportOptions:
    """What `export_hf` exports and how.

    window: a committed window's id (None: the newest, or the one of `step`).
    step: the window whose first step this is (the weights after that iteration).
    dtype: "fp32" (master weights where slot 0 holds them, fp32 compute weights elsewhere: refused when those are
        bf16, i.e. mixed precision on a window of W > 1) or "bf16" (the compute weights; master weights rounded).
    name_map: training name and tensor -> {HF name: tensor} (`NameMap`; e.g. a TorchTitan state-dict adapter's
        `to_hf` applied per tensor, `titan_name_map`); None: the training model's names, wrapper prefixes stripped.
    max_shard_bytes: the largest shard (bytes, or "1 GiB"); the exporter's host-memory bound follows from it.
    storage_options: fsspec options of an object-store location.
    overwrite: replace an existing non-empty `out_dir`.
    checkpoint_names: the folder holds transformers' checkpoint names and shapes (what `save_pretrained` writes,
        e.g. one tensor per expert, as on the Hub; `from_pretrained` converts them) rather than the in-memory state
        dict's (grouped experts); a name map that says so (`titan_name_map`) turns it on.
    """

    window: int | None = None
    step: int | None = None
    dtype: str = "fp32"
    name_map: NameMap | None = None
    max_shard_bytes: int | str = "1 GiB"
    storage_options: dict | None = None
    overwrite: bool = False
    checkpoint_names: bool = False

    def checked(self) -> HFExportOptions:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r}: use one of {sorted(DTYPES)} (--dtype fp32|bf16)")
        if self.window is not None and self.step is not None:
            raise ConfigError("give window or step, not both (--window N | --step S)")
        for name in ("window", "step"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ConfigError(f"{name} must be an integer >= 0, got {v!r}")
        parse_bytes(self.max_shard_bytes, "max_shard_bytes")
        return self


@dataclass
class HFExportReport:
    out_dir: str
    location: str
    window_id: int
    start_step: int  # the weights are the model's after this iteration (the window's first step)
    window: int  # the window's W (1: a dense snapshot)
    world_size: int  # of the run that wrote it
    dtype: str  # of the exported floating-point tensors
    source: str  # which weights were read: master weights, compute weights, or both (which for which)
    tensors: int
    shards: int
    total_bytes: int
    seconds: float
    memory_bound_bytes: int  # the most host memory the exporter holds: one shard's tensors + one stored item
    peak_held_bytes: int  # the most it held (its tensors and read buffers, counted)

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        return (
            f"exported window {self.window_id} (step {self.start_step}, W={self.window}) to {self.out_dir}: "
            f"{self.tensors} tensors in {self.shards} shard(s), {human_bytes(self.total_bytes)}, {self.dtype} from "
            f"{self.source}; peak host memory held {human_bytes(self.peak_held_bytes)} (bound "
            f"{human_bytes(self.memory_bound_bytes)}), {self.seconds:.2f} s"
        )


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


@dataclass
class _Planned:
    stored: StoredTensor
    outputs: dict[str, tuple[int, ...]]  # HF name -> shape
    nbytes: int  # of its outputs in the export dtype


def _out_dtype(st: StoredTensor, dtype: torch.dtype) -> torch.dtype:
    d = st.pieces[0].dtype
    return dtype if d.is_floating_point else d  # integer buffers keep their dtype


def _one_line(head: str, names: list[str], limit: int = 8) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return f"{head}: {', '.join(names[:limit])}{more}"


def plan_export(slot: SlotZero, expected: dict, name_map: NameMap, dtype: torch.dtype, what: str) -> list[_Planned]:
    """Every stored tensor's outputs through the name map (on meta tensors), checked complete; in target order."""
    problems = [p for st in slot.tensors.values() if (p := st.coverage_problem())]
    if problems:
        raise IncompleteExportError(_one_line(f"window {slot.window_id} slot 0 lacks part of a tensor", problems))
    planned, made = [], {}
    dup: list[str] = []
    for st in slot.tensors.values():
        od = _out_dtype(st, dtype)
        outs = name_map(st.fqn, torch.empty(st.shape, dtype=od, device="meta"))
        shapes = {n: tuple(t.shape) for n, t in outs.items()}
        for n in shapes:
            if n in made:
                dup.append(f"{n} (from {made[n]} and {st.fqn})")
            made[n] = st.fqn
        nbytes = sum(t.numel() * t.element_size() for t in outs.values())
        planned.append(_Planned(st, shapes, nbytes))
    shapes_out = {n: s for p in planned for n, s in p.outputs.items()}
    missing = [n for n in expected if n not in shapes_out]
    extra = sorted(n for n in shapes_out if n not in expected)
    wrong = [
        f"{n} {shapes_out[n]} != {expected[n]}" for n in expected if n in shapes_out and shapes_out[n] != expected[n]
    ]
    head = f"export of window {slot.window_id} refused, nothing written: {what}"
    if missing:
        raise IncompleteExportError(
            _one_line(
                f"{head} would miss {len(missing)} of its {len(expected)} tensors (dropped by the name map, or not "
                "in the window: check the name map and that --model-config is the run's model)",
                missing,
            )
        )
    for label, names in (("would write tensors it does not have", extra), ("would write names twice", dup)):
        if names:
            raise IncompleteExportError(_one_line(f"{head} {label} (fix the name map or --model-config)", names))
    if wrong:
        raise IncompleteExportError(_one_line(f"{head} has other shapes (is --model-config the run's?)", wrong))
    order = {n: i for i, n in enumerate(expected)}
    planned = [p for p in planned if p.outputs]  # a stored tensor the target does not hold (mapped to nothing)
    return sorted(planned, key=lambda p: min(order[n] for n in p.outputs))


def _source(slot: SlotZero, planned: list[_Planned], dtype: torch.dtype) -> str:
    """Which weights the export reads; refuses fp32 from bf16 compute weights (never an upcast posing as master)."""
    low = sorted(
        {
            p.stored.fqn
            for p in planned
            for pc in p.stored.pieces
            if pc.source == "compute" and pc.dtype != torch.float32
        }
    )
    if dtype == torch.float32 and low:
        raise IncompleteExportError(
            _one_line(
                f"window {slot.window_id} slot 0 holds fp32 master weights only of its first active operators; the "
                f"others' compute weights are {slot.compute_dtype} (mixed precision): export with dtype='bf16' "
                "(--dtype bf16), or a dense snapshot (a window of W = 1); not exact in fp32",
                low,
            )
        )
    kinds = {pc.source for p in planned for pc in p.stored.pieces}
    if kinds == {"model"}:
        return "master weights (every operator's full state: slot 0 of a dense snapshot)"
    cd = slot.compute_dtype.removeprefix("torch.")
    if kinds == {"compute"}:
        return f"compute weights ({cd})"
    if dtype == torch.float32:
        return (
            f"master weights of slot 0's active operators, compute weights ({cd}, equal to the masters) of the others"
        )
    return f"compute weights ({cd}) of slot 0's frozen operators, master weights rounded to bf16 of its active ones"


def _shards(planned: list[_Planned], max_bytes: int) -> list[list[_Planned]]:
    """Consecutive groups of at most `max_bytes` (a larger tensor alone); a stored tensor's outputs stay together."""
    shards: list[list[_Planned]] = [[]]
    size = 0
    for p in planned:
        if shards[-1] and size + p.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes
    return [s for s in shards if s]


class _Held:
    """Host bytes the exporter holds: counted as they are taken and let go; the peak is reported."""

    def __init__(self):
        self.now = self.peak = 0

    def set(self, n: int) -> None:
        self.now = n
        self.peak = max(self.peak, n)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        n *= s
    return n


def export_hf(
    location: str | os.PathLike,
    out_dir: str | os.PathLike,
    model: Any,
    options: HFExportOptions | None = None,
) -> HFExportReport:
    """Write a Hugging Face model folder from slot 0 of one committed window of a run.

    Args:
        location: the run's directory in any tier (e.g. /dev/shm/torchmoe-ckpt/node-0/<run>) or its object-store URI.
        out_dir: the folder to create (a local path): `model-0000N-of-0000M.safetensors`, their index, config.json.
        model: the target: a transformers model or config, a config.json (or its folder), or a model type.
        options: window/step, dtype, name map, shard size, storage options (`HFExportOptions`).

    Returns:
        `HFExportReport`: the window, the dtype and which weights it came from, shards, bytes, memory.

    Raises:
        IncompleteExportError: a target tensor would be missing, written twice, at another shape, or unexpected; or
            fp32 asked of bf16 compute weights. Nothing is left at `out_dir`.
        WindowChoiceError, CorruptCopyError, ConfigError, ValueError: no such window or location, a copy that does
            not verify, bad options.
    """
    t0 = time.perf_counter()
    opts = (options or HFExportOptions()).checked()
    dtype = DTYPES[opts.dtype]
    max_bytes = parse_bytes(opts.max_shard_bytes, "max_shard_bytes") or 1 << 30
    out = Path(out_dir)
    if "://" in str(out_dir):
        raise ConfigError(f"{out_dir}: the export folder must be a local path (copy it to a store afterwards)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not opts.overwrite:
        raise ConfigError(f"{out}: exists and is not empty: choose a new folder, or overwrite (--overwrite)")
    name_map = opts.name_map or default_name_map
    config, expected, cls_name = target_model(
        model, opts.checkpoint_names or bool(getattr(name_map, "checkpoint_names", False))
    )
    slot = SlotZero(str(location), opts.storage_options, opts.window, opts.step)
    planned = plan_export(slot, expected, name_map, dtype, cls_name)
    source = _source(slot, planned, dtype)
    shards = _shards(planned, max_bytes)
    largest_item = max((pc.item.length for p in planned for pc in p.stored.pieces), default=0)
    largest_shard = max(sum(p.nbytes for p in s) for s in shards)
    largest_split = max((p.nbytes for p in planned if len(p.outputs) > 1), default=0)  # clones beside their source
    bound = largest_shard + max(largest_item, largest_split)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    held = _Held()
    info = {
        "location": slot.location,
        "window": slot.window_id,
        "step": slot.start_step,
        "W": slot.window,
        "dtype": opts.dtype,
        "source": source,
    }
    try:
        weight_map, total = _write_shards(tmp, slot, shards, _Writing(name_map, dtype, held, info))
        _check_written(tmp, expected, weight_map)
        index = {"metadata": {"total_size": total, "torchmoe_ckpt": info}, "weight_map": weight_map}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        setattr(config, "dtype", dtype)  # noqa: B010  (transformers 5's name; from_pretrained(dtype="auto") reads it)
        config.save_pretrained(str(tmp))
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return HFExportReport(
        str(out),
        slot.location,
        slot.window_id,
        slot.start_step,
        slot.window,
        slot.world_size,
        opts.dtype,
        source,
        len(weight_map),
        len(shards),
        total,
        time.perf_counter() - t0,
        bound,
        held.peak,
    )


@dataclass(frozen=True)
class _Writing:
    """How the shards are written: the name map, the dtype, the held-bytes count, what the files record."""

    name_map: NameMap
    dtype: torch.dtype
    held: _Held
    info: dict


def _write_shards(tmp: Path, slot: SlotZero, shards: list, how: _Writing) -> tuple[dict[str, str], int]:
    """Each shard read, mapped and written in turn (safetensors), then let go; returns the weight map and bytes."""
    from safetensors.torch import save_file

    name_map, dtype, held, info = how.name_map, how.dtype, how.held, how.info
    weight_map: dict[str, str] = {}
    total = 0
    meta = {"format": "pt", "torchmoe_ckpt": json.dumps(info, sort_keys=True)}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        shard_bytes = 0  # this shard's tensors so far
        for p in shard:
            st = p.stored
            t_bytes = _nbytes(st.shape, _out_dtype(st, dtype))
            t = slot.read(st.fqn, _out_dtype(st, dtype), lambda n, b=shard_bytes + t_bytes: held.set(b + n))
            held.set(shard_bytes + t_bytes)
            got = dict(name_map(st.fqn, t))
            for n, v in got.items():
                if tuple(v.shape) != p.outputs.get(n):
                    raise IncompleteExportError(
                        f"the name map gave {n} {tuple(v.shape)} for {st.fqn}, planned {p.outputs.get(n)}: a "
                        "name map must give the same names and shapes for meta and real tensors"
                    )
                # split outputs may be views of one tensor: safetensors writes each on its own
                tensors[n] = v.contiguous().clone() if len(got) > 1 else v.contiguous()
                weight_map[n] = name
            if len(got) > 1:  # the clones beside the tensor they came from, until it is let go
                held.set(shard_bytes + t_bytes + p.nbytes)
            shard_bytes += p.nbytes
            del t, got
            held.set(shard_bytes)
        save_file(tensors, str(tmp / name), metadata=meta)
        os.chmod(tmp / name, 0o666 & ~_umask())  # as any other file the user writes (safetensors makes it 0600)
        total += sum(v.numel() * v.element_size() for v in tensors.values())
        del tensors
        held.set(0)
    return weight_map, total


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _check_written(tmp: Path, expected: dict, weight_map: dict[str, str]) -> None:
    """The completeness check again, on the files written: every target tensor once, at its shape, nothing else."""
    from safetensors import safe_open

    seen: dict[str, tuple] = {}
    twice = []
    for name in sorted(set(weight_map.values())):
        with safe_open(str(tmp / name), framework="pt") as f:
            for k in f.keys():
                if k in seen:
                    twice.append(k)
                seen[k] = tuple(f.get_slice(k).get_shape())
    missing = [n for n in expected if n not in seen]
    wrong = [n for n in seen if expected.get(n) != seen[n]]
    if missing or wrong or twice:
        raise IncompleteExportError(
            _one_line(
                "the written shards are not the target's state dict (missing, other shape or twice)",
                missing + wrong + twice,
            )
        )
