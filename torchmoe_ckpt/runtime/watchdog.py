"""Hung-collective watchdog: turn a collective that never completes into a prompt, logged process exit.

A frozen or dead peer leaves every other rank blocked in a collective until the process group's timeout, and
torchrun only restarts a *failed* worker. Regions that issue collectives run under `wd.watch(op)`; a daemon
thread sleeps until the oldest open region's deadline and, past it, writes one `event=hang` line to stderr,
dumps every thread's stack, tries to abort the process groups (bounded) and exits with EXIT_HANG, so torchrun
restarts the job. torch.distributed errors raised inside a region (a gloo timeout, a reset connection) also end
the process (`event=collective_error`): unwinding could block at exit on a thread waiting on the dead peer.
timeout_s=None switches it off; a region may have its own, longer bound (`watch(op, timeout_s=...)`).

    wd = CollectiveWatchdog(timeout_s=100.0, rank=rank)
    with wd.watch("all_reduce(grads)"):
        dist.all_reduce(grads)          # blocked past 100 s: event=hang on stderr, stacks dumped, exit EXIT_HANG
    with wd.watch("resume", timeout_s=300.0):
        recover(...)                    # its own, longer bound
    wd.close()
"""

from __future__ import annotations

import faulthandler
import json
import os
import select
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass

from ..core.config_values import check_timeout
from ..core.errors import is_collective_failure

EXIT_HANG = 124  # like coreutils' timeout(1): "the command timed out"
EXIT_COLLECTIVE_ERROR = 125  # torch.distributed raised inside a watched region
ABORT_WAIT_S = 2.0  # how long the process-group abort may take before we exit regardless

# The stop guard: on a restart torchrun (2.13) sends killpg(SIGTERM) and waits a fixed 30 s before SIGKILL, and a
# SIGSTOPped worker never acts on SIGTERM. This tiny process in the worker's process group gets the same SIGTERM
# and SIGKILLs the worker at once if it is stopped, else after `grace` seconds if it has not exited by itself.
_GUARD = r"""
import os, signal, sys, time
pid, grace = int(sys.argv[1]), float(sys.argv[2])
def state():
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
def stop(signum, frame):
    end = time.monotonic() + grace
    while os.getppid() == pid and state() not in ("T", "t") and time.monotonic() < end:
        time.sleep(0.05)
    if os.getppid() == pid:  # still our parent: the worker itself, not a recycled pid
        os.kill(pid, signal.SIGKILL)
    os._exit(0)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
os.write(1, b"ready\n")
os.close(1)
while os.getppid() == pid:
    time.sleep(0.5)
"""


def start_stop_guard(grace_s: float = 5.0) -> subprocess.Popen | None:
    """Start the stop guard for this process if it leads its own process group (as torchrun's workers do:
    that is how the guard receives the agent's killpg). Returns None elsewhere."""
    if os.name != "posix" or os.getpgrp() != os.getpid():
        return None
    guard = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _GUARD, str(os.getpid()), str(grace_s), "tmoe-stop-guard"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
    )
    out = guard.stdout
    assert out is not None  # stdout=PIPE
    # Until its handlers are installed a SIGTERM would kill the guard alone: wait for it to say so.
    ready, _, _ = select.select([out], [], [], 10.0)
    if not ready or out.readline() != b"ready\n":
        guard.kill()
        guard.wait()
        write_all(2, "event=stop_guard_failed: a frozen worker may wait out torchrun's SIGTERM grace\n")
        return None
    out.close()
    return guard


def _dist():
    """torch.distributed if this process already imported it; never imports torch on the exit path."""
    return sys.modules.get("torch.distributed")


def _rank() -> int | str:
    with suppress(Exception):  # never let diagnostics stop the exit
        dist = _dist()
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    return os.environ.get("RANK", "?")


def abort_process_groups() -> str:
    """Abort every process group if this torch can; returns what happened (for the log line). For gloo nothing
    is guaranteed to unblock a pending collective: the caller runs this in a thread, bounded by ABORT_WAIT_S."""
    try:
        dist = _dist()
        if dist is None or not (dist.is_available() and dist.is_initialized()):
            return "no_pg"
        from torch.distributed import distributed_c10d as c10d

        fn = getattr(c10d, "_abort_process_group", None)
        if fn is not None:
            fn()
            return "aborted"
        pg = c10d._get_default_group()
        if hasattr(pg, "abort"):
            pg.abort()
            return "aborted_default"
        return "unsupported"
    except Exception as exc:  # a backend without abort raises; the exit that follows is what matters
        return f"failed:{type(exc).__name__}"


class CollectiveWatchdog:
    def __init__(
        self,
        timeout_s: float | None,
        *,
        rank: int | None = None,
        events_path: str | os.PathLike | None = None,
        exit_on_dist_error: bool = True,
        stop_guard_s: float | None = 5.0,
    ):
        check_timeout("watchdog timeout_s", timeout_s)
        self.timeout_s = timeout_s
        self.enabled = timeout_s is not None
        self.rank = rank
        self.events_path = os.fspath(events_path) if events_path else None
        self.exit_on_dist_error = exit_on_dist_error
        self.stop_guard_s = stop_guard_s  # None: no stop guard
        self.guard: subprocess.Popen | None = None
        # Called with the event record before the abort and exit, on the thread that detected the failure; a
        # hook must not issue collectives (the peers are gone). jit.py saves the rank's state here.
        self.on_failure: list[Callable[[FailureEvent], None]] = []
        self._cv = threading.Condition()
        self._open: dict[int, tuple[str, float, float]] = {}  # token -> (op, start, timeout), from any thread
        self._next = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        # counters of this process (earlier attempts' hangs are in events_path)
        self.regions = 0
        self.max_region_s = 0.0
        self.hangs_detected = 0
        self.last_detect_s: float | None = None

    @contextmanager
    def watch(self, op: str, timeout_s: float | None = None) -> Iterator[None]:
        """Watch the region `op`; `timeout_s`: its own bound (default: the watchdog's). A no-op when off."""
        if self.timeout_s is None:
            yield
            return
        self._ensure_thread()
        start = time.monotonic()
        bound = self.timeout_s if timeout_s is None else timeout_s  # the region's own bound (resume: 300 s)
        with self._cv:
            token = self._next
            self._next += 1
            self._open[token] = (op, start, bound)
            self._cv.notify()  # the thread may be sleeping until a later deadline
        try:
            yield
        except BaseException as exc:
            if self.exit_on_dist_error and is_collective_failure(exc):
                write_all(2, "".join(traceback.format_exception(exc)))  # os._exit below skips Python's report
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
                self._fail("collective_error", op, time.monotonic() - start, error=error, limit=bound)
            raise
        finally:
            with self._cv:
                self._open.pop(token, None)
                self.regions += 1
                self.max_region_s = max(self.max_region_s, time.monotonic() - start)

    def _ensure_thread(self) -> None:
        """Start the watchdog thread (and the stop guard) at the first watched region, not at construction: a
        watchdog that is off (timeout_s=None) or never watches a region costs no thread and no guard process."""
        if self._thread is not None:
            return
        if self.stop_guard_s is not None:
            self.guard = start_stop_guard(self.stop_guard_s)
        self._thread = threading.Thread(target=self._loop, name="collective-watchdog", daemon=True)
        self._thread.start()

    def stats(self) -> dict:
        return {
            "timeout_s": self.timeout_s,
            "regions_watched": self.regions,
            "max_region_s": round(self.max_region_s, 4),
            "hangs_detected": self.hangs_detected,
            "last_detect_s": self.last_detect_s,
        }

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def _loop(self) -> None:
        with self._cv:
            while not self._closed:
                if not self._open:
                    self._cv.wait()
                    continue
                op, start, limit = min(self._open.values(), key=lambda r: r[1] + r[2])  # the earliest deadline
                left = start + limit - time.monotonic()
                if left > 0:
                    self._cv.wait(left)  # woken early by a new/closed region; re-evaluate either way
                    continue
                break
            else:
                return
        # Outside the lock: _fail must not hold a lock the main thread might need to unwind.
        self._fail("hang", op, time.monotonic() - start, limit=limit)

    def _fail(self, event: str, op: str, waited: float, error: str | None = None, limit: float | None = None) -> None:
        code = EXIT_HANG if event == "hang" else EXIT_COLLECTIVE_ERROR
        self.hangs_detected += event == "hang"
        self.last_detect_s = round(waited, 4)
        rank = self.rank if self.rank is not None else _rank()
        rec = FailureEvent(
            event,
            rank,
            op,
            round(waited, 3),
            self.timeout_s if limit is None else limit,
            os.getpid(),
            int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            code,
            error or None,
        )
        # os.write on fd 2, not logging/print: another thread may hold the stream's lock while stuck
        write_all(2, rec.line() + "\n")
        if self.events_path:
            with suppress(OSError):
                fd = os.open(self.events_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                write_all(fd, json.dumps(rec.to_dict()) + "\n")
                os.fsync(fd)
                os.close(fd)
        for hook in list(self.on_failure):
            try:
                hook(rec)
            except BaseException as exc:  # a failing hook must not keep the process from exiting
                write_all(2, f"event=failure_hook_error rank={rank} error={type(exc).__name__}: {exc}\n")
        if event == "hang":
            with suppress(Exception):
                faulthandler.dump_traceback(file=2, all_threads=True)
        result: list[str] = []
        t = threading.Thread(target=lambda: result.append(abort_process_groups()), daemon=True)
        t.start()
        t.join(ABORT_WAIT_S)
        write_all(2, f"event=exit rank={rank} abort={result[0] if result else 'timed_out'} exit_code={code}\n")
        os._exit(code)


@dataclass(frozen=True)
class FailureEvent:
    """A failure the watchdog detected, as its `event=hang` / `event=collective_error` line, its events file (JSON)
    and its `on_failure` hooks see it."""

    event: str  # "hang" or "collective_error"
    rank: int | str  # "?" where no process group or RANK says it
    op: str  # the region that hung or failed ("step 12", "resume", ...)
    waited_s: float
    timeout_s: float | None  # the bound that region was held to
    pid: int
    attempt: int  # torchrun's restart count
    exit_code: int
    error: str | None = None  # a collective's error (collective_error)

    def to_dict(self) -> dict:
        """The events file's JSON (without `error` when there is none)."""
        d = asdict(self)
        if d["error"] is None:
            del d["error"]
        return d

    def line(self) -> str:
        """`event=hang rank=1 op="step 12" ...`: strings with spaces, or empty, JSON-quoted."""
        return " ".join(
            f"{k}={json.dumps(v) if isinstance(v, str) and (' ' in v or not v) else v}"
            for k, v in self.to_dict().items()
        )


def write_all(fd: int, text: str) -> None:
    """os.write of all of `text`: no stream lock, which another thread may hold while stuck (also jit.py)."""
    data = text.encode()
    while data:
        data = data[os.write(fd, data) :]


def read_events(path: str | os.PathLike | None) -> list[dict]:
    """Watchdog events recorded by earlier attempts (their processes exited right after writing them)."""
    if not path or not os.path.exists(path):
        return []
    out = []
    for line in open(path):
        with suppress(ValueError):  # a line torn by the exit itself
            out.append(json.loads(line))
    return out
