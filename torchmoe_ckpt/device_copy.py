"""Device-to-host copies that never make the training thread wait for the device, in one place.

On a GPU the training thread only *queues* work; every `.cpu()`, `.item()` or blocking copy would stall it until
the GPU caught up. So:

- `host_copy(tree)` queues each CUDA tensor's copy into pinned host memory on the current stream and returns the
  host tensors at once (the replay log's batch, loss and gradient norm). They hold their values once the device
  has passed that point of the stream: the slot copy of the same iteration runs after it on the side stream, and a
  window is committed (and persisted) only once its slot copies are done, so a record is read only after that.
- `CopyStream` is where slot copies run: a CUDA side stream ordered after the optimizer step by an event, timed
  with CUDA events (the copy alone, not the wait for the update), which the next update waits for on the device.
  On CPU the same calls run the copy on the copy thread itself and time it with `perf_counter`, so the copy
  engine has one code path and CPU tests run it. The CUDA-only lines are marked.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
from torch.utils._pytree import tree_map

__all__ = ["CopyStream", "host_copy"]


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


class CopyStream:
    """Ordering and timing of the slot copies, for `device` (a CUDA device: side stream + events; else CPU)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        # CUDA only: created on the model's device, not on whichever device is current.
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None

    # -- training thread --
    def mark_ready(self):
        """Right after the optimizer step: a point the copy must come after (CUDA event; None on CPU, where the
        copy thread runs only once capture() hands it the job)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()  # CUDA only
        ev.record(torch.cuda.current_stream(self.device))  # CUDA only
        return ev

    def order_after(self, end) -> None:
        """The next update must not overwrite what a copy still reads: on CUDA the training stream waits for the
        copy's end event on the device (the host goes on); on CPU the copy is already finished here."""
        if self.cuda and end is not None:
            torch.cuda.current_stream(self.device).wait_event(end)  # CUDA only

    # -- copy thread --
    def bind_thread(self) -> None:
        """Call first in the copy thread: CUDA calls there use the model's device, not device 0."""
        if self.cuda:
            torch.cuda.set_device(self.device)  # CUDA only

    def context(self):
        return torch.cuda.stream(self.stream) if self.cuda else nullcontext()  # CUDA only: the side stream

    def begin(self, ready):
        """Start of one copy: on CUDA the side stream waits for `ready`, then a timing event; on CPU a clock."""
        if not self.cuda:
            return time.perf_counter()
        self.stream.wait_event(ready)  # CUDA only
        ev = torch.cuda.Event(enable_timing=True)  # CUDA only
        ev.record(self.stream)  # CUDA only
        return ev

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
