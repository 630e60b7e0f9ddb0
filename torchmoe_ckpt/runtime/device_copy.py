"""Device-to-host copies that never make the training thread wait for the device, in one place.

`host_copy` queues each CUDA tensor's copy into pinned memory and returns at once (replay records: read only
after the window's slot copies, which run after it, are done). `CopyStream` orders and times the slot copies: a
CUDA side stream after the optimizer step's event, which the next update waits for on the device; on CPU the
same calls copy on the copy thread, so the engine has one code path. CUDA-only lines are marked.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
from torch.utils._pytree import tree_map

__all__ = ["CopyStream", "copy_by_dtype", "host_copy"]


def _to_host(t: torch.Tensor, clone_cpu: bool) -> torch.Tensor:
    t = t.detach()
    if t.device.type == "cpu":
        return t.clone() if clone_cpu else t
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)  # CUDA only
    out.copy_(t, non_blocking=True)  # CUDA only: queued on the current stream, no wait
    return out


def host_copy(tree, clone_cpu: bool = False):
    """Host copies of every tensor in `tree` (a tensor or any pytree); other leaves as they are. CPU tensors are
    returned as they are, or cloned with `clone_cpu` (the caller may reuse their storage)."""
    return tree_map(lambda x: _to_host(x, clone_cpu) if torch.is_tensor(x) else x, tree)


def copy_by_dtype(dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool = False) -> int:
    """`dst.copy_(src)` for each pair, as one `_foreach_copy_` per (source dtype, destination dtype) group, in the
    pairs' order within a group; returns the number of calls.

    Why grouped: until pytorch#173531 (Jan 2026) the CUDA fast path of `_foreach_copy_` checked only that the
    sources share a dtype and then dispatched on the first destination's, so fp32 written into bf16 destinations
    overran them, silently. With the fix a mixed call takes the slow path, one launch per pair. One dtype pair per
    call is a single multi-tensor kernel on every version."""
    groups: dict[tuple[torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for d, s in zip(dsts, srcs, strict=True):
        ds, ss = groups.setdefault((s.dtype, d.dtype), ([], []))
        ds.append(d)
        ss.append(s)
    for ds, ss in groups.values():
        torch._foreach_copy_(ds, ss, non_blocking=non_blocking)  # pyright: ignore[reportPrivateImportUsage]  (torch private)
    return len(groups)


class CopyStream:
    """Ordering and timing of the slot copies, for `device` (a CUDA device: side stream + events; else CPU)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        # CUDA only: created on the model's device, not on whichever device is current.
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None

    def on_host(self, t: torch.Tensor) -> bool:
        """Whether `t` is in host memory already (no device-to-host copy needed). A seam: a test's stand-in for a
        CUDA copy stream treats a CPU tensor as a device one."""
        return t.device.type == "cpu"

    def to_host_after(self, clones: list[torch.Tensor]) -> list[torch.Tensor]:
        """Pinned host copies of `clones` (device tensors), queued on the side stream after an event recorded now
        on the training stream, each clone held until it is copied; the copies are filled once an event recorded
        after them on the side stream is complete. On CPU there is nothing to copy: `clones` as they are."""
        if not self.cuda:
            return clones
        ready = self.mark_ready()
        outs = []
        with self.context():
            self.stream.wait_event(ready)  # pyright: ignore[reportOptionalMemberAccess, reportArgumentType]  (CUDA: both exist)
            for c in clones:
                c.record_stream(self.stream)  # pyright: ignore[reportArgumentType]  (held until copied)
                o = torch.empty(c.shape, dtype=c.dtype, device="cpu", pin_memory=True)
                o.copy_(c, non_blocking=True)
                outs.append(o)
        return outs

    def mark_ready(self):
        """Right after the optimizer step: a point the copy must come after (a CUDA event; None on CPU)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()  # CUDA only
        ev.record(torch.cuda.current_stream(self.device))  # CUDA only
        return ev

    def order_after(self, end) -> None:
        """The training stream waits on the device for the copy's end (on CPU it is already finished)."""
        if self.cuda and end is not None:
            torch.cuda.current_stream(self.device).wait_event(end)  # CUDA only

    def bind_thread(self) -> None:
        """Call first in the copy thread: CUDA calls there use the model's device, not device 0."""
        if self.cuda:
            torch.cuda.set_device(self.device)  # CUDA only

    def context(self):
        return torch.cuda.stream(self.stream) if self.cuda else nullcontext()  # CUDA only: the side stream

    def begin(self, ready):
        """Start of one copy: on CUDA the side stream waits for `ready`, then a timing event; on CPU a clock."""
        if self.cuda:
            self.stream.wait_event(ready)  # pyright: ignore[reportOptionalMemberAccess]  (CUDA: the side stream exists)
        return self.end()

    def end(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)  # CUDA only
        ev.record(self.stream)  # CUDA only
        return ev

    def finish(self, start, end) -> float:
        """Block this (copy) thread until the copy is done; returns its seconds (the copy alone)."""
        if not self.cuda:
            return end - start
        end.synchronize()  # CUDA only
        return start.elapsed_time(end) / 1e3  # CUDA only
