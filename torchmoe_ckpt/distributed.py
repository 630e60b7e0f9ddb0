"""Process groups that come back after a torchrun restart.

Root cause of "Gloo connectFullMesh failed ... Connection refused" (or a hang) in attempt k > 0: with its
default c10d rendezvous, torchrun's agent hosts ONE TCPStore for the whole job and every attempt's workers
use it (`TORCHELASTIC_USE_AGENT_STORE=True`); torch >= 2.5 no longer prefixes the workers' keys by attempt
(`torch.distributed.rendezvous._create_c10d_store`: "we create a new TCPStore for every retry", which the
shared agent store does not do; pytorch/pytorch#135712). So attempt k finds attempt k-1's keys: gloo reads a
dead peer's address before the live peer has overwritten it (refused, or a hang until the init timeout), and
NCCL can read the previous unique id. Every sub-group (`new_group`, DeviceMesh) keeps its keys under the
default group's store, with names from a counter that restarts at 0: the same stale keys again.

`key_rendezvous_by_attempt()` puts the attempt back into the store's key prefix, as torch < 2.5 did, for
every env:// or tcp:// process group this process creates afterwards (TorchTitan's own init_distributed
included) and therefore for every sub-group. `key_groups_by_attempt()` is the late fallback for a default group
created before that (sub-groups created afterwards are keyed). Launching torchrun with
`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (torch's own opt-out: a fresh store per attempt) fixes it too.
"""

from __future__ import annotations

import importlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# `torch.distributed.rendezvous` the attribute is a function that shadows the module of that name.
rdzv = importlib.import_module("torch.distributed.rendezvous")

__all__ = [
    "init_process_group",
    "restart_attempt",
    "key_rendezvous_by_attempt",
    "key_groups_by_attempt",
    "default_group_keyed",
    "attempt_prefix",
    "default_backend",
    "library_group",
]


def restart_attempt() -> int:
    """Which torchrun attempt this process belongs to (0 = the first launch, or not under torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def attempt_prefix() -> str:
    return f"/torchmoe/attempt-{restart_attempt()}"


def _shared_agent_store() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def key_rendezvous_by_attempt() -> None:
    """From now on, every process group created through env:// or tcp:// rendezvous in this process keys its
    store by the torchrun attempt (no effect without torchrun's shared agent store). Idempotent; every rank
    must do the same, which it does when every rank runs the same code."""
    create = rdzv._create_c10d_store
    if getattr(create, "torchmoe_keyed", False):
        return

    def keyed(*args, **kwargs):
        store = create(*args, **kwargs)
        if _shared_agent_store():
            keyed.used = True
            return dist.PrefixStore(attempt_prefix(), store)
        return store

    keyed.torchmoe_keyed = True
    keyed.used = False
    rdzv._create_c10d_store = keyed


_late_keyed: list = []  # the default group keyed by key_groups_by_attempt (pybind stores take no attributes)


def default_group_keyed() -> bool:
    """Whether the default group's keys are this attempt's own: its rendezvous was keyed, it was keyed late,
    or there is no shared agent store (then each attempt has a fresh store). True before any group exists."""
    if not dist.is_initialized() or not _shared_agent_store():
        return True
    return bool(getattr(rdzv._create_c10d_store, "used", False)) or c10d._get_default_group() in _late_keyed


def key_groups_by_attempt() -> bool:
    """For a default group that was created before `key_rendezvous_by_attempt` (TorchTitan's stock entry point
    sets it up before any override module is imported): key every sub-group created from now on by attempt.
    Returns True when it had to (the default group itself was not keyed: its own rendezvous could have read
    the previous attempt's keys). Every rank must call it at the same point, as every rank does."""
    key_rendezvous_by_attempt()
    if default_group_keyed():
        return False
    pg = c10d._get_default_group()
    backend, store = c10d._world.pg_map[pg]
    c10d._world.pg_map[pg] = (backend, dist.PrefixStore(attempt_prefix(), store))
    _late_keyed.append(pg)
    return True


def default_backend() -> str:
    """gloo on CPU. With CUDA: NCCL for CUDA tensors and gloo for CPU tensors in one default group, so the user's
    own CPU collectives (all_gather_object of a small dict, a barrier on CPU) keep working next to NCCL."""
    return "cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo"


def init_process_group(backend: str | None = None, timeout_s: float = 120.0) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment, safely across restarts, and return
    (rank, world size). Without torchrun's variables it makes a one-process group, so the same script runs
    as `python script.py`. `backend`: `default_backend()` (gloo on CPU, "cuda:nccl,cpu:gloo" with CUDA, this
    process's GPU set to LOCAL_RANK first, as NCCL needs). Idempotent."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = backend or default_backend()
    if torch.cuda.is_available():  # CUDA only: one GPU per local rank, chosen before NCCL binds to one
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = timedelta(seconds=timeout_s)
    if "RANK" not in os.environ:
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        return 0, 1
    key_rendezvous_by_attempt()
    dist.init_process_group(backend, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


# ---- the library's own gloo groups ---------------------------------------------------------------------------
# Every collective the library issues itself (window agreements, operator sizes, routed-token sums, recovery's
# gathers) carries a few CPU numbers. On a GPU job the default group -- and any group the user passes -- is
# NCCL, which refuses CPU tensors (and would queue them behind the training's GPU collectives), so the library
# runs them on gloo groups of its own: one over every rank, and one per distinct rank set the caller plans
# over. Created on first use through `new_group`, i.e. keyed under the default group's store exactly like every
# other sub-group (attempt-keyed across torchrun restarts, see above), and again after a new default group.
_owned: dict = {"default": None, "groups": {}}


def library_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """The gloo group over the ranks of `group` (None or the default group: every rank) that the library's own
    collectives run on; never `group` itself. None without a process group. The first call for a rank set is
    collective over its ranks (every library collective is such a point: each member gets there in the same
    order); later calls return the same group until the default group is replaced."""
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
        # A sub-group mirror synchronises only its members (other ranks never come here); its name is hashed from
        # the ranks and the number of groups this process made, the same on members that run the same program.
        groups[ranks] = (
            dist.new_group(backend="gloo")
            if ranks is None
            else dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
        )
    return groups[ranks]
