"""The persist thread: persists captured slots on the host tier, commits windows there in order, then hands each
committed window to the peers and the object store (tiers/contracts.py: the call order of a save). Training only
enqueues."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Set
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch.distributed as dist

from ..core.config_values import human_bytes
from ..core.records import IterationRecord, SlotInfo
from ..core.slot import Slot
from ..core.window import Window
from ..runtime.agreement import reduce_float_on
from ..runtime.background import stop_at_exit
from ..storage_format.manifest import record_digest
from ..tiers.host_tier import HostTier
from ..tiers.object_tier import ObjectTier
from ..tiers.peer_interval import PeerInterval
from ..tiers.peer_lag import PeerLag
from ..tiers.window_tier import PartialWindow
from .run_status import RunStatus
from .tier_health import TierHealth
from .uploader import Uploader

if TYPE_CHECKING:
    from ..ownership.store_lease import StoreLease
    from ..storage_format.manifest import WindowManifest
    from ..tiers.contracts import ObjectStore
    from ..tiers.peer_tier import PeerTier

log = logging.getLogger("torchmoe_ckpt.host_tier")


# The jobs on the persist thread's queue (TorchTitan's checkpoint.py puts typed sentinels on its queues, too).
@dataclass(frozen=True)
class SlotJob:
    """Persist one captured slot once its copy finished (`HostTier.write_slot`)."""

    window_id: int
    slot: Slot
    info: SlotInfo  # what the slot's `.metadata` says it was written for (its step and record set when written)
    record: IterationRecord | None  # its iteration's replay record: its digest goes into `info`
    partial: PartialWindow | None  # sliding plans: how far its window got (written after the slot)


@dataclass(frozen=True)
class CommitJob:
    """Commit a window on the host tier, then push it to the peers, hand it to the store and collect."""

    window: Window
    extra: dict  # the manifest's extra fields (dtype, identity)
    keep_from: int  # the retention floor: the newest window every rank persisted
    queued_at: float = field(default_factory=time.perf_counter)  # for the commit and replication lags


@dataclass(frozen=True)
class FlushJob:
    """Set `done` once every job queued before it is processed."""

    done: threading.Event


@dataclass(frozen=True)
class StopJob:
    """Stop the thread (the jobs queued before it are processed first)."""


Job = SlotJob | CommitJob | FlushJob | StopJob


class PersistThread:
    """Background thread that persists captured slots and commits windows on the host tier, in order.

    Call order (tiers/contracts.py has the whole save): the training thread calls `slot` for each captured slot and
    `commit` once a window is complete, `flush` / `finish` at a checkpoint or the end; only this thread writes the
    tiers.
    """

    def __init__(
        self,
        tier: HostTier,
        peers: PeerTier | None = None,
        store: ObjectStore | None = None,
        lease: StoreLease | None = None,
        memory_line: Callable[[], str] | None = None,
    ):
        """Starts the thread; uploads first what a previous run committed but could not upload.

        Args:
            tier: this writer's host tier; its `options` give the stall policy and the upload backlog.
            peers: the peer tier (each committed window is pushed to its peers), None: no peers.
            store: the object store (each committed window is uploaded by an upload thread), None: no store.
            lease: this job's writer lease on the store's prefix, released by `finish` (a clean exit).
            memory_line: () -> "host memory X of LIMIT" for the status lines (`HostMemory.line`), None: not shown.
        """
        self.tier = tier
        self.health = TierHealth("host", tier.rank, tier.options.stall_iterations, tier.options.on_stall)
        self._failed: set[int] = set()  # windows with a failed or skipped write: never committed here
        self._attempted: set[int] = set()  # windows whose writing started
        pl = None if peers is None else peers.placement
        self._peers_here = None if pl is None else len(pl.peers[tier.rank])  # k of the r requested (placement)
        n_peers = None if pl is None else pl.r
        where = None if store is None else store.uri or type(store).__name__
        self.status = RunStatus(tier.rank, n_peers, where)
        self.status.memory = memory_line  # () -> "host memory X of LIMIT" for the status lines (HostMemory.line)
        # First what a previous run committed but could not upload (an outage, an exit before the store caught up).
        self.uploader = Uploader(store, tier, status=self.status) if store is not None else None
        if self.uploader is not None:
            self.uploader.catch_up()
        self.peers = peers  # pushes each committed window to this writer's peers
        # which windows are pushed (every k-th), and the lag in pushes missed
        self.interval = PeerInterval(tier.options.peer_interval, tier.options.peer_link_share)
        self.peer_lag = PeerLag(tier.options.peer_max_lag_windows, self.status.peer_lag_changed, self.interval)
        if peers is not None and pl is not None:
            self.status.peer_text = self._peer_text
        self.lease = lease
        self.jobs: queue.Queue[Job] = queue.Queue()
        # Jobs queued / processed: slot buffers released after `ticket()` are no longer read once `done(ticket)`.
        self._queued, self._processed = 0, 0
        # Windows kept beyond the retention floor while the object store still needs them.
        self.upload_backlog = tier.options.upload_backlog
        self.keep_floor: int | None = None  # the retention floor of the last collect (older kept windows: backlog)
        self.persisted: set[int] = set()  # window ids whose rank manifest is written
        self.errors: list[str] = []
        self.lag_seconds: list[float] = []  # window committed in memory -> manifest on the host tier
        self.bytes_written = 0
        self.replicated: set[int] = set()
        self.replication_lag_seconds: list[float] = []  # window committed in memory -> on all its peers
        # CPU seconds this thread spent per tier (time.thread_time): what the tiers take from training
        self.cpu_s = {"host": 0.0, "peers": 0.0}
        self._thread = threading.Thread(target=self._run, name="tmoe-host-tier", daemon=True)
        self._thread.start()
        stop_at_exit(self)

    def stats(self) -> dict:
        return {
            "windows_persisted": len(self.persisted),
            "bytes_written": self.bytes_written,
            "cpu_s": round(self.cpu_s["host"], 6),
            "lag_seconds_max": max(self.lag_seconds, default=0.0),
            "errors": self.errors[-5:],
            "health": self.health.stats(),
            "last_durable_window": self.health.stats()["last_durable_window"],
        }

    def summary(self) -> str:
        """One line for the exit summary: the last durable window and the tier's state."""
        h = self.health.stats()
        last = h["last_durable_window"]
        text = f"last durable window {last['window_id']} (step {last['last_step']})" if last else "no window persisted"
        bad = f"; {h['failed_writes']} failed write(s), now {h['state']}" if h["failed_writes"] else ""
        why = f" ({h['reason']})" if h["state"] != "ok" else ""
        return f"host tier {self.tier.dir} rank {self.tier.rank}: {text}{bad}{why}"

    def replication_stats(self) -> dict | None:
        rep = self.peers
        if rep is None:
            return None
        return {
            "bytes_sent": rep.bytes_sent,
            "data_bytes_sent": rep.data_bytes_sent,
            "cpu_s": round(self.cpu_s["peers"], 6),  # this thread's; gloo's own I/O threads not included
            "own_data_bytes": rep.own_data_bytes,
            "replicas": 0 if rep.placement is None else max((len(p) for p in rep.placement.peers), default=0),
            "replica_verified": rep.replica_verified,
            "replica_mismatch": rep.replica_mismatch,
            "stopped": rep.stopped,  # why the peer tier stopped (a partner past peer_timeout_s), or None
            "windows_replicated": len(self.replicated),
            **self.peer_lag.stats(),  # lag in windows, its bound, peer_durable, windows superseded on the link
            "links": rep.link_stats(),  # bytes/s per peer link
            "replication_lag_s_max": max(self.replication_lag_seconds, default=0.0),
            "replication_lag_s": [round(x, 4) for x in self.replication_lag_seconds],
        }

    def slot(
        self,
        window_id: int,
        slot: Slot,
        info: SlotInfo,
        record: IterationRecord | None = None,
        partial: PartialWindow | None = None,
    ) -> None:
        """Persist a captured slot (the training thread; returns at once, the copy may still be running).

        Args:
            window_id: the slot's window.
            slot: the captured slot; written once `slot.done` is set, never when its copy was torn.
            info: what its `.metadata` says it was written for (window, slot, start_step, plan, run).
            record: the iteration's replay record, bound to the slot by its digest (computed on this thread).
            partial: sliding plans: how far the window got, written after the slot (`WindowTier.write_partial`)
                so that a recovery can use it before the window commits.
        """
        self.health.check_stall(info.start_step + info.slot)  # the training thread: the stall policy may end it here
        self._put(SlotJob(window_id, slot, info, record, partial))

    def commit(self, window: Window, extra: dict, keep_from: int) -> None:
        """Commit `window` once its slots are written, push it to the peers, hand it to the store, and collect
        windows older than `keep_from` (the training thread; returns at once)."""
        job = CommitJob(window, extra, keep_from)
        self._put(job)
        self.interval.newest_commit = (window.id, job.queued_at)  # one assignment: training's pace (auto)
        if self.peers is not None and self.peers.pairs:
            self.peer_lag.committed(window.id)  # counters only: the warning is said when the lag crosses its bound

    def flush(self) -> None:
        """Wait until every job queued so far is processed (not the uploads)."""
        done = threading.Event()
        self._put(FlushJob(done))
        done.wait()

    def _put(self, job: Job) -> None:
        self._queued += 1  # one enqueuing thread (the training thread)
        self.jobs.put(job)

    def ticket(self) -> int:
        """The jobs queued so far: what `done` compares against."""
        return self._queued

    def done(self, ticket: int) -> bool:
        """Every job queued before `ticket()` returned `ticket` was processed (or dropped by a dead writer)."""
        return self._processed >= ticket

    def trim_spares(self) -> int:
        """Give back the host tier's and the held peer copies' spare files (memory pressure). Call it only while
        this thread is idle (after `flush`, before the next job is queued)."""
        n = self.tier.trim_spares()
        return n + (self.peers.trim_spares() if self.peers is not None else 0)

    def host_bytes(self, aliased: Set = frozenset()) -> dict[str, int]:
        """The tiers' part of the host-memory account (host_memory.py): the host tier's files (`aliased`: the live
        slot sets' own, counted by the allocator), what this rank holds for peers, a local store's on tmpfs."""
        out = dict(self.tier.host_bytes(aliased, self.keep_floor))
        if self.peers is not None:
            out.update(self.peers.host_bytes())
        store = None if self.uploader is None else self.uploader.store
        if isinstance(store, ObjectTier):  # a local store's (object_tier.py); the tensorstore format has none
            out.update(store.host_bytes())
        return out

    def finish(self, wait_s: float) -> dict:
        """At the end of a run: write what is committed to the host tier, give the object store up to `wait_s`
        seconds to take the pending uploads (exit stays bounded when it is down), and log the exit summary."""
        self.flush()
        t0 = time.monotonic()
        if self.uploader is not None:
            self.uploader.flush(wait_s)
        summary = self.status.exit_summary(time.monotonic() - t0, wait_s, str(self.tier.dir))
        # A clean exit gives the store prefix up now (store_lease.py); after the summary, whose wait is the uploads'
        # alone: with the store down, releasing may take the renewal thread's join (up to 2 s) and a failed read.
        if self.lease is not None:
            self.lease.release()
        return summary

    def shutdown(self) -> None:
        """Stop once the jobs queued so far are done (not waited for); the upload thread stops now."""
        self.jobs.put(StopJob())
        if self.uploader is not None:
            self.uploader.stop()

    def stop(self, timeout_s: float) -> None:
        """Finish the job in flight, then stop the thread (at interpreter exit: background.py). An abandoned
        writer (an emulated dead process) may be blocked on a peer that is gone: left as it is."""
        if not self._dead:
            self.shutdown()
            self._thread.join(timeout_s)

    def wait_stopped(self, timeout_s: float) -> bool:
        """After `abandon`: wait up to `timeout_s` for the job that was in flight to finish and the thread to end;
        whether it ended. An emulated death that then wipes the node's directory waits for it first (a real death
        stops the process and its writer at once; the abandoned writer would write into the wiped directory)."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def abandon(self, upload_wait_s: float = 0.0) -> None:
        """Emulate this process dying: drop the queued jobs (a job already running finishes) and stop; the store
        gets up to `upload_wait_s` for the windows already handed to it, then the upload thread stops too."""
        self._dead = True
        if self.uploader is not None and upload_wait_s > 0:
            self.uploader.flush(upload_wait_s)
        self.shutdown()  # not joined: a job blocked on a peer that "died" must not block the restart

    _dead = False

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if isinstance(job, StopJob):
                return
            if self._dead:
                self._processed += 1
                continue
            c0 = time.thread_time()
            try:
                if isinstance(job, SlotJob):
                    self._write_slot(job)
                elif isinstance(job, CommitJob):
                    c0 = self._commit(job, c0)
                else:
                    job.done.set()
            except BaseException as exc:  # DCP's CheckpointException is a BaseException
                # Keep training; peers / the store / retention failing must not stop the writer thread.
                log.warning("host tier write failed: %s", exc)
                self.errors.append(str(exc))
            finally:
                self.cpu_s["host"] += time.thread_time() - c0
                self._processed += 1

    def _commit(self, job: CommitJob, c0: float) -> float:
        """Commit on the host tier, push to the peers (collective), hand to the store, collect. `c0`: this job's
        thread-time start; returns where the host tier's share starts again (the peers' time is theirs)."""
        win, keep = job.window, job.keep_from
        man = self._write_commit(win, job.extra)
        if man is None:
            return c0
        self.lag_seconds.append(time.perf_counter() - job.queued_at)
        if self.peers is not None and self.interval.due(win.id):  # the same windows are due on every rank
            c1 = time.thread_time()
            self.cpu_s["host"] += c1 - c0
            # the link is behind: send the newest due window, not a queue of windows
            newer = self._newer_commit_queued(win.id + self.interval.k)
            sent0 = self._seconds_sent()
            self.peers.push(win.id, man, superseded_by=newer)
            self.interval.measured(self._seconds_sent() - sent0, self.interval.window_seconds(win.id, job.queued_at))
            # "auto": every rank is here for the same due window, so the agreement is a collective on all of them
            agree = self._agree_interval if self.peers.pairs and self.peers.stopped is None else None
            self.interval.advance(win.id, agree)
            c0 = time.thread_time()
            self.cpu_s["peers"] += c0 - c1
            if self.peers.stopped is not None:
                pass  # not on the peers: the lag grows until peer_durable says so (peer_lag.py)
            elif newer is not None:
                self.peer_lag.skipped()
            elif self.peers.pairs:
                self.replicated.add(win.id)
                self.replication_lag_seconds.append(time.perf_counter() - job.queued_at)
                self.peer_lag.replicated(win.id)
        last = win.start_step + win.plan.window - 1
        self.status.window_committed(win.id, win.start_step, last, man.total_bytes, self._peers_here)
        self.keep_floor = keep
        if self.uploader is not None:
            self.uploader.submit(win.id)
            # keep what still has to reach the store (a bounded backlog)
            needed = self.uploader.oldest_needed()
            if needed is not None:
                keep = max(min(keep, needed), keep - self.upload_backlog)
        self.tier.collect(keep)
        return c0

    def _newer_commit_queued(self, next_due: int) -> int | None:
        """The newest window from `next_due` on whose commit is queued behind the one in hand (None: none): it
        supersedes this one on the peer links. Every rank still runs the push (only the header travels: this
        test is local), so the pair order holds."""
        with self.jobs.mutex:
            ids = [j.window.id for j in self.jobs.queue if isinstance(j, CommitJob) and j.window.id >= next_due]
        return max(ids, default=None)

    def _seconds_sent(self) -> float:
        """Seconds this rank's outgoing peer links spent sending, so far."""
        links = self.peers.links.values() if self.peers is not None else ()
        return sum(k.seconds for k in links if k.direction == "to")

    def _agree_interval(self, wanted: int) -> int:
        """The largest k any rank wants (its link is the slowest). Collective on the peer tier's own gloo group."""
        group = self.peers.group if self.peers is not None else None
        return int(reduce_float_on(float(wanted), dist.ReduceOp.MAX, group))

    def peer_floor(self, floor: int) -> int:
        """The retention floor lowered to the newest window pushed to the peers (at most `interval.bound` windows
        lower): a node loss combines the survivors' host copies of that window with the peers' copies of the lost
        node's. k = 1 keeps today's floor."""
        rep = self.peer_lag.newest_replicated
        if self.peers is None or not self.peers.pairs or self.interval.bound <= 1 or rep is None:
            return floor
        return max(min(floor, rep), floor - self.interval.bound)

    def _peer_text(self) -> str:
        """The status lines' peer part: the lag, and each outgoing link's newest rate."""
        links = sorted(self.peers.links.values(), key=lambda k: k.peer) if self.peers is not None else []
        rates = ", ".join(f"to rank {k.peer} {human_bytes(k.last_bytes_per_s)}/s" for k in links if k.direction == "to")
        return self.peer_lag.text() + (f" ({rates})" if rates else "")

    def _write_slot(self, job: SlotJob) -> None:
        wid, slot = job.window_id, job.slot
        slot.done.wait()
        if wid in self._failed or not slot.complete:  # a torn copy is never persisted
            return
        if wid not in self._attempted:  # a window's first slot: back off after failures
            if not self.health.try_window():
                self._failed.add(wid)
                return
            self._attempted.add(wid)
        try:
            # the iteration's replay record, bound to this slot by its digest
            digest = record_digest(job.record.to_dict()) if job.record is not None else None
            info = replace(job.info, step=slot.step, record=digest)
            self.bytes_written += self.tier.write_slot(wid, slot, info, job.partial)
        except BaseException as exc:  # ENOSPC, EACCES, DCP's CheckpointException (a BaseException)
            self._give_up(wid, f"window {wid} slot {slot.index}", exc)

    def _write_commit(self, win: Window, extra: dict) -> WindowManifest | None:
        """Commit a window whose every slot was written: its manifest; None when it cannot be (nothing of it left)."""
        self._attempted.discard(win.id)
        if win.id in self._failed:
            self._failed.discard(win.id)
            return None
        try:
            man = self.tier.write_commit(win.id, win.start_step, win.plan, win.log, extra)
        except BaseException as exc:
            self._give_up(win.id, f"window {win.id} commit", exc)
            self._failed.discard(win.id)
            return None
        self.persisted.add(win.id)
        self.health.succeeded(win.id, win.start_step + win.plan.window - 1)
        return man

    def _give_up(self, wid: int, what: str, exc: BaseException) -> None:
        self._failed.add(wid)
        self.errors.append(f"{what}: {exc}"[:300])
        self.health.failed(what, exc)
        self.tier.remove_window(wid)  # nothing torn is left, and the space comes back
