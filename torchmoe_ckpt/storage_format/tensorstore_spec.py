"""The tensorstore format's building blocks: kvstore specs for a store URI, dtypes between torch and numpy, chunk
shapes (one expert per chunk), the process's tensorstore Context and I/O counters, and a host-tier slot read into
plain items. The tier is tensorstore_tier.py; the layout is in docs/tensorstore-format.md."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..core.errors import TorchmoeError
from ..core.operator import Piece
from ..core.slot import Slot, SlotItem
from ..model.operators import EXPERT_PARAM_NAMES
from .files import LocalFiles
from .slot_format import read_slot, read_slot_metadata

TS_SCHEMES = ("file", "memory", "s3")
META_KEY, REPLAY_KEY = "meta.json", "replay.pt"
META_FORMAT = "torchmoe-ckpt/tensorstore-window/1"
MAX_CHUNK_BYTES = 4 << 20
_TORCH = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)
DTYPES = {t: str(t).removeprefix("torch.") for t in _TORCH}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}


class NoTensorstoreDriver(TorchmoeError, ValueError):
    """tensorstore has no kvstore driver for this URI scheme (az://, abfs://): use the DCP format."""


def ts_module():
    import tensorstore as ts

    return ts


@functools.cache
def context():
    """One tensorstore Context per process: memory:// stores and OCDBT caches are shared through it."""
    return ts_module().Context()


def kvstore_spec(uri: str, storage_options: dict | None = None) -> dict:
    """A tensorstore kvstore spec (path ending in '/') for a store URI, with the fsspec storage options
    translated (s3: endpoint_url, region, key/secret -> the AWS_* environment, which the s3 driver reads)."""
    scheme, rest = uri.split("://", 1) if "://" in uri else ("file", uri)
    opts = dict(storage_options or {})
    if scheme == "file":
        return {"driver": "file", "path": str(Path(rest).resolve()).rstrip("/") + "/"}
    if scheme == "memory":
        return {"driver": "memory", "path": (rest.strip("/") + "/").lstrip("/")}
    if scheme in ("s3", "s3a"):
        bucket, _, path = rest.partition("/")
        ck = opts.get("client_kwargs") or {}
        region = ck.get("region_name") or opts.get("region_name") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        spec = {"driver": "s3", "bucket": bucket, "path": (path.strip("/") + "/").lstrip("/"), "aws_region": region}
        spec["aws_credentials"] = {"type": "environment"}
        if endpoint := ck.get("endpoint_url") or opts.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL"):
            spec["endpoint"] = endpoint
        if opts.get("key") and opts.get("secret"):  # the s3 driver takes credentials from the environment only
            os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = opts["key"], opts["secret"]
        return spec
    raise NoTensorstoreDriver(
        f"tensorstore has no kvstore driver for {scheme}:// ({uri!r}); the tensorstore "
        f"format works on {', '.join(s + '://' for s in TS_SCHEMES)}"
    )


def sub_spec(spec: dict, rel: str) -> dict:
    return dict(spec, path=spec.get("path", "") + rel)


def db_spec(base: dict, rel: str) -> dict:
    return {"driver": "ocdbt", "base": sub_spec(base, rel)}


def io_counters() -> dict:
    """Process-wide bytes/ops read and written by tensorstore's storage drivers (file, s3, memory):
    what actually crossed the wire, including OCDBT manifests and b-tree nodes. Take differences."""
    out = {"bytes_read": 0, "reads": 0, "bytes_written": 0, "writes": 0}
    names = {"bytes_read": "bytes_read", "read": "reads", "bytes_written": "bytes_written", "write": "writes"}
    for m in ts_module().experimental_collect_matching_metrics("/tensorstore/kvstore/"):
        parts = m["name"].split("/")  # /tensorstore/kvstore/<driver>/<metric>
        if len(parts) == 5 and parts[3] in ("file", "s3", "memory") and parts[4] in names:
            out[names[parts[4]]] += sum(int(v.get("value", 0)) for v in m.get("values", []))
    return out


def is_expert_key(key: str, global_shape) -> bool:
    base = key.split(".")
    return len(global_shape) >= 2 and any(n in base for n in EXPERT_PARAM_NAMES)


def chunk_shape(key: str, global_shape, piece_shape, itemsize: int) -> list[int]:
    """One expert per chunk for grouped expert tensors [E, ...]; else the piece's shape, at most MAX_CHUNK_BYTES."""
    if is_expert_key(key, global_shape):
        return [1] + [max(1, int(s)) for s in global_shape[1:]]
    shape = [max(1, int(s)) for s in piece_shape]
    if shape:
        row = max(1, int(np.prod(shape[1:], dtype=np.int64)) * itemsize)
        shape[0] = max(1, min(shape[0], MAX_CHUNK_BYTES // row))
    return shape


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ts_module().bfloat16.numpy_dtype)
    return t.numpy()


def to_torch(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    if dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def region(offset, shape) -> tuple:
    return tuple(slice(int(o), int(o) + int(s)) for o, s in zip(offset, shape))


def plain_item(key: str, global_shape, offset, shape, t: torch.Tensor) -> SlotItem:
    """A plain slot item (no operator): what a window copied between formats is made of."""
    pc = Piece(key, True, tuple(global_shape), tuple(offset), (), tuple(shape))
    return SlotItem(key, "step" if len(global_shape) == 0 else "data", "", pc, t)


def slot_from_dcp(index: int, path: Path) -> tuple[Slot, dict]:
    """One host-tier slot piece (slot_format.py) as a Slot of plain items, every item checked; returns (slot, the
    DCP planner info without the checksums)."""
    files = LocalFiles(path)
    md = read_slot_metadata(files, "")
    items = []
    for fqn, tm in md.state_dict_metadata.items():
        if not isinstance(tm, TensorStorageMetadata):
            raise ValueError(f"{path}: {fqn} is not a tensor; not a torchmoe-ckpt slot")
        for ch in tm.chunks:
            t = torch.empty(tuple(ch.sizes), dtype=tm.properties.dtype)
            items.append(plain_item(fqn, tm.size, ch.offsets, ch.sizes, t))
    slot = Slot(index, (), (), items)
    info = dict(read_slot(files, "", slot, md))
    info.pop("checksums", None)
    return slot, info
