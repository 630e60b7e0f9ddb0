"""Host-memory tier: each rank writes its slots as raw-bytes DCP checkpoints (the format of
raw_storage.RawWriter, readable by stock `dcp.load` with RawReader) into a node-local directory (default under
/dev/shm, so a copy survives a worker restart by torchrun but not a node loss).

Persisting costs about one summing pass: with the checkpointer on CPU, a slot's buffers ARE a mapped data file
of this directory (slot_files.py), so the snapshot copy writes the bytes and the persist hard-links the file
into the window, sums it once (sum64b512, checksums.py) and writes a small `.metadata` record; the DCP plan and
metadata are computed and pickled once per slot layout (raw_layout.py). Slots in plain memory (pinned CUDA
buffers, other callers) are copied into a kept mapping of a collected window's data file (`.spare/`,
mapped_files.py): one memcpy more, no shared-memory page allocated again.

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
import os
import shutil
import uuid
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from .. import faults
from ..dcp.raw_storage import RawReader
from ..errors import TorchmoeError
from ..identity import RunIdentity, identity_mismatch
from ..replay_log import IterationRecord, ReplayLog
from ..schedule import WindowPlan
from ..snapshot import Slot, build_slot
from ..window import Window
from .checksums import SUM64, tensor_block_sums
from .manifest import (
    FileEntry,
    WindowManifest,
    check_window,
    crc32_bytes,
    file_entry,
    parse_window_dirname,
    plan_digest,
    rank_manifest_name,
    slot_rank_dir,
    slot_record,
    window_dirname,
)
from .mapped_files import MappedFiles
from .slot_files import SlotFiles, backing
from .slot_format import DATA_FILE, RawLayout, layout_key
from .slot_planner import PLANNER_KEY, SlotLoadPlanner, verify_items
from .spare_files import keep_spares, spares

log = logging.getLogger("torchmoe_ckpt.host_tier")
# Each rank deliberately saves its own pieces without collectives (no_dist=True); DCP warns about that.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
DEFAULT_ROOT = "/dev/shm/torchmoe-ckpt"
MAX_SPARES = 16  # data files of collected windows kept per rank for reuse


class HostTier:
    def __init__(self, root: str | Path, run_id: str, rank: int, world_size: int):
        self.dir = Path(root) / run_id
        self.rank, self.world_size = rank, world_size
        self.dir.mkdir(parents=True, exist_ok=True)
        # (window, slot) -> what that slot's write reported: its files (size, CRC32) and its DCP info.
        self._written: dict[tuple[int, int], tuple[dict[str, FileEntry], dict]] = {}
        # Data files stay mapped across reuse (mapped_files.py): a persist is one memcpy plus one summing pass.
        self._maps = MappedFiles(limit=MAX_SPARES + 64)
        self._slot_files: SlotFiles | None = None
        self._layouts: dict[tuple, RawLayout] = {}  # by layout_key: planned once per layout, not per slot object

    def window_dir(self, window_id: int) -> Path:
        return self.dir / window_dirname(window_id)

    # ---- write path (background thread) --------------------------------------------------------------
    def write_slot(self, window_id: int, slot: Slot, info: dict) -> int:
        self._written.pop((window_id, slot.index), None)  # a failed write below leaves no record: no commit
        wdir = self.window_dir(window_id)
        out = slot_rank_dir(wdir, slot.index, self.rank)
        if out.exists():  # left over by a run that died before committing this window id
            self._maps.forget(out / DATA_FILE)
            shutil.rmtree(out)
            (wdir / rank_manifest_name(self.rank)).unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        lay = self._layout(slot)
        data = os.path.join(out, DATA_FILE)
        back = backing(slot)
        if back is not None:
            # The snapshot copy already wrote the bytes into this file (slot_files.py): link it into the window
            # (it is not reused until collect unlinks it) and sum it once for the checksums.
            os.link(back.path, data)
            sums = tensor_block_sums(back.t).numpy()
        else:
            spare = self._take_spare(lay.size)
            if spare is not None:  # a collected window's file: its shared-memory pages are reused, not faulted in
                os.rename(spare, data)
            # One copy_ per item into a kept shared mapping, one summing pass (mapped_files.py).
            sums = self._maps.write(data, lay.size, lay.items, lay)
        # DCP metadata planned and pickled once per layout (raw_layout.py); per save only ids and digests.
        meta, file_digest = lay.save_record(sums, info, str(out), uuid.uuid4().hex)
        tmp = os.path.join(out, ".metadata.tmp")
        with open(tmp, "wb") as f:
            f.write(meta)
        os.replace(tmp, os.path.join(out, ".metadata"))  # last: the slot checkpoint is complete
        # Reported by the call that wrote them: the commit lists these entries, not a later re-read.
        rel = f"slot-{slot.index:02d}/rank-{self.rank:05d}"
        files = {
            f"{rel}/{DATA_FILE}": FileEntry(lay.size, file_digest, SUM64),
            f"{rel}/.metadata": FileEntry(len(meta), crc32_bytes(meta)),
        }
        self._written[(window_id, slot.index)] = (files, dict(info))
        faults.point("persist")
        return lay.nbytes

    def _layout(self, slot: Slot) -> RawLayout:
        """The slot's raw layout, computed once per slot object (its items never change)."""
        got = getattr(slot, "_raw_layout", None)
        if got is None or got[0] != len(slot.items):
            base = None if backing(slot) is None else backing(slot).t
            key = layout_key(slot, base)  # the sets of one plan rotate: they share one planned layout
            tpl = self._layouts.get(key)
            lay = RawLayout(slot, base) if tpl is None else tpl.for_slot(slot)
            if tpl is None:
                if len(self._layouts) >= 64:
                    self._layouts.clear()
                self._layouts[key] = lay.template()  # no buffers: a dropped set's memory is not pinned
            got = slot._raw_layout = (len(slot.items), lay)
        return got[1]

    @property
    def slot_files(self) -> SlotFiles:
        """Allocator of slot buffers backed by this rank's data files (the checkpointer's, on CPU)."""
        if self._slot_files is None:
            self._slot_files = SlotFiles(self.dir, self.rank)
        return self._slot_files

    def write_commit(
        self, window_id: int, start_step: int, plan: WindowPlan, log_: ReplayLog, extra: dict
    ) -> WindowManifest:
        """Commit this rank's copy of a window: only if every slot write of it succeeded in this process.
        `extra["identity"]` (a RunIdentity dict) goes into the manifest's identity."""
        extra = dict(extra)
        identity = extra.pop("identity", None) or {}
        missing = [i for i in range(plan.window) if (window_id, i) not in self._written]
        if missing:
            raise UncommittableWindow(
                f"window {window_id} is not committed: the write of slot(s) {missing} failed or never happened"
            )
        digest = plan_digest(plan.to_dict())
        files: dict[str, FileEntry] = {}
        records = []
        for i in range(plan.window):
            got, info = self._written[(window_id, i)]
            rec = slot_record(info)
            if (
                rec["window"] != window_id
                or rec["slot"] != i
                or rec["step"] != start_step + i
                or rec["plan"] not in (None, digest)
            ):
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
        man = WindowManifest(
            window_id,
            start_step,
            plan.window,
            self.world_size,
            plan.to_dict(),
            files,
            dict(extra, rank=self.rank),
            identity=identity,
            slots=records,
        )
        faults.point("manifest")
        tmp = wdir / (rank_manifest_name(self.rank) + ".tmp")
        tmp.write_text(man.to_json())
        tmp.rename(wdir / rank_manifest_name(self.rank))  # the manifest, written last, is the commit
        for key in [k for k in self._written if k[0] <= window_id]:
            del self._written[key]
        return man

    def _spare_dir(self) -> Path:
        return self.dir / ".spare" / f"rank-{self.rank:05d}"

    def _take_spare(self, nbytes: int) -> Path | None:
        """The kept data file whose size is closest to `nbytes` (None when there is none)."""
        files = spares(self._spare_dir())
        if not files:
            return None
        return min(files, key=lambda f: abs(f.stat().st_size - nbytes))

    def _keep_spares(self, wdir: Path) -> None:
        """Move this rank's data files of a collected window aside for reuse (bounded)."""
        if self._slot_files is not None:
            return  # slots are shared-memory files of their own (slot_files.py): spares would never be taken
        files = []
        for f in sorted(wdir.glob(f"slot-*/rank-{self.rank:05d}/*.distcp")):
            if f.stat().st_nlink > 1:  # a live slot file's link (slot_files.py): unlinking frees it for reuse
                f.unlink()
            else:
                files.append(f)
        for f in keep_spares(files, self._spare_dir(), MAX_SPARES, wdir.name):
            self._maps.forget(f)  # deleted below: its mapping would pin the pages

    def collect(self, keep_from: int) -> list[int]:
        """Delete this rank's files of windows older than `keep_from` (manifest first); returns deleted ids."""
        gone = []
        for wid in self.window_ids(require_manifest=False):
            if wid >= keep_from:
                continue
            wdir = self.window_dir(wid)
            (wdir / rank_manifest_name(self.rank)).unlink(missing_ok=True)
            self._keep_spares(wdir)
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
            got = file_entry(f, want.algo)
            if got.bytes != want.bytes:
                problems.append(f"{rel}: {got.bytes} bytes, manifest says {want.bytes} (torn)")
            elif got.crc32 != want.crc32:
                problems.append(f"{rel}: {want.algo} {got.crc32:08x} != {want.crc32:08x} (corrupt)")
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
        md = RawReader(self.window_dir(window_id) / rel.rsplit("/", 1)[0]).read_metadata()
        return (md.planner_data or {}).get(PLANNER_KEY) or {}

    def load_window(self, window_id: int, ops: dict, compute_dtype: torch.dtype, identity: RunIdentity | None = None):
        """Read this rank's copy of a committed window back into fresh slot buffers (checked first)."""
        problems = self.check(window_id, identity)
        if problems:
            raise CorruptCopyError(
                f"window {window_id} on host tier {self.dir} is unusable: {problems[0]}"
                + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "")
            )
        man = self.manifest(window_id)
        plan = WindowPlan.from_dict(man.plan)
        slots = []
        for i, sp in enumerate(plan.slots):
            slot = build_slot(i, sp.active, sp.frozen, ops, compute_dtype)
            # Reads DCP's own format too. Items are checked by verify_items below (one clear CorruptCopyError),
            # not inside dcp.load (which would wrap the reason into a CheckpointException).
            reader = RawReader(slot_rank_dir(self.window_dir(window_id), i, self.rank), verify=False)
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
            raise CorruptCopyError(
                f"window {window_id}: replay records do not cover steps {man.start_step + 1}.."
                f"{man.start_step + plan.window - 1}"
            )
        return win


class UncommittableWindow(TorchmoeError, RuntimeError):
    """A window one of whose slot writes failed (or never ran): its manifest is never written."""


class CorruptCopyError(TorchmoeError, RuntimeError):
    """A copy of a window on some tier is torn or corrupt: skip it for the next tier; never load it."""
