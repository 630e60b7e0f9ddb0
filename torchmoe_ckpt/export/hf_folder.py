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

import json
import math
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.config_values import human_bytes, parse_bytes
from ..core.errors import ConfigError
from .hf_names import NameMap, default_name_map, target_model
from .hf_plan import IncompleteExportError, one_line, out_dtype, plan_export, shards_of, weights_source
from .slot_zero import SlotZero

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
INDEX_FILE = "model.safetensors.index.json"


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


class _Held:
    """Host bytes the exporter holds: counted as they are taken and let go; the peak is reported."""

    def __init__(self):
        self.now = self.peak = 0

    def set(self, n: int) -> None:
        self.now = n
        self.peak = max(self.peak, n)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size() * math.prod(shape)


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
    source = weights_source(slot, planned, dtype)
    shards = shards_of(planned, max_bytes)
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
            t_bytes = _nbytes(st.shape, out_dtype(st, dtype))
            t = slot.read(st.fqn, out_dtype(st, dtype), lambda n, b=shard_bytes + t_bytes: held.set(b + n))
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
            one_line(
                "the written shards are not the target's state dict (missing, other shape or twice)",
                missing + wrong + twice,
            )
        )
