"""Stage-boundary log (upstream logging): what a pipeline stage sends, kept on the sender in host memory.

Every activation sent forward and gradient sent backward is logged, tagged (iteration, micro-batch, direction),
plus a per-iteration record (global gradient norm, loss), so a failed neighbour can replay alone. `record()` only
queues; a writer thread writes each entry to a temporary name under `dir` (host memory that outlives the worker,
e.g. /dev/shm) and renames it. `collect(upto)` deletes iterations <= upto. When an entry would pass `max_bytes`,
logging stops until the next collection (`event=pp_log_overflow`): training is never slowed, and a failure that
needs an iteration in the gap recovers globally.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger("torchmoe_ckpt.pipeline_log")
DIRECTIONS = ("fwd", "bwd")


def entry_name(it: int, mb: int, direction: str) -> str:
    return f"t{it:08d}.m{mb:04d}.{direction}.pt"


def meta_name(it: int) -> str:
    return f"t{it:08d}.meta.pt"


def _iteration_of(name: str) -> int | None:
    if not (name.startswith("t") and name.endswith(".pt")) or len(name) < 9 or not name[1:9].isdigit():
        return None
    return int(name[1:9])


class BoundaryLog:
    """This stage's log of what it sent. One instance per stage rank; neighbours read it via `LogReader`."""

    def __init__(self, dir: str | os.PathLike, max_bytes: int | None = None):
        self.dir = Path(dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        # bytes per entry file; entries left by this stage's previous process (a torchrun restart) count too
        self._sizes: dict[str, int] = {p.name: _file_payload(p) for p in self.dir.glob("t*.pt")}
        self.held_bytes = sum(self._sizes.values())
        self.bytes_by_iteration: dict[int, int] = {}
        self.gap_from: int | None = None  # first iteration not (fully) logged, until a collection
        self.overflows = 0
        self.entries = 0
        self.write_seconds = 0.0
        self.errors: list[str] = []
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="tmoe-pp-log", daemon=True)
        self._thread.start()

    def record(self, it: int, mb: int, direction: str, tensor: torch.Tensor) -> None:
        if direction not in DIRECTIONS:
            raise ValueError(f"direction {direction!r} is not one of {DIRECTIONS}")
        self._put(it, entry_name(it, mb, direction), tensor.detach())

    def record_meta(self, it: int, grad_norm: torch.Tensor, loss: torch.Tensor) -> None:
        """The global gradient norm and loss, which a replaying neighbour cannot recompute alone; written after
        the iteration's entries, it marks the iteration complete on this stage."""
        self._put(it, meta_name(it), {"grad_norm": grad_norm.detach().clone(), "loss": loss.detach().clone()})

    def _put(self, it: int, name: str, obj) -> None:
        if self.gap_from is not None and it >= self.gap_from:
            return
        n = _nbytes(obj)
        if self.max_bytes is not None and self.held_bytes + n > self.max_bytes:
            self.gap_from = it
            self.overflows += 1
            log.warning(
                f"event=pp_log_overflow dir={self.dir} iteration={it} held_bytes={self.held_bytes} max_bytes="
                f"{self.max_bytes}: logging stops until the next window commits; a failure needing iteration >= {it} "
                "recovers globally"
            )
            return
        old = self._sizes.get(name, 0)  # a re-logged entry (replay) replaces the old one
        self.held_bytes += n - old
        self._sizes[name] = n
        self.bytes_by_iteration[it] = self.bytes_by_iteration.get(it, 0) + n - old
        self.entries += 1
        self._jobs.put((name, obj, n))

    def _delete(self, drop) -> int:
        self.flush()
        freed = 0
        for p in list(self.dir.iterdir()):
            it = _iteration_of(p.name)
            if it is not None and drop(it):
                n = self._sizes.pop(p.name, 0)
                freed += n
                if it in self.bytes_by_iteration:
                    self.bytes_by_iteration[it] -= n
                p.unlink(missing_ok=True)
        self.held_bytes = max(0, self.held_bytes - freed)
        return freed

    def collect(self, upto: int) -> int:
        """Delete entries of iterations <= upto (their window is superseded). Returns bytes freed."""
        freed = self._delete(lambda i: i <= upto)
        for it in [i for i in self.bytes_by_iteration if i <= upto]:
            del self.bytes_by_iteration[it]
        if self.gap_from is not None and (self.max_bytes is None or self.held_bytes < self.max_bytes):
            log.info("event=pp_log_resume dir=%s held_bytes=%d gap_from=%d", self.dir, self.held_bytes, self.gap_from)
            self.gap_from = None  # the next window starts with a complete log again
        return freed

    def drop_from(self, it: int) -> None:
        """Forget entries of iterations >= it (a recovered stage re-logs them while it replays)."""
        self._delete(lambda i: i >= it)

    def clear(self) -> None:
        self.drop_from(0)
        self.held_bytes = 0

    def flush(self) -> None:
        done = threading.Event()
        self._jobs.put(done)
        done.wait()

    def stats(self) -> dict:
        return {
            "held_bytes": self.held_bytes,
            "max_bytes": self.max_bytes,
            "entries": self.entries,
            "overflows": self.overflows,
            "gap_from": self.gap_from,
            "bytes_per_iteration": max(self.bytes_by_iteration.values(), default=0),
            "write_seconds": round(self.write_seconds, 4),
            "errors": self.errors[-3:],
        }

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if isinstance(job, threading.Event):
                job.set()
                continue
            name, obj, n = job
            t0 = time.perf_counter()
            try:
                tmp = self.dir / (name + ".tmp")
                torch.save({"payload": obj, "nbytes": n}, tmp)  # the copy into host memory
                tmp.rename(self.dir / name)
            except Exception as exc:  # a log that cannot be written is a gap, not a crash
                self.errors.append(f"{name}: {exc}")
                log.warning("event=pp_log_write_failed entry=%s error=%s", name, exc)
            self.write_seconds += time.perf_counter() - t0


class LogReader:
    """Reads another stage's `BoundaryLog` directory (the neighbour's host memory)."""

    def __init__(self, dir: str | os.PathLike):
        self.dir = Path(dir)

    def get(self, it: int, mb: int, direction: str) -> torch.Tensor:
        return self._load(entry_name(it, mb, direction))

    def meta(self, it: int) -> dict:
        return self._load(meta_name(it))

    def has(self, its, mbs: int, direction: str | None) -> bool:
        """Whether every entry (and the per-iteration record) of iterations `its` is there."""
        names = {p.name for p in self.dir.glob("t*.pt")} if self.dir.exists() else set()
        for it in its:
            if meta_name(it) not in names:
                return False
            if direction is not None and any(entry_name(it, m, direction) not in names for m in range(mbs)):
                return False
        return True

    def _load(self, name: str):
        path = self.dir / name
        if not path.exists():
            raise KeyError(f"no logged entry {name} in {self.dir}")
        return torch.load(path, weights_only=True)["payload"]


def _nbytes(obj) -> int:
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    return sum(_nbytes(v) for v in obj.values())


def _file_payload(p: Path) -> int:
    """Logged bytes an entry file accounts for (its tensor bytes, not the file's container overhead)."""
    try:
        return int(torch.load(p, weights_only=True)["nbytes"])
    except Exception:  # unreadable leftovers count by size
        return p.stat().st_size if p.exists() else 0
