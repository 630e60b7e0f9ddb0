"""FSDP2/HSDP setup for the harness (CPU + gloo; the process group comes from torchmoe_ckpt.init_process_group)."""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from torchmoe_harness.model import TinyMoE

EXPERT_PARAM_NAMES = ("w1_EFD", "w2_EDF", "w3_EFD")


def build_mesh(world_size: int, replicate: int) -> DeviceMesh:
    """1-D mesh for FSDP2, or a (dp_replicate, dp_shard) mesh for HSDP when replicate > 1."""
    if replicate < 1 or world_size % replicate:
        raise ValueError(f"hsdp replicate degree {replicate} must divide the world size {world_size}")
    if replicate == 1:
        return init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    return init_device_mesh("cpu", (replicate, world_size // replicate), mesh_dim_names=("dp_replicate", "dp_shard"))


def apply_fsdp(model: TinyMoE, mesh: DeviceMesh, compute_dtype: torch.dtype) -> None:
    """fully_shard each block, then the root. Expert tensors shard on the expert dim (Shard(0)) unless
    there are more shard ranks than experts, where they shard on dim 1 (TorchTitan's layout)."""
    shard_size = mesh.size(-1)
    experts = model.cfg.num_experts
    expert_dim = 0 if shard_size <= experts else 1
    expert_params = {id(p) for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in EXPERT_PARAM_NAMES}

    def placement(p: torch.nn.Parameter):
        return Shard(expert_dim) if id(p) in expert_params else Shard(0)

    mp = None
    if compute_dtype != torch.float32:
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    kwargs = dict(mesh=mesh, shard_placement_fn=placement)
    if mp is not None:
        kwargs["mp_policy"] = mp
    for block in model.layers.values():
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
