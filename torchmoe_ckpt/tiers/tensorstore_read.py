"""Reading a tensorstore-format window at any world size: the pieces a reader asks for, whichever ranks wrote
them (only the chunks inside the wanted regions are fetched), or one slot as global tensors. Every piece is checked
against its CRC32."""

from __future__ import annotations

import torch

from ..storage_format.layout import writer_rank
from ..storage_format.tensorstore_spec import context, kvstore_spec, region, sub_spec, ts_module
from .tensorstore_tier import TensorstoreTier


def _iter_pieces(uri, run_id, window_id, wanted, slot, storage_options):
    spec = sub_spec(kvstore_spec(uri, storage_options), f"{run_id}/")
    keys = ts_module().KvStore.open(spec, context=context()).result().list().result()
    for r in sorted({r for k in keys if (r := writer_rank(k.decode().split("/", 1)[0])) is not None}):
        t = TensorstoreTier(uri, run_id, r, storage_options, probe=False)
        meta = t._read_meta(window_id)
        if meta is None:
            raise RuntimeError(f"rank {r} has no committed window {window_id} in {uri}")
        for s in meta["slots"]:
            if slot is not None and s["slot"] != slot:
                continue
            sel = [
                e for e in s["items"] if wanted is None or any(_inside(e, o, sh) for o, sh in wanted.get(e["key"], ()))
            ]
            for e, tensor, problem in t.read_items(window_id, sel):
                if problem or tensor is None:
                    raise RuntimeError(f"rank {r} window {window_id}: {problem}")
                yield s["slot"], e, tensor


def read_pieces(
    uri: str,
    run_id: str,
    window_id: int,
    wanted: dict[str, list[tuple[tuple, tuple]]] | None = None,
    slot: int | None = None,
    storage_options: dict | None = None,
) -> dict:
    """Read pieces of a window, whichever ranks wrote them, into `{(slot, key, offset): tensor}`, each
    checked against its CRC32. `wanted` maps a key to regions `(offset, shape)`: only saved pieces inside
    those regions are read (an expert's piece is one chunk, so 2 of 8 experts read 2 chunks); None: all."""
    return {
        (s, e["key"], tuple(e["offset"])): t
        for s, e, t in _iter_pieces(uri, run_id, window_id, wanted, slot, storage_options)
    }


def _inside(e: dict, offset, shape) -> bool:
    return len(e["offset"]) == len(offset) and all(
        o <= eo and eo + es <= o + s for eo, es, o, s in zip(e["offset"], e["shape"], offset, shape)
    )


def read_global(uri: str, run_id: str, window_id: int, slot: int = 0, storage_options: dict | None = None) -> dict:
    """One slot of a window as global tensors `{key: tensor}` assembled from every rank's pieces (any
    reader world size, e.g. one process reading what 2 ranks wrote). Regions no rank saved stay zero."""
    out: dict[str, torch.Tensor] = {}
    for _, e, t in _iter_pieces(uri, run_id, window_id, None, slot, storage_options):
        if e["key"] not in out:
            out[e["key"]] = torch.zeros(e["global_shape"], dtype=t.dtype)
        out[e["key"]][region(e["offset"], e["shape"])] = t
    return out
