"""Operator granularity follows the optimizer (torchmoe_ckpt/model/granularity.py). On grouped expert tensors (one
[E, ...] tensor per weight, as TorchTitan and transformers 5.x store a layer's experts): AdamW keeps one operator
per expert; Adafactor (the RMS of the whole tensor) and Muon on a 2-D [E, F] tensor (gpt-oss's expert biases, one
matrix over every expert) make each layer's experts ONE operator -- every grouped tensor of that layer whole --
while routers, dense blocks and the other layers keep theirs, so a window stays sparse; routing and popularity
count every expert of a merged operator; the merge is named in the log and by `inspect`; recovery is exact (the
kill -9 cases: tests/model/test_optimizers_kill9.py). What no granularity can replay is refused in one line.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from test_optimizers import CFG  # tests/model is on sys.path under pytest
from torch import nn
from transformers import GptOssConfig, GptOssForCausalLM, MixtralConfig, MixtralForCausalLM

import torchmoe_ckpt as tmc
from torchmoe_ckpt.model.operators import discover_operators, expert_grid
from torchmoe_ckpt.model.optim_state import attach_optimizer_state
from torchmoe_ckpt.model.routing import RouterCounter
from torchmoe_ckpt.model.update_rules import UpdateRule, register_update_rule
from torchmoe_ckpt.planning.schedule import plan_window
from torchmoe_ckpt.planning.window_planner import WindowPlanner
from torchmoe_harness.optimizers import build_optimizers

SMALL = CFG  # the tiny Mixtral test_optimizers trains (its fields fit GptOssConfig too)
LAYER_EXPERTS = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


def mixtral(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MixtralForCausalLM(MixtralConfig(**SMALL))


def gpt_oss(seed: int = 0) -> nn.Module:
    """gpt-oss: grouped [E, D, 2F] / [E, F, D] experts with 2-D [E, 2F] / [E, D] expert biases."""
    torch.manual_seed(seed)
    return GptOssForCausalLM(GptOssConfig(**SMALL, head_dim=8, layer_types=["full_attention"] * 2))


def experts_of(ops) -> list:
    return [o for o in ops if o.kind == "expert"]


def sizes(ops):
    full = {o.name: o.full_bytes() for o in ops}
    comp = {o.name: o.compute_bytes(4) for o in ops}
    return full, comp


def assert_merged(model: nn.Module, ops, why: str) -> None:
    """Each MoE layer's experts are one operator holding every grouped tensor of the layer whole, uncut."""
    merged = experts_of(ops)
    assert [o.name for o in merged] == LAYER_EXPERTS
    params = dict(model.named_parameters())
    for o in merged:
        assert o.experts == (0, 1, 2, 3) and o.expert is None and not o.cuts
        assert why in o.merged, o.merged
        grouped = {n for n in params if n.startswith(o.name + ".")}
        assert {pc.fqn for pc in o.pieces} == grouped and len(grouped) >= 2  # w1/w2(/biases): the same cut group
        assert all(pc.shape == pc.global_shape == tuple(params[pc.fqn].shape) for pc in o.pieces)
    assert [o.name for o in ops if o.kind == "router"] == ["model.layers.0.mlp.router", "model.layers.1.mlp.router"]


def assert_sparse(ops, w: int = 3) -> None:
    """A window of W slots over the merged operators: every slot copies the full state of a strict subset, each
    operator exactly once, so the window stays sparse (across layers)."""
    order = [o.name for o in sorted(ops, key=lambda o: {"expert": 0, "router": 1, "dense": 2}[o.kind])]
    plan = plan_window(order, *sizes(ops), float("inf"), forced_window=w, warn=False)
    actives = [set(s.active) for s in plan.slots]
    assert len(actives) == w and all(0 < len(a) < len(ops) for a in actives)
    assert sorted(n for a in actives for n in a) == sorted(order)
    assert len(plan.slots[0].frozen) > 0  # later operators' compute weights only


def test_adafactor_makes_each_layers_grouped_experts_one_operator():
    model = mixtral()
    opt = torch.optim.Adafactor(model.parameters())
    per_expert = discover_operators(model)  # without the optimizer: one operator per expert, as before
    assert len(experts_of(per_expert)) == 8
    ops = discover_operators(model, optimizer=opt)
    assert_merged(model, ops, "Adafactor scales each update by the RMS of the whole parameter")
    assert len(ops) == len(per_expert) - 6
    attach_optimizer_state(model, ops, opt)  # not refused: nothing is cut any more
    op = ops[0]
    keys = {s.key for st in (op.state or {}).values() for s in st}
    assert keys == {"step", "row_var", "col_var"}
    assert_sparse(ops)


def test_muon_on_2d_expert_biases_makes_the_layer_one_operator():
    """torch.optim.Muon takes 2-D tensors only (a 3-D expert tensor is refused by torch itself), so the Muon
    recipe puts the 3-D experts on AdamW; but gpt-oss's [E, F] expert biases are 2-D: Muon orthogonalises each
    as one matrix over all experts, and the layer's experts -- their 3-D weights too, which share the cut --
    become one operator."""
    with pytest.raises(ValueError, match="Muon only supports 2D parameters"):
        torch.optim.Muon([nn.Parameter(torch.zeros(4, 8, 16))])
    model = gpt_oss()
    opts, _ = build_optimizers("muon-adamw", model, lr=1e-3)
    assert any(p.dim() == 2 and p.shape[0] == 4 for g in opts[0].param_groups for p in g["params"])
    ops = discover_operators(model, optimizer=opts)
    assert_merged(model, ops, "Muon orthogonalises each 2-D parameter as a whole")
    assert "gate_up_proj_bias (4, 48)" in ops[0].merged
    attach_optimizer_state(model, ops, opts)
    assert_sparse(ops)


def test_elementwise_and_per_matrix_updates_keep_one_operator_per_expert():
    """AdamW (element) on Mixtral and gpt-oss; Muon + AdamW on Mixtral (its 3-D experts on AdamW); a per-matrix
    rule (Muon's, DistMuon's) on a 3-D [E, F, D] tensor: cut along the batch dim, every expert its own operator."""
    names = [f"model.layers.{i}.mlp.experts.{e}" for i in range(2) for e in range(4)]
    for build, kind in ((mixtral, "adamw"), (gpt_oss, "adamw"), (mixtral, "muon-adamw")):
        model = build()
        opts, _ = build_optimizers(kind, model, lr=1e-3)
        ops = discover_operators(model, optimizer=opts)
        assert [o.name for o in experts_of(ops)] == names, kind
        assert all(o.experts == (o.expert,) and not o.merged and o.cuts for o in experts_of(ops))
        attach_optimizer_state(model, ops, opts)

    class BatchedMuon(torch.optim.SGD):
        """Stands for DistMuon (CUDA only): orthogonalises each matrix of a batch-first 3-D tensor."""

    register_update_rule(
        BatchedMuon, UpdateRule("matrix", lambda g, p, dt: {"momentum_buffer": torch.zeros_like(p)}, "per matrix")
    )
    model = mixtral()
    opt = BatchedMuon(model.parameters(), lr=0.1, momentum=0.9)
    ops = discover_operators(model, optimizer=opt)
    assert [o.name for o in experts_of(ops)] == names
    attach_optimizer_state(model, ops, opt)


def test_routing_and_popularity_count_every_expert_of_a_merged_operator():
    """The router hook counts E experts per layer (not one per operator); the popularity order holds a merged
    operator once, where its most popular expert ranks; every (layer, expert) maps to its operator."""
    model = mixtral()
    ops = discover_operators(model, optimizer=torch.optim.Adafactor(model.parameters()))
    grid = expert_grid(ops)
    assert len(grid) == 8 and set(grid.values()) == set(LAYER_EXPERTS)
    counter = RouterCounter(model, ops, top_k=2)
    model.train()
    model(torch.randint(0, 64, (2, 9)))
    counts, _ = counter.take()
    counter.close()
    assert counts.shape == (2, 4) and counts.sum(1).tolist() == [36.0, 36.0]  # 18 tokens x top-2, every expert
    planner = WindowPlanner(tmc.SparseConfig(window=3), ops, torch.float32, None, None, False, 0)
    skew = torch.tensor([[5.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]], dtype=torch.float64)
    planner.tracker.update(skew)
    order = planner.operator_order()
    assert sorted(order) == sorted(o.name for o in ops) and len(order) == len(ops)
    assert order[:2] == ["model.layers.1.mlp.experts", "model.layers.0.mlp.experts"]  # max 2 < max 5


def _train(build, kind: str, steps: int, tiers=None, stop_after=None, seed=0):
    model = build(seed)
    opts, scheds = build_optimizers(kind, model, lr=3e-3, lr_factor=lambda s: min(1.0, (s + 1) / 3))

    def fb(tokens):
        loss = F.cross_entropy(model(tokens[:, :-1]).logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss

    cfg = tmc.CheckpointConfig(tiers=tiers, window=tmc.SparseConfig(window=3), max_grad_norm=0.5)
    ckpt = tmc.Checkpointer(model, opts, fb, scheds, cfg, seed=0)
    losses = {}
    for step in range(ckpt.resume() + 1, steps + 1):
        losses[step] = ckpt.step(torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(step)))
        if step == stop_after:
            break
    ckpt.close()
    return model, opts, scheds, losses, ckpt


def _same(a, b) -> int:
    n = 0
    for (k, x), (k2, y) in zip(a[0].state_dict().items(), b[0].state_dict().items()):
        assert k == k2 and torch.equal(x, y), k
        n += 1
    for oa, ob in zip(a[1], b[1]):
        sa, sb = oa.state_dict(), ob.state_dict()
        assert sa["param_groups"] == sb["param_groups"] and sa["state"].keys() == sb["state"].keys()
        for i in sa["state"]:
            for key, x in sa["state"][i].items():
                assert x.dtype == sb["state"][i][key].dtype and torch.equal(x, sb["state"][i][key]), (i, key)
                n += 1
    for sa, sb in zip(a[2], b[2]):
        assert sa.state_dict() == sb.state_dict()
    for s, loss in b[3].items():
        assert torch.equal(loss, a[3][s]), s
    return n


@pytest.mark.parametrize(
    "build,kind,why",
    [(mixtral, "adafactor", "Adafactor scales each update"), (gpt_oss, "muon-adamw", "Muon orthogonalises")],
    ids=["adafactor-mixtral", "muon-gpt-oss"],
)
def test_merged_operators_recover_exactly_and_inspect_says_why(build, kind, why, tmp_path, caplog):
    """In one process: a run stopped after iteration 7 (windows 1-3 and 4-6 committed), resumed on another init:
    torch.equal with a run that never stopped, every tensor of the model, optimizer and scheduler, and the losses.
    The log and `inspect` name each merged operator and the reason."""
    from torchmoe_ckpt.ops.inspection import format_inspect, inspect_location

    ref = _train(build, kind, 10)
    tiers = tmc.TierConfig(root=str(tmp_path), run_id=kind)
    with caplog.at_level(logging.INFO, logger="torchmoe_ckpt"):
        first = _train(build, kind, 10, tiers=tiers, stop_after=7)
    assert [o.name for o in experts_of(first[4].ops)] == LAYER_EXPERTS
    assert f"operator model.layers.0.mlp.experts: all of its layer's experts as one operator, because {why}" in (
        caplog.text
    )
    got = _train(build, kind, 10, tiers=tiers, seed=123)  # another init: only recovery can make it equal
    assert got[4].resumed.recovered_step == 6 and sorted(got[3]) == [7, 8, 9, 10]
    assert _same(ref, got) > 30
    shown = format_inspect(inspect_location(str(tmp_path / "node-0" / kind)))
    assert f"operator model.layers.1.mlp.experts: all of its layer's experts as one operator, because {why}" in shown


def test_what_no_granularity_can_replay_is_refused_in_one_line():
    """LBFGS; an optimizer whose update couples parameters of different operators (declared "global"); operators
    discovered without the optimizer that cut a tensor it updates as a whole."""
    model = mixtral()
    params = list(model.parameters())

    def refused(call, match):
        with pytest.raises(tmc.UncapturedStateError, match=match) as exc:
            call()
        assert "\n" not in str(exc.value), exc.value

    noop = lambda b: b  # noqa: E731
    refused(lambda: tmc.Checkpointer(model, torch.optim.LBFGS(params), noop), "LBFGS keeps one state for all")

    class GlobalScaled(torch.optim.SGD):
        """Scales every update by the norm of all its parameters' gradients together."""

    register_update_rule(
        GlobalScaled, UpdateRule("global", lambda g, p, dt: {}, "scales each update by the norm of every gradient")
    )
    refused(
        lambda: tmc.Checkpointer(model, GlobalScaled(params, lr=0.1), noop),
        r"GlobalScaled scales each update by the norm of every gradient: its update couples parameters across 9 "
        r"operators \(lm_head, model.embed_tokens, model.layers.0.dense and 6 more\)",
    )
    # On one operator's parameters alone (the last layer norm), the same rule replays: accepted.
    norm = [model.model.norm.weight]
    tmc.Checkpointer(model, [GlobalScaled(norm, lr=0.1), torch.optim.AdamW(params[:-2] + params[-1:])], noop)

    cut = discover_operators(model)  # one operator per expert: Adafactor cannot step a slice
    refused(
        lambda: attach_optimizer_state(model, cut, torch.optim.Adafactor(params)),
        r"Adafactor scales each update .* is cut into 4 operators along dim 0, which it cannot be at all: .*"
        r"discover_operators\(model, optimizer=...\)",
    )
