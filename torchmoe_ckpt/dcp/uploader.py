"""Background uploads of committed host-tier windows to an object store, off the training path.

The store is any object with `upload(tier, window_id) -> bytes` and `apply_retention()`: `object_tier.ObjectTier`
(DCP files) or `tensorstore_format.TensorstoreTier`. The host tier's writer (`host_tier.TierWriter`) owns one.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Protocol

from .tier_health import TierHealth


class WindowStore(Protocol):
    """An object-store tier as the uploader sees it."""

    def upload(self, tier, window_id: int) -> int: ...   # bytes uploaded; the manifest goes last
    def apply_retention(self) -> list[int]: ...          # window ids deleted from the store


class Uploader:
    """Background uploads of committed windows; never blocks the caller."""

    def __init__(self, store: WindowStore, tier, max_pending: int = 2):  # tier: the host_tier.HostTier read from
        self.store, self.tier = store, tier
        self.q: queue.Queue = queue.Queue()
        self.max_pending = max_pending
        self.uploaded: list[int] = []
        self.dropped = 0
        self.lag_seconds: list[float] = []
        self.bytes = 0
        self.errors: list[str] = []
        self.health = TierHealth("object store", getattr(tier, "rank", 0))  # a store that is down is visible
        self._pending: list = []
        self._lock = threading.Condition()
        threading.Thread(target=self._run, name="tmoe-upload", daemon=True).start()

    def stats(self) -> dict:
        return {"windows_uploaded": len(self.uploaded), "last_window": self.uploaded[-1] if self.uploaded else None,
                "bytes": self.bytes, "dropped": self.dropped, "health": self.health.stats(),
                "upload_lag_s_max": max(self.lag_seconds, default=0.0), "errors": self.errors[-3:],
                "upload_lag_s": [round(x, 4) for x in self.lag_seconds]}

    def submit(self, window_id: int) -> None:
        with self._lock:
            self._pending.append((window_id, time.perf_counter()))
            while len(self._pending) > self.max_pending:  # a newer window supersedes the oldest pending one
                self._pending.pop(0)
                self.dropped += 1
            self._lock.notify()

    def flush(self, timeout: float = 60.0) -> bool:
        end = time.monotonic() + timeout
        with self._lock:
            while (self._pending or self._busy) and time.monotonic() < end:
                self._lock.wait(0.05)
            return not self._pending and not self._busy

    _busy = False
    _current: int | None = None

    def oldest_needed(self) -> int | None:
        """The oldest window still to be uploaded (the host tier must not collect it yet), or None."""
        with self._lock:
            ids = [w for w, _ in self._pending] + ([self._current] if self._busy else [])
        return min(ids) if ids else None

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._pending:
                    self._lock.wait()
                wid, t0 = self._pending.pop(0)
                self._busy, self._current = True, wid
            while True:  # the store may be down: keep trying (capped backoff) until it is back
                try:
                    self.bytes += self.store.upload(self.tier, wid)
                    self.store.apply_retention()
                    self.uploaded.append(wid)
                    self.lag_seconds.append(time.perf_counter() - t0)
                    self.health.succeeded(wid)
                    break
                except FileNotFoundError as exc:  # the local window was collected meanwhile: nothing to upload
                    self.errors.append(str(exc))
                    break
                except Exception as exc:
                    self.errors.append(str(exc)[:200])
                    self.health.failed(f"upload of window {wid}", exc)  # warns once, then backs off (capped)
                    time.sleep(self.health.retry_delay_s)
                    with self._lock:
                        if self._pending:  # a newer window is waiting: it supersedes this one
                            self.dropped += 1
                            break
            with self._lock:
                self._busy = False
                self._lock.notify_all()
