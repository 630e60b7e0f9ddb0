"""What the host tier and the object store (DCP format) share: one writer's windows as files in the layout
(layout.py), written slot by slot, committed by a manifest written last, on a local directory or any fsspec store
(files.py). `FilesWindowTier` implements contracts.py's `WindowTier` contract (its call order is there).

    FilesWindowTier    one writer's windows on one Files backend (a held peer copy, an orphan, inspection)
      HostTier         host_tier.py: node-local, slot files linked in, loads windows back for recovery
      ObjectTier       object_tier.py: the DCP-format object store (also a CopyTier of the host tier)
"""

from __future__ import annotations

import io
import os
import pickle
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from ..core.errors import TorchmoeError
from ..core.plan import WindowPlan
from ..core.records import ReplayLog, SlotInfo
from ..core.rejection import Rejection, RejectionKind
from ..model.identity import RunIdentity, identity_mismatch
from ..runtime import faults
from ..storage_format.checksums import SUM64, FileEntry, crc32_bytes, tensor_block_sums
from ..storage_format.layout import (
    DATA_FILE,
    METADATA,
    belongs_to,
    is_data_file,
    manifest_name,
    parse_window_dirname,
    partial_file,
    replay_file,
    slot_writer_dir,
    spare_dir,
    window_dirname,
    writer_name,
)
from ..storage_format.manifest import (
    WindowManifest,
    check_window,
    plan_digest,
    record_digest,
    slot_metadata_file,
    slot_record,
)
from ..storage_format.slot_format import SlotLayout, as_source, nbytes_of, pack, planner_info
from ..storage_format.spare_files import keep_spares, spares
from .contracts import WindowTier

MAX_LAYOUTS = 64  # slot layouts kept per tier (a plan change brings new ones; old plans' are dropped)


def saved(obj) -> bytes:
    """`obj` as `torch.save` writes it."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@dataclass(frozen=True)
class PartialWindow:
    """A sliding plan's window before its commit, as far as it got: written after each of its slots
    (`write_partial`) so that a recovery can continue through it before the window commits."""

    start_step: int  # the window's first step
    plan: WindowPlan
    records: list  # the IterationRecords of the replay log so far


class SlotWrite(NamedTuple):
    """What one slot write of this process reported: the commit lists these."""

    files: dict[str, FileEntry]  # its files, relative to the window directory
    info: SlotInfo  # what it was written for (window, slot, step, run, plan)


class UncommittableWindow(TorchmoeError, RuntimeError):
    """A window one of whose slot writes failed (or never ran): its manifest is never written."""


def write_slot_dir(files, rel: str, lay: SlotLayout, info: SlotInfo | None, write_data, algo: str = SUM64):
    """Write one writer's piece of a slot at `rel`: the data file through `write_data(data_rel)` (returns its block
    sums, sum64b512, or its bytes, CRC32), then its `.metadata`. Returns both files' entries and item checksums.
    `info` None: a save whose DCP planner is not ours."""
    files.makedirs(rel)
    got = write_data(f"{rel}/{DATA_FILE}")
    said = {} if info is None else info.to_dict()  # (into the pickled DCP metadata: the edge)
    meta, digest, items = lay.record(
        said, f"{files.where}/{rel}", uuid.uuid4().hex, sums=got if algo == SUM64 else None, data=got, algo=algo
    )
    files.write_last(f"{rel}/{METADATA}", meta)
    return {DATA_FILE: FileEntry(lay.size, digest, algo), METADATA: FileEntry(len(meta), crc32_bytes(meta))}, items


def data_writer(files, lay: SlotLayout, sources: list, algo: str = SUM64, maps=None, take_spare=None):
    """`write_data` of one save: through a kept mapping of `maps` (local files, sum64b512; see `mapped`), else the
    data file assembled in memory and written whole (a store, a plain directory)."""
    if maps is not None and files.local and algo == SUM64:
        return mapped(maps, files, lay, mapped_items(lay, sources), take_spare)

    def write(data_rel: str):
        data = pack(lay, sources)
        files.write(data_rel, data.numpy())
        return tensor_block_sums(data).numpy() if algo == SUM64 else data.numpy()

    return write


def mapped_items(lay: SlotLayout, sources: list) -> list:
    """[(offset, bytes, data)] of a save, as MappedFiles.write takes them."""
    return [(off, n, as_source(d)) for off, n, d in zip(lay.offsets, lay.lengths, sources)]


def mapped(maps, files, lay: SlotLayout, items: list, take_spare=None):
    """`write_data` through a kept shared mapping of the data file (mapped_files.py); `take_spare(size)` offers a
    collected window's file to write over (its pages are reused, not faulted in)."""

    def write(data_rel: str):
        path = files.path(data_rel)
        spare = take_spare(lay.size) if take_spare is not None else None
        if spare is not None:
            os.rename(spare, path)
        return maps.write(str(path), lay.size, items, lay)

    return write


class FilesWindowTier(WindowTier):
    """One writer's windows on one Files backend (declares contracts.py's `WindowTier`: pyright checks every member
    against it)."""

    def __init__(self, files, rank: int, world_size: int, node_ranks: list[int] | None = None):
        """`files`: the backend (files.py). `rank`: the writer whose windows these are. `world_size`: recorded
        in the manifests this tier commits. `node_ranks`: every rank writing into this directory (a host tier's
        node; recorded in its manifests: verify expects them all), None: not recorded."""
        self.files, self.rank, self.world_size = files, rank, world_size
        self.node_ranks = node_ranks
        self.writer = writer_name(rank)
        # (window, slot) -> what that slot's write reported: its files and its DCP info (the commit lists these).
        self._written: dict[tuple[int, int], SlotWrite] = {}
        self._layouts: dict[tuple, SlotLayout] = {}  # planned once per layout, not per save

    def layout(self, items: list, offsets=None, size=None) -> SlotLayout:
        key = SlotLayout.key(items, offsets, size)
        lay = self._layouts.get(key)
        if lay is None:
            if len(self._layouts) >= MAX_LAYOUTS:
                self._layouts.clear()
            lay = self._layouts[key] = SlotLayout(items, offsets, size)
        return lay

    def write_items(self, window_id: int, slot: int, items: list, info: SlotInfo, algo: str = SUM64) -> list:
        """Write one slot from [(WriteItem, tensor or bytes)] (the DCP adapters'); returns DCP's WriteResults."""
        lay = self.layout([(wi, nbytes_of(wi, d)) for wi, d in items])
        sources = [d for _, d in items]
        write = data_writer(self.files, lay, sources, algo, self._maps, self.take_spare)
        return lay.results(f"{self.writer}/{DATA_FILE}", self._store_slot(window_id, slot, lay, info, write, algo))

    def _store_slot(self, window_id: int, slot: int, lay: SlotLayout, info: SlotInfo, write_data, algo=SUM64) -> list:
        self._written.pop((window_id, slot), None)  # a failed write below leaves no record: no commit
        rel = f"{window_dirname(window_id)}/{slot_writer_dir(slot, self.writer)}"
        if self.files.exists(rel):  # left over by a run that died before committing this window id
            self._discard_slot(rel)
            self.files.remove([f"{window_dirname(window_id)}/{manifest_name(self.writer)}"])
        entries, digests = write_slot_dir(self.files, rel, lay, info, write_data, algo)
        d = slot_writer_dir(slot, self.writer)
        self._written[(window_id, slot)] = SlotWrite({f"{d}/{k}": e for k, e in entries.items()}, info)
        return digests

    def _discard_slot(self, rel: str) -> None:
        self.files.remove_tree(rel)

    def written(self, window_id: int, slot: int) -> dict[str, FileEntry]:
        """The files one slot write of this process reported (relative to the window directory)."""
        return self._written[(window_id, slot)].files

    def write_commit(
        self, window_id: int, start_step: int, plan: WindowPlan, log: ReplayLog | None, extra: dict
    ) -> WindowManifest:
        """Commit this writer's copy of a window, only if every slot write of it succeeded in this process. `log`:
        the replay records (None: they are items of the slots, a DCP user's); `extra["identity"]`: the manifest's."""
        extra = dict(extra)
        identity = extra.pop("identity", None) or {}
        missing = [i for i in range(plan.window) if (window_id, i) not in self._written]
        if missing:
            raise UncommittableWindow(
                f"window {window_id} is not committed: the write of slot(s) {missing} failed or never happened"
            )
        digest = plan_digest(plan.to_dict())
        files, records = {}, []
        for i in range(plan.window):
            got, info = self._written[(window_id, i)]
            rec = slot_record(info)
            where = (rec["window"], rec["slot"], rec["step"], rec["plan"] in (None, digest))
            if where != (window_id, i, start_step + i, True):
                raise UncommittableWindow(f"window {window_id} slot {i} was written as {rec}: not committed")
            files.update(got)
            records.append(rec)
        w = window_dirname(window_id)
        if log is not None:
            data = saved([r.to_dict() for r in log.records.values()])
            self.files.write(f"{w}/{replay_file(self.writer)}", data)
            files[replay_file(self.writer)] = FileEntry(len(data), crc32_bytes(data))
        extra = dict(extra, rank=self.rank, **({"node_ranks": self.node_ranks} if self.node_ranks else {}))
        man = WindowManifest(window_id, start_step, plan.window, self.world_size, plan.to_dict(), files, extra)
        man.identity, man.slots = identity, records
        faults.point("manifest")
        self.files.write_last(f"{w}/{manifest_name(self.writer)}", man.to_json().encode())  # the commit
        self.window_data_files = sum(map(is_data_file, files))
        for wid, slot in [(wid, slot) for wid, slot in self._written if wid <= window_id]:
            del self._written[(wid, slot)]
        return man

    def write_partial(self, window_id: int, start_step: int, plan: WindowPlan, records: list, slots: int) -> None:
        """A sliding plan's window before its commit: how far it got (its first `slots` slots), its plan and replay
        records so far, replaced atomically after each slot (recovery may continue through them)."""
        recs = [r.to_dict() for r in records]
        data = saved(dict(window=window_id, start_step=start_step, plan=plan.to_dict(), slots=slots, records=recs))
        self.files.write_last(f"{window_dirname(window_id)}/{partial_file(self.writer)}", data)

    def window_ids(self, require_manifest: bool = True, rank: int | None = None) -> list[int]:
        """Windows this writer committed (`require_manifest=False`: every window directory)."""
        man = manifest_name(self.writer_of(rank))
        named = [(parse_window_dirname(n), n) for n in self.files.listdir("")]
        return sorted(
            w for w, n in named if w is not None and (not require_manifest or self.files.exists(f"{n}/{man}"))
        )

    def manifest(self, window_id: int, rank: int | None = None) -> WindowManifest:
        rel = f"{window_dirname(window_id)}/{manifest_name(self.writer_of(rank))}"
        return WindowManifest.from_json(bytes(self.files.read(rel)))

    def writer_of(self, rank: int | None) -> str:
        return self.writer if rank is None else writer_name(rank)

    def verify(self, window_id: int, rank: int | None = None) -> list[Rejection]:
        """Problems with one writer's copy of a window's files (empty list = every file verifies)."""
        try:
            man = self.manifest(window_id, rank)
        except FileNotFoundError:
            return [Rejection(RejectionKind.NOT_COMMITTED, "no manifest (window not committed on this tier)")]
        except ValueError as exc:
            return [Rejection(RejectionKind.BAD_MANIFEST, f"bad manifest: {exc}")]
        return self.verify_files(window_id, man)

    def verify_files(self, window_id: int, man: WindowManifest) -> list[Rejection]:
        w, problems = window_dirname(window_id), []
        for rel, want in man.files.items():
            try:
                why = want.problem(rel, self.files.entry(f"{w}/{rel}", want.algo))
            except FileNotFoundError:
                why = Rejection(RejectionKind.MISSING_FILE, f"{rel}: missing", file=rel)
            if why is not None:
                problems.append(why)
        return problems

    def check(
        self,
        window_id: int,
        identity: RunIdentity | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> list[Rejection]:
        """What recovery checks before loading a writer's copy: `verify`, where the manifest and every slot file sit
        (window/slot/step/run, and the world size: `world_size`, default this tier's), and, given `identity`, that
        this run wrote it. `torchmoe-ckpt verify` calls it too (ops/inspection.py), then `record_problems`."""
        problems = self.verify(window_id, rank)
        if problems:
            return problems
        rank = self.rank if rank is None else rank
        man = self.manifest(window_id, rank)
        if identity is not None and (why := identity_mismatch(man.identity, identity)):
            return [Rejection(RejectionKind.FOREIGN, f"identity: {why}", detail=why)]
        world = self.world_size if world_size is None else world_size
        return check_window(man, window_id, rank, world, lambda rel: self.slot_info(window_id, rel))

    def record_problems(
        self, window_id: int, man: WindowManifest, records: list[dict] | None = None, rank: int | None = None
    ) -> list[Rejection]:
        """Replay records that are not the ones their slots were written with (each slot's DCP metadata holds its
        record's digest): an edited record whose CRC and manifest checksum were recomputed is refused, never
        replayed. `records`: as loaded (None: read from the writer's replay file, if the manifest lists one).
        Recovery checks this at load (HostTier.load_window), `torchmoe-ckpt verify` with the same function."""
        if records is None:
            rel = replay_file(self.writer_of(rank))
            if rel not in man.files:
                return []  # a DCP user's window: its records are items of the slots
            try:
                data = bytes(self.files.read(f"{window_dirname(window_id)}/{rel}"))
                records = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
            except Exception as exc:  # a file whose CRC was recomputed over bytes that are not records
                why = f"{rel}: replay records unreadable ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
                return [Rejection(RejectionKind.UNREADABLE, why, file=rel)]
        out = []
        for record in records or []:
            slot = record.get("step", -1) - man.start_step
            meta = slot_metadata_file(man, slot) if 0 < slot < man.window else None
            want = self.slot_info(window_id, meta).get("record") if meta is not None else None
            if want is not None and record_digest(record) != want:
                why = (
                    f"window {window_id}: the replay record of step {record.get('step')} is not the one slot {slot} "
                    "was written with (its digest differs: an edited or swapped record); it is not replayed"
                )
                out.append(Rejection(RejectionKind.FORGED_RECORD, why, file=replay_file(self.writer_of(rank))))
        return out

    def slot_info(self, window_id: int, rel: str) -> dict:
        """The planner info (window, slot, step, run, plan, checksums) of a slot's `.metadata` in a window."""
        return planner_info(pickle.loads(bytes(self.files.read(f"{window_dirname(window_id)}/{rel}"))))

    def remove_window(self, window_id: int) -> None:
        """Remove this writer's files of a window, its manifest first; the directory too once it is empty."""
        w = window_dirname(window_id)
        self.files.remove([f"{w}/{manifest_name(self.writer)}"])
        self._discard([f"{w}/{r}" for r in self.files.find(w) if belongs_to(r, self.writer)], w)
        if not self.files.find(w):
            self.files.remove_tree(w)

    _maps = None  # MappedFiles: data files written through kept mappings (the host tier's)
    max_spares = 0  # data files of collected windows kept (local backends) for the next ones to be written over
    window_data_files = 0  # data files of the newest window this writer committed (spare limits derive from it)

    def spare_path(self) -> Path:
        return Path(self.files.path(spare_dir(self.writer)))  # an internal name: never listed as a window

    def take_spare(self, nbytes: int) -> Path | None:
        """The kept data file whose size is closest to `nbytes` (None: none), to be written over (its pages reused)."""
        files = spares(self.spare_path()) if self.max_spares else []
        return min(files, key=lambda f: abs(f.stat().st_size - nbytes)) if files else None

    def trim_spares(self) -> int:
        """Delete every spare data file (memory pressure); returns their bytes. Only while nothing writes here."""
        n = 0
        for f in spares(self.spare_path()):
            n += f.stat().st_size
            self._delete(f)
        return n

    def _discard(self, rels: list[str], window_dir: str) -> None:
        """Remove a collected window's files, keeping (bounded) its data files as spares."""
        if self.files.local:
            data = [Path(self.files.path(r)) for r in rels if is_data_file(r)]
            if self.max_spares:
                # a second link is a live slot file's (slot_files.py): unlinking it frees the slot for reuse
                spare = [f for f in data if f.stat().st_nlink == 1]
                for f in keep_spares(spare, self.spare_path(), self.max_spares, window_dir):
                    if f.parent == self.spare_path():  # a spare beyond the limit (it went down)
                        self._delete(f)
            for f in data:
                if f.exists():  # to be deleted: a kept mapping would hold its pages
                    self._forget(f)
        self.files.remove(rels)

    def _forget(self, path: Path) -> None:
        """A data file about to be deleted (the host tier drops its mapping: it would pin the pages)."""

    def _delete(self, path: Path) -> None:
        self._forget(path)
        path.unlink(missing_ok=True)

    def collect(self, keep_from: int) -> list[int]:
        """Delete this writer's files of windows older than `keep_from`; returns the deleted ids."""
        gone = [w for w in self.window_ids(require_manifest=False) if w < keep_from]
        for wid in gone:
            self.remove_window(wid)
        return gone
