"""How far the peer copy is behind, and how fast each peer link carries it: the replication lag (pushes missed: windows
due to be pushed (peer_interval.py) that were committed in memory after the newest one that reached every peer, and
not pushed yet or skipped), bytes/s per link, and the lag bound
(`TierConfig.peer_max_lag_windows`). Past the bound the peer copy is reported as not durable: one warning when it
crosses, one line when it is back within (run_status.py speaks them), and `stats()['peers']['peer_durable']`.

The training thread reports commits (`committed`: counters only, no sync); the persist thread reports pushes
(`replicated`, `superseded`). A window that a newer committed window replaced while the link was busy is skipped
(persist_thread.py), so a slow link makes the lag grow, never a queue of windows in host memory."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from .peer_interval import PeerInterval


@dataclass
class LinkStats:
    """One peer link of this rank, one direction: what crossed it, how long the transfers took, the newest rate."""

    peer: int  # the rank at the other end
    direction: str  # "to" (pushes sent) | "from" (copies received)
    bytes: int = 0
    seconds: float = 0.0  # time spent in transfers on this link (the header's round trip included)
    last_bytes_per_s: float = 0.0  # the newest transfer's rate (a link throttled later shows it at once)

    def add(self, nbytes: int, seconds: float) -> None:
        self.bytes += nbytes
        self.seconds += seconds
        if nbytes and seconds > 0:
            self.last_bytes_per_s = nbytes / seconds

    @property
    def bytes_per_s(self) -> float:
        """Mean throughput of the transfers on this link."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "peer": self.peer,
            "direction": self.direction,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 4),
            "bytes_per_s": round(self.bytes_per_s, 1),
            "last_bytes_per_s": round(self.last_bytes_per_s, 1),
        }


class PeerLag:
    """The peer copy's lag in pushes missed against `max_lag` (>= 1); `say(text, warn)` speaks a crossing
    (RunStatus). A window the interval does not push is no lag: the durable peer copy is the newest pushed one."""

    def __init__(
        self, max_lag: int, say: Callable[[str, bool], None] | None = None, interval: PeerInterval | None = None
    ):
        self.max_lag, self.say = max_lag, say
        self.interval = interval if interval is not None else PeerInterval(1)
        self.newest_committed: int | None = None  # newest window committed in memory (the training thread's)
        self.newest_replicated: int | None = None  # newest window whose copy reached every peer
        self.missed = 0  # due windows skipped (superseded) since `newest_replicated`
        self.lag_max = 0  # the largest lag seen
        self.superseded = 0  # windows skipped on the link: a newer one was committed before it was sent
        self.behind_count = 0  # times the lag crossed the bound
        self.behind = False
        self._lock = threading.Lock()

    @property
    def commits_since(self) -> int:
        """Due windows committed in memory that the peers do not have (0: the newest due one is on every peer)."""
        return self.missed + self.interval.pending(self.newest_committed)

    @property
    def lag(self) -> int:
        return self.commits_since

    @property
    def durable(self) -> bool:
        return not self.behind

    def committed(self, window_id: int) -> None:
        """The training thread committed `window_id` in memory (handed to the persist thread)."""
        with self._lock:
            self.newest_committed = window_id
            self.interval.committed(window_id)
            self._check()

    def replicated(self, window_id: int) -> None:
        """`window_id` reached every peer."""
        with self._lock:
            self.newest_replicated, self.missed = window_id, 0
            self.interval.passed(window_id)  # used alone (no persist thread): the schedule moves past it
            self._check()

    def skipped(self) -> None:
        """A due window was not sent: a newer committed due window replaces it (a push missed)."""
        with self._lock:
            self.superseded += 1
            self.missed += 1

    def _check(self) -> None:
        lag = self.commits_since
        self.lag_max = max(self.lag_max, lag)
        if lag > self.max_lag and not self.behind:
            self.behind, self.behind_count = True, self.behind_count + 1
            on = "none yet" if self.newest_replicated is None else f"window {self.newest_replicated}"
            self._say(
                f"peer copy behind: {lag} push(es) missed up to window {self.newest_committed} committed in memory "
                f"(on the peers: {on}; pushing {self.interval.text()}), more than peer_max_lag_windows = "
                f"{self.max_lag}; the peer copy is not "
                "durable until it catches up (the peer links are slower than training makes windows: "
                f"{self.superseded} window(s) skipped so far, host memory is not queued)",
                True,
            )
        elif lag <= self.max_lag and self.behind:
            self.behind = False
            self._say(f"peer copy caught up: window {self.newest_replicated} on the peers (lag {lag})", True)

    def _say(self, text: str, warn: bool) -> None:
        if self.say is not None:
            self.say(text, warn)

    def text(self) -> str:
        """The status lines' part: 'lag 1' or 'behind (lag 6 > 4, not durable)'."""
        lag = self.commits_since
        return f"behind (lag {lag} > {self.max_lag}, not durable)" if self.behind else f"lag {lag}"

    def stats(self) -> dict:
        with self._lock:
            return {
                "lag_windows": self.commits_since,  # pushes missed (due windows), not windows
                **self.interval.stats(),
                "lag_windows_max": self.lag_max,
                "peer_max_lag_windows": self.max_lag,
                "peer_durable": not self.behind,
                "newest_replicated": self.newest_replicated,
                "windows_superseded": self.superseded,
                "times_behind": self.behind_count,
            }
