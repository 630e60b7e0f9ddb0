"""A process group that comes back after a torchrun restart.

Under `torchrun --max-restarts N` every attempt rendezvouses through the same agent store. A plain
`dist.init_process_group("gloo")` in attempt k > 0 sometimes reads the *previous* attempt's peer addresses
from that store (the keys are not namespaced by attempt) and fails with "Gloo connectFullMesh failed ...
Connection refused", about half the time in our runs. Keying the whole group (and every sub-group created
from it, whose keys live under the same prefix) by the attempt number removes the stale keys from view.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["init_process_group", "restart_attempt"]


def restart_attempt() -> int:
    """Which torchrun attempt this process belongs to (0 = the first launch, or not under torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def init_process_group(backend: str | None = None, timeout_s: float = 120.0) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment, safely across restarts, and return
    (rank, world size). Without torchrun's variables it makes a one-process group, so the same script runs
    as `python script.py`. `backend`: default gloo on CPU, nccl when CUDA is available. Idempotent."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = timedelta(seconds=timeout_s)
    if "RANK" not in os.environ:
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        return 0, 1
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = restart_attempt()
    if attempt == 0:
        dist.init_process_group(backend, timeout=timeout)
    else:
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=(rank == 0 and not agent), timeout=timeout, multi_tenant=not agent)
        dist.init_process_group(backend, store=dist.PrefixStore(f"/torchmoe/attempt-{attempt}", store),
                                rank=rank, world_size=world, timeout=timeout)
    return rank, world
