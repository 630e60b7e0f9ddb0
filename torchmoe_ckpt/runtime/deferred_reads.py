"""The checkpointer's own device-to-host reads of each step, off the training stream (`reads_on_copy_stream`).

Why: every device-to-host copy of every stream shares one copy engine. A read the checkpointer queues on the
training stream (the replay record's batch, loss, gradient norm and hyper-parameters per iteration; the
routed-token counts at a window start) waits there behind the slot copy the side stream is running, and everything
the training stream queues after it waits too. On the copy stream the read waits there instead, and nobody waits
for it: the values are read later (the records when their window is persisted, after the slot copies that follow
them on the same stream; the counts at the next window start, after `landed`).

How (CUDA): the device sources are cloned on the training stream first, by kernel (`_foreach_copy_`, one call per
dtype: a multi-tensor kernel, not a device-to-device memcpy that would share the copy engine), so that a caller
reusing its buffers (a batch) or the allocator reusing freed ones cannot change what is read; the copy stream waits
for an event recorded after the clones, copies them into pinned memory non-blocking, and holds the clones until then
(`CopyStream.to_host_after`). Host tensors are passed on as they are (cloned only with `clone_cpu`): one may be a
pinned copy still landing. On a CPU the same calls run (streams are no-ops), equal to the training-stream path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from .device_copy import CopyStream, copy_by_dtype, host_copy

__all__ = ["HostReads"]


class HostReads:
    """Where the checkpointer's per-step reads go: the copy stream of `copier` (`on_copy_stream`) or the training
    stream (non-blocking, as `host_copy`). `copy(tree)` returns host tensors that are filled once `landed()`, an
    event recorded after them where they were queued, is complete (None on a CPU: already filled)."""

    def __init__(self, copier: CopyStream, on_copy_stream: bool):
        self.copier = copier
        self.on_copy_stream = on_copy_stream
        self.reads = 0  # tensors read (stats)

    def copy(self, tree: Any, clone_cpu: bool = False) -> Any:
        """Host copies of every tensor in `tree` (any pytree; other leaves as they are). Host tensors are returned
        as they are, or cloned with `clone_cpu` (the caller may reuse them), as `host_copy` does.

        A host tensor is never read here unless `clone_cpu`: it may be one of our own pinned copies whose
        device-to-host copy is still queued on the copy stream (a replay record's batch), and reading it now would
        read it before it lands. Passed on, it is read where every read of this stream is, after `landed()`."""
        if tree is None:
            return None
        if not self.on_copy_stream:
            out = host_copy(tree_map_only(DTensor, _local, tree), clone_cpu)
            self.reads += sum(torch.is_tensor(x) for x in tree_flatten(tree)[0])
            return out
        leaves, spec = tree_flatten(tree)
        pos = [i for i, x in enumerate(leaves) if torch.is_tensor(x)]
        if not pos:
            return tree
        self.reads += len(pos)
        # A DTensor (the loss under TorchTitan's tensor parallelism) is read as this rank's local tensor, as
        # TorchTitan reduces it: the record is this rank's, and a foreach copy cannot mix it with plain tensors.
        for i in pos:
            leaves[i] = _local(leaves[i])
        on_device = []
        for i in pos:
            if self.copier.on_host(leaves[i]):
                leaves[i] = leaves[i].detach().clone() if clone_cpu else leaves[i].detach()
            else:
                on_device.append(i)
        if on_device:
            srcs = [leaves[i].detach() for i in on_device]
            with torch.no_grad():
                # Cloned by kernel on the training stream, one per dtype (not a device-to-device memcpy, which
                # would share the copy engine with the slot copy): a reused buffer cannot change what is read.
                clones = [torch.empty_like(s, memory_format=torch.contiguous_format) for s in srcs]
                copy_by_dtype(clones, srcs)
            for i, host in zip(on_device, self.copier.to_host_after(clones), strict=True):
                leaves[i] = host
        return tree_unflatten(leaves, spec)

    def landed(self):
        """An event recorded after the reads queued so far, on the stream they went to (None on a CPU)."""
        if not self.copier.cuda:
            return None
        ev = torch.cuda.Event()  # CUDA only
        stream = self.copier.stream if self.on_copy_stream else torch.cuda.current_stream(self.copier.device)
        ev.record(stream)  # CUDA only
        return ev


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
