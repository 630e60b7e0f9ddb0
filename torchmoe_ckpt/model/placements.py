"""Which DTensor placements the capture handles, checked once at start (issue 44): a placement it cannot capture
is one line naming the fix before the first step, never a traceback inside one.

Handled: `Shard(d)` and `Replicate()` on any number of mesh dimensions (FSDP2, HSDP, tensor parallelism,
expert parallelism). Each rank captures its local shard, and the window records that shard's global offset
(model/operators.py `local_offset`). A replicated dimension (an HSDP replica, a TP-replicated norm) holds the same
values on every rank of that dimension; each rank keeps its own copy.

Refused, on a mesh dimension wider than 1:
- `_StridedShard` (what FSDP2 puts on a dimension that tensor parallelism shards too): its local shard is not one
  block of the global tensor. The windows' global offsets (the DCP items, the dense export, the tensorstore
  format's global arrays) would place it wrongly.
- `Partial` (a pending reduction): not a state that can be restored by value.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..core.errors import ConfigError

__all__ = ["PlacementError", "check_placements"]


class PlacementError(ConfigError):
    """A parameter or buffer with a DTensor placement the capture cannot handle (the module docstring)."""


HANDLED = (Shard, Replicate)  # exact types: _StridedShard derives from Shard in some torch versions


def check_placements(model: nn.Module) -> None:
    """Raise `PlacementError` (one line) for the first parameter or buffer whose placement is not handled. The
    placements are the same on every rank, so every rank raises."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not isinstance(t, DTensor):
            continue
        names = t.device_mesh.mesh_dim_names or tuple(str(i) for i in range(t.device_mesh.ndim))
        for i, (dim, p) in enumerate(zip(names, t.placements)):
            # on a mesh dimension of size 1 every placement is the whole tensor (TorchTitan's TP alone keeps a
            # 1-wide FSDP dimension with a strided shard on it)
            if type(p) in HANDLED or t.device_mesh.size(i) == 1:
                continue
            kind = type(p).__name__
            if kind == "_StridedShard":
                why = (
                    "a strided shard (FSDP2 on a dimension tensor parallelism shards too) is not one block of the "
                    "global tensor, which the windows' global offsets assume"
                )
                fix = "shard each tensor dimension on one mesh dimension only: FSDP2 alone, or tensor parallelism alone"
            else:
                why = "a pending reduction is not a state that can be restored by value"
                fix = "reduce it before training (a parameter or buffer is Shard or Replicate)"
            raise PlacementError(
                f"{name}: DTensor placement {p} on mesh dimension {dim!r} (placements {tuple(t.placements)}) is "
                f"not supported by sparse checkpointing: {why}; fix: {fix}"
            )
