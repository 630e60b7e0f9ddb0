"""The checkpointer's own device-to-host reads of each step, off the training stream (`reads_on_copy_stream`).

Why: every device-to-host copy of every stream shares one copy engine. A read the checkpointer queues on the
training stream (the replay record's batch, loss, gradient norm and hyper-parameters per iteration; the
routed-token counts at a window start) waits there behind the slot copy the side stream is running, and everything
the training stream queues after it waits too. On the copy stream the read waits there instead, and nobody waits
for it: the values are read later (the records when their window is persisted, after the slot copies that follow
them on the same stream; the counts at the next window start, after `landed`).

How (CUDA): the sources are cloned on the training stream first, device to device (`_foreach_copy_`: not a
device-to-host copy, so not behind the slot's; whether a kernel or an engine runs it is the GPU check's to show), so
that a caller reusing its buffers (a batch) or the allocator reusing freed ones cannot change what is read; the copy
stream waits for an event recorded after the clones, copies them into pinned memory non-blocking, and holds the
clones until then (`record_stream`). On a CPU the same calls run (streams are no-ops): the clones are the host
copies, equal to what the training-stream path returns.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from .device_copy import CopyStream, host_copy

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
        """Host copies of every tensor in `tree` (any pytree; other leaves as they are). `clone_cpu`: CPU tensors
        are cloned (the caller may reuse them); on the copy-stream path every tensor is cloned first anyway."""
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
        srcs = [_local(leaves[i]).detach() for i in pos]
        with torch.no_grad():
            clones = [torch.empty_like(s, memory_format=torch.contiguous_format) for s in srcs]
            torch._foreach_copy_(clones, srcs)  # pyright: ignore[reportPrivateImportUsage]  (device to device on CUDA)
        if self.copier.cuda:  # CUDA only: the pinned copies on the side stream, after the clones
            ready = self.copier.mark_ready()
            with self.copier.context():
                self.copier.stream.wait_event(ready)  # pyright: ignore[reportOptionalMemberAccess, reportArgumentType]  (CUDA: both exist)
                outs = []
                for c in clones:
                    if c.device.type == "cpu":
                        outs.append(c)
                        continue
                    c.record_stream(self.copier.stream)  # pyright: ignore[reportArgumentType]  (held until copied)
                    o = torch.empty(c.shape, dtype=c.dtype, device="cpu", pin_memory=True)
                    o.copy_(c, non_blocking=True)
                    outs.append(o)
            clones = outs
        for i, c in zip(pos, clones):
            leaves[i] = c
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
