"""DCP planning shared by the sparse save planners (`partial_global_plan`: a slot covers only part of most tensors,
so DCP's "chunks must fill the tensor" check alone is relaxed), and `SlotSavePlanner`, the DCP planner of a
captured `Slot` for any StorageWriter (its items are shards with global offsets; window, slot, step, plan and a
CRC32 per item go into `Metadata.planner_data`). The host tier does not run it: it plans a layout once.
"""

from __future__ import annotations

import dataclasses
import logging
import logging.handlers
import threading

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    _validate_global_plan,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem

from ..core.records import SlotInfo
from ..core.slot import Slot
from ..storage_format.checksums import crc32_tensor
from ..storage_format.slot_format import PLANNER_KEY, checksum_name, write_item


def partial_global_plan(
    planner: DefaultSavePlanner, all_plans: list[SavePlan], what: str
) -> tuple[list[SavePlan], list[SavePlan], Metadata]:
    """(deduplicated local plans, global plan, metadata) of a sparse slot save. Of DCP's checks only "invalid fill
    tensor-volume" is relaxed (and not logged); out-of-bounds and overlapping chunks still raise."""
    plans = planner._dedup_save_plans(all_plans)  # HSDP replicas and step counters are written once
    global_plan, md = create_default_global_save_plan(plans)
    errors = [e for e in _plan_errors(global_plan, md) if "invalid fill tensor-volume" not in e]
    if errors:
        raise ValueError(f"{what} is inconsistent across ranks: {'; '.join(errors)[:500]}")
    return plans, global_plan, md


_PLAN_CHECK = threading.Lock()


def _plan_errors(global_plan: list[SavePlan], md: Metadata) -> list[str]:
    """DCP's global-plan check as a list of messages, kept off the log (torch 2.13 returns them; torch 2.11 returns
    a bool and logs them, so they are collected from its logger)."""
    quiet = logging.getLogger(_validate_global_plan.__module__)
    collect = logging.handlers.BufferingHandler(capacity=1 << 30)  # keeps every record (never flushed)
    with _PLAN_CHECK:  # tier threads plan concurrently: one logger setting (and one set of messages) at a time
        level, propagate = quiet.level, quiet.propagate
        quiet.setLevel(logging.WARNING)
        quiet.propagate = False
        quiet.addHandler(collect)
        try:
            got = _validate_global_plan(global_plan, md)
        finally:
            quiet.removeHandler(collect)
            quiet.propagate = propagate
            quiet.setLevel(level)
    if isinstance(got, bool):
        messages = [" ".join(r.getMessage().split()) for r in collect.buffer]
        return [] if got else messages or ["DCP's global-plan check failed"]
    return list(got)


def _index_key(fqn: str, offset) -> tuple:
    return fqn, tuple(offset) if offset is not None else ()


class SlotSavePlanner(DefaultSavePlanner):
    def __init__(self, slot: Slot, info: SlotInfo):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=True)
        self.slot, self.info = slot, info
        self._buffers: dict[tuple, torch.Tensor] = {}

    def create_local_plan(self) -> SavePlan:
        items = [write_item(it) for it in self.slot.items]
        self._buffers = {_index_key(wi.index.fqn, wi.index.offset): it.buffer for wi, it in zip(items, self.slot.items)}
        sums = {
            checksum_name(wi.index.fqn, wi.index.offset): crc32_tensor(it.buffer)
            for wi, it in zip(items, self.slot.items)
        }
        self.plan = SavePlan(items, planner_data={"checksums": sums})
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, global_plan, md = partial_global_plan(self, all_plans, "slot plan")
        sums: dict[str, int] = {}
        for p in all_plans:
            sums.update((p.planner_data or {}).get("checksums", {}))
        kept = {checksum_name(i.index.fqn, i.index.offset) for p in global_plan for i in p.items}
        data = {PLANNER_KEY: dict(self.info.to_dict(), checksums={k: v for k, v in sums.items() if k in kept})}
        self.global_plan, self.metadata = global_plan, dataclasses.replace(md, planner_data=data)
        return global_plan, self.metadata

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self._buffers[_index_key(write_item.index.fqn, write_item.index.offset)]
