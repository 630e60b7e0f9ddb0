"""Background uploads of committed host-tier windows to an object store (any copy tier, tiers/contracts.py), off the
training path: a store that is down is retried with capped backoff, whole windows at a time; `catch_up()` queues
what a previous run left behind; every outcome goes to the `status.RunStatus` the user reads."""

from __future__ import annotations

import threading
import time

from ..tiers.contracts import CopyTier
from .tier_health import TierHealth

CATCH_UP = "catch-up"  # a queue entry: list the store and queue what it lacks


class Uploader:
    """Background uploads of committed windows; never blocks the caller."""

    def __init__(self, store: CopyTier, tier, max_pending: int = 2, status=None):
        """`tier`: the HostTier read from; `status`: a status.RunStatus (or None)."""
        self.store, self.tier, self.status = store, tier, status
        self.max_pending = max_pending
        self.uploaded: list[int] = []
        self.dropped = 0
        self.lag_seconds: list[float] = []
        self.bytes = 0
        self.cpu_s = 0.0  # the upload thread's CPU (time.thread_time): what the store tier takes from training
        self.errors: list[str] = []
        self.health = TierHealth("object store", getattr(tier, "rank", 0))  # a store that is down is visible
        self._pending: list = []
        self._current = None  # the entry the upload thread works on (a window id or CATCH_UP), None while idle
        self._stopped = False
        self._lock = threading.Condition()
        threading.Thread(target=self._run, name="tmoe-upload", daemon=True).start()

    def stats(self) -> dict:
        return {
            "windows_uploaded": len(self.uploaded),
            "last_window": self.uploaded[-1] if self.uploaded else None,
            "bytes": self.bytes,
            "cpu_s": round(self.cpu_s, 6),
            "dropped": self.dropped,
            "health": self.health.stats(),
            "upload_lag_s_max": max(self.lag_seconds, default=0.0),
            "errors": self.errors[-3:],
            "upload_lag_s": [round(x, 4) for x in self.lag_seconds],
        }

    def submit(self, window_id: int) -> None:
        with self._lock:
            self._pending.append((window_id, time.perf_counter()))
            while len(self._pending) > self.max_pending:  # a newer window supersedes the oldest pending one
                old, _ = self._pending.pop(0)
                self.dropped += 1
                if self.status is not None:
                    self.status.superseded(old, window_id)
            self._lock.notify()

    def catch_up(self) -> None:
        """Queue the committed host windows the store lacks (newest `max_pending`; listed on the upload thread)."""
        with self._lock:
            self._pending.insert(0, (CATCH_UP, time.perf_counter()))
            self._lock.notify()

    def _catch_up(self) -> None:
        try:
            newest = max(self.store.window_ids(), default=-1)
        except Exception as exc:  # the store is down: the next committed window will find out, with a warning
            self.errors.append(f"catch-up listing: {exc}"[:200])
            return
        missing = [w for w in self.tier.window_ids() if w > newest]
        for wid in missing[-self.max_pending :]:
            self.submit(wid)

    def flush(self, timeout: float = 60.0) -> bool:
        end = time.monotonic() + timeout
        with self._lock:
            while (self._pending or self._current is not None) and time.monotonic() < end:
                self._lock.wait(0.05)
            return not self._pending and self._current is None

    def stop(self) -> None:
        """Stop the upload thread after the upload in flight (or its next retry); what is pending stays on the host
        tier for the next run's `catch_up`."""
        with self._lock:
            self._stopped = True
            self._pending.clear()
            self._lock.notify_all()

    def _next(self) -> tuple[int | str, float] | None:
        """The next queued entry (a window id or CATCH_UP, and when it was queued), marked current; None: stopped."""
        with self._lock:
            while not self._pending and not self._stopped:
                self._lock.wait()
            if self._stopped:
                return None
            wid, t0 = self._pending.pop(0)
            self._current = wid
        return wid, t0

    def _upload(self, wid: int, t0: float) -> None:
        """Upload one committed window, retrying while the store is down (capped backoff), until it is in the
        store, collected on the host tier meanwhile, superseded by a newer window, or the thread stops."""
        while True:
            try:
                self.bytes += self.store.upload(self.tier, wid)  # a torn copy raises: the window is redone
                self.store.collect()
                self.uploaded.append(wid)
                self.lag_seconds.append(time.perf_counter() - t0)
                self.health.succeeded(wid)
                if self.status is not None:
                    self.status.uploaded_window(wid, self.lag_seconds[-1])
                return
            except FileNotFoundError as exc:  # the local window was collected meanwhile: nothing to upload
                self.errors.append(str(exc))
                if self.status is not None:
                    self.status.superseded(wid, None)
                return
            except Exception as exc:
                self.errors.append(str(exc)[:200])
                self.health.failed(f"upload of window {wid}", exc)  # warns once, then backs off (capped)
                if self.status is not None:
                    self.status.upload_failed(wid, self.health.reason, self.health.backoff_cap_s)
            time.sleep(self.health.retry_delay_s)
            if self._give_up(wid):
                return

    def _give_up(self, wid: int) -> bool:
        """After a failed try and its backoff: whether to stop retrying `wid` (stopped, or a newer one waits)."""
        with self._lock:
            if self._stopped:
                return True
            if self._pending:  # a newer window is waiting: it supersedes this one
                self.dropped += 1
                if self.status is not None:
                    self.status.superseded(wid, self._pending[-1][0])
                return True
        return False

    def oldest_needed(self) -> int | None:
        """The oldest window still to be uploaded (the host tier must not collect it yet), or None."""
        with self._lock:
            ids = [w for w, _ in self._pending] + [self._current]
        return min((w for w in ids if w is not None and w is not CATCH_UP), default=None)

    def _run(self) -> None:
        while True:
            entry = self._next()
            if entry is None:
                return
            wid, t0 = entry
            c0 = time.thread_time()
            if isinstance(wid, int):
                self._upload(wid, t0)
            else:  # CATCH_UP
                self._catch_up()
            self.cpu_s += time.thread_time() - c0
            with self._lock:
                self._current = None
                self._lock.notify_all()
