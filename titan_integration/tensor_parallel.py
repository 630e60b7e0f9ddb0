"""What sparse checkpointing supports under TorchTitan's tensor parallelism, checked before training (issue 44).

Tensor parallelism alone (``[parallelism] tensor_parallel_degree = N`` on N ranks, sequence parallelism and the
loss-parallel loss as TorchTitan sets them up) is captured and recovered exactly after ``kill -9``
(tests/titan_glue/test_titan_families.py, ``qwen3-tp2``). Each rank captures its local shards at their global
offsets (torchmoe_ckpt/model/placements.py says which placements). The recorded loss is this rank's local tensor,
as TorchTitan reduces it (torchmoe_ckpt/runtime/deferred_reads.py).

TP combined with another parallelism (FSDP, HSDP, context, pipeline or expert parallelism) has not been verified
exact, so it is refused here in one line rather than risked. Torch-free, like the pipeline's check: the launcher
runs it before any worker starts.
"""

from __future__ import annotations

from titan_integration.sparse_config import JobConfigError

__all__ = ["check_tensor_parallel_job"]


def check_tensor_parallel_job(config, sc, world_size: int) -> None:
    """Refuse (JobConfigError, one line) TP combined with any other parallelism while sparse checkpointing is on."""
    par = config.parallelism
    tp = par.tensor_parallel_degree
    if tp <= 1 or not sc.enable:
        return
    others = {
        "data_parallel_replicate_degree": par.data_parallel_replicate_degree,
        "context_parallel_degree": par.context_parallel_degree,
        "pipeline_parallel_degree": par.pipeline_parallel_degree,
        "expert_parallel_degree": par.expert_parallel_degree,
    }
    shard = par.data_parallel_shard_degree
    if shard == -1:  # TorchTitan's "the rest of the ranks"
        outer = tp * others["data_parallel_replicate_degree"] * others["context_parallel_degree"]
        shard = max(1, world_size // max(1, outer * others["pipeline_parallel_degree"]))
    others["data_parallel_shard_degree"] = shard
    combined = [f"{k} = {v}" for k, v in others.items() if v > 1]
    if combined:
        raise JobConfigError(
            f"[parallelism] tensor_parallel_degree = {tp} with {', '.join(combined)} ({world_size} ranks): sparse "
            "checkpointing recovers tensor parallelism alone so far (TP combined with FSDP, HSDP, context, "
            f"pipeline or expert parallelism is not verified exact); fix: run TP alone (--nproc_per_node {tp}, "
            "the other degrees 1), or tensor_parallel_degree = 1"
        )
