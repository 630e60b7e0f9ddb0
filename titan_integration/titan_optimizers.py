"""TorchTitan's optimizers as the core sees them (torchmoe_ckpt.model.optim_state).

* ``DistMuon`` (the Kimi K2.x recipe: matrices on DistMuon, the rest on AdamW, by parameter group) gets its update
  rule: one momentum buffer per parameter, and each matrix -- the last two dims; grouped [E, F, D] expert tensors
  are batches of matrices -- orthogonalised as a whole, so an expert cut from dim 0 replays exactly and a 2-D
  tensor cut into operators is refused. DistMuon runs on CUDA only ("DistMuon requires one CUDA device per
  process"): on CPU a job with it fails at construction, in TorchTitan, before any of our code.
* ``implementation = "fused_opt_states_bf16"``: TorchTitan makes Adam/AdamW's moments bf16 in a step pre-hook,
  for states that do not exist yet. Sparse checkpointing creates the state up front (what slots are loaded into),
  so it creates it in bf16 itself, value for value what the hook makes. Stepping fp32 parameters with bf16 states
  needs torch's CUDA fused kernel; torch's CPU AdamW refuses it ("expected scalar type Float but found
  BFloat16"), so on CPU such a job fails at its first step, in torch.
"""

from __future__ import annotations

import torch

from torchmoe_ckpt.model.optim_state import UpdateRule, init_optimizer_state, register_update_rule

__all__ = ["init_titan_optimizer_state", "register_titan_optimizers"]

BF16_STATES = "fused_opt_states_bf16"


def _momentum(group: dict, p: torch.Tensor, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    # DistMuon._momentum: zeros like the (DTensor) gradient, i.e. like the parameter.
    return {"momentum_buffer": torch.zeros_like(p, memory_format=torch.preserve_format, dtype=dtype)}


def register_titan_optimizers() -> None:
    from torchtitan.distributed.flex_shard.dist_muon import DistMuon

    register_update_rule(
        DistMuon, UpdateRule("matrix", _momentum, "orthogonalises each matrix (the last two dims) as a whole")
    )


def init_titan_optimizer_state(container, implementation: str | None) -> None:
    """Every inner optimizer's state as its first step would make it, Adam/AdamW's moments in bf16 under
    ``fused_opt_states_bf16`` (what TorchTitan's pre-hook would have made)."""
    for opt in container:
        bf16 = implementation == BF16_STATES and isinstance(opt, (torch.optim.Adam, torch.optim.AdamW))
        init_optimizer_state(opt, state_dtype=torch.bfloat16 if bf16 else None)
