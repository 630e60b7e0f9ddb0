"""Which slot-buffer allocator a checkpointer uses, chosen once: `FileSlotPool` (W /dev/shm files per set, the
snapshot copy is the persist) on CPU with a host tier, or with `host_buffers="shm-registered"` (files page-locked
with `cudaHostRegister`); else `ArenaSlotPool` (one arena per set, pinned on CUDA).
"""

from __future__ import annotations

import torch

from ..core.errors import ConfigError
from ..core.sparse_config import HOST_BUFFERS
from .file_slot_pool import FileSlotPool
from .slot_pool import ArenaSlotPool, SlotAllocator


def make_slot_allocator(
    ops: dict, compute_dtype: torch.dtype, cuda: bool, host_tier=None, writer=None, host_buffers: str = "auto"
) -> SlotAllocator:
    """`host_tier`: a HostTier or None; `writer`: its persist thread (sets are reused once it is past them)."""
    if host_buffers not in HOST_BUFFERS:
        raise ConfigError(f"host_buffers {host_buffers!r} is not one of {HOST_BUFFERS}")
    if host_tier is not None and ((not cuda and host_buffers == "auto") or host_buffers == "shm-registered"):
        files = host_tier.slot_files
        if cuda:
            files.register = cuda_host_register  # CUDA only
        return FileSlotPool(files, ops, compute_dtype, writer, pin_fallback=cuda)
    return ArenaSlotPool(ops, compute_dtype, pin_memory=cuda, writer=writer)


def cuda_host_register(t: torch.Tensor):
    """Page-lock `t` (a /dev/shm mapping) for asynchronous device copies; returns the undo. CUDA only."""
    cudart = torch.cuda.cudart()  # CUDA only
    ptr, n = t.data_ptr(), t.numel()
    err = cudart.cudaHostRegister(ptr, n, 0)  # pyright: ignore[reportOptionalMemberAccess]  (CUDA: cudaHostRegisterDefault)
    if int(err) != 0:
        raise OSError(f"cudaHostRegister of a {n}-byte shared-memory mapping failed (cudaError {int(err)})")
    return lambda: cudart.cudaHostUnregister(ptr)  # pyright: ignore[reportOptionalMemberAccess]  (CUDA only)
