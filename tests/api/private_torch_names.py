"""Every private torch name the library (torchmoe_ckpt/) touches, why, and the torch versions it was checked on.

tests/api/test_private_torch_names.py scans the library's source and fails on a private name that is not here, and
on an entry here that the library no longer touches. A key is either a path from torch (`torch.x._y`, cut after
its last private part) or `._name`: a private attribute of an object whose type the source does not name (a
DTensor, a process group, a planner), with `of` saying whose it is. `required`: used without a guard (no
`hasattr`/`getattr` default, no `try`), so the path must exist in every torch in CHECKED_ON. `absent_in`: torch
versions that lack it, where the library takes its guarded fallback; `cuda_only`: absent from CPU builds.

Upgrading torch: run that test on the new version; for each entry, check the name still means what `why` says
(its source in torch, not only that it exists), then add the version to CHECKED_ON.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Private:
    why: str  # what the library needs it for, and why no public API does
    of: str = "torch"  # whose name it is
    required: bool = True  # False: behind a guard, with a fallback
    absent_in: tuple[str, ...] = ()  # torch versions without it (the fallback runs there)
    cuda_only: bool = False  # only in CUDA builds of torch (absent from the CPU wheel)


# torch version (major.minor) -> how the list was checked on it
CHECKED_ON: dict[str, str] = {
    "2.13": "this test, on the CPU build `make setup` installs (2.13.0)",
    "2.11": (
        "the GPU image's torch: the library's suite runs there (docs/gpu.md), so every required entry imports and "
        "runs; this test itself was written in a session without a GPU machine: run it there once and correct "
        "`absent_in` where it says so"
    ),
}

PRIVATE_NAMES: dict[str, Private] = {
    # ---- batched copies --------------------------------------------------------------------------------------
    "torch._foreach_copy_": Private(
        "one call copies a whole slot's tensors (one GIL release, one kernel launch list on CUDA); there is no "
        "public batched copy, and per-tensor copy_ contends for the GIL with training (capture/snapshot.py)"
    ),
    "torch.utils._pytree": Private(
        "tree_map/tree_flatten over a batch or a replay record of any nesting; torch.utils._pytree is what "
        "torch.compile, DCP and FSDP use themselves, and torch has no public pytree module"
    ),
    # ---- process groups and rendezvous -----------------------------------------------------------------------
    "torch.distributed.distributed_c10d._get_default_group": Private(
        "the default ProcessGroup object itself (its backend's timeout, its store, whether it was re-keyed); "
        "dist.group.WORLD is the same object but typed as a placeholder"
    ),
    "torch.distributed.distributed_c10d._world": Private(
        "pg_map: the store of the default group is wrapped in a PrefixStore per restart round, so a restarted "
        "job's sub-groups do not read the dead attempt's keys (docs/torchtitan.md, rendezvous keys); no public "
        "API sets a group's store"
    ),
    "torch.distributed.rendezvous._create_c10d_store": Private(
        "wrapped so that every env:// / tcp:// rendezvous gets a store keyed by the restart attempt (torch >= 2.5 "
        "stopped prefixing keys by attempt, pytorch/pytorch#135712); the hook is the one place all groups pass"
    ),
    "torch.distributed.distributed_c10d._abort_process_group": Private(
        "the watchdog aborts every group before exiting so a peer blocked in gloo/NCCL returns at once; behind "
        "getattr, with ProcessGroup.abort() as the fallback (runtime/watchdog.py)",
        required=False,
    ),
    "._device_types": Private(
        "the devices a group has backends for (cuda, cpu), to read the NCCL one's timeout first",
        of="torch.distributed.ProcessGroup",
    ),
    "._get_backend": Private(
        "the backend behind a group for one device, to read its configured timeout (no public getter); behind "
        "suppress(Exception): a fake or custom backend gives None",
        of="torch.distributed.ProcessGroup",
        required=False,
    ),
    "._timeout": Private(
        "the timeout a backend's options hold (the process-group timeout the watchdog's bound must stay below)",
        of="torch.distributed backend options (ProcessGroupGloo.Options, ProcessGroupNCCL.Options)",
        required=False,
    ),
    # ---- DTensor and FSDP2 -----------------------------------------------------------------------------------
    "._local_tensor": Private(
        "this rank's shard of a DTensor without building a new tensor (to_local() may return a view that "
        "autograd tracks; the snapshot and the copy path need the storage itself, by data_ptr)",
        of="torch.distributed.tensor.DTensor",
    ),
    "torch.distributed.tensor._utils": Private(
        "compute_local_shape_and_global_offset: where this rank's shard sits in the global tensor, the same "
        "function DCP uses for its chunk metadata, so slot chunks line up with DCP's"
    ),
    "torch.distributed.tensor._random": Private(
        "older torch versions keep DTensor's RNG tracker states apart from the device generator; they are logged "
        "so a replay draws the same numbers. Read through sys.modules, only if DTensor loaded it",
        required=False,
    ),
    "._rng_tracker": Private(
        "the tracker inside torch.distributed.tensor._random (above), behind getattr",
        of="torch.distributed.tensor._random",
        required=False,
    ),
    "._get_fsdp_state": Private(
        "FSDP2's state of a fully_shard module, for its mixed-precision policy; behind getattr (no FSDP2: the "
        "parameters' dtype)",
        of="torch.distributed.fsdp.FSDPModule",
        required=False,
    ),
    "._mp_policy": Private(
        "FSDP2's MixedPrecisionPolicy (param_dtype is the compute dtype slots store frozen weights in); behind getattr",
        of="torch.distributed.fsdp FSDPState",
        required=False,
    ),
    # ---- DCP ---------------------------------------------------------------------------------------------------
    "torch.distributed.checkpoint.default_planner._validate_global_plan": Private(
        "DCP's own global-plan check, run on a sparse slot's plan with one check relaxed (a slot fills only the "
        "active operators' chunks); reimplementing it would drift from DCP's"
    ),
    "._dedup_save_plans": Private(
        "DefaultSavePlanner's de-duplication of HSDP replicas' identical items, so a slot writes each once as "
        "dcp.save does",
        of="torch.distributed.checkpoint.DefaultSavePlanner",
    ),
    "torch.distributed.checkpoint.filesystem._StorageInfo": Private(
        "the storage_data record of DCP's own FileSystemWriter format, so the raw reader also reads checkpoints "
        "dcp.save wrote"
    ),
    "torch.distributed._shard._utils": Private(
        "narrow_tensor_by_index: the narrowing DCP's own readers apply to a read request's offsets and lengths"
    ),
    "torch.distributed.checkpoint._fsspec_filesystem": Private(
        "FsspecWriter/FsspecReader, DCP's fsspec storage (the dense export writes to any fsspec URI with it); "
        "torch exports them from this module only"
    ),
    # ---- optimizers, modules, autograd -------------------------------------------------------------------------
    "torch.optim.optimizer._get_scalar_dtype": Private(
        "the dtype torch's optimizers give their `step` tensor (float32, or float64 with the default dtype); the "
        "state made up front must be bit-identical to what lazy init makes"
    ),
    "torch.nn.modules.conv._ConvNd": Private(
        "the base of every Conv*d: a convolution's 3-D weight is never a stack of experts (Qwen3.5's depthwise "
        "convs); isinstance on the base covers Conv1d/2d/3d and transposed ones"
    ),
    "._non_persistent_buffers_set": Private(
        "the buffers a module registered with persistent=False, left out of the slots as state_dict leaves them "
        "out; behind getattr",
        of="torch.nn.Module",
        required=False,
    ),
    "torch._C._current_graph_task_id": Private(
        "-1 outside a backward pass: router hooks count routed tokens in the forward only, not again when "
        "activation checkpointing re-runs the forward inside backward; behind getattr",
        required=False,
    ),
    "torch._C._host_emptyCache": Private(
        "hands the caching host allocator's free pinned blocks back after a pinned arena is dropped (CUDA only; "
        "torch.cuda has no public call for the host cache); behind getattr",
        required=False,
        cuda_only=True,
    ),
    # ---- pipeline parallelism (pipeline/stock.py, a PipelineStage subclass) ----------------------------------
    "torch.distributed.pipelining._utils": Private(
        "InferenceMode: whether a stage's shapes are static, so the warm-up vote can be decided locally; imported "
        "in a try (torch < 2.13 has no warm-up vote: the module is there, InferenceMode is not)",
        required=False,
    ),
    "torch.distributed.pipelining.PipelineStage._warmup_forward_vote": Private(
        "overridden to decide the warm-up vote locally when every stage has static shapes (no collective while a "
        "peer may be dead); only called by torch >= 2.13",
        required=False,
        absent_in=("2.11",),
    ),
    "torch.distributed.pipelining.PipelineStage._warmup_backward_result": Private(
        "the backward half of the same vote, overridden with it", required=False, absent_in=("2.11",)
    ),
    "._user_meta": Private(
        "the stage's user-declared input/output metadata, which InferenceMode.needs_dynamic reads",
        of="torch.distributed.pipelining.PipelineStage",
        required=False,
        absent_in=("2.11",),
    ),
    # ---- not torch's: other libraries' private names the scan cannot tell from torch's ----------------------
    "._config": Private(
        "azure-storage-blob's client pipeline config, for its retry policy: one quick inner retry instead of ~80 s "
        "per call, our own retries wrap every call; behind getattr",
        of="azure-storage-blob (BlobServiceClient)",
        required=False,
    ),
}
