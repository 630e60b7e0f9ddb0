"""What an operator owns on this rank: its tensor pieces, its optimizer state pieces, and the operator itself (found
by `model.operators.discover_operators`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Piece:
    """The region of one tensor that an operator owns on this rank."""

    fqn: str  # parameter/buffer name in the model
    is_param: bool
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]  # offset of this piece in the global tensor
    local_slices: tuple[slice, ...]  # where this piece sits in the rank-local tensor
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32  # the tensor's own dtype (buffers are copied in it: int64 counters)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class StatePiece:
    """The part of one optimizer state tensor (`optimizer.state[p][key]`) an operator owns on this rank."""

    key: str  # exp_avg, exp_avg_sq, max_exp_avg_sq, momentum_buffer, row_var, col_var, step, ...
    piece: Piece | None  # its region (the parameter's own piece when shaped and sharded like it); None: scalar
    dtype: torch.dtype

    @property
    def scalar(self) -> bool:
        """A 0-dim state (`step`): one per tensor, shared by the operators sliced from it."""
        return self.piece is None

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * (1 if self.piece is None else self.piece.numel)


@dataclass
class Operator:
    name: str
    kind: str  # "expert" | "router" | "dense"
    layer: int | None = None  # index of the repeated block (or MoE) it belongs to; None: top level
    expert: int | None = None  # the one expert it holds; None: not an expert, or several (`experts`)
    pieces: list[Piece] = field(default_factory=list)
    moe: str | None = None  # module path of its MoE block (expert and router operators)
    modules: tuple[str, ...] = ()  # router operators: the modules whose forward routes (for hooks)
    # Tensors this operator owns only a slice of, and the dims it is cut along; the same on every rank.
    cuts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # The experts (indices in its MoE) an expert operator holds: one, or all of its layer's when merged.
    experts: tuple[int, ...] = ()
    # Why its layer's experts are one operator (model/granularity.py: the optimizer couples across the cut); "": not.
    merged: str = ""
    # Optimizer state per parameter fqn (optim_state.attach_optimizer_state); None: the AdamW layout.
    state: dict[str, tuple[StatePiece, ...]] | None = None

    def __post_init__(self) -> None:
        if self.kind == "expert" and not self.experts and self.expert is not None:
            self.experts = (self.expert,)

    def param_numel(self) -> int:
        return sum(p.numel for p in self.pieces if p.is_param)

    def full_bytes(self, master_itemsize: int = 4, optim_states: int = 2) -> int:
        """Master weights + optimizer state + buffers, as copied for an ACTIVE operator (else: AdamW's layout)."""
        if self.state is None:
            params = self.param_numel() * master_itemsize * (1 + optim_states)
            steps = 8 * len({p.fqn for p in self.pieces if p.is_param})
            return params + steps + self.buffer_bytes()
        n = self.buffer_bytes()
        for p in self.pieces:
            if p.is_param:
                n += p.numel * p.dtype.itemsize + sum(s.nbytes for s in self.state.get(p.fqn, ()))
        return n

    def compute_bytes(self, compute_itemsize: int) -> int:
        """Compute weights (+ buffers used in forward), as copied for a FROZEN operator."""
        return self.param_numel() * compute_itemsize + self.buffer_bytes()

    def buffer_bytes(self) -> int:
        return sum(p.numel * p.dtype.itemsize for p in self.pieces if not p.is_param)
