"""Host-memory tier: each rank writes its slots, through DCP, into a node-local directory (default under
/dev/shm, so a copy survives a worker restart by torchrun but not a node loss).

Layout, per window (every rank writes only its own files, so no collective runs off the training thread):

    <root>/<run>/window-000042/slot-00/rank-00003/{.metadata, __0_0.distcp}   one self-contained DCP
                                                                              checkpoint of this rank's pieces
                               replay/rank-00003.pt                          the window's replay records
                               MANIFEST.rank-00003.json                      written last: this rank's files + CRC32

A window is readable by rank r on this node iff its rank manifest exists, every file verifies, the manifest
matches its own checksum, and every slot file was written for the window/slot/step/run where it sits
(`check`). The manifest lists only what the slot writes of this process reported (sizes and CRC32 hashed
from the files right after DCP wrote them, in the same call), never what happens to be on disk at commit
time: a window one of whose slot writes failed (ENOSPC, ...) is never committed.
Slots are written by a background thread after their copy finished; the training thread never waits on it.
"""
from __future__ import annotations

import io
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
from ..identity import RunIdentity, identity_mismatch
from .manifest import (FileEntry, WindowManifest, check_window, crc32_bytes, file_entry, parse_window_dirname,
                       plan_digest, rank_manifest_name, slot_rank_dir, slot_record, window_dirname)
from .planner import PLANNER_KEY, SlotLoadPlanner, SlotSavePlanner, verify_items

log = logging.getLogger("torchmoe_ckpt.host_tier")
# Each rank deliberately saves its own pieces without collectives (no_dist=True); DCP warns about that.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
DEFAULT_ROOT = "/dev/shm/torchmoe-ckpt"


class HostTier:
    def __init__(self, root: str | Path, run_id: str, rank: int, world_size: int):
        self.dir = Path(root) / run_id
        self.rank, self.world_size = rank, world_size
        self.dir.mkdir(parents=True, exist_ok=True)
        # (window, slot) -> what that slot's write reported: its files (size, CRC32) and its DCP info.
        self._written: dict[tuple[int, int], tuple[dict[str, FileEntry], dict]] = {}

    def window_dir(self, window_id: int) -> Path:
        return self.dir / window_dirname(window_id)

    # ---- write path (background thread) --------------------------------------------------------------
    def write_slot(self, window_id: int, slot: Slot, info: dict) -> int:
        self._written.pop((window_id, slot.index), None)  # a failed write below leaves no record: no commit
        wdir = self.window_dir(window_id)
        out = slot_rank_dir(wdir, slot.index, self.rank)
        if out.exists():  # left over by a run that died before committing this window id
            shutil.rmtree(out)
            (wdir / rank_manifest_name(self.rank)).unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        dcp.save({}, storage_writer=FileSystemWriter(out, sync_files=False, overwrite=True),
                 planner=SlotSavePlanner(slot, info), no_dist=True)
        # Hashed here, in the call that wrote them: the commit lists these entries, not a later re-read.
        files = {str(f.relative_to(wdir)): file_entry(f) for f in sorted(out.iterdir())}
        self._written[(window_id, slot.index)] = (files, dict(info))
        faults.point("persist")
        return slot.nbytes

    def write_commit(self, window_id: int, start_step: int, plan: WindowPlan, log_: ReplayLog, extra: dict) -> WindowManifest:
        """Commit this rank's copy of a window: only if every slot write of it succeeded in this process.
        `extra["identity"]` (a RunIdentity dict) goes into the manifest's identity."""
        extra = dict(extra)
        identity = extra.pop("identity", None) or {}
        missing = [i for i in range(plan.window) if (window_id, i) not in self._written]
        if missing:
            raise UncommittableWindow(f"window {window_id} is not committed: the write of slot(s) {missing} failed "
                                      "or never happened")
        digest = plan_digest(plan.to_dict())
        files: dict[str, FileEntry] = {}
        records = []
        for i in range(plan.window):
            got, info = self._written[(window_id, i)]
            rec = slot_record(info)
            if (rec["window"] != window_id or rec["slot"] != i or rec["step"] != start_step + i
                    or rec["plan"] not in (None, digest)):
                raise UncommittableWindow(f"window {window_id} slot {i} was written as {rec}: not committed")
            files.update(got)
            records.append(rec)
        wdir = self.window_dir(window_id)
        replay = wdir / "replay" / f"rank-{self.rank:05d}.pt"
        replay.parent.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        torch.save([r.to_dict() for r in log_.records.values()], buf)
        data = buf.getvalue()
        replay.write_bytes(data)
        files[str(replay.relative_to(wdir))] = FileEntry(len(data), crc32_bytes(data))
        man = WindowManifest(window_id, start_step, plan.window, self.world_size, plan.to_dict(), files,
                             dict(extra, rank=self.rank), identity=identity, slots=records)
        faults.point("manifest")
        tmp = wdir / (rank_manifest_name(self.rank) + ".tmp")
        tmp.write_text(man.to_json())
        tmp.rename(wdir / rank_manifest_name(self.rank))  # the manifest, written last, is the commit
        for key in [k for k in self._written if k[0] <= window_id]:
            del self._written[key]
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
        """Problems with one rank's copy of a window's files (empty list = every file verifies)."""
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

    def check(self, window_id: int, identity: RunIdentity | None = None, rank: int | None = None) -> list[str]:
        """Everything recovery checks before loading this rank's copy: the files (`verify`), where the manifest
        and every slot file sit (window/slot/step/run), and, given `identity`, that this run wrote it."""
        problems = self.verify(window_id, rank)
        if problems:
            return problems
        rank = self.rank if rank is None else rank
        man = self.manifest(window_id, rank)
        if identity is not None and (why := identity_mismatch(man.identity, identity)):
            return [f"identity: {why}"]
        return check_window(man, window_id, rank, self.world_size, lambda rel: self._slot_info(window_id, rel))

    def _slot_info(self, window_id: int, rel: str) -> dict:
        md = FileSystemReader(self.window_dir(window_id) / rel.rsplit("/", 1)[0]).read_metadata()
        return (md.planner_data or {}).get(PLANNER_KEY) or {}

    def load_window(self, window_id: int, ops: dict, compute_dtype: torch.dtype, identity: RunIdentity | None = None):
        """Read this rank's copy of a committed window back into fresh slot buffers (checked first)."""
        problems = self.check(window_id, identity)
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
        win = Window(window_id, man.start_step, plan, slots, rlog, captured=plan.window)
        if not win.committed:
            raise CorruptCopyError(f"window {window_id}: replay records do not cover steps {man.start_step + 1}.."
                                   f"{man.start_step + plan.window - 1}")
        return win


class UncommittableWindow(RuntimeError):
    """A window one of whose slot writes failed (or never ran): its manifest is never written."""


class CorruptCopyError(RuntimeError):
    """A copy of a window on some tier is torn or corrupt: skip it for the next tier; never load it."""
