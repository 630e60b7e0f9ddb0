"""Where a restart's time goes, from the kill to the first trained iteration (issue 17).

Each worker keeps wall-clock marks of its own start (``mark``): the process start (from /proc), TorchTitan's
``main()`` called (every import and our launcher's checks done), the process group ready, the model built
(our checkpoint manager is built after the model, its parallelisation, optimizer and data loader), recovery
done, and the first iteration trained after it. The kill's time comes from the fault injection
(``torchmoe_ckpt.runtime.faults.last_kill_time``), when a fault was injected; a real ``kill -9`` has none, and the
breakdown then starts at the process start. Phases, in seconds:

  agent_restart   kill -> this worker process started (torchrun noticed, stopped the others, spawned anew)
  imports         process start -> TorchTitan's main() (Python, torch, TorchTitan, our launcher's checks)
  process_group   TorchTitan's config parse, init_process_group, device meshes
  model_build     model (meta init, parallelisation, weights), optimizer, LR schedulers, data loader
  recovery        tiers, run identity, the newest window found, loaded and replayed
  first_step      the first iteration trained after the recovery

Rank 0 logs one line ``torchmoe: event=restart_timing attempt=N ...`` after the first trained iteration of a
restarted (or resumed) run. Every rank keeps the values with the absolute marks (``result()``) and, with
``TORCHMOE_TITAN_EXPORT=DIR``, writes them to ``DIR/restart-timing-rank-R-attempt-A.json`` (not into the
recovery report, which is the same on every rank).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from torchtitan.tools.logging import logger

from torchmoe_ckpt.runtime import faults

__all__ = ["mark", "note", "reset", "breakdown", "after_step", "result", "PHASES"]

PHASES = ("agent_restart", "imports", "process_group", "model_build", "recovery", "first_step")
_marks: dict[str, float] = {}
_done = False
_result: dict | None = None
_notes: dict = {}  # facts of this process recorded with the breakdown (note())


def _process_start() -> float | None:
    """This process's start time (epoch seconds), from /proc (Linux; None elsewhere). The start is counted in
    clock ticks since boot, so it is placed on the wall clock through CLOCK_BOOTTIME (/proc/stat's btime is
    whole seconds and drifts)."""
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])  # field 22: start time in clock ticks since boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def reset() -> None:
    """Forget every mark (a standby's child starts a new attempt in a process that already ran the start of
    the first one: titan_integration.standby)."""
    global _done, _result
    _marks.clear()
    _notes.clear()
    _done, _result = False, None


def mark(name: str) -> None:
    """Record the first time this process reached `name` (later calls keep the first)."""
    _marks.setdefault(name, time.time())


def note(**values) -> None:
    """Facts of this process to record with the breakdown (the standby's state: titan_integration.standby)."""
    _notes.update(values)


def breakdown(marks: dict[str, float], kill: float | None) -> dict[str, float | None]:
    """Phases in seconds from absolute marks (missing marks give None; the total runs from the kill if known)."""
    start = marks.get("process_start")
    if kill is not None and (start is None or kill > start):
        kill = None  # a kill after this process started is not the one that restarted it
    chain = [
        ("agent_restart", kill, start),
        ("imports", start, marks.get("titan_main")),
        ("process_group", marks.get("titan_main") or start, marks.get("pg_ready")),
        ("model_build", marks.get("pg_ready"), marks.get("model_built")),
        ("recovery", marks.get("model_built"), marks.get("recovered")),
        ("first_step", marks.get("recovered"), marks.get("first_step")),
    ]
    out: dict[str, float | None] = {
        name: (round(b - a, 3) if a is not None and b is not None else None) for name, a, b in chain
    }
    first, end = kill if kill is not None else start, marks.get("first_step")
    out["total"] = round(end - first, 3) if first is not None and end is not None else None
    out["from"] = "kill" if kill is not None else "process_start"
    return out


def result() -> dict | None:
    """This process's breakdown once its first iteration is trained (phases, ``marks``, ``kill``), else None."""
    return _result


def after_step(report: dict | None, rank: int, attempt: int) -> None:
    """Called after every trained iteration with the recovery report (None: nothing recovered); the first call
    closes the breakdown (cheap afterwards)."""
    global _done, _result
    if _done:
        return
    _done = True
    mark("first_step")
    marks = dict(_marks)
    start = _process_start()
    if start is not None:
        marks["process_start"] = start
    # rank 0 reads the kill time and removes its file (a later failure of another kind must not reuse it)
    kill = faults.last_kill_time(consume=True) if attempt > 0 and rank == 0 else None
    res = breakdown(marks, kill)
    _result = dict(res, attempt=attempt, marks=marks, kill=kill, **_notes)
    out = os.environ.get("TORCHMOE_TITAN_EXPORT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"restart-timing-rank-{rank}-attempt-{attempt}.json").write_text(json.dumps(_result))
    if rank == 0 and (attempt > 0 or report is not None):
        vals = " ".join(f"{k}={'-' if res[k] is None else format(res[k], '.2f')}" for k in (*PHASES, "total"))
        logger.info(
            f"torchmoe: event=restart_timing attempt={attempt} {vals} (seconds, total from the "
            f"{res['from'].replace('_', ' ')} to the first trained iteration)"
        )
