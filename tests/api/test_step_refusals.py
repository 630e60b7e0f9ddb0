"""Mistakes in the own loop's step function are refused at the first step, in one line naming the fix, before the
optimizer steps: a `forward_backward` that never calls `loss.backward()` (it would train nothing, silently), and
one that returns the loss as a float. In-process, one rank, no tiers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.tiny_moe import TOP_K, Net, batch_for  # tests/ is on sys.path under pytest

import torchmoe_ckpt as tmc


def _loop(step_fn_of):
    model = Net(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = tmc.CheckpointConfig(window=tmc.SparseConfig(window=3), router_top_k=TOP_K)
    ck = tmc.Checkpointer(model, opt, step_fn_of(model), None, cfg)
    ck.resume()
    return model, ck


def _loss(model, tokens):
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def test_a_step_function_without_backward_is_refused_at_the_first_step():
    model, ck = _loop(lambda model: lambda tokens: _loss(model, tokens))  # no loss.backward()
    before = {k: v.clone() for k, v in model.named_parameters()}
    try:
        with pytest.raises(tmc.ConfigError) as err:
            ck.step(batch_for(1))
        assert "\n" not in str(err.value)
        assert ck.step_count == 0  # refused before the optimizer stepped: nothing trained, nothing counted
        assert all(torch.equal(before[k], v) for k, v in model.named_parameters())
    finally:
        ck.close()


def test_a_step_function_with_backward_trains():
    def with_backward(model):
        def fb(tokens):
            loss = _loss(model, tokens)
            loss.backward()
            return loss

        return fb

    model, ck = _loop(with_backward)
    before = {k: v.clone() for k, v in model.named_parameters()}
    try:
        for step in (1, 2):
            ck.step(batch_for(step))
        assert ck.step_count == 2 and not all(torch.equal(before[k], v) for k, v in model.named_parameters())
    finally:
        ck.close()


def test_a_loss_returned_as_a_float_is_refused():
    model, ck = _loop(lambda model: lambda tokens: float(_loss(model, tokens)))
    try:
        with pytest.raises(TypeError) as err:
            ck.step(batch_for(1))
        assert "\n" not in str(err.value) and ck.step_count == 0
    finally:
        ck.close()
