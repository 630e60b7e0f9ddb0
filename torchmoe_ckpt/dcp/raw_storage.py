"""`dcp.save` / `dcp.load` through the storage tiers: `RawWriter` writes the slot format, each rank its own piece
under `<path>/<writer>/` (into a `SparseSchedule.slot_path` through the run directory's tier, committing the
writer's window manifest on the window's last slot, since DCP's `finish` runs on the coordinator only); `RawReader`
merges the pieces it finds.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections import OrderedDict
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ..core.records import SlotInfo
from ..storage_format.checksums import SUM64
from ..storage_format.files import open_files
from ..storage_format.layout import DATA_FILE, METADATA, parse_slot_path, writer_name
from ..storage_format.manifest import WindowManifest
from ..storage_format.slot_format import ItemSource, SlotLayout, chunk_sizes, load_item, nbytes_of, read_slot_metadata
from ..tiers.host_tier import HostTier
from ..tiers.object_tier import ObjectTier
from ..tiers.window_tier import FilesWindowTier, UncommittableWindow, data_writer, write_slot_dir

log = logging.getLogger("torchmoe_ckpt.dcp")
MAX_TIERS = 8  # tier objects kept for the run directories DCP users save into (each keeps its planned layouts)
_TIERS: OrderedDict[tuple, FilesWindowTier] = OrderedDict()


class NoPlanning:
    """DCP's planning hooks left as they are: every writer and reader handles its own piece."""

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans: list) -> list:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return bool(str(checkpoint_id))


def done(value=None) -> Future:
    """A Future that already holds `value`: these writers and readers finish their I/O before returning."""
    fut: Future = Future()
    fut.set_result(value)
    return fut


def run_tier(
    run: str, rank: int, world: int, storage_options: dict | None = None, store: bool | None = None
) -> FilesWindowTier:
    """The tier object of a run directory for one writer (HostTier for a local path, ObjectTier for a URI), kept
    across saves: its planned layouts, its record of which slots of a window this process wrote."""
    store = "://" in run if store is None else store
    key = (run, rank, world, store, repr(sorted((storage_options or {}).items())))
    tier = _TIERS.pop(key, None)
    if tier is None:
        if store:
            uri = run if "://" in run else f"file://{os.path.abspath(run)}"
            tier = ObjectTier(uri, "", rank, storage_options, world_size=world)
        else:
            tier = HostTier(Path(run).parent, Path(run).name, rank, world)
    _TIERS[key] = tier
    while len(_TIERS) > MAX_TIERS:
        _TIERS.popitem(last=False)
    return tier


class RawWriter(NoPlanning, StorageWriter):
    _store: bool | None = None  # the tier kind of a window save: None = by the path (URI: store)

    def __init__(
        self, path: str | os.PathLike = "", storage_options: dict | None = None, checksum_algo: str = SUM64, mapped=None
    ):
        """`checksum_algo`: "sum64b512" (default) or "crc32". `mapped` (a MappedFiles): a plain local directory's data
        file is written through a kept shared mapping (a window save uses its tier's)."""
        super().__init__()
        self.path, self.storage_options, self.algo, self.mapped = str(path), storage_options, checksum_algo, mapped
        self.rank, self.world = 0, 1
        self.save_id = uuid.uuid4().hex
        self.written: dict[str, int] = {}  # data file (relative to path) -> bytes, this writer's
        self.file_checksum: dict[str, tuple[str, int]] = {}  # data file -> (algo, 32-bit digest)
        # a window save: its tier, window id and slot
        self.tier: FilesWindowTier | None = None
        self.window: int | None = None
        self.slot: int | None = None
        self.slot_files: dict = {}  # a window save: the files of this writer's piece (relative to the window)
        self.closes_window = False  # the save was the window's last slot
        self.committed: WindowManifest | None = None  # the window manifest this save committed then

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = str(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self.written, self.file_checksum, self.committed = {}, {}, None

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank", 0)
        collective = kwargs.get("use_collectives", True) and dist.is_initialized()
        self.world = dist.get_world_size() if collective else 1

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        items = [(wi, planner.resolve_data(wi)) for wi in plan.items]
        info: SlotInfo | None = getattr(planner, "info", None)  # ours (SparseSavePlanner, SlotSavePlanner) say it
        wplan = getattr(planner, "window_plan", None)  # SparseSavePlanner: the window plan of the schedule
        where = parse_slot_path(self.path) if wplan is not None else None
        self.tier, self.window, self.slot, self.committed, self.closes_window = None, None, None, None, False
        if where is not None and wplan is not None and info is not None:  # (where is None without a window plan)
            run, self.window, self.slot = where
            if (self.window, self.slot) != (info.window, info.slot):
                raise ValueError(
                    f"{self.path}: saving window {info.window} slot {info.slot} into the directory "
                    f"of window {self.window} slot {self.slot}; use schedule.slot_path(root, step)"
                )
            tier = self.tier = run_tier(run, self.rank, self.world, self.storage_options, self._store)
            results = tier.write_items(self.window, self.slot, items, info, self.algo)
            entries = self.slot_files = tier.written(self.window, self.slot)
            self.closes_window = self.slot == wplan.window - 1
            if self.closes_window:  # this writer's window manifest, if every slot of it was written here
                extra = {"identity": {"fingerprint": info.run} if info.run else {}}
                try:
                    self.committed = tier.write_commit(self.window, info.start_step, wplan, None, extra)
                except UncommittableWindow as exc:  # e.g. saving began mid-window: the window is never visible
                    log.info("%s", exc)
        else:
            files = open_files(self.path, self.storage_options)
            lay = SlotLayout([(wi, nbytes_of(wi, d)) for wi, d in items])
            sources = [d for _, d in items]
            write = data_writer(files, lay, sources, self.algo, self.mapped)
            got, digests = write_slot_dir(files, writer_name(self.rank), lay, info, write, self.algo)
            entries = {f"{writer_name(self.rank)}/{k}": e for k, e in got.items()}
            results = lay.results(f"{writer_name(self.rank)}/{DATA_FILE}", digests)
        for rel, e in entries.items():
            if not rel.endswith(METADATA):
                name = rel.split("/", 1)[1] if where is not None else rel
                self.written[name] = e.bytes
                self.file_checksum[name] = (e.algo, e.crc32)
        return done(results)

    def write_from(self, first: RawWriter) -> int:
        """As a later tier of a TieredWriter: the files `first` just wrote, copied here, each commit file last (a
        slot's `.metadata`, the window manifest once `first` committed it); returns the bytes."""
        if first.tier is None:  # a plain directory: the writer's piece
            src, dst = open_files(first.path, first.storage_options), open_files(self.path, self.storage_options)
            for rel in sorted(first.written) + [f"{writer_name(first.rank)}/{METADATA}"]:
                (dst.write_last if rel.endswith(METADATA) else dst.write)(rel, src.read(rel))
            self.written = dict(first.written)
            return sum(first.written.values())
        where = parse_slot_path(self.path)
        if where is None or where[1:] != (first.window, first.slot):
            raise ValueError(f"{self.path}: a later tier must save the same slot as the first ({first.path})")
        run, self.window, self.slot = where
        store = self.tier = run_tier(run, self.rank, self.world, self.storage_options, True)
        assert isinstance(store, ObjectTier)  # store=True
        nbytes = store.upload(first.tier, self.window, first.slot_files, commit=False)
        if first.committed is not None:
            store.upload(first.tier, self.window, {}, commit=True)  # the manifest, once every file is here
            self.committed = first.committed
        self.written = dict(first.written)
        return nbytes

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        pass  # every writer committed its own piece in write_data


class RawReader(NoPlanning, StorageReader):
    """Reads the slot format at `path` (a local path or any fsspec URI): a writer's piece, or a slot directory's
    pieces merged, every item checked before it is copied; DCP's own torch.save format reads too."""

    def __init__(self, path: str | os.PathLike = "", storage_options: dict | None = None, verify: bool = True):
        super().__init__()
        self.path, self.storage_options, self.verify = str(path), storage_options, verify
        self.files = open_files(self.path, storage_options) if self.path else None
        self.storage_data: dict = {}
        self.load_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = str(checkpoint_id)
            self.files = open_files(self.path, self.storage_options)
        self.storage_data, self.load_id = {}, uuid.uuid4().hex

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's rank-local fallback: a slot's metadata is whole already
            raise FileNotFoundError("the slot format has no rank-local metadata mode")
        md = read_slot_metadata(self.files, "")
        assert md.storage_meta is not None  # the slot format records one
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.metadata, self.storage_data = metadata, metadata.storage_data
        self._sizes = chunk_sizes(metadata)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list] = {}
        for req in plan.items:
            if req.storage_index not in self.storage_data:  # planned against another tier's fuller view
                raise FileNotFoundError(f"{self.path} holds no {req.storage_index.fqn} at {req.storage_index.offset}")
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        source = ItemSource(self.metadata, self._sizes, self.verify, self.path)
        for rel, reqs in per_file.items():
            raw = self.read_file(rel)
            for req in reqs:
                load_item(raw, rel, req, planner, source)
        return done()

    def read_file(self, rel: str):
        """The bytes of data file `rel` (PeerReader reads them from wherever a copy is held)."""
        if self.files is None:
            raise FileNotFoundError("no checkpoint path given (reset(checkpoint_id) names it)")
        return self.files.read(rel)


def has_checkpoint(path: str | os.PathLike, storage_options: dict | None = None) -> bool:
    """Whether `path` holds a committed checkpoint: a `.metadata` of its own, or of a writer's piece in it."""
    files = open_files(path, storage_options)
    return files.exists(METADATA) or any(files.exists(f"{w}/{METADATA}") for w in files.listdir(""))


def committed_windows(location: str | os.PathLike, storage_options: dict | None = None, rank: int | None = None):
    """The windows a writer (default: this rank) committed under a run directory (its manifest is there)."""
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    return FilesWindowTier(open_files(location, storage_options), rank, 1).window_ids()
