"""Per-iteration capture of one slot into host buffers that are allocated once and reused.

A slot holds, for its ACTIVE operators, the full state (fp32 master weights, AdamW exp_avg/exp_avg_sq,
step, buffers) and, for the operators whose full copy comes later in the window, only the compute weights
(bf16/fp16 cast, or fp32 in pure fp32 training). Each captured tensor is a `SlotItem` that already knows
its DCP identity (key, global offsets, global size), so storage tiers write it without reshaping.

The copy runs off the training thread: on CPU a worker thread, on CUDA pinned buffers and a side stream.
The training thread waits only when the next update would overwrite a source still being copied.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from . import faults
from .operators import Operator, Piece, local_tensor

ROLES_FULL = ("master", "exp_avg", "exp_avg_sq")


@dataclass
class SlotItem:
    key: str          # DCP fqn, e.g. "model.<param>", "optim.<param>.exp_avg", "compute.<param>"
    role: str         # master | exp_avg | exp_avg_sq | step | compute | buffer
    op: str           # owning operator
    piece: Piece
    buffer: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def write_item(self):
        """This item as a standard DCP WriteItem (a shard with global offsets)."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        offsets = torch.Size(self.piece.global_offset if self.role != "step" else ())
        sizes = torch.Size(self.piece.shape if self.role != "step" else ())
        glob = torch.Size(self.piece.global_shape if self.role != "step" else ())
        return WriteItem(index=MetadataIndex(self.key, offsets), type=WriteItemType.SHARD,
                         tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, sizes),
                                                     properties=TensorProperties.create_from_tensor(self.buffer),
                                                     size=glob))


@dataclass
class Slot:
    """One slot's host buffers. `step` is the training iteration whose post-update state it holds."""
    index: int
    active: tuple[str, ...]
    frozen: tuple[str, ...]
    items: list[SlotItem]
    step: int | None = None
    done: threading.Event = field(default_factory=threading.Event)
    copy_seconds: float = 0.0
    error: BaseException | None = None

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)

    @property
    def complete(self) -> bool:
        return self.done.is_set() and self.error is None and self.step is not None

    def write_items(self) -> list:
        return [i.write_item() for i in self.items]


class StateAccess:
    """Resolves slot items to the live tensors of a model + optimizer (rank-local storage)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.params = dict(model.named_parameters())
        self.buffers = {n: b for n, b in model.named_buffers() if b is not None}
        self.buffers.update((n, p) for n, p in self.params.items() if not p.requires_grad)  # held by value
        self.optimizer = optimizer

    def source(self, item: SlotItem) -> torch.Tensor:
        piece = item.piece
        if item.role == "buffer":
            return local_tensor(self.buffers[piece.fqn])[piece.local_slices]
        p = self.params[piece.fqn]
        if item.role in ("master", "compute"):
            return local_tensor(p)[piece.local_slices]
        state = self.optimizer.state[p]
        if item.role == "step":
            return state["step"]
        return local_tensor(state[item.role])[piece.local_slices]


def build_slot(index: int, active: tuple[str, ...], frozen: tuple[str, ...], ops: dict[str, Operator],
               compute_dtype: torch.dtype, pin_memory: bool = False) -> Slot:
    """Allocate the host buffers of one slot (done once per window plan, then reused)."""
    items: list[SlotItem] = []
    seen_steps: set[str] = set()

    def alloc(shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=pin_memory)

    for name in active:
        for pc in ops[name].pieces:
            if not pc.is_param:
                items.append(SlotItem(f"model.{pc.fqn}", "buffer", name, pc, alloc(pc.shape, pc.dtype)))
                continue
            if pc.numel == 0:  # uneven sharding left this rank no elements, but a step counter
                if pc.fqn not in seen_steps:
                    seen_steps.add(pc.fqn)
                    items.append(SlotItem(f"optim.{pc.fqn}.step", "step", name, pc, alloc((), torch.float32)))
                continue
            items.append(SlotItem(f"model.{pc.fqn}", "master", name, pc, alloc(pc.shape, torch.float32)))
            items.append(SlotItem(f"optim.{pc.fqn}.exp_avg", "exp_avg", name, pc, alloc(pc.shape, torch.float32)))
            items.append(SlotItem(f"optim.{pc.fqn}.exp_avg_sq", "exp_avg_sq", name, pc, alloc(pc.shape, torch.float32)))
            if pc.fqn not in seen_steps:  # one step counter per tensor, shared by the experts sliced from it
                seen_steps.add(pc.fqn)
                items.append(SlotItem(f"optim.{pc.fqn}.step", "step", name, pc, alloc((), torch.float32)))
    for name in frozen:
        for pc in ops[name].pieces:
            if pc.numel == 0:
                continue
            role, dtype, key = ("compute", compute_dtype, f"compute.{pc.fqn}") if pc.is_param else \
                ("buffer", pc.dtype, f"model.{pc.fqn}")
            items.append(SlotItem(key, role, name, pc, alloc(pc.shape, dtype)))
    return Slot(index, tuple(active), tuple(frozen), items)


class SimulatedCopyFault(RuntimeError):
    """Raised by the fault hook to tear a slot copy in the middle (failure-injection tests)."""


class SnapshotEngine:
    """Copies slots off the training thread and measures how long the training thread waits for it."""

    def __init__(self, access: StateAccess, use_cuda: bool = False):
        self.access = access
        self.use_cuda = use_cuda and torch.cuda.is_available()
        self.inflight: Slot | None = None
        self.wait_seconds_total = 0.0
        self.waits: list[float] = []
        # One-shot hook called with (slot, items_copied); may raise SimulatedCopyFault to tear the copy.
        self.fault_hook: Callable[[Slot, int], None] | None = None
        self._jobs: queue.Queue = queue.Queue()
        self._stream = torch.cuda.Stream() if self.use_cuda else None
        self._thread = threading.Thread(target=self._run, name="tmoe-snapshot", daemon=True)
        self._thread.start()

    def capture(self, slot: Slot, step: int) -> None:
        """Start copying the live state into `slot` (call right after the optimizer step)."""
        self.wait()
        slot.done.clear()
        slot.error, slot.step = None, None
        pairs = []
        with torch.no_grad():
            for it in slot.items:
                if it.role == "buffer":
                    # Buffers may change in the next forward (counters, running stats), before the next update
                    # that the copy thread is ordered against: copy them now, they are small.
                    it.buffer.copy_(self.access.source(it))
                else:
                    pairs.append((self.access.source(it), it.buffer))
        self.inflight = slot
        if self._stream is not None:
            # Side stream: ordered after the optimizer step, overlapping the next forward/backward.
            self._stream.wait_stream(torch.cuda.current_stream())
        self._jobs.put((slot, step, pairs))

    def shutdown(self) -> None:
        """Stop the copy thread (after a simulated crash, or at exit)."""
        self._jobs.put(None)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            slot, step, pairs = job
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    if self._stream is not None:
                        with torch.cuda.stream(self._stream):
                            for src, dst in pairs:
                                dst.copy_(src, non_blocking=True)
                        self._stream.synchronize()
                    else:
                        for n, (src, dst) in enumerate(pairs):
                            if n == len(pairs) // 2:
                                faults.point("snapshot_copy")
                            if self.fault_hook is not None and n == len(pairs) // 2:
                                hook, self.fault_hook = self.fault_hook, None
                                hook(slot, n)
                            dst.copy_(src)
                slot.step = step
            except BaseException as exc:  # surfaced to the training thread by wait()
                slot.error = exc
            slot.copy_seconds = time.perf_counter() - t0
            slot.done.set()

    def wait(self) -> float:
        """Block until the in-flight copy is finished; returns (and accumulates) the seconds waited."""
        slot = self.inflight
        if slot is None:
            return 0.0
        t0 = time.perf_counter()
        slot.done.wait()
        waited = time.perf_counter() - t0
        self.inflight = None
        self.wait_seconds_total += waited
        self.waits.append(waited)
        if slot.error is not None:
            raise slot.error
        return waited


@torch.no_grad()
def restore_slot(slot: Slot, access: StateAccess, roles: tuple[str, ...] | None = None) -> int:
    """Copy a slot back into live tensors (all items, or only those with the given roles). Returns bytes."""
    n = 0
    for it in slot.items:
        if roles is not None and it.role not in roles:
            continue
        access.source(it).copy_(it.buffer)
        n += it.nbytes
    return n
