"""Which committed windows are pushed to the peers (`TierConfig.peer_interval`): every k-th one. The others are not
pushed at all: no header, no collective. A push is collective over the peer group, so every rank must push the
same windows; the schedule is therefore decided only from values every rank has: the window ids (the same on
every rank) and, for "auto", a value agreed over the peer group right after each due push (the persist thread's
own gloo group, never the training thread's).

The rule for "auto": the push of one window takes `push_s` seconds of link time and training makes a window every
`window_s` seconds; pushing every k-th window occupies the link `push_s / (k * window_s)` of the time, so
k = ceil(push_s / (share * window_s)), clamped to [1, AUTO_MAX]. Each rank computes its own k from its newest
measurement, the largest is agreed (the slowest link decides), and it sets the gap to the next due window.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Literal

AUTO_MAX = 8  # "auto" never pushes less often than every 8th window: the host keeps up to that many more windows

Interval = int | Literal["auto"]


def interval_for(push_s: float, window_s: float, share: float, cap: int = AUTO_MAX) -> int:
    """The smallest k for which pushing every k-th window occupies at most `share` of the link's time
    (`push_s / (k * window_s) <= share`), in [1, cap]. Unmeasured (push_s or window_s <= 0): 1."""
    if push_s <= 0 or window_s <= 0:
        return 1
    return max(1, min(cap, math.ceil(push_s / (share * window_s) - 1e-9)))


class PeerInterval:
    """The push schedule of one writer: the window due next and the current k. Advanced by the persist thread
    at each due window (`advance`), read by the training thread for the lag (`pending`); values only, no sync.

    Call order (persist thread, every rank, per committed window w): `due(w)`; if due, the push (collective),
    then `advance(w, agree)`, whose `agree` (for "auto") is the collective that agrees k."""

    def __init__(self, interval: Interval = 1, share: float = 0.05):
        self.auto = interval == "auto"
        self.k = 1 if self.auto else int(interval)
        self.share = share
        self.next_due: int | None = None  # None: the first window committed is due
        self.first_committed: int | None = None  # the training thread's first commit (the schedule's anchor)
        self.wanted = 1  # this rank's own k from its newest measurement (auto)
        self.newest_commit: tuple[int, float] | None = None  # (window, perf_counter) of training's newest commit
        self._last_due: tuple[int, float] | None = None  # (window, commit time) of the previous due window
        self._lock = threading.Lock()

    @property
    def bound(self) -> int:
        """The largest k this schedule may use: windows the host keeps beyond the newest pushed one."""
        return AUTO_MAX if self.auto else self.k

    def committed(self, window_id: int) -> None:
        """The training thread committed `window_id` (the anchor of the schedule before any push)."""
        with self._lock:
            if self.first_committed is None:
                self.first_committed = window_id

    def due(self, window_id: int) -> bool:
        """Whether `window_id` is pushed (the persist thread; the same answer on every rank)."""
        with self._lock:
            if self.next_due is None:
                self.next_due = window_id
            return window_id >= self.next_due

    def window_seconds(self, window_id: int, queued_at: float) -> float:
        """Training's seconds per window, after the push of due `window_id` (committed at `queued_at`): from its
        commit to the newest one (committed while it was pushed: known after the first push already), else from
        the previous due window's commit. 0: not measured yet."""
        prev, self._last_due = self._last_due, (window_id, queued_at)
        newest = self.newest_commit
        if newest is not None and newest[0] > window_id:
            return (newest[1] - queued_at) / (newest[0] - window_id)
        if prev is None or window_id <= prev[0]:
            return 0.0
        return (queued_at - prev[1]) / (window_id - prev[0])

    def measured(self, push_s: float, window_s: float) -> None:
        """This rank's newest push (seconds its links took for one window) and training's seconds per window."""
        if self.auto and push_s > 0 and window_s > 0:
            self.wanted = interval_for(push_s, window_s, self.share)

    def advance(self, window_id: int, agree: Callable[[int], int] | None = None) -> None:
        """`window_id` was due and its push ran (sent or superseded): the next due is k windows later. "auto":
        k is `agree(self.wanted)` first (a collective: every rank calls it at the same due window)."""
        k = self.k
        if self.auto and agree is not None:
            k = max(1, min(AUTO_MAX, int(agree(self.wanted))))
        with self._lock:
            self.k = k
            self.next_due = window_id + k

    def passed(self, window_id: int) -> None:
        """`window_id` reached the peers: the next due is after it (a no-op once `advance` moved past it)."""
        with self._lock:
            if self.next_due is None or self.next_due <= window_id:
                self.next_due = window_id + self.k

    def pending(self, newest_committed: int | None) -> int:
        """Due windows committed but not yet pushed: from the next due one to `newest_committed` (the current k
        for the windows not reached yet)."""
        with self._lock:
            start = self.next_due if self.next_due is not None else self.first_committed
            if newest_committed is None or start is None or newest_committed < start:
                return 0
            return 1 + (newest_committed - start) // self.k

    def text(self) -> str:
        return f"every {self.k}{' (auto)' if self.auto else ''}"

    def stats(self) -> dict:
        return {"peer_interval": self.k, "peer_interval_auto": self.auto, "peer_interval_wanted": self.wanted}
