"""Host-memory tier: each writer's slots in the slot format in a node-local directory (default /dev/shm: a copy
survives a worker restart, not a node loss), committed per window by the writer's manifest (window_tier.py).
On CPU a slot's buffers ARE a mapped data file here (slot_files.py): persisting is a hard link, one summing pass
and a small `.metadata`; other slots are copied into a kept mapping of a spare file (mapped_files.py).
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Set
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..core.plan import WindowPlan
from ..core.records import IterationRecord, ReplayLog, SlotInfo
from ..core.slot import Slot, SlotBacking, build_slot
from ..core.window import Window
from ..model.identity import RunIdentity
from ..runtime import faults
from ..storage_format import usage
from ..storage_format.checksums import tensor_block_sums
from ..storage_format.files import LocalFiles
from ..storage_format.layout import partial_file, replay_file, slot_writer_dir, slots_dir, window_dirname
from ..storage_format.manifest import plan_digest, record_digest, slot_record
from ..storage_format.mapped_files import MappedFiles
from ..storage_format.slot_files import SlotFiles
from ..storage_format.slot_format import CorruptCopyError, SlotLayout, read_slot, slot_items
from .window_tier import FilesWindowTier, PartialWindow, mapped, mapped_items

if TYPE_CHECKING:
    from .orphans import OrphanCopies
    from .peer_interval import Interval

# Each writer deliberately saves its own pieces without collectives (no_dist=True); DCP warns about that.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
MAX_MAPPINGS = 80  # data-file mappings kept open (mapped_files.py); their memory is the files'


@dataclass(frozen=True)
class HostTierOptions:
    """A host tier's settings beyond its directory (build_tiers fills them from a `TierConfig`; the defaults are
    TierConfig's, for a HostTier built directly, as the tests and the harness do)."""

    orphans: OrphanCopies | None = None  # this host's copies under an older node numbering (orphans.py)
    node_ranks: list[int] | None = None  # every rank writing into this node directory: its manifests record them
    stall_iterations: int | None = 50  # TierConfig.stall_iterations: read by the PersistThread (tier_health.py)
    on_stall: str = "warn"  # TierConfig.on_stall
    upload_backlog: int = 4  # TierConfig.upload_backlog: windows kept for a slow or unreachable object store
    spare_windows: int = 1  # TierConfig.spare_windows: collected windows whose data files are written over
    peer_max_lag_windows: int = 4  # TierConfig.peer_max_lag_windows: the peer copy's lag bound (peer_lag.py)
    peer_interval: Interval = 1  # TierConfig.peer_interval: push every k-th window, or "auto" (peer_interval.py)
    peer_link_share: float = 0.05  # TierConfig.peer_link_share: "auto"'s share of the link's time


@dataclass(frozen=True)
class _SlotLayoutCache:
    """A slot's layout, computed once per slot object (`Slot.raw_layout`: its items never change)."""

    n_items: int  # len(slot.items) when computed
    layout: SlotLayout
    items: list  # [(offset, bytes, buffer)], as MappedFiles.write takes them


class HostTier(FilesWindowTier):
    """This writer's windows in a node-local directory `<root>/<run_id>` (contracts.py: the `WindowTier` contract)."""

    def __init__(
        self, root: str | Path, run_id: str, rank: int, world_size: int, options: HostTierOptions | None = None
    ):
        """Creates `<root>/<run_id>` (OSError when it cannot be; build_tiers words that as a ConfigError).

        Args:
            root: the node-local host directory (default /dev/shm/torchmoe-ckpt/node-N via build_tiers).
            run_id: the run's directory name under `root`.
            rank, world_size: this writer and the job's size (recorded in the manifests).
            options: orphans, node ranks, stall policy, upload backlog, spare windows (`HostTierOptions`).
        """
        self.options = options if options is not None else HostTierOptions()
        self.dir = Path(root) / run_id
        self.dir.mkdir(parents=True, exist_ok=True)
        super().__init__(LocalFiles(self.dir), rank, world_size, self.options.node_ranks)
        self.orphans = self.options.orphans
        self.spare_windows = self.options.spare_windows  # collected windows whose data files are kept to reuse
        # Data files stay mapped across reuse (mapped_files.py): a persist is one memcpy plus one summing pass.
        self._maps = MappedFiles(limit=MAX_MAPPINGS)
        self._slot_files: SlotFiles | None = None

    def window_dir(self, window_id: int) -> Path:
        return self.dir / window_dirname(window_id)

    def slot_dir(self, window_id: int, slot: int, rank: int | None = None) -> Path:
        """A writer's piece of one slot: a self-contained DCP checkpoint (stock dcp.load reads it)."""
        return self.window_dir(window_id) / slot_writer_dir(slot, self.writer_of(rank))

    def write_slot(self, window_id: int, slot: Slot, info: SlotInfo, partial: PartialWindow | None = None) -> int:
        """Persist one captured slot of the checkpointer (the persist thread); returns its bytes. `partial`
        (sliding plans): how far its window got, recorded after the slot (`write_partial`)."""
        lay, items = self._slot_layout(slot)
        back = slot.backing
        write = self._linker(back) if back is not None else mapped(self._maps, self.files, lay, items, self.take_spare)
        self._store_slot(window_id, slot.index, lay, info, write)
        if partial is not None:
            self.write_partial(window_id, partial.start_step, partial.plan, partial.records, slot.index + 1)
        faults.point("persist")
        return lay.nbytes

    def _linker(self, back: SlotBacking):
        """`write_data` of a slot whose buffers are a slot file: the snapshot copy already wrote the bytes into it
        (slot_files.py): link it into the window (it is not reused until collect unlinks it) and sum it once."""

        def link(data_rel: str):
            os.link(back.path, self.dir / data_rel)
            return tensor_block_sums(back.t).numpy()

        return link

    def _slot_layout(self, slot: Slot) -> tuple[SlotLayout, list]:
        """The slot's layout and its [(offset, bytes, buffer)], computed once per slot object (its items never
        change)."""
        got = slot.raw_layout
        if not isinstance(got, _SlotLayoutCache) or got.n_items != len(slot.items):
            base = None if slot.backing is None else slot.backing.t
            items, offsets = slot_items(slot, base)
            lay = self.layout(items, offsets, None if base is None else base.numel())
            got = _SlotLayoutCache(len(slot.items), lay, mapped_items(lay, [it.buffer for it in slot.items]))
            slot.raw_layout = got
        return got.layout, got.items

    def _discard_slot(self, rel: str) -> None:
        for f in (self.dir / rel).glob("*.distcp"):
            self._maps.forget(f)
        super()._discard_slot(rel)

    @property
    def slot_files(self) -> SlotFiles:
        """Allocator of slot buffers backed by this writer's data files (the checkpointer's, on CPU)."""
        if self._slot_files is None:
            self._slot_files = SlotFiles(self.dir, self.writer)
        return self._slot_files

    @property
    def max_spares(self) -> int:
        """Spare data files kept: `spare_windows` windows' worth; none with slot files (their sets are reused whole)."""
        return 0 if self._slot_files is not None else self.spare_windows * self.window_data_files

    def host_bytes(self, aliased: Set = frozenset(), backlog_below: int | None = None) -> dict[str, int]:
        """This writer's host memory here, from the file system: window files other than the live slot sets'
        (`aliased`: their (device, inode)s), split at the retention floor `backlog_below` into kept windows and the
        object store's backlog; spares; stale slot-file names; mappings of deleted files (pinned while mapped)."""
        seen: set = set()
        wins = usage.window_bytes(self.dir, self.writer, seen, aliased)
        floor = min(wins, default=0) if backlog_below is None else backlog_below
        return {
            "window_files": sum(n for w, n in wins.items() if w >= floor)
            + usage.tree_bytes(self.dir / slots_dir(self.writer), seen, aliased),
            "upload_backlog": sum(n for w, n in wins.items() if w < floor),
            "spares": usage.tree_bytes(self.spare_path(), seen, aliased),
            "unlinked_mappings": self._maps.unlinked_bytes(),
        }

    def _forget(self, path: Path) -> None:
        self._maps.forget(path)

    def load_window(self, window_id: int, ops: dict, compute_dtype: torch.dtype, identity: RunIdentity | None = None):
        """Read this writer's copy of a committed window back into fresh slot buffers (checked first)."""
        problems = self.check(window_id, identity)
        if problems:
            raise CorruptCopyError(
                f"window {window_id} on host tier {self.dir} is unusable: {problems[0]}"
                + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""),
                rejection=problems[0],
            )
        man = self.manifest(window_id)
        plan = WindowPlan.from_dict(man.plan)
        slots = []
        for i, sp in enumerate(plan.slots):
            slot = build_slot(i, sp.active, sp.frozen, ops, compute_dtype)
            self._read_slot(window_id, slot)  # every item checked
            slot.step = man.start_step + i
            slot.done.set()
            slots.append(slot)
        rel = self.window_dir(window_id) / replay_file(self.writer)
        records = torch.load(rel, weights_only=True, map_location="cpu")
        forged = self.record_problems(window_id, man, records)  # what `verify` checks too
        if forged:
            raise CorruptCopyError(str(forged[0]), rejection=forged[0])
        win = Window(window_id, man.start_step, plan, slots, _replay_log(records), captured=plan.window)
        if not win.committed:
            raise CorruptCopyError(
                f"window {window_id}: replay records do not cover steps {man.start_step + 1}.."
                f"{man.start_step + plan.window - 1}"
            )
        return win

    def load_partial(self, window_id: int, start_step: int, ops: dict, compute_dtype: torch.dtype, run=None):
        """The slots this writer wrote of a window not committed (sliding plans, `write_partial`), as a Window
        whose `captured` says how many, or None when there is none that starts at `start_step`; every slot is
        read item by item against its checksums and must have been written for this window, slot, step, plan
        and `run` (a fingerprint; None: not checked). Stops at the first slot that is not (a torn last write)."""
        rel = f"{window_dirname(window_id)}/{partial_file(self.writer)}"
        try:
            got = torch.load(io.BytesIO(bytes(self.files.read(rel))), weights_only=True, map_location="cpu")
        except (OSError, RuntimeError, ValueError, EOFError):
            return None
        if got.get("window") != window_id or got.get("start_step") != start_step:
            return None
        plan = WindowPlan.from_dict(got["plan"])
        if not plan.sliding:
            return None
        digest = plan_digest(got["plan"])
        records = {d["step"]: d for d in got["records"]}
        slots = []
        for i, sp in enumerate(plan.slots[: got["slots"]]):
            slot = build_slot(i, sp.active, sp.frozen, ops, compute_dtype)
            try:
                info = self._read_slot(window_id, slot)
            except (OSError, CorruptCopyError, ValueError, KeyError):
                break
            rec = slot_record(SlotInfo.from_dict(info))  # (read back from its `.metadata`)
            where = (rec["window"], rec["slot"], rec["step"], rec["plan"])
            if where != (window_id, i, start_step + i, digest) or (run is not None and rec["run"] not in (None, run)):
                break
            want = info.get("record")  # the slot's replay record, bound by its digest (as a committed window's)
            if want is not None and (start_step + i not in records or record_digest(records[start_step + i]) != want):
                break
            slot.step = start_step + i
            slot.done.set()
            slots.append(slot)
        if not slots:
            return None
        return Window(window_id, start_step, plan, slots, _replay_log(got["records"]), captured=len(slots))

    def _read_slot(self, window_id: int, slot: Slot) -> dict:
        """This writer's piece of a slot of a window into `slot`'s buffers, every item checked; its planner info."""
        return read_slot(self.files, f"{window_dirname(window_id)}/{slot_writer_dir(slot.index, self.writer)}", slot)


def _replay_log(records: list[dict]) -> ReplayLog:
    rlog = ReplayLog()
    for d in records:
        rlog.add(IterationRecord.from_dict(d))
    return rlog
