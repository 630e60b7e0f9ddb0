"""Agreement across ranks: a failure on any rank fails every rank (DCP's `_DistWrapper` idea).

A step that can fail on one rank (a load, a replay, a check) is run on every rank with `run_everywhere`: each
rank tries it, then every rank learns every rank's reason, and all of them take the same branch (a rank that went
on alone would hang its peers at the next collective). Every collective here runs on the library's gloo group
(`distributed.library_group`) and is a no-op without a process group.

A failed collective (a peer frozen or gone past the process group's timeout, `core.errors.is_collective_failure`)
is never agreed on: agreeing would wait once more for the same peer, so it is re-raised and ends the step (the
watchdog exits the process).

Call order (every rank, same order): `attempt(fn)` (local) -> `gather_failures(why)` (collective), or both in one
`run_everywhere(fn)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from ..core.errors import is_collective_failure
from .distributed import library_group

__all__ = [
    "all_gather_objects",
    "all_ok",
    "attempt",
    "failure_reason",
    "gather_failures",
    "reduce_float",
    "reduce_float_on",
    "run_everywhere",
]

T = TypeVar("T")
R = TypeVar("R")  # a failure's reason: the text of `failure_reason`, or a typed record of the caller's (it pickles)


def all_gather_objects(obj: object, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's `obj`, by rank (a one-element list without a process group). Collective over `group`'s ranks
    (None: every rank), on the library's gloo group."""
    if not dist.is_initialized():
        return [obj]
    gloo = library_group(group)
    out: list = [None] * dist.get_world_size(gloo)
    dist.all_gather_object(out, obj, group=gloo)
    return out


def reduce_float(value: float, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None = None) -> float:
    """`value` reduced with `op` (e.g. `dist.ReduceOp.MIN`) over `group`'s ranks (None: every rank); `value` itself
    without a process group. Collective."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op, group=library_group(group))
    return float(t.item())


def reduce_float_on(value: float, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None) -> float:
    """`value` reduced with `op` over exactly `group`, a gloo group its caller owns (the peer tier's, used from the
    persist thread: the library's shared gloo group belongs to the training thread, and two threads' collectives
    on one group would interleave). `value` itself without a process group or without `group`. Collective."""
    if not dist.is_initialized() or group is None:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op, group=group)
    return float(t.item())


def failure_reason(exc: BaseException) -> str:
    """ "TypeName: first line of the message" (never cut within the line: its end is often its point)."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


def attempt(
    fn: Callable[..., T], *args: object, reason: Callable[[BaseException], R] = failure_reason
) -> tuple[T | None, R | None]:
    """This rank's part (local, no collective): `(fn(*args), None)`, or `(None, reason(exc))` for every exception
    but a process exit and a failed collective (both re-raised)."""
    try:
        return fn(*args), None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if is_collective_failure(exc):
            raise
        return None, reason(exc)


def gather_failures(why: R | None, group: dist.ProcessGroup | None = None) -> dict[int, R]:
    """Every rank's reason, by rank: {} when no rank failed (`why` None everywhere). Collective."""
    return {r: w for r, w in enumerate(all_gather_objects(why, group)) if w is not None}


def run_everywhere(
    fn: Callable[..., T], *args: object, reason: Callable[[BaseException], R] = failure_reason
) -> tuple[T | None, dict[int, R]]:
    """`fn(*args)` on this rank, then the agreement: (its result, every failed rank's reason). The reasons are the
    same on every rank, so `if failures:` takes the same branch everywhere. Collective (every rank calls it)."""
    result, why = attempt(fn, *args, reason=reason)
    return result, gather_failures(why)


def all_ok(ok: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank when `ok` is True on every rank, else False on every rank. Collective."""
    return all(all_gather_objects(bool(ok), group))
