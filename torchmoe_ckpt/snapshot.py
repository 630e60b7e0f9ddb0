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
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from . import faults
from .background import stop_at_exit
from .errors import TorchmoeError
from .operators import Operator, Piece, local_tensor

ROLES_FULL = ("master", "exp_avg", "exp_avg_sq")


@dataclass
class SlotItem:
    key: str  # DCP fqn, e.g. "model.<param>", "optim.<param>.exp_avg", "compute.<param>"
    role: str  # master | exp_avg | exp_avg_sq | step | compute | buffer
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

        offsets = torch.Size(self.piece.global_offset if self.role != "step" else ())
        sizes = torch.Size(self.piece.shape if self.role != "step" else ())
        glob = torch.Size(self.piece.global_shape if self.role != "step" else ())
        return WriteItem(
            index=MetadataIndex(self.key, offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets, sizes),
                properties=TensorProperties.create_from_tensor(self.buffer),
                size=glob,
            ),
        )


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


def build_slot(
    index: int,
    active: tuple[str, ...],
    frozen: tuple[str, ...],
    ops: dict[str, Operator],
    compute_dtype: torch.dtype,
    pin_memory: bool = False,
    alloc: Callable[[tuple, torch.dtype], torch.Tensor] | None = None,
) -> Slot:
    """Allocate the host buffers of one slot (done once per window plan, then reused). `alloc(shape, dtype)`
    replaces the allocator (meta tensors: the slot's layout without memory, as DCP planners use it)."""
    items: list[SlotItem] = []
    seen_steps: set[str] = set()
    if alloc is None:

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
            role, dtype, key = (
                ("compute", compute_dtype, f"compute.{pc.fqn}")
                if pc.is_param
                else ("buffer", pc.dtype, f"model.{pc.fqn}")
            )
            items.append(SlotItem(key, role, name, pc, alloc(pc.shape, dtype)))
    return Slot(index, tuple(active), tuple(frozen), items)


class SimulatedCopyFault(TorchmoeError, RuntimeError):
    """Raised by the fault hook to tear a slot copy in the middle (failure-injection tests)."""


class SnapshotEngine:
    """Copies slots off the training thread and measures how long the training thread waits for it."""

    def __init__(self, access: StateAccess, use_cuda: bool = False):
        self.access = access
        self.use_cuda = use_cuda and torch.cuda.is_available()
        self.inflight: Slot | None = None
        self.wait_seconds_total = 0.0
        self.waits: list[float] = []
        # What copies cost under training (for pricing the window): the last one as (bytes, wall s, copy-thread
        # CPU s), and totals over every finished copy.
        self.last_copy: tuple[int, float, float] | None = None
        self.copy_totals = {"copies": 0, "bytes": 0, "wall_s": 0.0, "cpu_s": 0.0}
        self._sources: dict[int, tuple] = {}  # id(slot) -> (slot ref, state key, source views): see capture
        self._views_key: tuple | None = None  # the state key the per-piece views below were resolved under
        self._views: dict[tuple, tuple] = {}  # (id(piece), role) -> (piece, live view)
        # One-shot hook called with (slot, items_copied); may raise SimulatedCopyFault to tear the copy.
        self.fault_hook: Callable[[Slot, int], None] | None = None
        # A slower host link, emulated (benchmarks: the regime sweep of bench_ettr): a copy of n bytes takes at
        # least n / throttle_bytes_per_s seconds; the copy thread sleeps the rest (no CPU, like a DMA transfer).
        self.throttle_bytes_per_s: float | None = None
        self._jobs: queue.Queue = queue.Queue()
        self._stream = torch.cuda.Stream() if self.use_cuda else None
        self._thread = threading.Thread(target=self._run, name="tmoe-snapshot", daemon=True)
        self._thread.start()
        stop_at_exit(self)

    def capture(self, slot: Slot, step: int) -> None:
        """Start copying the live state into `slot` (call right after the optimizer step)."""
        self.wait()
        slot.done.clear()
        slot.error, slot.step = None, None
        # Resolving each item to its live tensor (lookups and a slice, ~4 us) costs milliseconds per capture for
        # hundreds of items on the training thread: resolve a slot once and reuse the views while the model's
        # and optimizer's tensors are the same storage (a new optimizer state or a reload changes the key).
        acc = self.access
        key = tuple(local_tensor(t).data_ptr() for t in acc.params.values()) + tuple(
            local_tensor(v).data_ptr() for st in acc.optimizer.state.values() for v in st.values() if torch.is_tensor(v)
        )
        hit = self._sources.get(id(slot))
        if hit is None or hit[0]() is not slot or hit[1] != key:
            # A new plan (another W, a popularity reorder) brings new slots made of the same pieces: their views
            # are cached per (piece, role) while the storage key holds, so a window start resolves nothing anew.
            if self._views_key != key:
                self._views_key, self._views = key, {}
            views = self._views
            srcs = []
            for it in slot.items:
                if it.role == "buffer":
                    srcs.append(None)
                    continue
                vk = (id(it.piece), it.role)
                got = views.get(vk)
                if got is None or got[0] is not it.piece:  # the piece is held, so its id is not reused
                    got = views[vk] = (it.piece, acc.source(it))
                srcs.append(got[1])
            self._sources[id(slot)] = hit = (weakref.ref(slot), key, srcs)
            while len(self._sources) > 64:  # slots dropped from the pool leave stale entries behind
                self._sources.pop(next(iter(self._sources)))
        pairs = []
        with torch.no_grad():
            for it, src in zip(slot.items, hit[2]):
                if src is None:
                    # Buffers may change in the next forward (counters, running stats), before the next update
                    # that the copy thread is ordered against: copy them now, they are small.
                    it.buffer.copy_(acc.source(it))
                else:
                    pairs.append((src, it.buffer))
        self.inflight = slot
        if self._stream is not None:
            # Side stream: ordered after the optimizer step, overlapping the next forward/backward.
            self._stream.wait_stream(torch.cuda.current_stream())
        self._jobs.put((slot, step, pairs))

    def shutdown(self) -> None:
        """Stop the copy thread (after a simulated crash, or at exit)."""
        self._jobs.put(None)

    def stop(self, timeout_s: float) -> None:
        """Finish the copy in flight, then stop the thread (at interpreter exit: background.py)."""
        self._jobs.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            slot, step, pairs = job
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                with torch.no_grad():
                    if self._stream is not None:
                        with torch.cuda.stream(self._stream):
                            for src, dst in pairs:
                                dst.copy_(src, non_blocking=True)
                        self._stream.synchronize()
                    else:
                        # Two batched calls instead of one Python call per item: each call drops the GIL once
                        # for the whole batch (per-item calls contend for it with the training thread).
                        half = len(pairs) // 2
                        if half:
                            torch._foreach_copy_([d for _, d in pairs[:half]], [s for s, _ in pairs[:half]])
                        if pairs:  # the tear point: half-way through the items, as before
                            faults.point("snapshot_copy")
                            if self.fault_hook is not None:
                                hook, self.fault_hook = self.fault_hook, None
                                hook(slot, half)
                            torch._foreach_copy_([d for _, d in pairs[half:]], [s for s, _ in pairs[half:]])
                if self.throttle_bytes_per_s:
                    rest = sum(d.numel() * d.element_size() for _, d in pairs) / self.throttle_bytes_per_s
                    time.sleep(max(0.0, rest - (time.perf_counter() - t0)))
                slot.step = step
            except BaseException as exc:  # surfaced to the training thread by wait()
                slot.error = exc
            slot.copy_seconds = time.perf_counter() - t0
            if slot.error is None:
                last = (sum(d.numel() * d.element_size() for _, d in pairs), slot.copy_seconds, time.thread_time() - c0)
                tot = self.copy_totals
                tot["copies"] += 1
                tot["bytes"] += last[0]
                tot["wall_s"] += last[1]
                tot["cpu_s"] += last[2]
                self.last_copy = last
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
