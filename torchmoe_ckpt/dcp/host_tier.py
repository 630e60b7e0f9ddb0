"""Host-memory tier: each rank writes its slots, through DCP, into a node-local directory (default under
/dev/shm, so a copy survives a worker restart by torchrun but not a node loss).

Layout, per window (every rank writes only its own files, so no collective runs off the training thread):

    <root>/<run>/window-000042/slot-00/rank-00003/{.metadata, __0_0.distcp}   one self-contained DCP
                                                                              checkpoint of this rank's pieces
                               replay/rank-00003.pt                          the window's replay records
                               MANIFEST.rank-00003.json                      written last: this rank's files + CRC32

A window is readable by rank r on this node iff its rank manifest exists and every file verifies.
Slots are written by a background thread after their copy finished; the training thread never waits on it.
"""
from __future__ import annotations

import logging
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from .. import faults
from ..replay_log import IterationRecord, ReplayLog
from ..schedule import WindowPlan
from ..snapshot import Slot, build_slot
from ..window import Window
from .manifest import (FileEntry, WindowManifest, file_entry, parse_window_dirname, rank_manifest_name, slot_rank_dir,
                       window_dirname)
from .planner import SlotLoadPlanner, SlotSavePlanner, verify_items

log = logging.getLogger("torchmoe_ckpt.host_tier")
# Each rank deliberately saves its own pieces without collectives (no_dist=True); DCP warns about that.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
DEFAULT_ROOT = "/dev/shm/torchmoe-ckpt"


class HostTier:
    def __init__(self, root: str | Path, run_id: str, rank: int, world_size: int):
        self.dir = Path(root) / run_id
        self.rank, self.world_size = rank, world_size
        self.dir.mkdir(parents=True, exist_ok=True)

    def window_dir(self, window_id: int) -> Path:
        return self.dir / window_dirname(window_id)

    # ---- write path (background thread) --------------------------------------------------------------
    def write_slot(self, window_id: int, slot: Slot, info: dict) -> int:
        out = slot_rank_dir(self.window_dir(window_id), slot.index, self.rank)
        if out.exists():  # left over by a run that died before committing this window id
            shutil.rmtree(out)
            (self.window_dir(window_id) / rank_manifest_name(self.rank)).unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        dcp.save({}, storage_writer=FileSystemWriter(out, sync_files=False, overwrite=True),
                 planner=SlotSavePlanner(slot, info), no_dist=True)
        faults.point("persist")
        return slot.nbytes

    def write_commit(self, window_id: int, start_step: int, plan: WindowPlan, log_: ReplayLog, extra: dict) -> WindowManifest:
        wdir = self.window_dir(window_id)
        replay = wdir / "replay" / f"rank-{self.rank:05d}.pt"
        replay.parent.mkdir(parents=True, exist_ok=True)
        torch.save([r.to_dict() for r in log_.records.values()], replay)
        files: dict[str, FileEntry] = {}
        for i in range(plan.window):
            d = slot_rank_dir(wdir, i, self.rank)
            for f in sorted(d.iterdir()):
                files[str(f.relative_to(wdir))] = file_entry(f)
        files[str(replay.relative_to(wdir))] = file_entry(replay)
        man = WindowManifest(window_id, start_step, plan.window, self.world_size, plan.to_dict(), files,
                             dict(extra, rank=self.rank))
        faults.point("manifest")
        tmp = wdir / (rank_manifest_name(self.rank) + ".tmp")
        tmp.write_text(man.to_json())
        tmp.rename(wdir / rank_manifest_name(self.rank))  # the manifest, written last, is the commit
        return man

    def collect(self, keep_from: int) -> list[int]:
        """Delete this rank's files of windows older than `keep_from` (manifest first); returns deleted ids."""
        gone = []
        for wid in self.window_ids(require_manifest=False):
            if wid >= keep_from:
                continue
            wdir = self.window_dir(wid)
            (wdir / rank_manifest_name(self.rank)).unlink(missing_ok=True)
            for slot_dir in wdir.glob("slot-*"):
                shutil.rmtree(slot_dir / f"rank-{self.rank:05d}", ignore_errors=True)
            (wdir / "replay" / f"rank-{self.rank:05d}.pt").unlink(missing_ok=True)
            if not any(wdir.glob("MANIFEST.rank-*.json")) and not any(wdir.glob("slot-*/rank-*")):
                shutil.rmtree(wdir, ignore_errors=True)
            gone.append(wid)
        return gone

    # ---- read path -----------------------------------------------------------------------------------
    def window_ids(self, require_manifest: bool = True) -> list[int]:
        ids = []
        for p in self.dir.glob("window-*"):
            wid = parse_window_dirname(p.name)
            if wid is not None and (not require_manifest or (p / rank_manifest_name(self.rank)).exists()):
                ids.append(wid)
        return sorted(ids)

    def manifest(self, window_id: int, rank: int | None = None) -> WindowManifest:
        path = self.window_dir(window_id) / rank_manifest_name(self.rank if rank is None else rank)
        return WindowManifest.from_json(path.read_text())

    def verify(self, window_id: int, rank: int | None = None) -> list[str]:
        """Problems with one rank's copy of a window (empty list = every file verifies)."""
        try:
            man = self.manifest(window_id, rank)
        except FileNotFoundError:
            return ["no manifest (window not committed on this tier)"]
        except ValueError as exc:
            return [f"bad manifest: {exc}"]
        wdir, problems = self.window_dir(window_id), []
        for rel, want in man.files.items():
            f = wdir / rel
            if not f.exists():
                problems.append(f"{rel}: missing")
                continue
            got = file_entry(f)
            if got.bytes != want.bytes:
                problems.append(f"{rel}: {got.bytes} bytes, manifest says {want.bytes} (torn)")
            elif got.crc32 != want.crc32:
                problems.append(f"{rel}: CRC32 {got.crc32:08x} != {want.crc32:08x} (corrupt)")
        return problems

    def load_window(self, window_id: int, ops: dict, compute_dtype: torch.dtype):
        """Read this rank's copy of a committed window back into fresh slot buffers (verified first)."""
        problems = self.verify(window_id)
        if problems:
            raise CorruptCopyError(f"window {window_id} on host tier {self.dir} is unusable: {problems[0]}"
                                   + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
        man = self.manifest(window_id)
        plan = WindowPlan.from_dict(man.plan)
        slots = []
        for i, sp in enumerate(plan.slots):
            slot = build_slot(i, sp.active, sp.frozen, ops, compute_dtype)
            reader = FileSystemReader(slot_rank_dir(self.window_dir(window_id), i, self.rank))
            dcp.load({}, storage_reader=reader, planner=SlotLoadPlanner(slot), no_dist=True)
            bad = verify_items(slot, reader.read_metadata())
            if bad:
                raise CorruptCopyError(f"window {window_id} slot {i}: item checksums do not match for {bad[:3]}")
            slot.step = man.start_step + i
            slot.done.set()
            slots.append(slot)
        rlog = ReplayLog()
        for d in torch.load(self.window_dir(window_id) / "replay" / f"rank-{self.rank:05d}.pt", weights_only=True):
            rlog.add(IterationRecord.from_dict(d))
        return Window(window_id, man.start_step, plan, slots, rlog, captured=plan.window)


class CorruptCopyError(RuntimeError):
    """A copy of a window on some tier is torn or corrupt: skip it for the next tier; never load it."""
