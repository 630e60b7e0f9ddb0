"""Per-iteration capture of one slot into host buffers that are allocated once and reused.

A slot holds the full state (master weights, every optimizer state tensor, buffers) of its ACTIVE operators and
the compute weights of the others it carries. Each `SlotItem` knows its DCP identity, so tiers write it as is.
The copy runs off the training thread (device_copy.py); training waits only before the next update would
overwrite a source still being copied, and on CUDA that wait is on the device.
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
from torch.distributed.tensor import DTensor

from ..core.errors import TorchmoeError
from ..core.slot import Slot, SlotItem
from ..model.operators import local_tensor
from ..runtime import faults
from ..runtime.background import stop_at_exit
from ..runtime.deferred_reads import HostReads
from ..runtime.device_copy import CopyStream, copy_by_dtype
from .copy_chunks import ChunkedCopy, chunk_copy_lists
from .device_staging import DeviceStaging, staging_need

ROLES_FULL = ("master", "exp_avg", "exp_avg_sq")  # AdamW's full-state roles (other optimizers: their state keys)


class StateAccess:
    """Resolves slot items to the live tensors of a model + optimizer (rank-local storage)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.params = dict(model.named_parameters())
        self.buffers = {n: b for n, b in model.named_buffers() if b is not None}
        self.buffers.update((n, p) for n, p in self.params.items() if not p.requires_grad)  # held by value
        self.optimizer = optimizer
        self._param_list = list(self.params.values())
        self._dtensors = any(isinstance(p, DTensor) for p in self._param_list)

    def state_key(self) -> tuple:
        """The storage of every live parameter and optimizer state tensor: cached views of them are valid while it
        is unchanged. Checked at every capture (a reload or `.to()` must never leave a view on old storage), so it
        is one flat comprehension, the DTensor unwrap only when there are DTensors (~3x the old generator's speed,
        docs/gpu.md "Less Python per copy job")."""
        st = self.optimizer.state.values()
        T = torch.Tensor
        if not self._dtensors:
            return (
                *[p.data_ptr() for p in self._param_list],
                *[v.data_ptr() for s in st for v in s.values() if isinstance(v, T)],
            )
        return (
            *[getattr(p, "_local_tensor", p).data_ptr() for p in self._param_list],
            *[getattr(v, "_local_tensor", v).data_ptr() for s in st for v in s.values() if isinstance(v, T)],
        )

    def source(self, item: SlotItem) -> torch.Tensor:
        piece = item.piece
        if item.role == "buffer":
            return local_tensor(self.buffers[piece.fqn])[piece.local_slices]
        p = self.params[piece.fqn]
        if item.role in ("master", "compute"):
            return local_tensor(p)[piece.local_slices]
        v = local_tensor(self.optimizer.state[p][item.role])
        return v if v.dim() == 0 else v[piece.local_slices]  # a factored state's piece is cut to its own shape


class SimulatedCopyFault(TorchmoeError, RuntimeError):
    """Raised by the fault hook to tear a slot copy in the middle (failure-injection tests)."""


@dataclass
class _Job:
    """One slot copy in flight. `released`: the sources may be overwritten once the training stream is ordered
    after `end` (CUDA: as soon as the copies are queued; CPU: once they are done). The lists below `kept` are
    filled on the copy thread (`_prepare`), which also checks the cached views against the live storage: the
    training thread's part of a capture is the buffers and an event."""

    slot: Slot
    step: int
    ready: object  # CopyStream.mark_ready()
    keep: list[torch.Tensor]  # device staging copies of buffers, alive until the copy is done
    kept: list[torch.Tensor]  # the host buffers `keep` goes into
    srcs: list[torch.Tensor] = field(default_factory=list)
    dsts: list[torch.Tensor] = field(default_factory=list)
    tear_at: int = 0  # where the copy is split in two batches (the fault point), in srcs
    tear_items: int = 0  # the slot items copied before it (what the fault hook is told)
    host_bytes: int = 0  # what lands on the host (a chunked copy's spacers not counted)
    stage: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # (sources, staging views): device staging
    end: object = None
    staged: object = None  # device staging: the end of the device-to-device copy (what the next update waits for)
    released: threading.Event = field(default_factory=threading.Event)


@dataclass
class _SlotCopy:
    """One slot's copy as resolved (cached per slot): `copy` to the host (from the staging views when `stage`),
    `stage` the device-to-device copy into the staging buffer (None: not staged), `buffers` its buffer items."""

    copy: ChunkedCopy
    stage: tuple[list[torch.Tensor], list[torch.Tensor]] | None
    buffers: list[SlotItem]


class SnapshotEngine:
    """Copies slots off the training thread (one code path for CPU and CUDA: device_copy.CopyStream) and measures
    how long training waits. On CUDA the next update waits on the device (`wait`); the host waits for a copy to be
    done only at a window commit (`wait_done`)."""

    def __init__(
        self,
        access: StateAccess,
        device: torch.device | str | None = None,
        chunk_bytes: int | None = None,
        defer: bool = False,
        staging: bool = False,
        reads_on_copy_stream: bool = False,
    ):
        """`chunk_bytes` (`SparseConfig.copy_chunk_bytes`): copy same-dtype items in chunks of at most this many
        bytes with a spacer kernel between them, so the copy engine serves the training stream's own small reads
        in between (copy_chunks.py); None: one copy per item. `defer` (`copy_phase="backward"`): a capture's copy
        waits until `issue()` (the next backward, copy_phase.py) or until something needs it. `staging`
        (`device_staging`): through a staging buffer on the device (device_staging.py). `reads_on_copy_stream`:
        where `reads` (the checkpointer's own per-step reads) go (runtime/deferred_reads.py)."""
        if chunk_bytes is not None and (isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int)):
            raise ValueError(f"chunk_bytes must be an int or None, got {chunk_bytes!r}")
        self.access = access
        self.chunk_bytes = chunk_bytes
        if device is None:  # where the model lives: its slots are copied from there
            device = next((local_tensor(p).device for p in access.params.values()), torch.device("cpu"))
        self.copier = CopyStream(device)
        self.use_cuda = self.copier.cuda
        self.reads = HostReads(self.copier, reads_on_copy_stream)
        self.staging = DeviceStaging(self.copier.device) if staging else None
        self.defer = defer
        self._deferred: _Job | None = None  # captured, not yet handed to the copy thread (defer)
        self._defer_lock = threading.Lock()  # issue() may come from autograd's device thread
        self.issued_by_hook = 0  # deferred copies issued from the backward hook (the rest: by a wait)
        self.inflight: _Job | None = None  # not yet released: the next update waits for it
        self._last: _Job | None = None  # the newest job, maybe not done
        self.wait_seconds_total = 0.0
        self.waits: list[float] = []
        # What copies cost under training: the last one (bytes, copy s, copy-thread CPU s) and totals.
        self.last_copy: tuple[int, float, float] | None = None
        self.copy_totals = {"copies": 0, "bytes": 0, "wall_s": 0.0, "cpu_s": 0.0}
        self._sources: dict[int, tuple] = {}  # id(slot) -> (slot ref, cache key, _SlotCopy)
        self._views_key: tuple | None = None  # the state key the per-piece views below were resolved under
        self._views: dict[tuple, tuple] = {}  # (id(piece), role) -> (piece, live view)
        # One-shot hook called with (slot, items_copied); may raise SimulatedCopyFault to tear the copy.
        self.fault_hook: Callable[[Slot, int], None] | None = None
        # An emulated slower host link (benchmarks): a copy of n bytes lasts at least n / throttle seconds.
        self.throttle_bytes_per_s: float | None = None
        # Benchmarks' ablation: the whole path (resolve, queue, events, thread) runs but nothing is copied, which
        # isolates what the copy thread's Python costs the training thread (the GPU check's phase 3).
        self.skip_copies = False
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="tmoe-snapshot", daemon=True)
        self._thread.start()
        stop_at_exit(self)

    def capture(self, slot: Slot, step: int) -> None:
        """Start copying the live state into `slot` (call right after the optimizer step)."""
        self.wait()
        slot.done.clear()
        slot.error, slot.step = None, None
        buffer_items = [it for it in slot.items if it.role == "buffer"]
        keep: list[torch.Tensor] = []
        with torch.no_grad():  # buffers may change in the next forward, before the update: copied or staged now
            for it in buffer_items:
                if self.use_cuda:
                    keep.append(self.access.source(it).clone())
                else:
                    it.buffer.copy_(self.access.source(it))
        kept = [it.buffer for it in buffer_items] if keep else []
        job = _Job(slot, step, self.copier.mark_ready(), keep, kept)
        self.inflight = self._last = job
        if self.defer:
            with self._defer_lock:
                self._deferred = job
        else:
            self._jobs.put(job)

    def issue(self, from_hook: bool = False) -> None:
        """Hand a deferred copy to the copy thread (copy_phase="backward": from the next backward's first hook;
        any thread). No-op when none is deferred."""
        with self._defer_lock:
            job, self._deferred = self._deferred, None
        if job is not None:
            self.issued_by_hook += from_hook
            self._jobs.put(job)

    def issue_from_hook(self) -> None:
        """`issue`, counted as issued by the backward hook (copy_phase.BackwardTrigger)."""
        self.issue(from_hook=True)

    def discard_deferred(self) -> None:
        """A deferred copy not issued yet when the training state was lost: its slot is torn, never filled from
        the lost state (recover_in_memory)."""
        with self._defer_lock:
            job, self._deferred = self._deferred, None
        if job is not None:
            job.slot.error = RuntimeError(
                "the slot copy was deferred and never issued: the training state was lost or the engine stopped"
            )
            job.slot.done.set()
            job.released.set()

    def _resolve(self, slot: Slot) -> _SlotCopy:
        """The copy of the slot's sources into its host buffers, as issued, cached while the live tensors keep their
        storage (and, staged, while the staging buffer stays): per capture one key check and one dict lookup."""
        acc, stg = self.access, self.staging
        key = acc.state_key()
        staged = stg is not None and stg.target > 0
        ckey = (key, stg.generation if staged and stg is not None else -1)
        hit = self._sources.get(id(slot))
        if hit is None or hit[0]() is not slot or hit[1] != ckey:
            # A new plan's slots are made of the same pieces: views are cached per (piece, role) too.
            if self._views_key != key:
                self._views_key, self._views = key, {}
            views = self._views
            srcs, dsts, buffers = [], [], []
            for it in slot.items:
                if it.role == "buffer":
                    buffers.append(it)
                    continue
                vk = (id(it.piece), it.role)
                got = views.get(vk)
                if got is None or got[0] is not it.piece:  # the piece is held, so its id is not reused
                    got = views[vk] = (it.piece, acc.source(it))
                srcs.append(got[1])
                dsts.append(it.buffer)
            stage = None
            if staged and stg is not None and staging_need(dsts) <= stg.target:
                gen = stg.generation
                with self.copier.context():  # the buffer's memory belongs to the copy stream, its only user
                    stage = (srcs, stg.views(dsts))
                if stg.generation != gen:  # a new buffer: views of the old one must not keep it alive
                    for k in [k for k, v in self._sources.items() if v[2].stage is not None]:
                        del self._sources[k]
                ckey = (key, stg.generation)
            copy = chunk_copy_lists(stage[1] if stage else srcs, dsts, self.chunk_bytes)
            # Weakly: a slot its allocator dropped takes its entry (and the buffers it holds) with it.
            ref = weakref.ref(slot, _forget_slot(self._sources, id(slot)))
            self._sources[id(slot)] = hit = (ref, ckey, _SlotCopy(copy, stage, buffers))
            while len(self._sources) > 64:  # bounded, should slots outlive their use
                self._sources.pop(next(iter(self._sources)))
        return hit[2]

    def shutdown(self) -> None:
        """Stop the copy thread (after a simulated crash, or at exit). A deferred copy is never issued now: its slot
        is torn, so nothing (the persist thread) waits for it for ever."""
        self.discard_deferred()
        self._jobs.put(None)

    def stop(self, timeout_s: float) -> None:
        """Finish the copy in flight, then stop the thread (at interpreter exit: background.py)."""
        self.discard_deferred()
        self._jobs.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        self.copier.bind_thread()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._copy(job)

    def _prepare(self, job: _Job) -> None:
        """On the copy thread: the slot's copy lists (the cached ones once the live storage is checked unchanged:
        nothing replaces a source between the capture and its copy, the next update waits for this one), the
        buffers' staged clones appended, and the tear point."""
        resolved = self._resolve(job.slot)
        plan, keep = resolved.copy, job.keep
        job.srcs, job.dsts, job.host_bytes, job.stage = plan.srcs, plan.dsts, plan.host_bytes, resolved.stage
        if keep:
            job.srcs, job.dsts = plan.srcs + keep, plan.dsts + job.kept
            job.host_bytes += sum(d.numel() * d.element_size() for d in job.kept)
        # The tear point: half-way through the items (a chunked item counts once), on CPU and CUDA alike.
        n_plan = len(plan.item_ends)
        job.tear_items = half = (n_plan + len(keep)) // 2
        job.tear_at = plan.split_at_item(half) if half <= n_plan else len(plan.srcs) + half - n_plan

    def _copy(self, job: _Job) -> None:
        slot = job.slot
        t0, c0 = time.perf_counter(), time.thread_time()
        seconds = None
        try:
            with torch.no_grad(), self.copier.context():
                self._prepare(job)
                srcs, dsts = job.srcs, job.dsts
                start = self.copier.begin(job.ready)
                if job.stage is not None:
                    self._stage(job)
                # Two batched calls: each drops the GIL once for the batch (per-item calls contend for it).
                half = job.tear_at
                if half and not self.skip_copies:
                    torch._foreach_copy_(dsts[:half], srcs[:half], non_blocking=self.use_cuda)  # pyright: ignore[reportPrivateImportUsage]  (torch private)
                if srcs:  # the tear point: half-way through the items, on CPU and CUDA alike
                    faults.point("snapshot_copy")
                    if self.fault_hook is not None:
                        hook, self.fault_hook = self.fault_hook, None
                        hook(slot, job.tear_items)
                    if not self.skip_copies:
                        torch._foreach_copy_(dsts[half:], srcs[half:], non_blocking=self.use_cuda)  # pyright: ignore[reportPrivateImportUsage]  (torch private)
                job.end = self.copier.end()
            if self.use_cuda:
                job.released.set()  # queued: the update may be queued behind it (CopyStream.order_after)
            seconds = self.copier.finish(start, job.end)
            if self.throttle_bytes_per_s:  # the emulated slower link: the copy lasts n bytes / throttle at least
                rest = job.host_bytes / self.throttle_bytes_per_s
                time.sleep(max(0.0, rest - (time.perf_counter() - t0)))
                seconds = max(seconds or 0.0, time.perf_counter() - t0)
            slot.step = job.step
        except BaseException as exc:  # surfaced to the training thread by wait()
            slot.error = exc
        slot.copy_seconds = seconds if seconds is not None else time.perf_counter() - t0
        if slot.error is None:
            self._account(job, time.thread_time() - c0)
        job.keep.clear()
        slot.done.set()
        job.released.set()

    def _stage(self, job: _Job) -> None:
        """Device staging: the device-to-device copy first (on CUDA one multi-tensor kernel per (source, staging)
        dtype pair, the cast fused: copy_by_dtype says why never one mixed call); the next update waits for its end
        only (`staged`). In the copy stream's context."""
        if not self.skip_copies and job.stage is not None:
            copy_by_dtype(job.stage[1], job.stage[0], non_blocking=self.use_cuda)
        job.staged = self.copier.end()
        if not self.use_cuda:
            job.released.set()  # CPU: the sources are free once staged; the host copy follows

    def _account(self, job: _Job, cpu_s: float) -> None:
        """A finished copy: its bytes, seconds and copy-thread CPU into the totals."""
        if job.stage is not None and self.staging is not None:
            self.staging.staged_copies += 1
        last = (job.host_bytes, job.slot.copy_seconds, cpu_s)
        self.copy_totals["copies"] += 1
        for k, v in zip(("bytes", "wall_s", "cpu_s"), last):
            self.copy_totals[k] += v
        self.last_copy = last

    def wait(self) -> float:
        """Before the next update: block until the in-flight copy no longer needs its sources (CUDA: queued, the
        training stream then waits on the device). Returns the seconds waited; raises the copy's error."""
        job = self.inflight
        if job is None:
            return 0.0
        self.issue()  # deferred and no backward issued it (an iteration without one): now
        waited = self._timed(job.released)
        self.inflight = None  # only now: a wait cut short must not let the next update overwrite its sources
        self.waits.append(waited)
        if job.slot.error is not None:
            raise job.slot.error
        self.copier.order_after(job.staged if job.staged is not None else job.end)  # staged: the device copy only
        return waited

    def wait_done(self) -> float:
        """Block until the newest copy is on the host (a window commit reads it); raises the copy's error."""
        self.wait()
        job = self._last
        if job is None:
            return 0.0
        waited = self._timed(job.slot.done)
        if job.slot.error is not None:
            raise job.slot.error
        return waited

    def _timed(self, event: threading.Event) -> float:
        t0 = time.perf_counter()
        event.wait()
        waited = time.perf_counter() - t0
        self.wait_seconds_total += waited
        return waited


def _forget_slot(sources: dict, key: int):
    """A weakref callback removing a dead slot's cached sources (only its own entry: the id may be reused)."""

    def forget(ref) -> None:
        got = sources.get(key)
        if got is not None and got[0] is ref:
            del sources[key]

    return forget


@torch.no_grad()
def restore_slot(slot: Slot, access: StateAccess, roles: tuple[str, ...] | None = None) -> int:
    """Copy a slot back into live tensors (all items, or those with `roles`) in place; returns bytes."""
    n = 0
    for it in slot.items:
        if roles is not None and it.role not in roles:
            continue
        access.source(it).copy_(it.buffer)
        n += it.nbytes
    return n
