"""`copy_phase="backward"`: a slot's copy issued from the next iteration's backward instead of right after the update.

Why: the forward is where the training stream makes its own small device-to-host reads (a router's `.tolist()`, a
`bincount`, TorchTitan's expert-parallel split sizes); a slot copy running then delays each of them on the shared
copy engine. The backward makes none, so a copy issued when the backward starts overlaps no read of the step.

How: a forward hook on the model's root module puts a gradient hook on its output; the gradient of the output is
the first thing the backward computes, so the hook fires as the backward starts and hands the deferred copy to the
copy thread (`SnapshotEngine.issue`, from whichever thread autograd runs the hook on). The copy still holds the
post-update state of its own iteration: nothing writes the parameters or the optimizer state before the next
update, and the next update waits for the copy first (`SnapshotEngine.wait`, which also issues a copy no backward
issued: an iteration without one, a commit, a flush). Buffers (which the forward may change) are copied or cloned
at capture, as in the default phase.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = ["BackwardTrigger"]


class BackwardTrigger:
    """Calls `issue()` when a backward through `model`'s output starts (at most once per forward that needs a
    gradient; a no-op when nothing is deferred). `close()` removes the hook."""

    def __init__(self, model: nn.Module, issue: Callable[[], None]):
        self._issue = issue
        self.fired = 0
        self._handle = model.register_forward_hook(self._forward_hook)

    def _forward_hook(self, module: nn.Module, args, output) -> None:
        if not torch.is_grad_enabled():
            return
        out = next((t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad), None)
        if out is not None:
            out.register_hook(self._on_backward)

    def _on_backward(self, grad: torch.Tensor) -> None:
        self.fired += 1
        self._issue()

    def close(self) -> None:
        self._handle.remove()
