"""A slot: the host buffers one iteration's copy fills, one item per tensor piece, and how they are laid out for an
active operator (full state) and a frozen one (compute weights); filled by the copy engine, persisted by the tiers."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .operator import Operator, Piece, StatePiece


@dataclass
class SlotItem:
    key: str  # DCP fqn, e.g. "model.<param>", "optim.<param>.exp_avg", "compute.<param>"
    role: str  # master | compute | buffer | the optimizer state key (exp_avg, step, momentum_buffer, row_var, ...)
    op: str  # owning operator
    piece: Piece
    buffer: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def write_item(self):
        """This item as a standard DCP WriteItem (a shard with global offsets)."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        pc = self.piece  # a 0-dim state (step) is one whole tensor, whatever piece carries it
        scalar = self.buffer.dim() == 0
        offsets, sizes, glob = (torch.Size(() if scalar else x) for x in (pc.global_offset, pc.shape, pc.global_shape))
        return WriteItem(
            index=MetadataIndex(self.key, offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets, sizes),
                properties=TensorProperties.create_from_tensor(self.buffer),
                size=glob,
            ),
        )


class SlotBacking(Protocol):
    """The mapped file a slot's buffers are views of (storage_format/slot_files.py's `Backing`, a /dev/shm data file).
    A Protocol so that core imports no storage; it names what the layers above read through `Slot.backing`."""

    @property
    def path(self) -> str: ...  # the file's name (a window hard-links it)

    @property
    def fd(self) -> int: ...

    @property
    def t(self) -> torch.Tensor: ...  # uint8 view of the whole file

    def free(self) -> bool: ...  # no window links the file: the slot may be written again


class SlotLayoutMemo(Protocol):
    """A persist's layout of one slot, computed once and kept on it (tiers/host_tier.py's `_SlotLayoutCache`).
    The tier narrows it to its own type; `n_items` tells one made before the items changed."""

    @property
    def n_items(self) -> int: ...


@dataclass
class Slot:
    """One slot's host buffers. `step` is the training iteration whose post-update state it holds. `backing` and
    `raw_layout` are set by the storage layer and the host tier (plain slots have neither)."""

    index: int
    active: tuple[str, ...]
    frozen: tuple[str, ...]
    items: list[SlotItem]
    step: int | None = None
    done: threading.Event = field(default_factory=threading.Event)
    copy_seconds: float = 0.0
    error: BaseException | None = None
    # not compared or printed: they describe where the buffers live, not what they hold
    backing: SlotBacking | None = field(default=None, compare=False, repr=False)
    raw_layout: SlotLayoutMemo | None = field(default=None, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)

    @property
    def complete(self) -> bool:
        return self.done.is_set() and self.error is None and self.step is not None

    def write_items(self) -> list:
        return [i.write_item() for i in self.items]


_ADAMW_LAYOUT = (("exp_avg", False), ("exp_avg_sq", False), ("step", True))


def full_specs(op: Operator) -> tuple[list[tuple], list[tuple]]:
    """An ACTIVE operator's full copy: per tensor piece (key, role, piece, shape, dtype), and per parameter its
    0-dim states (fqn, piece, [(key, dtype)]), held once per tensor. From `Operator.state`, else AdamW's layout."""
    items: list[tuple] = []
    scalars: list[tuple] = []
    for pc in op.pieces:
        if not pc.is_param:
            items.append((f"model.{pc.fqn}", "buffer", pc, pc.shape, pc.dtype))
            continue
        if op.state is None:
            master = torch.float32
            state = [StatePiece(k, None if sc else pc, torch.float32) for k, sc in _ADAMW_LAYOUT]
        else:
            master, state = pc.dtype, op.state.get(pc.fqn, ())
        sc = [(s.key, s.dtype) for s in state if s.scalar]
        if sc:  # uneven sharding may leave this rank no elements of the tensor, but its step counter
            scalars.append((pc.fqn, pc, sc))
        if pc.numel == 0:
            continue
        items.append((f"model.{pc.fqn}", "master", pc, pc.shape, master))
        for s in state:
            if s.piece is not None and s.piece.numel > 0:  # None: a scalar (listed above)
                items.append((f"optim.{pc.fqn}.{s.key}", s.key, s.piece, s.piece.shape, s.dtype))
    return items, scalars


def compute_specs(op: Operator, compute_dtype: torch.dtype) -> list[tuple]:
    """A FROZEN operator's copy: per non-empty piece (key, role, piece, shape, dtype), compute weights and buffers."""
    return [
        (f"compute.{pc.fqn}", "compute", pc, pc.shape, compute_dtype)
        if pc.is_param
        else (f"model.{pc.fqn}", "buffer", pc, pc.shape, pc.dtype)
        for pc in op.pieces
        if pc.numel > 0
    ]


def build_slot(  # noqa: PLR0913  (the slot: index, active, frozen; its sources; how its buffers are made)
    index: int,
    active: tuple[str, ...],
    frozen: tuple[str, ...],
    ops: dict[str, Operator],
    compute_dtype: torch.dtype,
    pin_memory: bool = False,
    alloc: Callable[[tuple, torch.dtype], torch.Tensor] | None = None,
) -> Slot:
    """Allocate one slot's host buffers; `alloc(shape, dtype)` replaces the allocator (e.g. meta tensors)."""
    items: list[SlotItem] = []
    seen_scalars: set[str] = set()
    alloc = alloc or (lambda shape, dtype: torch.empty(shape, dtype=dtype, pin_memory=pin_memory))
    for name in active:
        full, scalars = full_specs(ops[name])
        items += [SlotItem(key, role, name, pc, alloc(shape, dt)) for key, role, pc, shape, dt in full]
        for fqn, pc, sc in scalars:
            if fqn not in seen_scalars:  # one step counter per tensor, shared by the experts sliced from it
                seen_scalars.add(fqn)
                items += [SlotItem(f"optim.{fqn}.{k}", k, name, pc, alloc((), dt)) for k, dt in sc]
    for name in frozen:
        items += [
            SlotItem(k, role, name, pc, alloc(sh, dt))
            for k, role, pc, sh, dt in compute_specs(ops[name], compute_dtype)
        ]
    return Slot(index, tuple(active), tuple(frozen), items)
