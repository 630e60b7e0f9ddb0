"""Operators: the units sparse checkpointing schedules, named by module path.

An operator is one expert of one MoE layer (`<moe>.experts.<e>`: a dim-0 slice of grouped `[E, ...]` tensors,
or one module of an expert list) -- or all of a layer's grouped experts (`<moe>.experts`) when the optimizer's
update couples across that cut (model/granularity.py) --, one router (`<moe>.router`, with the MoE's own `[E]`
tensors), the non-expert state of one repeated block (`<block>.dense`) or a top-level module. Every parameter and
persistent buffer lands in exactly one operator, as pieces of this rank's local shards with global offsets from the
DTensor placement.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..core.operator import Operator, Piece, StatePiece
from ..runtime.distributed import library_group
from .granularity import coupled_experts
from .moe_structure import OperatorDiscoveryError, OperatorSpec, ancestors, find_moe_blocks
from .placements import check_placements

__all__ = [
    "Piece",
    "StatePiece",
    "Operator",
    "OperatorSpec",
    "OperatorDiscoveryError",
    "discover_operators",
    "expert_grid",
    "merged_operators",
    "moe_order",
    "local_tensor",
    "EXPERT_PARAM_NAMES",
]

# Grouped expert tensor names of TorchTitan and the harness (the tensorstore layout keys on them).
EXPERT_PARAM_NAMES = ("w1_EFD", "w2_EDF", "w3_EFD", "w1", "w2", "w3")
# Wrapper path components (activation checkpointing, torch.compile) left out of operator names.
_WRAPPER_PARTS = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)(?=\.|$)")


def local_offset(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offset, local shape) of this rank's shard of `t`."""
    if isinstance(t, DTensor):
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return tuple(offset), tuple(shape)
    return (0,) * t.dim(), tuple(t.shape)


def _whole_piece(fqn: str, t: torch.Tensor, is_param: bool) -> Piece | None:
    offset, shape = local_offset(t)
    if any(s == 0 for s in shape) and t.dim() > 0 and not is_param:
        return None  # uneven sharding left this rank empty
    # An empty shard of a parameter still has optimizer state on this rank: its step counter (a slot holds it).
    return Piece(fqn, is_param, tuple(t.shape), offset, tuple(slice(0, s) for s in shape), shape, t.dtype)


def _expert_piece(fqn: str, t: torch.Tensor, expert: int, is_param: bool) -> Piece | None:
    """The rows of expert `expert` (dim 0) held by this rank, whatever dim the tensor is sharded on."""
    offset, shape = local_offset(t)
    lo = expert - offset[0]
    if lo < 0 or lo >= shape[0] or any(s == 0 for s in shape[1:]):
        return None
    slices = (slice(lo, lo + 1),) + tuple(slice(0, s) for s in shape[1:])
    return Piece(fqn, is_param, tuple(t.shape), (expert,) + offset[1:], slices, (1,) + shape[1:], t.dtype)


def _clean(path: str) -> str:
    return _WRAPPER_PARTS.sub("", path).lstrip(".")


def discover_operators(model: nn.Module, spec: OperatorSpec | None = None, optimizer=None) -> list[Operator]:
    """All operators of `model` in a canonical order (by layer, then experts, router, dense), the same names on
    every rank.

    Args:
        model: the model as this rank holds it (FSDP2/DTensor shards, wrappers and torch.compile allowed).
        spec: where experts and routers are, when structural detection does not find them (None: detected).
        optimizer: the optimizer(s) that train it: the granularity follows their update rules (an MoE layer whose
            grouped expert tensors they update as a whole is one operator). None: one operator per expert.

    Returns:
        Every operator: one per expert (or per layer's experts, see `optimizer`), one router per MoE layer, the
        dense state of each repeated block and the top-level modules; every parameter and persistent buffer in
        exactly one of them, as this rank's pieces.

    Raises:
        PlacementError: a DTensor placement the capture cannot handle (model/placements.py).
        OperatorDiscoveryError: MoE-looking modules match no experts, or a pattern of `spec` matches nothing.
        UncapturedStateError: an optimizer whose update rule is unknown (optim_state.rule_of).
    """
    check_placements(model)  # a placement the capture cannot take: one line now, not a traceback in a step
    moes, blocks, tensors = find_moe_blocks(model, spec)
    # A parameter that never trains has no optimizer state: it is held like a buffer, by value.
    params = {n for n, p in model.named_parameters() if p.requires_grad}
    layers = _Layers.of(model, moes, blocks)
    table = _OperatorTable()
    merged = coupled_experts(model, moes, optimizer)
    for moe in moes:
        _add_moe(table, moe, layers, tensors, params, merged.get(moe.path, ""))
    for fqn, t in tensors.items():
        if fqn not in table.claimed:
            _add_dense(table, fqn, t, layers, fqn in params)
    return sorted(table.ops.values(), key=_canonical)


class _Layers:
    """Layer indices: the position of each repeated block (or of an MoE outside any block) in module order."""

    def __init__(self, layer_of: dict[str, int]):
        self.layer_of = layer_of
        self.holders = {a for u in layer_of for a in [u, *ancestors(u)]}  # modules that hold a block or an MoE

    @classmethod
    def of(cls, model: nn.Module, moes, blocks: list[str]) -> _Layers:
        inside = set(blocks)
        units = blocks + [
            m.path for m in moes if m.path not in inside and not any(a in inside for a in ancestors(m.path))
        ]
        order = {p: i for i, p in enumerate(dict(model.named_modules()))}
        units.sort(key=order.__getitem__)
        return cls({u: i for i, u in enumerate(units)})

    def unit(self, fqn: str) -> str | None:
        """The block (or MoE) `fqn` sits in; None: outside every one."""
        return next((a for a in ancestors(fqn) if a in self.layer_of), None)


class _OperatorTable:
    """The operators found so far, and the tensors they claimed."""

    def __init__(self):
        self.ops: dict[str, Operator] = {}
        self.claimed: set[str] = set()

    def add(self, name: str, kind: str, fqn: str, piece: Piece | None, **kw) -> None:
        o = self.ops.setdefault(name, Operator(name, kind, **kw))
        self.claimed.add(fqn)
        if piece is not None:
            o.pieces.append(piece)


def _add_moe(table: _OperatorTable, moe, layers: _Layers, tensors: dict, params: set[str], merged: str) -> None:
    """One operator per expert (a dim-0 slice of each grouped tensor, or its own modules) and the MoE's router;
    `merged` (why): one operator for all the experts, each grouped tensor whole."""
    path = moe.path if moe.path in layers.layer_of else layers.unit(moe.path)
    layer, base = layers.layer_of[path], _clean(moe.path)  # pyright: ignore[reportArgumentType]  (an MoE is a unit or in one)
    if merged:
        name = f"{base}.experts" if base else "experts"
        experts = tuple(range(moe.num_experts))
        table.ops[name] = Operator(name, "expert", layer, moe=moe.path, experts=experts, merged=merged)
        for fqn in moe.grouped:
            table.add(name, "expert", fqn, _whole_piece(fqn, tensors[fqn], fqn in params))
    else:
        for e in range(moe.num_experts):
            name = f"{base}.experts.{e}" if base else f"experts.{e}"
            cuts = {fqn: (0,) for fqn in moe.grouped}
            table.ops[name] = Operator(name, "expert", layer, e, moe=moe.path, cuts=cuts, experts=(e,))
            for fqn in moe.grouped:
                table.add(name, "expert", fqn, _expert_piece(fqn, tensors[fqn], e, fqn in params))
            for fqn in moe.per_expert[e] if moe.per_expert else ():
                table.add(name, "expert", fqn, _whole_piece(fqn, tensors[fqn], fqn in params))
    if moe.router:
        name = f"{base}.router" if base else "router"
        table.ops[name] = Operator(name, "router", layer, moe=moe.path, modules=tuple(moe.router_modules))
        for fqn in moe.router:
            table.add(name, "router", fqn, _whole_piece(fqn, tensors[fqn], fqn in params))


def _add_dense(table: _OperatorTable, fqn: str, t: torch.Tensor, layers: _Layers, is_param: bool) -> None:
    """A tensor no expert or router claimed: its block's dense operator, else the outermost module on the way down
    that holds no block and no MoE (else the tensor itself), with no layer."""
    u = layers.unit(fqn)
    if u is not None:
        name, layer = f"{_clean(u)}.dense", layers.layer_of[u]
    else:
        name = next((a for a in reversed(list(ancestors(fqn))) if a and a not in layers.holders), fqn)
        name, layer = _clean(name), None
    table.add(name, "dense", fqn, _whole_piece(fqn, t, is_param), layer=layer)


_KIND_RANK = {"expert": 0, "router": 1, "dense": 2}


def _canonical(o: Operator) -> tuple:
    """By layer (top-level operators last), then experts, router, dense, then expert index and name."""
    top = 1 << 30
    return (top if o.layer is None else o.layer, _KIND_RANK[o.kind], o.expert or 0, o.name)


def moe_order(ops: list[Operator]) -> list[str]:
    """The MoE blocks' module paths in MoE-layer order (the rows of `expert_grid` and of routed-token counts)."""
    seen: dict[str, int] = {}
    for o in ops:
        if o.kind == "expert" and o.moe is not None and o.moe not in seen:
            seen[o.moe] = o.layer if o.layer is not None else 1 << 30
    return sorted(seen, key=lambda m: (seen[m], m))


def expert_grid(ops: list[Operator]) -> dict[tuple[int, int], str]:
    """(layer index among MoE layers, expert) -> operator name (every expert of a merged operator names it)."""
    idx = {m: i for i, m in enumerate(moe_order(ops))}
    return {(idx[o.moe], e): o.name for o in ops if o.kind == "expert" for e in o.experts}  # pyright: ignore[reportArgumentType]  (an expert has its MoE)


def merged_operators(ops) -> dict[str, str]:
    """Operator name -> why its layer's experts are one operator, for every merged operator (shown to users)."""
    return {o.name: o.merged for o in (ops.values() if isinstance(ops, dict) else ops) if o.merged}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def agreed_sizes(
    ops: dict[str, Operator], compute_dtype: torch.dtype, group=None
) -> tuple[dict[str, int], dict[str, int]]:
    """Full and compute bytes per operator, the max over `group`'s ranks: every rank plans from the same sizes."""
    names = list(ops)
    sizes = torch.tensor(
        [[ops[n].full_bytes(), ops[n].compute_bytes(compute_dtype.itemsize)] for n in names], dtype=torch.float64
    )
    if dist.is_initialized():
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=library_group(group))
    full, compute = ({n: int(sizes[i, k]) for i, n in enumerate(names)} for k in (0, 1))
    return full, compute
