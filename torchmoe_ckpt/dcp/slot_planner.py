"""DCP planning shared by the sparse save planners, and the DCP planner of the library's own `Slot` objects.

`partial_global_plan`: a slot covers only part of most tensors by design, so DCP's "chunks must fill the tensor"
check is relaxed for exactly that error (and not logged); out-of-bounds and overlapping chunks are still
rejected. SparseSavePlanner (a DCP user's state dict) and SlotSavePlanner use it.

`SlotSavePlanner` saves a captured `Slot` with any DCP StorageWriter: every `SlotItem` is already a shard with
global offsets (one chunk per expert row of a grouped tensor), so the plan is the slot's items; window, slot,
iteration, plan and a CRC32 per item go into `Metadata.planner_data`. The host tier does not run it (it plans a
slot's layout once, storage/slot_format.py); with our RawWriter it writes the same metadata the host tier does.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    _validate_global_plan,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem

from ..snapshot import Slot
from ..storage.checksums import crc32_tensor
from ..storage.slot_format import PLANNER_KEY, checksum_name, write_item


def partial_global_plan(
    planner: DefaultSavePlanner, all_plans: list[SavePlan], what: str
) -> tuple[list[SavePlan], list[SavePlan], Metadata]:
    """(deduplicated local plans, global plan, metadata) of a sparse slot save. A slot covers only part of
    most tensors by design: of DCP's checks only "invalid fill tensor-volume" is relaxed (and not logged,
    DCP would log every expected partial tensor); out-of-bounds and overlapping chunks still raise."""
    plans = planner._dedup_save_plans(all_plans)  # HSDP replicas and step counters are written once
    global_plan, md = create_default_global_save_plan(plans)
    quiet = logging.getLogger(_validate_global_plan.__module__)
    level, quiet.level = quiet.level, logging.ERROR
    try:
        errors = [e for e in _validate_global_plan(global_plan, md) if "invalid fill tensor-volume" not in e]
    finally:
        quiet.setLevel(level)
    if errors:
        raise ValueError(f"{what} is inconsistent across ranks: {'; '.join(errors)[:500]}")
    return plans, global_plan, md


def _index_key(fqn: str, offset) -> tuple:
    return fqn, tuple(offset) if offset is not None else ()


class SlotSavePlanner(DefaultSavePlanner):
    def __init__(self, slot: Slot, info: dict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=True)
        self.slot, self.info = slot, info
        self._buffers: dict[tuple, torch.Tensor] = {}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.is_coordinator = state_dict, is_coordinator

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
        data = {PLANNER_KEY: dict(self.info, checksums={k: v for k, v in sums.items() if k in kept})}
        self.global_plan, self.metadata = global_plan, dataclasses.replace(md, planner_data=data)
        return global_plan, self.metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self._buffers[_index_key(write_item.index.fqn, write_item.index.offset)]
