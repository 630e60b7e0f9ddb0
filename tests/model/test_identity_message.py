"""The one line that refuses another run's windows (model/identity.py): its first difference in words, then every
other part that differs too, so that a job pointed at another model's windows reads as another model, not as a
dtype to change (a qwen3 job's windows under a gpt-oss job's run id said only "dtype float32 != bfloat16")."""

from __future__ import annotations

import torch

from torchmoe_ckpt.model.identity import build_identity, identity_mismatch, refusal
from torchmoe_ckpt.model.operators import discover_operators
from torchmoe_harness.model import TinyMoE, TinyMoEConfig


def _identity(dtype=torch.float32, seed=0, **cfg):
    model = TinyMoE(TinyMoEConfig(**cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return build_identity(model, opt, dtype, discover_operators(model), "r", data="d", seed=seed)


def test_another_model_names_every_part_that_differs():
    window = _identity(num_experts=4).to_dict()
    this = _identity(dtype=torch.bfloat16, num_experts=8, dim=48)
    why = identity_mismatch(window, this)
    assert why is not None and why.startswith("dtype float32 != bfloat16; also: "), why
    assert "expert count" in why and "model tensors" in why and "operators" in why, why
    line = refusal("r", why)
    assert "\n" not in line and "new run id" in line


def test_one_difference_is_named_once():
    window = _identity(num_experts=4).to_dict()
    assert identity_mismatch(window, _identity(num_experts=4, seed=1)) == "seed 0 != 1"
    assert identity_mismatch(window, _identity(dtype=torch.bfloat16, num_experts=4)) == "dtype float32 != bfloat16"
    assert identity_mismatch(window, _identity(num_experts=4)) is None
