"""Fault injection at named points of training and checkpointing, off unless configured.

    TORCHMOE_FAULT="kill:point=upload:rank=1:step=7;kill:point=forward:rank=0:step=7"   (or `arm(...)`)

`<action>:key=value:...`, `;`-separated. action: kill (SIGKILL) | freeze (SIGSTOP); point: one of POINTS;
rank (default 0); step: first iteration it fires at (default 1); attempt: the torchrun attempt it fires in
(default 0). A fault fires once; with TORCHMOE_FAULT_STATE=<dir> once per job (a marker file per fault, `attempt`
ignored). The kill's time is also left in torchrun's log folder (`last_kill_time()`) to measure the restart.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from contextlib import suppress
from dataclasses import dataclass

log = logging.getLogger("torchmoe_ckpt.faults")
POINTS = tuple("forward backward optimizer snapshot_copy persist manifest replication upload recovery".split())
ACTIONS = {"kill": signal.SIGKILL, "freeze": signal.SIGSTOP}


@dataclass
class Fault:
    action: str
    point: str
    rank: int = 0
    step: int = 1
    attempt: int = 0
    fired: bool = False


def parse(text: str | None) -> list[Fault]:
    out = []
    for part in filter(None, (p.strip() for p in (text or "").split(";"))):
        action, *fields = part.split(":")
        kv = dict(f.split("=", 1) for f in fields if "=" in f)
        bad = [f for f in fields if "=" not in f] + sorted(set(kv) - {"point", "rank", "step", "attempt"})
        if action not in ACTIONS or kv.get("point") not in POINTS or bad:
            raise ValueError(
                f"bad fault {part!r}: use <{'|'.join(ACTIONS)}>:point=<{'|'.join(POINTS)}>"
                f"[:rank=R][:step=S][:attempt=A]"
            )
        out.append(
            Fault(action, kv["point"], int(kv.get("rank", 0)), int(kv.get("step", 1)), int(kv.get("attempt", 0)))
        )
    return out


_faults: list[Fault] = parse(os.environ.get("TORCHMOE_FAULT"))
_iteration = 0


def arm(faults: list[Fault] | str) -> None:
    global _faults
    _faults = parse(faults) if isinstance(faults, str) else list(faults)


def set_iteration(step: int) -> None:
    """The training loop says which iteration runs now (faults with `step` fire from it on)."""
    global _iteration
    _iteration = step


def point(name: str) -> None:
    if not _faults:
        return
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    state = os.environ.get("TORCHMOE_FAULT_STATE")
    for i, f in enumerate(_faults):
        if f.fired or f.point != name or f.rank != rank or _iteration < f.step or (not state and f.attempt != attempt):
            continue
        f.fired = True
        if state:
            os.makedirs(state, exist_ok=True)  # a missing marker folder must not make the fault silently not fire
            try:
                os.close(os.open(os.path.join(state, f"fault-{i}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                continue  # fired in an earlier attempt of this job
        # One line on stderr first: the test summary and the user see what was injected where.
        now = time.time()
        print(
            f"event=fault_injected action={f.action} point={name} rank={rank} iteration={_iteration} "
            f"attempt={attempt} time={now:.3f}",
            file=sys.stderr,
            flush=True,
        )
        if path := _kill_time_file():
            with suppress(OSError), open(path, "w") as fh:  # only a measurement is lost
                fh.write(f"{now:.6f}")
        os.kill(os.getpid(), ACTIONS[f.action])


def _kill_time_file() -> str | None:
    """In torchrun's own log folder of this job (error file: <job>/attempt_K/<rank>/error.json), which every
    attempt shares and torchrun already leaves behind; None outside torchrun."""
    attempt_dir = os.path.dirname(os.path.dirname(os.environ.get("TORCHELASTIC_ERROR_FILE", "")))
    if not os.path.basename(attempt_dir).startswith("attempt_"):
        return None  # not torchrun's layout: leave nothing anywhere
    return os.path.join(os.path.dirname(attempt_dir), "torchmoe-last-kill.time")


def last_kill_time(consume: bool = False) -> float | None:
    """Wall-clock time of the newest fault injected in this torchrun job (None if none); `consume` removes it."""
    path = _kill_time_file()
    try:
        with open(path) as fh:  # type: ignore[arg-type]
            t = float(fh.read())
        if consume:
            os.unlink(path)  # type: ignore[arg-type]
        return t
    except (OSError, TypeError, ValueError):
        return None
