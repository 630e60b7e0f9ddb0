"""Operators: the units that sparse checkpointing schedules.

An operator is one expert of one MoE layer (a slice of the grouped `w1/w2/w3` tensors along the expert
dimension), one router (gate weight + the MoE's `expert_bias`), the non-expert parameters of one
transformer block, or a top-level module (embeddings, final norm, output head). Each operator is mapped to
the pieces of *this rank's* local shards that it owns, with global offsets taken from the DTensor
placement, so FSDP2 `Shard(0)`, `Shard(1)` (more shard ranks than experts) and HSDP replicas all work.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

EXPERT_PARAM_NAMES = ("w1_EFD", "w2_EDF", "w3_EFD", "w1", "w2", "w3")
ROUTER_BUFFER_NAMES = ("expert_bias_E", "expert_bias")
_LAYER_RE = re.compile(r"^(.*?layers\.(\d+))\.")


@dataclass(frozen=True)
class Piece:
    """The region of one tensor that an operator owns on this rank."""
    fqn: str                        # parameter/buffer name in the model
    is_param: bool
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]  # offset of this piece in the global tensor
    local_slices: tuple[slice, ...] # where this piece sits in the rank-local tensor
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class Operator:
    name: str
    kind: str                       # "expert" | "router" | "dense"
    layer: int | None = None
    expert: int | None = None
    pieces: list[Piece] = field(default_factory=list)

    def param_numel(self) -> int:
        return sum(p.numel for p in self.pieces if p.is_param)

    def full_bytes(self, master_itemsize: int = 4, optim_states: int = 2) -> int:
        """Master weights + optimizer moments (+ step) + buffers, as copied for an ACTIVE operator."""
        params = self.param_numel() * master_itemsize * (1 + optim_states)
        steps = 8 * len({p.fqn for p in self.pieces if p.is_param})
        return params + steps + self.buffer_bytes()

    def compute_bytes(self, compute_itemsize: int) -> int:
        """Compute weights (+ buffers used in forward), as copied for a FROZEN operator."""
        return self.param_numel() * compute_itemsize + self.buffer_bytes()

    def buffer_bytes(self) -> int:
        return sum(p.numel * 4 for p in self.pieces if not p.is_param)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _local_offset(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offset, local shape) of this rank's shard of `t`."""
    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return tuple(offset), tuple(shape)
    return (0,) * t.dim(), tuple(t.shape)


def _whole_piece(fqn: str, t: torch.Tensor, is_param: bool) -> Piece | None:
    offset, shape = _local_offset(t)
    if any(s == 0 for s in shape) and t.dim() > 0:
        return None  # uneven sharding left this rank empty
    return Piece(fqn, is_param, tuple(t.shape), offset, tuple(slice(0, s) for s in shape), shape)


def _expert_piece(fqn: str, t: torch.Tensor, expert: int) -> Piece | None:
    """The rows of expert `expert` (dim 0) held by this rank, whatever dim the tensor is sharded on."""
    offset, shape = _local_offset(t)
    lo = expert - offset[0]
    if lo < 0 or lo >= shape[0]:
        return None
    slices = (slice(lo, lo + 1),) + tuple(slice(0, s) for s in shape[1:])
    return Piece(fqn, True, tuple(t.shape), (expert,) + offset[1:], slices, (1,) + shape[1:])


def discover_operators(model: nn.Module) -> list[Operator]:
    """All operators of `model`, in a canonical order (by layer, then experts, router, dense), each with the
    pieces this rank holds. Every rank returns the same names in the same order (pieces may differ)."""
    ops: dict[str, Operator] = {}
    claimed: set[str] = set()

    def op(name: str, kind: str, layer=None, expert=None) -> Operator:
        if name not in ops:
            ops[name] = Operator(name, kind, layer, expert)
        return ops[name]

    def layer_of(fqn: str) -> tuple[str | None, int | None]:
        m = _LAYER_RE.match(fqn)
        return (m.group(1), int(m.group(2))) if m else (None, None)

    params = dict(model.named_parameters())
    buffers = {n: b for n, b in model.named_buffers() if b is not None}
    # Experts: grouped tensors whose leading dim is the expert count of their MoE.
    for fqn, p in params.items():
        leaf = fqn.rsplit(".", 1)[-1]
        if leaf in EXPERT_PARAM_NAMES and p.dim() == 3:
            prefix, layer = layer_of(fqn)
            for e in range(p.shape[0]):
                o = op(f"{prefix or 'model'}.experts.{e}", "expert", layer, e)
                piece = _expert_piece(fqn, p, e)
                if piece is not None:
                    o.pieces.append(piece)
            claimed.add(fqn)
    # Routers: gate parameters plus the load-balancing bias buffer of the same MoE.
    for fqn, t in list(params.items()) + list(buffers.items()):
        leaf = fqn.rsplit(".", 1)[-1]
        is_router = ".router." in f".{fqn}" or leaf in ROUTER_BUFFER_NAMES
        if fqn in claimed or not is_router:
            continue
        prefix, layer = layer_of(fqn)
        piece = _whole_piece(fqn, t, fqn in params)
        o = op(f"{prefix or 'model'}.router", "router", layer)
        if piece is not None:
            o.pieces.append(piece)
        claimed.add(fqn)
    # Everything else: one dense operator per transformer block, one per top-level module.
    for fqn, p in params.items():
        if fqn in claimed:
            continue
        prefix, layer = layer_of(fqn)
        name = f"{prefix}.dense" if prefix else fqn.split(".", 1)[0]
        o = op(name, "dense", layer)
        piece = _whole_piece(fqn, p, True)
        if piece is not None:
            o.pieces.append(piece)
    kind_rank = {"expert": 0, "router": 1, "dense": 2}
    return sorted(ops.values(), key=lambda o: (o.layer if o.layer is not None else 1 << 30, kind_rank[o.kind],
                                               o.expert if o.expert is not None else 0, o.name))


def expert_grid(ops: list[Operator]) -> dict[tuple[int, int], str]:
    """(layer index among MoE layers, expert) -> operator name."""
    layers = sorted({o.layer for o in ops if o.kind == "expert"})
    idx = {layer: i for i, layer in enumerate(layers)}
    return {(idx[o.layer], o.expert): o.name for o in ops if o.kind == "expert"}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return _local(t)
