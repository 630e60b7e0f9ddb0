"""torchrun entry (2 ranks, gloo) for tests/model/test_placements.py: each placement on a (2, 1) mesh named
("fsdp", "tp"), through operator discovery; prints one `placement=<case> result=<ok|the refusal>` line per case
on rank 0. A strided shard or a Partial on the 1-wide dimension is the whole tensor and passes; on the 2-wide
one it is refused."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import torchmoe_ckpt as tmc
from torchmoe_ckpt.model.identity import mesh_replicate
from torchmoe_ckpt.model.operators import discover_operators
from torchmoe_ckpt.model.placements import PlacementError

CASES = {
    "shard-shard": (Shard(0), Shard(1)),
    "strided-on-1-wide": (Shard(1), _StridedShard(0, split_factor=2)),
    "strided-on-2-wide": (_StridedShard(0, split_factor=2), Shard(0)),
    "partial-on-1-wide": (Shard(0), Partial()),
    "partial-on-2-wide": (Partial(), Replicate()),
}


def main() -> None:
    rank, _ = tmc.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("fsdp", "tp"))
    for case, placements in CASES.items():
        m = nn.Linear(4, 4, bias=False)
        m.weight = nn.Parameter(DTensor.from_local(torch.randn(2, 4), mesh, placements, run_check=False))
        try:
            discover_operators(m)
            result = f"ok replicate={mesh_replicate(m)}"
        except PlacementError as exc:
            result = str(exc)
        if rank == 0:
            print(f"placement={case} result={result}", flush=True)


if __name__ == "__main__":
    main()
