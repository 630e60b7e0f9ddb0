"""Sparse DCP planners on a *standard* state dict, for a DCP user who checkpoints every iteration sparsely
(docs/dcp-user.md): iteration `step` writes its slot of the window plan under the keys a dense save uses
(`model.<fqn>`, `optim.state.<fqn>.<key>`), later operators' compute weights under `compute.<fqn>`, and its replay
record as one bytes item; `load_sparse_window` reads a window back for `torchmoe_ckpt.recovery.sparse_to_dense`.
"""

from __future__ import annotations

import dataclasses
import io
import re
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..core.records import IterationRecord, ReplayLog, SlotInfo
from ..core.slot import Slot, SlotItem, build_slot
from ..core.window import Window
from ..model.operators import agreed_sizes, discover_operators, local_tensor
from ..model.optim_state import attach_optimizer_state
from ..planning.schedule import plan_window
from ..storage_format.layout import slot_name
from ..storage_format.manifest import plan_digest
from ..storage_format.slot_format import INFO_KEYS, PLANNER_KEY, planner_info
from ..tiers.window_tier import saved
from .slot_planner import partial_global_plan

# DCP's state-dict helpers drop these wrapper names from FQNs (torch.compile, activation checkpointing).
_WRAPPERS = re.compile(r"(^|\.)(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)(?=\.|$)")


def _meta(shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")  # shape and dtype only: planning allocates nothing


def _fqn(item: SlotItem) -> str:
    return _WRAPPERS.sub("", item.piece.fqn).lstrip(".")


def replay_key(rank: int) -> str:
    return f"replay.rank-{rank:05d}"


class SparseSchedule:
    """The window plan a DCP user's loop follows: windows start at `first_step`, `first_step + W`, ...; slot i holds
    the state after iteration `start_step + i`. Collective with a process group (every rank agrees the sizes)."""

    def __init__(  # noqa: PLR0913  (the DCP user's public constructor: the model and how to plan it, by keyword)
        self,
        model: torch.nn.Module,
        window: int,
        compute_dtype: torch.dtype,
        first_step: int = 1,
        ops=None,
        group=None,
        optimizer=None,
    ):
        """Plan the windows of `model` once (Algorithm 1 with a forced window); collective with a process group.

        Args:
            model: the (possibly FSDP2-sharded) model whose operators are checkpointed.
            window: W, the slots per window.
            compute_dtype: the dtype later operators' compute weights are kept in (e.g. torch.bfloat16).
            first_step: the first checkpointed iteration (window 0 starts there).
            ops: the operators (default: `discover_operators(model, optimizer=optimizer)`).
            group: the process group whose ranks agree the sizes (default: the default group, if initialized).
            optimizer: one or several; slots hold its state as it is (created now if missing); None: AdamW's.
        """
        ops = ops if ops is not None else discover_operators(model, optimizer=optimizer)
        if optimizer is not None:
            attach_optimizer_state(model, ops, optimizer)
        self.ops = {o.name: o for o in ops}
        self.compute_dtype, self.first_step = compute_dtype, first_step
        kind = {"expert": 0, "router": 1, "dense": 2}
        order = [o.name for o in sorted(ops, key=lambda o: kind[o.kind])]  # experts, routers, dense (stable)
        full, comp = agreed_sizes(self.ops, compute_dtype, group)
        self.plan = plan_window(order, full, comp, float("inf"), forced_window=window, warn=False)
        self.digest = plan_digest(self.plan.to_dict())

    @property
    def window(self) -> int:
        return self.plan.window

    def locate(self, step: int) -> tuple[int, int, int]:
        """(window id, slot index, window start step) of iteration `step`."""
        if step < self.first_step:
            raise ValueError(f"step {step} is before the first checkpointed step {self.first_step}")
        wid, slot = divmod(step - self.first_step, self.window)
        return wid, slot, self.first_step + wid * self.window

    def slot_items(self, slot: int, alloc=None) -> Slot:
        """The items slot `slot` holds on this rank (meta tensors unless `alloc` gives real buffers)."""
        sp = self.plan.slots[slot]
        return build_slot(slot, sp.active, sp.frozen, self.ops, self.compute_dtype, alloc=alloc or _meta)

    def slot_name(self, step: int) -> str:
        """Where step's slot goes under a tier's root: `window-NNNNNN/slot-SS`."""
        return slot_name(*self.locate(step)[:2])

    def slot_path(self, root: str | Path, step: int) -> str:
        return f"{str(root).rstrip('/')}/{self.slot_name(step)}"

    def info(self, step: int, run: str = "") -> SlotInfo:
        """What the save of `step`'s slot is written for (its `.metadata` says so)."""
        wid, slot, start = self.locate(step)
        return SlotInfo(wid, slot, start, window_size=self.window, plan=self.digest, run=run or None, step=step)


def dcp_key(item: SlotItem, model_key: str = "model", optim_key: str = "optim") -> str:
    """The key of a slot item in a standard (flattened) DCP state dict; compute weights get their own."""
    fqn = _fqn(item)
    if item.role in ("master", "buffer"):
        return f"{model_key}.{fqn}"
    if item.role == "compute":
        return f"compute.{fqn}"
    return f"{optim_key}.state.{fqn}.{item.role}"  # the optimizer state key: exp_avg, step, momentum_buffer, ...


def _source(sd: dict, item: SlotItem, model_key: str, optim_key: str) -> torch.Tensor:
    """The live tensor region of a standard state dict that `item` captures (a view, no copy)."""
    fqn, model = _fqn(item), item.role in ("master", "buffer", "compute")
    try:
        t = sd[model_key][fqn] if model else sd[optim_key]["state"][fqn][item.role]
    except KeyError:
        raise KeyError(
            f"state dict has no {dcp_key(item, model_key, optim_key)!r}: pass get_state_dict(model, "
            f"optimizer) as {{{model_key!r}: ..., {optim_key!r}: ...}}, after the first optimizer "
            "step"
        ) from None
    if not model and (not torch.is_tensor(t) or t.dim() == 0):
        return t if torch.is_tensor(t) else torch.tensor(float(t))  # a 0-dim state (step), whole
    return local_tensor(t)[item.piece.local_slices]


class SparseSavePlanner(DefaultSavePlanner):
    """Emit only iteration `step`'s slot of `schedule` from a standard state dict (see the module doc)."""

    def __init__(
        self,
        schedule: SparseSchedule,
        step: int,
        record: IterationRecord | None = None,
        run: str = "",
        model_key: str = "model",
        optim_key: str = "optim",
    ):
        """Pass as `dcp.save(state_dict, checkpoint_id=schedule.slot_path(root, step), planner=...)` every step.

        Args:
            schedule: the run's `SparseSchedule`.
            step: the iteration whose slot this save writes (state after it).
            record: the iteration's replay record (required to recover through the window: `load_sparse_window`).
            run: a fingerprint of the run, recorded in the slot (a window of another run is refused).
            model_key, optim_key: where the state dict holds the model's and the optimizer's state.

        Raises:
            ValueError: `step` is before `schedule.first_step`.
        """
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=True)
        self.schedule, self.step, self.record, self.keys = schedule, step, record, (model_key, optim_key)
        self.info = schedule.info(step, run)
        self.window_plan = schedule.plan  # our writers commit the window's manifest with its last slot
        self.slot = schedule.slot_items(self.info.slot)
        self._items: dict[tuple, SlotItem] = {}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.is_coordinator = state_dict, is_coordinator
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for it in self.slot.items:
            wi = it.write_item()
            index = MetadataIndex(dcp_key(it, *self.keys), wi.index.offset)
            items.append(dataclasses.replace(wi, index=index))
            self._items[(index.fqn, tuple(index.offset or ()))] = it
        if self.record is not None:
            self._record_bytes = io.BytesIO(saved(self.record.to_dict()))
            data = BytesIOWriteData(nbytes=len(self._record_bytes.getbuffer()))
            index = MetadataIndex(replay_key(self.rank))
            items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO, bytes_io_data=data))
        self.plan = SavePlan(items)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        _, global_plan, md = partial_global_plan(self, all_plans, "sparse slot plan")
        md = dataclasses.replace(md, planner_data={PLANNER_KEY: self.info.to_dict()})
        self.global_plan, self.metadata = global_plan, md
        return global_plan, md

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            self._record_bytes.seek(0)
            return self._record_bytes
        it = self._items[(write_item.index.fqn, tuple(write_item.index.offset or ()))]
        src = _source(self.state_dict, it, *self.keys)
        if it.role == "compute":
            return src.to(self.schedule.compute_dtype)  # the only copy the planner makes (a cast)
        return src.detach()


class SparseLoadPlanner(DefaultLoadPlanner):
    """Read iteration `step`'s slot back into the state dict given to `dcp.load` (ACTIVE operators get their full
    state, later ones their compute weights), or, `into=Slot`, into its buffers (the replay record: `self.record`)."""

    def __init__(
        self,
        schedule: SparseSchedule,
        step: int,
        into: Slot | None = None,
        model_key: str = "model",
        optim_key: str = "optim",
    ):
        """Pass as `dcp.load(state_dict, checkpoint_id=schedule.slot_path(root, step), planner=...)`.

        Args:
            schedule: the run's `SparseSchedule`.
            step: the iteration whose slot is read.
            into: read into this slot's buffers instead of the state dict (`load_sparse_window`).
            model_key, optim_key: where the state dict holds the model's and the optimizer's state.
        """
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.schedule, self.step, self.keys, self.into = schedule, step, (model_key, optim_key), into
        self.slot = into if into is not None else schedule.slot_items(schedule.locate(step)[1])
        self.record: IterationRecord | None = None
        self._dest: dict[tuple, SlotItem] = {}
        self._pending: dict[int, torch.Tensor] = {}  # id(buffer read in the compute dtype) -> its destination

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        info, want = planner_info(metadata), self.schedule.info(self.step).to_dict()  # (read: the DCP edge)
        bad = [k for k in INFO_KEYS if info.get(k) != want[k]]
        if bad:
            raise ValueError(
                f"checkpoint holds {', '.join(f'{k} {info.get(k)!r}' for k in bad)}, expected "
                f"{', '.join(f'{want[k]!r}' for k in bad)}: a slot of another step or plan"
            )

    def create_local_plan(self) -> LoadPlan:
        reads: list[ReadItem] = []
        assert self.metadata is not None  # DCP calls set_up_planner first
        md = self.metadata.state_dict_metadata
        for it in self.slot.items:
            key, wi = dcp_key(it, *self.keys), it.write_item()
            stored, td = md.get(key), wi.tensor_data
            if not isinstance(stored, TensorStorageMetadata) or td is None:
                raise KeyError(f"slot checkpoint has no {key!r}: written for another model or plan")
            chunk = ChunkStorageMetadata(td.chunk.offsets, td.chunk.sizes)
            found = create_read_items_for_chunk_list(key, stored, [chunk])
            got = sum(int(torch.Size(r.lengths).numel()) for r in found)
            if got != torch.Size(chunk.sizes).numel():
                raise KeyError(f"slot checkpoint covers {got} elements of {key} at {tuple(chunk.offsets)}")
            dest = MetadataIndex(key, chunk.offsets)
            reads += [dataclasses.replace(r, dest_index=dest) for r in found]
            self._dest[(key, tuple(chunk.offsets))] = it
        rk = replay_key(self.rank)
        if rk in md:
            at, e = MetadataIndex(rk), torch.Size(())
            reads.append(
                ReadItem(
                    type=LoadItemType.BYTE_IO,
                    dest_index=at,
                    dest_offsets=e,
                    storage_index=at,
                    storage_offsets=e,
                    lengths=e,
                )
            )
        self.plan = LoadPlan(reads)
        return self.plan

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        it = self._dest[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset or ()))]
        view = it.buffer if self.into is not None else _source(self.state_dict, it, *self.keys)
        for dim, (off, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, off, length)
        if it.role == "compute" and self.into is None:  # read in the compute dtype, cast up in commit_tensor
            tmp = torch.empty(view.shape, dtype=self.schedule.compute_dtype)
            self._pending[id(tmp)] = view
            return tmp
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        view = self._pending.pop(id(tensor), None)
        if view is not None:
            view.copy_(tensor)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.record = IterationRecord.from_dict(torch.load(value, weights_only=True, map_location="cpu"))


def load_sparse_window(schedule: SparseSchedule, window_id: int, reader_for, pin_memory: bool = False) -> Window:
    """The W slots of window `window_id` as a `Window` for `torchmoe_ckpt.recovery.sparse_to_dense`. Collective
    like `dcp.load` (every rank calls it).

    Args:
        schedule: the run's `SparseSchedule`.
        window_id: the window to read.
        reader_for: step -> the StorageReader of that step's slot (e.g. `lambda s: TieredReader([...])`).
        pin_memory: read into pinned host buffers (faster copies to the GPU).

    Returns:
        The window, every slot read and checked, with its replay records.

    Raises:
        ValueError: the replay records do not cover the window (a save without `record`).
        CorruptCopyError, FileNotFoundError: from the reader (no tier holds a verified copy).
    """
    start = schedule.first_step + window_id * schedule.window
    slots, log = [], ReplayLog()
    for i in range(schedule.window):
        slot = schedule.slot_items(i, alloc=lambda shape, dtype: torch.empty(shape, dtype=dtype, pin_memory=pin_memory))
        planner = SparseLoadPlanner(schedule, start + i, into=slot)
        # public DCP API; torch re-exports it without __all__
        dcp.load({}, storage_reader=reader_for(start + i), planner=planner)  # pyright: ignore[reportPrivateImportUsage]
        if planner.record is not None:
            log.add(planner.record)
        slot.step = start + i
        slot.done.set()
        slots.append(slot)
    win = Window(window_id, start, schedule.plan, slots, log, captured=schedule.window)
    if not win.committed:
        raise ValueError(
            f"window {window_id}: replay records do not cover steps "
            f"{start + 1}..{start + schedule.window - 1}"
            " (save each step with SparseSavePlanner(schedule, step, record))"
        )
    return win
