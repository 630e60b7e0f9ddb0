"""DCP planners for sparse slots.

`SlotSavePlanner` writes one slot as a standard DCP checkpoint: every `SlotItem` is already a shard with
global offsets (one chunk per expert row of a grouped tensor), so the plan is the slot's items. A slot
covers only part of most tensors by design, so DCP's "chunks must fill the tensor" check is relaxed for
exactly that error, and only for tensors the slot declares partial; out-of-bounds and overlapping chunks
are still rejected. Window, slot, iteration, plan and a CRC32 per item go into `Metadata.planner_data`.

`SlotLoadPlanner` reads a slot back into this rank's host buffers by global offsets (any rank layout that
saved it: DCP intersects the saved chunks with the requested ones). Stock `dcp.load` also reads a slot into
plain full-size tensors: regions no chunk covers are left untouched.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import threading
import zlib

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    _validate_global_plan,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..snapshot import Slot, SlotItem
from . import checksums
from .raw_storage import PLANNER_KEY
from .raw_storage import checksum_name as _checksum_name


def item_crc32(buf: torch.Tensor) -> int:
    return zlib.crc32(buf.detach().contiguous().reshape(-1).view(torch.uint8).numpy()) & 0xFFFFFFFF


def partial_global_plan(
    planner: DefaultSavePlanner, all_plans: list[SavePlan], what: str
) -> tuple[list[SavePlan], list[SavePlan], Metadata]:
    """(deduplicated local plans, global plan, metadata) of a sparse slot save. A slot covers only part of
    most tensors by design: of DCP's checks only "invalid fill tensor-volume" is relaxed (and not logged,
    DCP would log every expected partial tensor); out-of-bounds and overlapping chunks still raise."""
    plans = planner._dedup_save_plans(all_plans)  # HSDP replicas and step counters are written once
    global_plan, md = create_default_global_save_plan(plans)
    errors = [e for e in _plan_errors(global_plan, md) if "invalid fill tensor-volume" not in e]
    if errors:
        raise ValueError(f"{what} is inconsistent across ranks: {'; '.join(errors)[:500]}")
    return plans, global_plan, md


_PLAN_CHECK = threading.Lock()


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _plan_errors(global_plan: list[SavePlan], md: Metadata) -> list[str]:
    """DCP's global-plan check as a list of messages, kept off the log (DCP would log every expected partial
    tensor). torch 2.13 returns the messages; torch 2.11 returns a bool and only logs them, so they are
    collected from its logger."""
    quiet = logging.getLogger(_validate_global_plan.__module__)
    collect = _Messages()
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
        return [] if got else [" ".join(m.split()) for m in collect.messages] or ["DCP's global-plan check failed"]
    return list(got)


def _index_key(fqn: str, offset) -> tuple:
    return fqn, tuple(offset) if offset is not None else ()


_WRITE_ITEMS: dict[tuple, WriteItem] = {}  # a slot item's DCP WriteItem, shared by the slots of every plan


def _write_item(it: SlotItem) -> WriteItem:
    """`it.write_item()`, built once per (key, region, dtype): a new plan (a reorder, another W) re-plans its
    slots from the same pieces, and building ~200 WriteItems costs milliseconds each time."""
    pc, b = it.piece, it.buffer
    key = (it.key, it.role, pc.global_offset, pc.shape, pc.global_shape, b.dtype, b.requires_grad, b.is_pinned())
    wi = _WRITE_ITEMS.get(key)
    if wi is None:
        if len(_WRITE_ITEMS) > 65536:  # bounded: pieces of models this process no longer trains
            _WRITE_ITEMS.clear()
        wi = _WRITE_ITEMS[key] = it.write_item()
    return wi


class SlotSavePlanner(DefaultSavePlanner):
    def __init__(self, slot: Slot, info: dict, checksums: bool = True):
        """`checksums=False`: the writer records the item CRC32s (RawWriter(planner_checksums=True)) while it
        copies the bytes, instead of a separate pass here."""
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=True)
        self.slot, self.info, self.checksums = slot, info, checksums
        self._buffers: dict[tuple, torch.Tensor] = {}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.is_coordinator = state_dict, is_coordinator

    def create_local_plan(self) -> SavePlan:
        # The items of a slot object never change (its buffers are allocated once per window plan and reused),
        # so they are planned once and cached on the slot: later windows re-plan nothing.
        cached = getattr(self.slot, "_dcp_local", None)
        if cached is None or cached[0] != len(self.slot.items):
            items = [_write_item(it) for it in self.slot.items]
            buffers = {_index_key(wi.index.fqn, wi.index.offset): it.buffer for wi, it in zip(items, self.slot.items)}
            cached = self.slot._dcp_local = (len(self.slot.items), items, buffers)
        _, items, self._buffers = cached
        sums: dict[str, int] = {}
        if self.checksums:
            sums = {
                _checksum_name(wi.index.fqn, wi.index.offset): item_crc32(it.buffer)
                for wi, it in zip(items, self.slot.items)
            }
        self.plan = SavePlan(items, planner_data={"checksums": sums})
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        cached = getattr(self.slot, "_dcp_global", None)
        if cached is not None and len(all_plans) == 1 and all_plans[0].items is cached[0]:
            _, plans, global_plan, md = cached  # one rank, the same cached items: the same global plan
        else:
            plans, global_plan, md = partial_global_plan(self, all_plans, "slot plan")
            if len(all_plans) == 1:
                self.slot._dcp_global = (all_plans[0].items, plans, global_plan, md)
        plans = [dataclasses.replace(p, planner_data=a.planner_data) for p, a in zip(plans, all_plans)]
        sums: dict[str, int] = {}
        for p in plans:
            sums.update((p.planner_data or {}).get("checksums", {}))
        kept = {_checksum_name(i.index.fqn, i.index.offset) for p in global_plan for i in p.items}
        data = {PLANNER_KEY: dict(self.info, checksums={k: v for k, v in sums.items() if k in kept})}
        md = dataclasses.replace(md, planner_data=data)
        self.global_plan, self.metadata = global_plan, md
        return global_plan, md

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self._buffers[_index_key(write_item.index.fqn, write_item.index.offset)]


class SlotLoadPlanner(DefaultLoadPlanner):
    """Fill `slot`'s buffers (this rank's pieces) from a saved slot checkpoint."""

    def __init__(self, slot: Slot):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.slot = slot
        self._dest: dict[tuple, SlotItem] = {}

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        reads: list[ReadItem] = []
        md = self.metadata.state_dict_metadata
        for it in self.slot.items:
            wi = it.write_item()
            if wi.index.fqn not in md:
                raise KeyError(
                    f"slot checkpoint has no tensor {wi.index.fqn!r}: it was written for another model or plan"
                )
            chunk = ChunkStorageMetadata(wi.tensor_data.chunk.offsets, wi.tensor_data.chunk.sizes)
            found = create_read_items_for_chunk_list(wi.index.fqn, md[wi.index.fqn], [chunk])
            got = sum(int(torch.Size(r.lengths).numel()) for r in found)
            if got != it.buffer.numel():
                raise KeyError(
                    f"slot checkpoint covers {got} of {it.buffer.numel()} elements of "
                    f"{wi.index.fqn} at {tuple(chunk.offsets)}"
                )
            for r in found:
                r = dataclasses.replace(r, dest_index=MetadataIndex(wi.index.fqn, chunk.offsets))
                reads.append(r)
            self._dest[_index_key(wi.index.fqn, chunk.offsets)] = it
        self.plan = LoadPlan(reads)
        return self.plan

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        buf = self._dest[_index_key(read_item.dest_index.fqn, read_item.dest_index.offset)].buffer
        view = buf
        for dim, (off, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, off, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # loaded in place


def verify_items(slot: Slot, metadata: Metadata) -> list[str]:
    """Keys of `slot` items whose loaded bytes do not match the checksum recorded when the slot was saved."""
    sums = ((metadata.planner_data or {}).get(PLANNER_KEY) or {}).get("checksums", {})
    bad = []
    for it in slot.items:
        wi = it.write_item()
        name = _checksum_name(wi.index.fqn, wi.index.offset)
        want = sums.get(name)  # a CRC32 int, or an algorithm-named string (checksums.py: "sum64b512:...")
        if isinstance(want, str):
            ok = checksums.matches(it.buffer.detach().contiguous().reshape(-1).view(torch.uint8).numpy(), want)
        else:
            ok = want is not None and want == item_crc32(it.buffer)
        if not ok:
            bad.append(name)
    return bad


def slot_info(metadata_bytes: bytes) -> dict:
    """The planner info (window, slot, step, run, plan, checksums) of a slot's pickled DCP `.metadata`."""
    md = pickle.loads(metadata_bytes)
    return (getattr(md, "planner_data", None) or {}).get(PLANNER_KEY) or {}
