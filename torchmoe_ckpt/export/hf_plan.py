"""The plan of an export (`export_hf`), checked before a byte is read: every stored tensor of slot 0 through the name
map on meta tensors, the completeness check (every tensor of the target exactly once at its shape, nothing else),
which weights are read (master or compute), and the shards."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.errors import TorchmoeError
from .hf_names import NameMap
from .slot_zero import SlotZero, StoredTensor

__all__ = ["IncompleteExportError", "Planned", "one_line", "out_dtype", "plan_export", "shards_of", "weights_source"]


class IncompleteExportError(TorchmoeError, ValueError):
    """The export would not write every tensor of the target model exactly once at its shape (a dropped expert, a
    name map that misses or duplicates a name, a window that lacks part of a tensor): nothing is written."""


@dataclass
class Planned:
    stored: StoredTensor
    outputs: dict[str, tuple[int, ...]]  # HF name -> shape
    nbytes: int  # of its outputs in the export dtype


def out_dtype(st: StoredTensor, dtype: torch.dtype) -> torch.dtype:
    d = st.pieces[0].dtype
    return dtype if d.is_floating_point else d  # integer buffers keep their dtype


def one_line(head: str, names: list[str], limit: int = 8) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return f"{head}: {', '.join(names[:limit])}{more}"


def plan_export(slot: SlotZero, expected: dict, name_map: NameMap, dtype: torch.dtype, what: str) -> list[Planned]:
    """Every stored tensor's outputs through the name map (on meta tensors), checked complete; in target order."""
    problems = [p for st in slot.tensors.values() if (p := st.coverage_problem())]
    if problems:
        raise IncompleteExportError(one_line(f"window {slot.window_id} slot 0 lacks part of a tensor", problems))
    planned, made = [], {}
    dup: list[str] = []
    for st in slot.tensors.values():
        od = out_dtype(st, dtype)
        outs = name_map(st.fqn, torch.empty(st.shape, dtype=od, device="meta"))
        shapes = {n: tuple(t.shape) for n, t in outs.items()}
        for n in shapes:
            if n in made:
                dup.append(f"{n} (from {made[n]} and {st.fqn})")
            made[n] = st.fqn
        nbytes = sum(t.numel() * t.element_size() for t in outs.values())
        planned.append(Planned(st, shapes, nbytes))
    shapes_out = {n: s for p in planned for n, s in p.outputs.items()}
    missing = [n for n in expected if n not in shapes_out]
    extra = sorted(n for n in shapes_out if n not in expected)
    wrong = [
        f"{n} {shapes_out[n]} != {expected[n]}" for n in expected if n in shapes_out and shapes_out[n] != expected[n]
    ]
    head = f"export of window {slot.window_id} refused, nothing written: {what}"
    if missing:
        raise IncompleteExportError(
            one_line(
                f"{head} would miss {len(missing)} of its {len(expected)} tensors (dropped by the name map, or not "
                "in the window: check the name map and that --model-config is the run's model)",
                missing,
            )
        )
    for label, names in (("would write tensors it does not have", extra), ("would write names twice", dup)):
        if names:
            raise IncompleteExportError(one_line(f"{head} {label} (fix the name map or --model-config)", names))
    if wrong:
        raise IncompleteExportError(one_line(f"{head} has other shapes (is --model-config the run's?)", wrong))
    order = {n: i for i, n in enumerate(expected)}
    planned = [p for p in planned if p.outputs]  # a stored tensor the target does not hold (mapped to nothing)
    return sorted(planned, key=lambda p: min(order[n] for n in p.outputs))


def weights_source(slot: SlotZero, planned: list[Planned], dtype: torch.dtype) -> str:
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
            one_line(
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


def shards_of(planned: list[Planned], max_bytes: int) -> list[list[Planned]]:
    """Consecutive groups of at most `max_bytes` (a larger tensor alone); a stored tensor's outputs stay together."""
    shards: list[list[Planned]] = [[]]
    size = 0
    for p in planned:
        if shards[-1] and size + p.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes
    return [s for s in shards if s]
