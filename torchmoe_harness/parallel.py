"""FSDP2/HSDP setup for the harness (CPU + gloo, or CUDA + NCCL; the process group comes from
torchmoe_ckpt.init_process_group), optionally with expert parallelism (the experts left out of FSDP2)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from torchmoe_harness.expert_parallel import WEIGHTS, ExpertDispatch
from torchmoe_harness.model import GroupedExperts, TinyMoE

EXPERT_PARAM_NAMES = WEIGHTS  # ("w1_EFD", "w2_EDF", "w3_EFD")


def build_mesh(world_size: int, replicate: int, device_type: str = "cpu") -> DeviceMesh:
    """1-D mesh for FSDP2, or a (dp_replicate, dp_shard) mesh for HSDP when replicate > 1, on `device_type`
    ("cpu": gloo; "cuda": NCCL, through the default group's backend for that device)."""
    if replicate < 1 or world_size % replicate:
        raise ValueError(f"hsdp replicate degree {replicate} must divide the world size {world_size}")
    if replicate == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp_shard",))
    shape = (replicate, world_size // replicate)
    return init_device_mesh(device_type, shape, mesh_dim_names=("dp_replicate", "dp_shard"))


def _average_over(world: int):
    def hook(p: torch.Tensor) -> None:
        p.grad.div_(world)

    return hook


def apply_expert_parallel(model: TinyMoE, mesh: DeviceMesh, compute_dtype: torch.dtype) -> set[nn.Parameter]:
    """Make each expert weight a DTensor sharded Shard(0) on the expert dim over `mesh` (FSDP2's mesh, so
    clipping and the checkpointer see one mesh): this rank owns experts [rank * E/world, (rank + 1) * E/world)
    whole. Returns them, for `apply_fsdp(ignored=...)`: FSDP2 must never all-gather them."""
    if mesh.ndim != 1:
        raise ValueError(
            "expert_parallel supports plain FSDP2 (hsdp = 1) only: an HSDP mesh would need the "
            "experts replicated over dp_replicate and their gradients all-reduced there"
        )
    world, rank = mesh.size(), mesh.get_local_rank()
    if model.cfg.num_experts % world:
        raise ValueError(
            f"expert_parallel needs num_experts ({model.cfg.num_experts}) divisible by the world "
            f"size ({world}): each rank owns the same number of whole experts"
        )
    dispatch = ExpertDispatch(mesh.get_group(), compute_dtype)
    owned: set[nn.Parameter] = set()
    for mod in model.modules():
        if not isinstance(mod, GroupedExperts):
            continue
        for name in EXPERT_PARAM_NAMES:
            shard = getattr(mod, name).detach().chunk(world, dim=0)[rank].clone()  # init is identical on every rank
            p = nn.Parameter(DTensor.from_local(shard, mesh, [Shard(0)], run_check=False))
            # Every rank's tokens reach an expert through the all_to_all, so its gradient is the sum over ranks'
            # losses: divide by the world size, as FSDP2's reduce-scatter averages the other gradients.
            p.register_post_accumulate_grad_hook(_average_over(world))
            setattr(mod, name, p)
            owned.add(p)
        mod.dispatch = dispatch
    return owned


def apply_fsdp(
    model: TinyMoE, mesh: DeviceMesh, compute_dtype: torch.dtype, ignored: set[nn.Parameter] | None = None
) -> None:
    """fully_shard each block, then the root. Expert tensors shard on the expert dim (Shard(0)) unless
    there are more shard ranks than experts, where they shard on dim 1 (TorchTitan's layout). `ignored`
    parameters (expert parallelism) stay out of FSDP2."""
    shard_size = mesh.size(-1)
    experts = model.cfg.num_experts
    expert_dim = 0 if shard_size <= experts else 1
    expert_params = {id(p) for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in EXPERT_PARAM_NAMES}

    def placement(p: torch.nn.Parameter):
        return Shard(expert_dim) if id(p) in expert_params else Shard(0)

    mp = None
    if compute_dtype != torch.float32:
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    kwargs = dict(mesh=mesh, shard_placement_fn=placement, ignored_params=ignored)
    if mp is not None:
        kwargs["mp_policy"] = mp
    for block in model.layers.values():
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
