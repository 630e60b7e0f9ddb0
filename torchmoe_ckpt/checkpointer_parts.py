"""The parts of one `SparseCheckpointer`, built from typed inputs before its first step.

`build_parts` makes, in this order: the state access and the copy engine (with its backward trigger when copies
start in the backward pass), the persist thread (with tiers), the slot allocator, the window planner and the
host-memory account over them. Then it validates what only the built parts can tell (device staging on every
rank, a window within `host_memory_limit`). Whatever it started is stopped before a refusal leaves it: a refused
start leaves no thread running. The checkpointer decides what they do per iteration; nothing here runs per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .capture.copy_phase import BackwardTrigger
from .capture.host_memory import HostMemory, MemoryHolders
from .capture.slot_alloc import make_slot_allocator
from .capture.slot_pool import SlotAllocator
from .capture.snapshot import SnapshotEngine, StateAccess
from .config import SparseConfig
from .core.errors import ConfigError
from .core.operator import Operator
from .core.window import Window
from .persist.build_tiers import Tiers
from .persist.persist_thread import PersistThread
from .planning.window_planner import WindowPlanner
from .tiers.host_tier import HostTier

__all__ = ["CheckpointerParts", "PartsInputs", "build_parts"]

# A value reduced with a `dist.ReduceOp` over the checkpointer's agreement group. Collective.
Agree = Callable[[float, Any], float]  # (value, a dist.ReduceOp member)
# The windows that hold host memory now: (current, committed, inherited after a restart).
HeldWindows = Callable[[], tuple[Window | None, Window | None, Window | None]]


@dataclass(frozen=True)
class PartsInputs:
    """What the parts are built from: the state checkpointed, the config, where it is persisted, and the two
    callbacks into the checkpointer that owns them."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    compute_dtype: torch.dtype
    cfg: SparseConfig
    ops: list[Operator]  # discovered, their optimizer state attached (optim_state.attach_optimizer_state)
    host_tier: HostTier | None  # None: windows in this process only
    tiers: Tiers | None  # the opened tiers (peers, object store, lease), with host_tier
    group: dist.ProcessGroup | None  # the ranks that plan together
    sum_counts: bool  # routed-token counts are this rank's own: summed over `group` once per window
    rank: int
    agree: Agree
    windows: HeldWindows


@dataclass
class CheckpointerParts:
    """What a `SparseCheckpointer` owns besides its window bookkeeping. `stop` ends the threads (idempotent)."""

    access: StateAccess
    engine: SnapshotEngine  # the copy thread (a side stream on CUDA)
    trigger: BackwardTrigger | None  # copy_phase = "backward": starts copies from the backward pass
    persist: PersistThread | None  # with tiers: writes slots and manifests, replicates, uploads
    slots: SlotAllocator
    planner: WindowPlanner
    memory: HostMemory

    def stop(self, end_writer: Callable[[PersistThread], None] = PersistThread.shutdown) -> None:
        """End the threads: the trigger's hooks, the copy thread, the staging buffer, the slot sets, then the
        persist thread through `end_writer` (shutdown; abandon when a failure is emulated)."""
        _stop_started(self.trigger, self.engine, self.slots, self.persist, end_writer)


def build_parts(inputs: PartsInputs) -> CheckpointerParts:
    """The parts, built and validated (see the module's docstring).

    Raises:
        ConfigError: device staging is refused on some rank (every rank raises), or a bad host_buffers value.
        HostMemoryLimitError: no window fits in `cfg.host_memory_limit`.
    """
    cfg = inputs.cfg
    access = StateAccess(inputs.model, inputs.optimizer)
    # On the model's device (a side stream on CUDA); the copy path's switches (docs/gpu.md, "The fix switches").
    engine = SnapshotEngine(
        access,
        chunk_bytes=cfg.copy_chunk_bytes,
        defer=cfg.copy_phase == "backward",
        staging=cfg.device_staging,
        reads_on_copy_stream=cfg.reads_on_copy_stream,
    )
    trigger: BackwardTrigger | None = None
    persist: PersistThread | None = None
    slots: SlotAllocator | None = None
    try:
        trigger = BackwardTrigger(inputs.model, engine.issue_from_hook) if engine.defer else None
        persist = _persist_thread(inputs)
        slots = make_slot_allocator(
            {o.name: o for o in inputs.ops},
            inputs.compute_dtype,
            engine.use_cuda,
            inputs.host_tier,
            persist,
            cfg.host_buffers,
        )
        planner = WindowPlanner(
            cfg,
            inputs.ops,
            inputs.compute_dtype,
            inputs.group,
            inputs.agree,
            inputs.sum_counts,
            inputs.rank,
            cuda=engine.use_cuda,
            reads=engine.reads,
        )
        limit = cfg.host_memory_limit
        assert not isinstance(limit, str)  # SparseConfig parsed it into bytes
        memory = HostMemory(MemoryHolders(slots, persist, engine.staging, inputs.windows), limit)
        if persist is not None:
            persist.status.memory = memory.line  # "host memory X of LIMIT" in the status lines
        _check_staging(engine, planner, memory, inputs.agree)
        planner.cap_by_memory(memory, None if persist is None else persist.peers)
    except BaseException:  # refused (HostMemoryLimitError, device staging, a bad value): no thread left running
        _stop_started(trigger, engine, slots, persist, PersistThread.shutdown)
        raise
    return CheckpointerParts(access, engine, trigger, persist, slots, planner, memory)


def _persist_thread(inputs: PartsInputs) -> PersistThread | None:
    if inputs.host_tier is None or inputs.tiers is None:
        return None
    t = inputs.tiers
    return PersistThread(inputs.host_tier, t.peers, t.store, t.lease)


def _check_staging(engine: SnapshotEngine, planner: WindowPlanner, memory: HostMemory, agree: Agree) -> None:
    """Device staging that cannot stage the smallest slot on one rank is refused on every rank (collective when
    staging is on: the same configuration on every rank)."""
    if engine.staging is None:
        return
    if memory.limit is not None:  # on a CPU the staging buffer is host memory, under the limit
        engine.staging.room = memory.room_for
    why = engine.staging.refusal(planner.floor_slot_bytes())
    agreed = agree(float(why is None), dist.ReduceOp.MIN)  # (a statement of its own: never skipped on one rank)
    if agreed < 1:
        raise ConfigError(why or "device_staging=True cannot stage on another rank (its message says why)")


def _stop_started(
    trigger: BackwardTrigger | None,
    engine: SnapshotEngine,
    slots: SlotAllocator | None,
    persist: PersistThread | None,
    end_writer: Callable[[PersistThread], None],
) -> None:
    if trigger is not None:
        trigger.close()
    engine.shutdown()
    if engine.staging is not None:
        engine.staging.release()
    if slots is not None:
        slots.close()
    if persist is not None:
        end_writer(persist)
