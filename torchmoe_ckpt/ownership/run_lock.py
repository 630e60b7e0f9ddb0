"""One writer per run: `LOCK.json` in the run's host directory, so a second job on the same run id and directory
fails at start with one line instead of mixing its windows with the first job's.

The job is torchrun's agent on this node (`TORCHELASTIC_RUN_ID` plus the agent's pid: the same across restarts of
one launch, different for every launch), else this process. The node's local rank 0 takes the lock, the other
local ranks wait until it names their job. A stale lock (its process gone or its pid recycled) or this job's own
(a restart) is taken over, logged. Judging and writing is one step under an exclusive `flock` of `.LOCK.mutex`:
a non-atomic read-judge-replace let several processes take over one stale lock at once."""

from __future__ import annotations

import fcntl
import getpass
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..core.errors import ConfigError
from ..storage_format.commit import write_last
from ..storage_format.layout import LOCK_NAME

MUTEX_NAME = ".LOCK.mutex"  # flock'ed while the lock is judged and written (never replaced)

log = logging.getLogger("torchmoe_ckpt.run_lock")


class RunLockedError(ConfigError):
    """Another live job holds this run directory; the message names the holder and the fix."""


def _pid_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc), to tell a recycled pid from the holder."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    now = _pid_start(pid)
    return start is None or now is None or now == start


def this_job(world: int = 1) -> dict:
    """Who this process writes for: the workers' parent (torchrun's agent, or e.g. mp.spawn's), else itself."""
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    pid = os.getppid() if under_torchrun or world > 1 else os.getpid()
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return {
        "job": f"{run}@{socket.gethostname()}:{pid}",
        "torchrun_run_id": run if under_torchrun else None,
        "owner": _user(),
        "host": socket.gethostname(),
        "pid": pid,
        "pid_start": _pid_start(pid),
        "worker_pid": os.getpid(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    }


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry in some containers
        return str(os.getuid())


def read(run_dir: str | Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / LOCK_NAME).read_text())
    except FileNotFoundError:
        return None
    except ValueError:  # torn by a crash mid-write (we write atomically, so only a foreign file): stale
        return {"job": "unreadable", "host": None, "pid": -1}


def _verdict(holder: dict | None, me: dict) -> str:
    """ "free", "mine" (this job's own: a restart), "stale" (its job is gone) or "held"."""
    if holder is None:
        return "free"
    if holder.get("job") == me["job"]:
        return "mine"
    gone = holder.get("host") == me["host"] and not _alive(int(holder.get("pid", -1)), holder.get("pid_start"))
    return "stale" if gone or holder.get("job") == "unreadable" else "held"


def held_by_another_job(run_dir: str | Path, me: dict) -> bool:
    """Whether a live job other than `me` (`this_job()`) holds the run directory's lock."""
    return _verdict(read(run_dir), me) == "held"


def _create(run_dir: Path, me: dict) -> bool:
    """Write a fresh lock atomically, by link: fails if one appeared meanwhile (a takeover is a commit-last write)."""
    tmp = run_dir / f".{LOCK_NAME}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(me, indent=1))
    try:
        os.link(tmp, run_dir / LOCK_NAME)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def acquire(run_dir: str | Path, leader: bool, world: int = 1, wait_s: float = 60.0) -> dict:
    """Take (leader: this node's local rank 0) or join (the other local ranks) the run's lock. Returns the
    lock's content; raises `RunLockedError` (one line: holder and fix) when another live job holds it. A
    directory that cannot be written is the host tier's unhealthy state, not an error: the lock is left
    unwritten (such a job cannot mix windows into the run either), a warning says why and training goes on."""
    try:
        return _acquire(Path(run_dir), leader, world, wait_s)
    except OSError as exc:
        log.warning(
            "event=tier_unhealthy tier=host rank=%s reason='run lock of %s: %s: %s': the host directory cannot be "
            "written; what it holds is still recovered, new windows are retried (TierConfig.on_stall applies)",
            os.environ.get("RANK", "0"),
            run_dir,
            type(exc).__name__,
            exc,
        )
        return dict(this_job(world), unwritten=f"{type(exc).__name__}: {exc}")


def _refuse(run_dir: Path, holder: dict) -> RunLockedError:
    """The one-line refusal when another live job holds the lock: who holds it, and the fix."""
    return RunLockedError(
        f"run directory {run_dir} is in use by another job (torchrun run id {holder.get('torchrun_run_id')}, "
        f"pid {holder.get('pid')} on host {holder.get('host')}, owner {holder.get('owner')}, started "
        f"{holder.get('started')}): two jobs on one run would mix their windows; give this job another "
        f"run_id (TierConfig.run_id) or root, or stop that job (if it is gone, delete {run_dir / LOCK_NAME})"
    )


def _probe_writable(run_dir: Path) -> None:
    """Raise OSError when this process cannot write the run directory (then the leader cannot either)."""
    probe = run_dir / f".lock-probe-{os.getpid()}"
    probe.write_bytes(bytes(4096))  # a page: on a full tmpfs an empty file would still fit
    probe.unlink()


@contextmanager
def _mutex(run_dir: Path) -> Iterator[None]:
    """Exclusive between the processes of this host that judge and write this run's lock."""
    fd = os.open(run_dir / MUTEX_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


def _acquire(run_dir: Path, leader: bool, world: int, wait_s: float) -> dict:
    me = this_job(world)
    deadline = time.monotonic() + wait_s
    while True:
        holder = read(run_dir)
        verdict = _verdict(holder, me)
        if verdict == "held":
            assert holder is not None  # "held" judges a lock that exists
            raise _refuse(run_dir, holder)
        if not leader:  # wait for this node's local rank 0 to take it for this job
            if verdict == "mine":
                assert holder is not None  # "mine" judges a lock that exists
                return holder
            _probe_writable(run_dir)  # OSError: the leader cannot write it either (acquire says so)
            if time.monotonic() > deadline:
                raise RunLockedError(
                    f"run directory {run_dir}: this node's local rank 0 did not take the run lock "
                    f"within {wait_s:.0f} s (it holds {holder}); check that rank's log"
                )
            time.sleep(0.05)
            continue
        with _mutex(run_dir):
            got = _take(run_dir, me)
        if got is not None:
            return got
        # a concurrent job took it first: loop and judge that one (refused while it lives)


def _take(run_dir: Path, me: dict) -> dict | None:
    """The leader's judge-and-write, under the mutex: the lock's content once it names this job, else None."""
    holder = read(run_dir)
    verdict = _verdict(holder, me)
    if verdict == "held" or (verdict == "free" and not _create(run_dir, me)):
        return None  # refused in acquire's next round; or created outside the mutex meanwhile: judge that one
    holder = holder or {}  # "free" and created: nothing to log about a holder
    if verdict == "stale":
        log.warning(
            "event=run_lock_takeover run_dir=%s reason=stale: the holder (pid %s on host %s, run id %s, "
            "started %s) is gone",
            run_dir,
            holder.get("pid"),
            holder.get("host"),
            holder.get("torchrun_run_id"),
            holder.get("started"),
        )
    elif verdict == "mine" and holder.get("worker_pid") != me["worker_pid"]:
        log.warning(
            "event=run_lock_takeover run_dir=%s reason=restart: same job (run id %s), attempt %d",
            run_dir,
            me["torchrun_run_id"],
            me["attempt"],
        )
    if verdict in ("stale", "mine"):
        write_last(run_dir / LOCK_NAME, json.dumps(me, indent=1).encode())
    got = read(run_dir)
    return got if got is not None and got.get("job") == me["job"] else None
