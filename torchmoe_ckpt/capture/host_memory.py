"""Every host byte the checkpointer holds, counted from its owners (never estimated), and the limit on them.

The limit is checked at construction against the plan's worst case (auto W capped to the largest W that fits,
agreed over the ranks, else refused with the figure and the knobs), and at every window start that needs a new
slot set (free sets and spares given back, the persist thread drained first; still over: HostMemoryLimitError).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.config_values import (
    human_bytes,
    parse_bytes,  # noqa: F401 (re-exported: defined torch-free for config.py)
)
from ..core.errors import ConfigError
from ..tiers.object_tier import ObjectTier
from .device_staging import ALIGN as STAGING_ALIGN
from .file_slot_pool import FileSlotPool
from .slot_pool import ArenaSlotPool, SlotAllocator, pageup

if TYPE_CHECKING:
    from ..core.window import Window
    from ..persist.persist_thread import PersistThread
    from .device_staging import DeviceStaging

log = logging.getLogger("torchmoe_ckpt.host_memory")
META_PER_ITEM = 320  # bytes of a slot's `.metadata` per item, an upper bound (measured 210-240)
LINE_REFRESH_S = 1.0  # seconds a status line's host-memory figure is reused (HostMemory.line)
REPLAY_RECORD = 8192  # bytes per logged iteration besides its batch: CPU RNG state (5 KB), scalars, pickling
KNOBS = (
    "a smaller window (SparseConfig.window / max_window; TorchTitan: window, max_window), fewer replicas "
    "(TierConfig.replicas), a smaller upload backlog (TierConfig.upload_backlog), no spare files "
    "(TierConfig.spare_windows = 0)"
)


class HostMemoryLimitError(ConfigError):
    """The checkpointer would hold more host memory than `host_memory_limit` (the message gives the figure)."""


@dataclass(frozen=True)
class MemoryHolders:
    """What HostMemory counts: the parts of one checkpointer that hold host memory (SparseCheckpointer builds it
    once its parts exist; the windows are read when counted, as they change every window)."""

    slots: SlotAllocator  # the slot sets (their buffers, or their /dev/shm files)
    persist: PersistThread | None  # the tiers' files, peer copies and transfer buffers (None: no tiers)
    staging: DeviceStaging | None  # on a CPU its "device" staging buffer is host memory
    windows: Callable[[], tuple[Window | None, Window | None, Window | None]]  # (current, committed, inherited)


class HostMemory:
    """The account and the limit of one checkpointer's host memory (its `MemoryHolders`)."""

    def __init__(self, ck: MemoryHolders, limit: int | None):
        self.ck, self.limit = ck, limit
        self.peak = 0
        self.need: dict | None = None  # the construction check's figure
        self.drain_waits, self.drain_wait_s = 0, 0.0
        self._warned_over = False
        self._line: tuple[float, str] | None = None  # (when, the status line's figure): line()

    def account(self) -> dict:
        ck = self.ck
        parts = dict(ck.slots.host_bytes())
        if ck.persist is not None:
            parts.update(ck.persist.host_bytes(ck.slots.files()))
        current, committed, inh = ck.windows()
        wins = {id(w): w for w in (current, committed, inh) if w is not None}
        parts["replay_logs"] = sum(r.nbytes() for w in wins.values() for r in w.log.records.values())
        parts["inherited_window"] = 0 if inh is None else sum(s.nbytes for s in inh.slots)
        stg = ck.staging
        if stg is not None and not stg.cuda:  # on a CPU the "device" staging buffer is host memory
            parts["device_staging"] = stg.held
        total = sum(parts.values())
        self.peak = max(self.peak, total)
        return {
            "total": total,
            "limit": self.limit,
            "peak": self.peak,
            "parts": parts,
            "allocator": ck.slots.kind,
            "allocations": ck.slots.allocations,
            "prepared": ck.slots.prepared,
            "alloc_seconds": {k: round(v, 6) for k, v in ck.slots.alloc_seconds.items()},
            "alloc_count": dict(ck.slots.alloc_count),
            "drain_waits": self.drain_waits,
            "drain_wait_s": round(self.drain_wait_s, 6),
            "need": self.need,
        }

    def total(self) -> int:
        return self.account()["total"]

    def line(self) -> str:
        """For the status line: 'host memory 5.0 GiB of 8.0 GiB', recounted at most every LINE_REFRESH_S (the
        count walks the host tier's files, ~4 ms under training here: a status line per committed window at a
        dense snapshot every iteration paid it every step, on the persist thread, holding the GIL)."""
        now = time.monotonic()
        if self._line is None or now - self._line[0] >= LINE_REFRESH_S:
            self._line = (now, self._count_line())
        return self._line[1]

    def _count_line(self) -> str:
        a = self.account()
        stg = self.ck.staging
        on_device = f", device staging {human_bytes(stg.held)}" if stg is not None and stg.cuda and stg.held else ""
        return (
            f"host memory {human_bytes(a['total'])}"
            + (f" of {human_bytes(self.limit)}" if self.limit is not None else "")
            + on_device
        )

    def plan_need(self, plan, senders: int = 0) -> dict:
        """Worst-case host bytes with windows of `plan`, as {part: bytes} (docs/storage-tiers.md). Copies held for
        `senders` peers are priced at this rank's window; logged batches are counted at run time only."""
        from ..storage_format.checksums import BLOCK

        ck, alloc = self.ck, self.ck.slots
        pool = alloc.fallback if isinstance(alloc, FileSlotPool) else alloc  # the arena pool knows the items' sizes
        assert isinstance(pool, ArenaSlotPool), type(pool).__name__  # make_slot_allocator builds one of the two
        B = alloc.set_bytes(plan)
        F = pool.file_bytes(plan, BLOCK)  # one window's data files in the host tier
        # Its small files in whole pages: each slot's `.metadata`, the manifest, the replay records.
        small = sum(pageup(META_PER_ITEM * n + 2048) for n in pool.item_counts(plan))
        small += pageup(len(json.dumps(plan.to_dict())) + 256 * (2 * plan.window + 1) + 4096)
        small += pageup(plan.window * REPLAY_RECORD)
        tw = ck.persist
        backlog = 0 if tw is None or tw.uploader is None else tw.upload_backlog
        spare_w = 0 if tw is None else tw.tier.spare_windows
        # peer_interval k > 1: the windows from the newest pushed one on stay (persist_thread.peer_floor)
        interval = None if tw is None or tw.peers is None else tw.interval
        peer_k = 0 if interval is None or interval.bound <= 1 else interval.bound
        out: dict[str, int] = {}
        if alloc.kind == "shm-files":  # the sets are the window files: current, committed, previous, backlog
            out["slot_sets"] = (3 + backlog + peer_k) * B
            out["window_files"] = (3 + backlog + peer_k) * small
        else:
            out["slot_sets"] = 2 * B  # the window being captured and the committed one
            if tw is not None:  # the tier's copies: previous, committed, the one being written; backlog; spares
                out["window_files"] = 3 * (F + small)
                out["upload_backlog"] = backlog * (F + small)
                if peer_k:
                    out["peer_interval"] = peer_k * (F + small)
                out["spares"] = spare_w * F
        if senders:  # per sender: two copies held, and the arriving one or the collected one's spares
            out["peer_copies"] = senders * (2 + max(1, spare_w)) * (F + small)
            from ..tiers.peer_tier import CHUNK  # each of the peer tier's two transfer buffers at most

            out["peer_buffers"] = 2 * min(CHUNK, F)
        store = None if tw is None or tw.uploader is None else tw.uploader.store
        if isinstance(store, ObjectTier) and store.in_memory():  # a local store on tmpfs
            out["store_files"] = (store.keep + 1 + spare_w) * (F + small)  # kept, being uploaded, spares
        out["replay_logs"] = 2 * plan.window * REPLAY_RECORD  # RNG states and scalars of two windows
        stg = ck.staging
        if stg is not None and not stg.cuda:  # the staging buffer (CPU: host memory): the largest slot, aligned
            out["device_staging"] = plan.worst_slot_bytes + STAGING_ALIGN * max(pool.item_counts(plan), default=0)
        out["inherited_window"] = pool.set_need(plan, 1)  # after a restart, until the next window commits
        return out

    def check(self, plans, forced: int | None, max_w: int, agree, senders: int = 0):
        """The construction check. `plans(W)`: this rank's plan; `forced`: the forced W or None (auto, up to `max_w`);
        `agree(x, "min" | "max")`: over the planning ranks. Returns the largest W auto mode may use (None: forced or
        no limit); raises HostMemoryLimitError when no window fits on some rank."""
        if self.limit is None:
            return None

        def need(w):
            parts = self.plan_need(plans(w), senders)
            return sum(parts.values()), parts

        cap = 0
        for w in [forced] if forced is not None else range(1, max_w + 1):  # the need grows with W
            if need(w)[0] > self.limit:
                break
            cap = w
        cap = int(agree(cap, "min"))
        w = forced or max(cap, 1)
        total, parts = need(w)
        worst = int(agree(total, "max"))
        self.need = {"window": w, "total": total, "parts": parts, "limit": self.limit}
        if cap < 1:
            raise HostMemoryLimitError(self._refusal(w, total, parts, worst))
        if forced is None and cap < max_w:
            log.warning(
                f"torchmoe: auto window capped at W={cap} by host_memory_limit {human_bytes(self.limit)} "
                f"(W={cap + 1} would need {human_bytes(need(cap + 1)[0])} per rank)"
            )
        return None if forced is not None else cap

    def _refusal(self, w: int, total: int, parts: dict, worst: int) -> str:
        assert self.limit is not None  # a refusal needs a limit
        shown = ", ".join(f"{k} {human_bytes(v)}" for k, v in parts.items() if v)
        here = f"{human_bytes(total)} ({shown})"
        if worst > total:  # another rank holds more (uneven shards): its figure is the one to meet
            here = f"{human_bytes(worst)} on another rank (this one: {here})"
        return (
            f"host_memory_limit {human_bytes(self.limit)} per rank is below what this checkpointer can hold with "
            f"W={w}: {here}; lower it with {KNOBS}, or raise host_memory_limit to at least {human_bytes(worst)} "
            f"({worst} bytes)"
        )

    def before_window(self, plan, window_id: int) -> None:
        """Keep the window start within the limit (module docstring)."""
        if self.limit is None:
            return
        ck, alloc = self.ck, self.ck.slots
        if alloc.has_free(plan):  # no new set: a total over the limit (peer copies, logs) is warned once
            total = self.total()
            over = total > self.limit
            if over and not self._warned_over:
                log.warning(
                    f"torchmoe: host memory {human_bytes(total)} is over host_memory_limit "
                    f"{human_bytes(self.limit)} at window {window_id} (no new slot set was needed): "
                    "see stats()['host_memory']['parts']"
                )
            self._warned_over = over
            return
        add = alloc.set_bytes(plan)
        if self.total() + add <= self.limit:
            return
        if ck.persist is not None:  # the persist thread may be about to free a set (a collect, a copy)
            t0 = time.perf_counter()
            ck.persist.flush()
            self.drain_waits += 1
            self.drain_wait_s += time.perf_counter() - t0
            ck.persist.trim_spares()  # safe now: the persist thread is idle until this window starts
            if alloc.has_free(plan):
                return
        alloc.trim()
        a = self.account()
        if a["total"] + add > self.limit:
            shown = ", ".join(f"{k} {human_bytes(v)}" for k, v in a["parts"].items() if v)
            raise HostMemoryLimitError(
                f"host memory limit {human_bytes(self.limit)} per rank reached at the start of window {window_id}: "
                f"it holds {human_bytes(a['total'])} ({shown}) and a new slot set needs {human_bytes(add)}; "
                f"lower it with {KNOBS}, or raise host_memory_limit"
            )

    def room_for(self, nbytes: int) -> bool:
        """`nbytes` more stay within the limit (a slot set allocated ahead: slot_pool.prepare)."""
        return self.limit is None or self.total() + nbytes <= self.limit
