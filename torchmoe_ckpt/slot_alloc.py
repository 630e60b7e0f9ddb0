"""Which slot-buffer allocator a checkpointer uses: chosen here, once, at construction (slot_pool.py has the
contract every allocator keeps).

* CPU with a host tier: `storage.slot_files.FileSlotPool`, a set is W shared-memory files (the snapshot copy
  is the persist);
* CUDA with a host tier, `host_buffers="auto"` (or `"arena"`, on CPU too): `slot_pool.ArenaSlotPool`, a set is
  one arena (pinned on CUDA), which the host tier copies into its files;
* CUDA with a host tier, `host_buffers="shm-registered"` (opt-in, unmeasured): `FileSlotPool` whose files are
  page-locked with `cudaHostRegister`, so the device-to-host copy lands in the persisted file;
* no host tier: `ArenaSlotPool`, one pinned (CUDA) or plain (CPU) arena per set.
"""

from __future__ import annotations

import torch

from .config import HOST_BUFFERS
from .errors import ConfigError
from .slot_pool import ArenaSlotPool, SlotAllocator
from .storage.slot_files import FileSlotPool


def make_slot_allocator(
    ops: dict, compute_dtype: torch.dtype, cuda: bool, host_tier=None, writer=None, host_buffers: str = "auto"
) -> SlotAllocator:
    """The allocator for a checkpointer (see the table above). `host_tier`: a storage.host_tier.HostTier or None;
    `writer`: its persist thread (sets are reused once it is past them)."""
    if host_buffers not in HOST_BUFFERS:
        raise ConfigError(f"host_buffers {host_buffers!r} is not one of {HOST_BUFFERS}")
    if host_tier is not None and ((not cuda and host_buffers == "auto") or host_buffers == "shm-registered"):
        files = host_tier.slot_files
        if cuda:
            files.register = cuda_host_register  # CUDA only
        return FileSlotPool(files, ops, compute_dtype, writer, pin_fallback=cuda)
    return ArenaSlotPool(ops, compute_dtype, pin_memory=cuda, writer=writer)


def cuda_host_register(t: torch.Tensor):
    """Page-lock the memory of `t` (a shared mapping of a /dev/shm file) for asynchronous device copies; returns
    the undo. CUDA only. An OSError makes the allocator keep that plan's slots in a pinned arena instead."""
    cudart = torch.cuda.cudart()  # CUDA only
    ptr, n = t.data_ptr(), t.numel()
    err = cudart.cudaHostRegister(ptr, n, 0)  # CUDA only: cudaHostRegisterDefault
    if int(err) != 0:
        raise OSError(f"cudaHostRegister of a {n}-byte shared-memory mapping failed (cudaError {int(err)})")
    return lambda: cudart.cudaHostUnregister(ptr)  # CUDA only
