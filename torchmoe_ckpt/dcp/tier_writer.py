"""The host tier's writer: a background thread that persists captured slots, commits windows on the host
tier in order, then hands each committed window to the peers and the object store. The training thread only
enqueues."""
from __future__ import annotations

import logging
import queue
import threading
import time

from ..snapshot import Slot
from .host_tier import HostTier
from .uploader import Uploader

log = logging.getLogger("torchmoe_ckpt.host_tier")
MAX_UPLOAD_BACKLOG = 4  # windows kept in host memory for a slow or unreachable object store


class TierWriter:
    """Background thread that persists captured slots and commits windows on the host tier, in order."""

    def __init__(self, tier: HostTier, replicator=None, store=None):
        self.tier = tier
        # Uploads each committed window to the object store (object_tier / tensorstore_format) in the background.
        self.uploader = Uploader(store, tier) if store is not None else None
        self.replicator = replicator  # peer_tier.PeerReplicator: pushes each committed window to peers
        self.jobs: queue.Queue = queue.Queue()
        self.persisted: set[int] = set()   # window ids whose rank manifest is written
        self.errors: list[str] = []
        self.lag_seconds: list[float] = []  # window committed in memory -> manifest on the host tier
        self.bytes_written = 0
        self.replicated: set[int] = set()
        self.replication_lag_seconds: list[float] = []  # window committed in memory -> on all its peers
        self._thread = threading.Thread(target=self._run, name="tmoe-host-tier", daemon=True)
        self._thread.start()

    def stats(self) -> dict:
        return {"windows_persisted": len(self.persisted), "bytes_written": self.bytes_written,
                "lag_seconds_max": max(self.lag_seconds, default=0.0), "errors": self.errors}

    def replication_stats(self) -> dict | None:
        rep = self.replicator
        if rep is None:
            return None
        return {"bytes_sent": rep.bytes_sent, "data_bytes_sent": rep.data_bytes_sent,
                "own_data_bytes": rep.own_data_bytes,
                "replicas": max((len(p) for p in rep.placement.peers), default=0),
                "replica_verified": rep.replica_verified, "replica_mismatch": rep.replica_mismatch,
                "windows_replicated": len(self.replicated),
                "replication_lag_s_max": max(self.replication_lag_seconds, default=0.0),
                "replication_lag_s": [round(x, 4) for x in self.replication_lag_seconds]}

    def slot(self, window_id: int, slot: Slot, info: dict) -> None:
        self.jobs.put(("slot", window_id, slot, info))

    def commit(self, window, extra: dict, keep_from: int) -> None:
        self.jobs.put(("commit", window, extra, keep_from, time.perf_counter()))

    def flush(self) -> None:
        done = threading.Event()
        self.jobs.put(("flush", done))
        done.wait()

    def shutdown(self) -> None:
        self.jobs.put(None)

    def abandon(self) -> None:
        """Emulate this process dying: drop the queued jobs (a job already running finishes) and stop."""
        self._dead = True
        self.jobs.put(None)  # not joined: a job blocked on a peer that "died" must not block the restart

    _dead = False

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if self._dead:
                continue
            try:
                if job[0] == "slot":
                    _, wid, slot, info = job
                    slot.done.wait()
                    if slot.complete:  # a torn copy is never persisted
                        self.bytes_written += self.tier.write_slot(wid, slot, dict(info, step=slot.step))
                elif job[0] == "commit":
                    _, win, extra, keep, t0 = job
                    man = self.tier.write_commit(win.id, win.start_step, win.plan, win.log, extra)
                    self.persisted.add(win.id)
                    self.lag_seconds.append(time.perf_counter() - t0)
                    if self.replicator is not None:
                        self.replicator.push(win.id, man)
                        self.replicated.add(win.id)
                        self.replication_lag_seconds.append(time.perf_counter() - t0)
                    if self.uploader is not None:
                        self.uploader.submit(win.id)
                        needed = self.uploader.oldest_needed()
                        if needed is not None:  # keep what still has to reach the store (a bounded backlog)
                            keep = max(min(keep, needed), keep - MAX_UPLOAD_BACKLOG)
                    self.tier.collect(keep)
                else:
                    job[1].set()
            except BaseException as exc:  # DCP's CheckpointException is a BaseException
                # Keep training; the window simply never becomes visible on this tier.
                log.warning("host tier write failed: %s", exc)
                self.errors.append(str(exc))
