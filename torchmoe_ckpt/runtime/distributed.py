"""Process groups that come back after a torchrun restart, and after a host is replaced.

torchrun's agent hosts one TCPStore for the whole job (`TORCHELASTIC_USE_AGENT_STORE=True`) and torch >= 2.5 no
longer prefixes the workers' keys by round (pytorch/pytorch#135712), so a restarted round reads the previous
round's keys (gloo "connectFullMesh failed ... Connection refused", or a hang). TORCHELASTIC_RESTART_COUNT is no
fix (each agent counts its own restarts). `key_rendezvous_by_attempt()` gives each rendezvous a store of its own
round: rank 0 starts a fresh TCPStore and advertises "port nonce" in the agent's store; the others connect and
accept it only if it holds that nonce. `key_groups_by_attempt()` is the late fallback for a default group created
before that. `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` is still needed when the rank-0 host survives and a new host
joins (torch 2.13): `init_process_group` says so once on multi-host jobs.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from contextlib import suppress
from datetime import timedelta
from typing import ParamSpec, TypeVar, cast

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..core.errors import TorchmoeError

# The C++ stores, which torch.distributed re-exports without naming them in its __all__.
Store = dist.Store  # pyright: ignore[reportPrivateImportUsage]
TCPStore = dist.TCPStore  # pyright: ignore[reportPrivateImportUsage]
PrefixStore = dist.PrefixStore  # pyright: ignore[reportPrivateImportUsage]
HashStore = dist.HashStore  # pyright: ignore[reportPrivateImportUsage]

# `torch.distributed.rendezvous` the attribute is a function that shadows the module of that name.
rdzv = importlib.import_module("torch.distributed.rendezvous")

log = logging.getLogger("torchmoe_ckpt.distributed")

__all__ = [
    "init_process_group",
    "restart_attempt",
    "note_restarts",
    "refusal_notes_restarts",
    "key_rendezvous_by_attempt",
    "key_groups_by_attempt",
    "default_group_keyed",
    "default_backend",
    "library_group",
    "library_new_group",
    "default_group_timeout",
]

ROUND_STORE_KEY = "/torchmoe/round-store"  # in the agent's store: "<port> <nonce>" of a round's own store
_NONCE_KEY = "/torchmoe/round-nonce"  # in a round's own store: the nonce its advertisement names
_rendezvous_count = itertools.count()  # process groups rendezvoused by this process (the same on every rank)


def restart_attempt() -> int:
    """How often this host's torchrun agent restarted its workers (0: the first launch, or not under torchrun).
    Per agent: a host that joined later counts from 0."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def note_restarts(exc: BaseException, rank: int) -> None:
    """A refused start under torchrun: torchrun restarts a failed worker `--max-restarts` times, so the same
    refusal would appear that many times more in one log, each looking like a new failure. Say it in the refusal
    itself (its message, and `exc.restarts_left`) and in one `event=start_refused` line. A worker cannot end the
    job instead: every non-zero exit is a failure torchrun restarts, and some refusals do go away (another job's
    store lease expires). Not under torchrun, or already noted: nothing."""
    max_restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS")
    if not isinstance(exc, TorchmoeError) or exc.restarts_left is not None or not (max_restarts or "").isdigit():
        return
    attempt = restart_attempt()
    left = max(0, int(max_restarts or 0) - attempt)
    exc.restarts_left = left
    said = (
        f"torchrun (--max-restarts {max_restarts}) will start this job {left} more time(s) and, unless the cause "
        "goes away by itself, each start refuses the same way: fix it and relaunch, or stop the job now"
        if left
        else f"torchrun's restarts are used up (--max-restarts {max_restarts}): the job ends here"
    )
    if exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}; {said}", *exc.args[1:])
    log.error(
        "event=start_refused rank=%d attempt=%d restarts_left=%d error=%s",
        rank,
        attempt,
        left,
        type(exc).__name__,
    )


_P = ParamSpec("_P")
_R = TypeVar("_R")


def refusal_notes_restarts(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """`fn` (a start: `Checkpointer(...)`, `startup.start`) refusing with a TorchmoeError says that torchrun will
    repeat the refusal (`note_restarts`)."""

    @functools.wraps(fn)
    def noted(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(*args, **kwargs)
        except TorchmoeError as exc:
            note_restarts(exc, dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0")))
            raise

    return noted


def _shared_agent_store() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def round_store(agent_store: Store, host: str, rank: int, world_size: int, timeout: timedelta, seq: int = 0) -> Store:
    """A store that holds only this rendezvous round's keys, found through `agent_store` (module doc). Collective
    in effect. `seq`: which rendezvous of this process it is (the same on every rank), so each gets its own."""
    key = f"{ROUND_STORE_KEY}/{seq}"
    if rank == 0:
        store = TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        nonce = uuid.uuid4().hex
        store.set(_NONCE_KEY, nonce)
        agent_store.set(key, f"{store.port} {nonce}")
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        port, nonce = agent_store.get(key).decode().split()
        with suppress(OSError, RuntimeError):  # DistStoreError / DistNetworkError are RuntimeErrors
            socket.create_connection((host, int(port)), timeout=2.0).close()  # refused at once when the server is gone
            store = TCPStore(host, int(port), world_size, is_master=False, timeout=timedelta(seconds=5))
            if store.check([_NONCE_KEY]) and store.get(_NONCE_KEY).decode() == nonce:
                store.set_timeout(timeout)
                return store
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"rank {rank}: no store of this rendezvous round was advertised under {key!r} within "
                f"{timeout.total_seconds():.0f} s (rank 0 of the round never started, or its host cannot be "
                f"reached at {host})"
            )
        time.sleep(0.1)


def key_rendezvous_by_attempt() -> None:
    """From now on, every process group created through env:// or tcp:// rendezvous gets a store of its own round
    (only with torchrun's shared agent store). Idempotent; every rank must do the same."""
    create = rdzv._create_c10d_store
    if getattr(create, "torchmoe_keyed", False):
        return

    def keyed(hostname, port, rank, world_size, timeout, *args, **kwargs):
        store = create(hostname, port, rank, world_size, timeout, *args, **kwargs)
        if _shared_agent_store():
            keyed.used = True
            return round_store(store, hostname, rank, world_size, timeout, next(_rendezvous_count))
        return store

    keyed.torchmoe_keyed = True
    keyed.used = False
    rdzv._create_c10d_store = keyed  # pyright: ignore[reportAttributeAccessIssue]  (torch's private store hook)


_late_keyed: list = []  # the default group keyed by key_groups_by_attempt (pybind stores take no attributes)


def default_group_keyed() -> bool:
    """Whether the default group's keys are this round's own (round store, keyed late, or no shared agent store).
    True before any group exists."""
    if not dist.is_initialized() or not _shared_agent_store():
        return True
    return bool(getattr(rdzv._create_c10d_store, "used", False)) or c10d._get_default_group() in _late_keyed


def key_groups_by_attempt() -> bool:
    """For a default group created before `key_rendezvous_by_attempt` (TorchTitan's stock entry point): key every
    later sub-group by a prefix the round's ranks agree on (rank 0's nonce, broadcast). Returns True when it had
    to. Every rank must call it at the same point."""
    key_rendezvous_by_attempt()
    if default_group_keyed():
        return False
    pg = c10d._get_default_group()
    nonce = [uuid.uuid4().hex]
    # On the default group itself: its store may hold an earlier round's keys, so a new group could not be trusted.
    dist.broadcast_object_list(nonce, src=0)
    backend, store = c10d._world.pg_map[pg]
    c10d._world.pg_map[pg] = (backend, PrefixStore(f"/torchmoe/round-{nonce[0]}", store))
    _late_keyed.append(pg)
    return True


def default_backend() -> str:
    """gloo on CPU; with CUDA, NCCL for CUDA tensors and gloo for CPU tensors (the user's CPU collectives work)."""
    return "cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo"


def _warn_shared_store_multi_host() -> None:
    if _shared_agent_store() and int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1 and dist.get_rank() == 0:
        log.warning(
            "event=rendezvous_note: torchrun shares its agent store with the workers (the default); a host "
            "that replaces a lost one at a non-zero node rank while node rank 0 survives cannot join in "
            "torch 2.13 (the new agent waits 60 s for the store address inside torchrun and exits); fix: "
            "launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every host"
        )


def init_process_group(backend: str | None = None, timeout_s: float = 120.0) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment, safely across restarts. Idempotent.

    Args:
        backend: the process group's backend (default: `default_backend()`).
        timeout_s: the process group's timeout; the library's own gloo groups take the same.

    Returns:
        (rank, world size); without torchrun, (0, 1) on a one-process group.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = backend or default_backend()
    if torch.cuda.is_available():  # CUDA only: one GPU per local rank, chosen before NCCL binds to one
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = timedelta(seconds=timeout_s)
    if "RANK" not in os.environ:
        dist.init_process_group(backend, store=HashStore(), rank=0, world_size=1, timeout=timeout)
        return 0, 1
    key_rendezvous_by_attempt()
    dist.init_process_group(backend, timeout=timeout)
    _warn_shared_store_multi_host()
    return dist.get_rank(), dist.get_world_size()


def default_group_timeout() -> timedelta | None:
    """The timeout the user gave the default process group (`init_process_group(timeout=...)`; torch's defaults
    otherwise), read from its backend, the device one (NCCL) first; None without a process group."""
    if not dist.is_initialized():
        return None
    pg = c10d._get_default_group()
    for device in sorted(pg._device_types, key=lambda d: d.type == "cpu"):
        with suppress(Exception):  # a backend without options (a fake or custom one): try the next
            return pg._get_backend(device).options._timeout
    return None


def library_new_group(ranks: list[int] | None = None, **kwargs) -> dist.ProcessGroup:
    """A gloo group of the library's own, with the default group's timeout: every collective the library issues
    (recovery's agreement, peer copies, exports) ends when the user's own collectives would, never later.
    Collective over `ranks` (all ranks when None), like `dist.new_group`."""
    group = dist.new_group(ranks, timeout=default_group_timeout(), backend="gloo", **kwargs)
    return cast(dist.ProcessGroup, group)  # a group, not NON_GROUP_MEMBER: only its members call this


# The library's own collectives carry a few CPU numbers; on a GPU job the default group is NCCL, which refuses
# CPU tensors, so they run on gloo groups of the library's own (one per rank set), made again after a new default.
_owned: dict = {"default": None, "groups": {}}


def library_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """The gloo group over the ranks of `group` (None: every rank) for the library's own collectives; None without
    a process group. The first call for a rank set is collective over its ranks."""
    if not dist.is_initialized():
        return None
    default = c10d._get_default_group()
    if _owned["default"] is not default:
        _owned["default"], _owned["groups"] = default, {}
    ranks = None if group is None or group is default else tuple(dist.get_process_group_ranks(group))
    if ranks is not None and len(ranks) == dist.get_world_size():
        ranks = None
    groups = _owned["groups"]
    if ranks not in groups:
        # A sub-group mirror synchronises only its members (other ranks never come here).
        groups[ranks] = (
            library_new_group() if ranks is None else library_new_group(list(ranks), use_local_synchronization=True)
        )
    return groups[ranks]
