"""What a user reads while a job runs: one line per committed window, a warning when the object store fails or
falls behind (once per change of state, and a line when it recovers) and a summary at exit (the line after a
recovery: ops/status.py). Rank 0 speaks at INFO, other ranks log the same lines at DEBUG. Logger "torchmoe_ckpt",
lines start "torchmoe:". A window's line waits for its upload while the store keeps up (so it can say "uploaded");
while the store is failing or behind it is said at once with "pending". Thread-safe: the persist thread and the
uploader call it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from ..core.config_values import human_bytes

log = logging.getLogger("torchmoe_ckpt")


def _ids(ids) -> str:
    ids = sorted(ids)
    return ", ".join(map(str, ids[:8])) + (f", ... ({len(ids)} in all)" if len(ids) > 8 else "")


class RunStatus:
    """Status lines of one rank's checkpointing (host tier, peers, object store)."""

    def __init__(self, rank: int, peers: int | None = None, store: str | None = None):
        self.rank, self.peers, self.store = rank, peers, store  # peers: r (None: no peer tier); store: its URI
        self.level = logging.INFO if rank == 0 else logging.DEBUG
        self.warn_level = logging.WARNING if rank == 0 else logging.DEBUG
        self.lines: deque[str] = deque(maxlen=256)  # the last lines said (tests, summaries); bounded for long runs
        self.store_state = "ok"  # ok | failing | behind
        # window -> (first step, last step, bytes) on host: the newest and those still waiting (bounded)
        self.committed: dict[int, tuple[int, int, int]] = {}
        self.committed_count = 0
        self.uploaded_count = 0
        self.superseded_count = 0  # windows a newer one replaced in the upload queue (never uploaded)
        self.pending: dict[int, float] = {}  # window -> when it was handed to the uploader
        self._held: set[int] = set()  # window lines waiting for their upload
        self._peers_ok: int | None = None  # k: peers this rank's copies went to (placement; r when None)
        self._fail_since: float | None = None
        self._failed_attempts = 0
        self._lock = threading.Lock()
        # () -> "host memory X of LIMIT" (host_memory.HostMemory.line): set by the checkpointer once its host-memory
        # account exists (that account reads this thread's tiers, so it is built after them)
        self.memory: Callable[[], str] | None = None
        # () -> "lag 1" / "behind (lag 6 > 4, not durable)" and each link's rate (peer_lag.py): set with a peer tier
        self.peer_text: Callable[[], str] | None = None
        # () -> "policy dense k=12 (predicted ETTR ...)" (planning/policy.py): set by the checkpointer
        self.policy_text: Callable[[], str | None] | None = None

    def say(self, text: str, level: int | None = None) -> None:
        self.lines.append(text)
        log.log(self.level if level is None else level, "torchmoe: %s", text)

    def window_committed(self, wid: int, first: int, last: int, nbytes: int, peers_ok: int | None = None) -> None:
        """Window `wid` is on the host tier (and on its peers); with a store, its upload was just queued."""
        with self._lock:
            self.committed[wid] = (first, last, nbytes)
            self.committed_count += 1
            self._forget_old()
            self._peers_ok = peers_ok
            if self.store is None:
                self.say(self._window_line(wid, None))
                return
            self.pending[wid] = time.monotonic()
            if self.store_state == "ok" and len(self.pending) == 1:
                self._held.add(wid)  # said when it is uploaded
            else:
                self._release_held()  # an older window still waiting for its upload is said first
                lag = time.monotonic() - min(self.pending.values())
                self.say(self._window_line(wid, f"pending ({len(self.pending)} behind, lag {lag:.1f} s)"))

    def _window_line(self, wid: int, store: str | None) -> str:
        first, last, nbytes = self.committed[wid]
        text = f"window {wid} steps {first}..{last} bytes {human_bytes(nbytes)} host ok"
        if self.peers is not None:
            ok = self.peers if self._peers_ok is None else self._peers_ok
            text += f" peers {ok}/{self.peers}" + (f" {self.peer_text()}" if self.peer_text is not None else "")
        text += f" store {store}" if store is not None else ""
        policy = self.policy_text() if self.policy_text is not None else None
        text += f"; {policy}" if policy else ""
        return text + (f"; {self.memory()}" if self.memory is not None else "")

    def peer_lag_changed(self, text: str, warn: bool) -> None:
        """The peer copy crossed its lag bound (peer_lag.py): said once per crossing."""
        self.say(text, self.warn_level if warn else None)

    def uploaded_window(self, wid: int, lag_s: float) -> None:
        with self._lock:
            self.pending.pop(wid, None)
            self.uploaded_count += 1
            if wid in self._held:
                self._held.discard(wid)
                self.say(self._window_line(wid, f"uploaded (lag {lag_s:.2f} s)"))
            if self.store_state == "failing":
                took = time.monotonic() - (self._fail_since or time.monotonic())
                self.say(
                    f"object store back: window {wid} uploaded after {self._failed_attempts} failed attempt(s) "
                    f"in {took:.1f} s; "
                    + (f"catching up on {len(self.pending)} pending window(s)" if self.pending else "nothing pending"),
                    self.warn_level,
                )
            elif self.store_state == "behind" and not self.pending:
                self.say(f"object store caught up: window {wid} uploaded (lag {lag_s:.2f} s)", self.warn_level)
            if self.store_state == "failing" or not self.pending:
                self.store_state = "ok" if not self.pending else "behind"
            self._fail_since, self._failed_attempts = None, 0

    def upload_failed(self, wid: int, reason: str, retry_s: float) -> None:
        with self._lock:
            self._failed_attempts += 1
            self._release_held()
            if self.store_state == "failing":
                return
            self.store_state, self._fail_since = "failing", time.monotonic()
            self.say(
                f"object store failing: {reason}; training goes on, windows stay in host memory "
                f"and are uploaded when the store is back (retrying every <= {max(retry_s, 0.5):.1f} s)",
                self.warn_level,
            )

    def superseded(self, wid: int, by: int) -> None:
        """Window `wid` was dropped from the upload queue: a newer one replaces it (the store is too slow)."""
        with self._lock:
            if self.pending.pop(wid, None) is not None:
                self.superseded_count += 1
            self._release_held()
            if self.store_state != "ok":
                return
            self.store_state = "behind"
            self.say(
                f"object store behind: window {wid} was superseded by window {by} before it was "
                f"uploaded (uploads are slower than training); the store keeps the newest windows",
                self.warn_level,
            )

    def _forget_old(self) -> None:
        newest = max(self.committed)
        for w in [w for w in self.committed if w != newest and w not in self.pending and w not in self._held]:
            del self.committed[w]

    def _release_held(self) -> None:
        for w in sorted(self._held):  # their upload is not coming soon: say them now
            self.say(self._window_line(w, "pending"))
        self._held.clear()

    def exit_summary(self, waited_s: float, wait_limit_s: float, host_dir: str | None = None) -> dict:
        with self._lock:
            self._release_held()
            newest = max(self.committed, default=None)
            summ = {
                "windows_committed": self.committed_count,
                "newest": newest,
                "uploaded": self.uploaded_count,
                "pending": sorted(self.pending),
                "superseded": self.superseded_count,
                "waited_s": round(waited_s, 2),
                "wait_limit_s": wait_limit_s,
            }
            text = f"exit: {self.committed_count} window(s) committed"
            if newest is not None:
                first, last, _ = self.committed[newest]
                text += f" (newest {newest}, steps {first}..{last})"
            text += " on the host tier" + (f" {host_dir}" if host_dir else "")
            mem = f" ({self.memory()} at exit)" if self.memory is not None else ""  # what stays in /dev/shm
            level = self.warn_level
            if not self.committed_count:
                durable = summ["durable_on_host"] = _committed_on_host(host_dir, self.rank)  # an earlier attempt's
                if durable:  # this attempt added nothing, but a restart still has a window to resume from
                    line = (
                        f"exit: no window committed by this attempt; window {durable[-1]} (committed earlier) is "
                        f"the newest on the host tier {host_dir}: a restart resumes from it. This attempt's "
                        "windows did not commit (every host-tier write failed, see the warnings above, or it "
                        f"ran fewer iterations than one window){mem}"
                    )
                else:  # nothing to resume from: a restart of this run would start over
                    line = (
                        text + ": nothing a restart could resume from. A window commits once all W iterations "
                        "of it are copied and written, so the run was shorter than one window (fewer iterations "
                        "than W, or it stopped before the copies finished) or every host-tier write failed (see "
                        "the warnings above)"
                    )
            elif self.store is None:
                line, level = text + mem, self.level
            elif not self.pending:
                waited = f" (waited {waited_s:.1f} s)" if waited_s >= 0.05 else ""
                line = f"{text}; object store {self.store}: {self.uploaded_count} uploaded, none pending{waited}{mem}"
                level = self.level
            else:
                label = "windows" if len(self.pending) > 1 else "window"
                old = self.superseded_count
                line = (
                    f"{text}; object store {self.store}: {self.uploaded_count} uploaded, {len(self.pending)} pending "
                    f"({label} {_ids(self.pending)}) after waiting {waited_s:.1f} s of exit_wait_s = "
                    f"{wait_limit_s:g}; they are in host memory and a run with the same run_id uploads them"
                    + (f"; {old} older window(s) were superseded by newer ones" if old else "")
                    + mem
                )
            self.say(line, level)
            return summ


def _committed_on_host(host_dir: str | None, rank: int) -> list[int]:
    """Windows this rank has committed in `host_dir` (its manifest is there), whichever attempt wrote them."""
    from ..storage_format.files import LocalFiles
    from ..tiers.window_tier import FilesWindowTier

    try:
        return FilesWindowTier(LocalFiles(host_dir), rank, 0).window_ids() if host_dir else []
    except OSError:
        return []
