"""Operator discovery on models we did not write: Hugging Face `transformers` MoE families built tiny from code,
nn.ModuleList experts, blocks not under `layers`, TorchTitan-style names, an OperatorSpec where structure is
not enough; routed-token counts from router hooks. In-process, CPU, no process group unless said."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

from torchmoe_ckpt.core.slot import build_slot
from torchmoe_ckpt.model.moe_structure import state_tensors
from torchmoe_ckpt.model.operators import OperatorDiscoveryError, OperatorSpec, discover_operators, expert_grid
from torchmoe_ckpt.model.routing import TOP_K_KEYS, RouterCounter
from torchmoe_harness.hf_models import build_hf_model, is_moe_model_type, moe_model_types
from torchmoe_harness.model import TinyMoE, TinyMoEConfig

transformers.logging.set_verbosity_error()

# transformers 5.23 model types whose own default config cannot build a model (not ours to fix):
# dbrx: DbrxAttentionConfig has no rope_theta; lfm2_moe: layer_types is None; qwen4_exp*: no token_budget.
BROKEN_UPSTREAM = {"dbrx", "lfm2_moe", "qwen4_exp", "qwen4_exp_text"}
# Layouts structure cannot read (product-key experts as [E, D] embeddings): need an OperatorSpec.
NEEDS_SPEC = {
    "doge": OperatorSpec(
        experts=("model.layers.*.mlp.down_embed", "model.layers.*.mlp.up_embed"),
        routers=("model.layers.*.mlp.router_gate",),
    )
}


def assert_covered_once(model: nn.Module, ops) -> None:
    """Every state_dict key (tied aliases of one tensor aside) lands in exactly one operator, whole, or in
    the expert operators of one MoE as disjoint dim-0 slices that tile it."""
    names = set(model.state_dict())
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - dict(model.named_parameters()).keys()
    tensors = state_tensors(model)
    owners: dict[str, set[str]] = collections.defaultdict(set)
    numel: dict[str, int] = collections.Counter()
    rows: dict[str, list[int]] = collections.defaultdict(list)
    for o in ops:
        for pc in o.pieces:
            owners[pc.fqn].add(o.moe if o.kind == "expert" else o.name)
            numel[pc.fqn] += pc.numel
            if o.kind == "expert" and pc.shape != tuple(tensors[pc.fqn].shape):
                rows[pc.fqn].append(pc.global_offset[0])
            trains = isinstance(tensors[pc.fqn], nn.Parameter) and tensors[pc.fqn].requires_grad
            assert pc.dtype == tensors[pc.fqn].dtype and pc.is_param == trains  # no-grad params held by value
    assert set(owners) == names - aliases
    for fqn, who in owners.items():
        assert len(who) == 1, (fqn, who)
        assert numel[fqn] == tensors[fqn].numel(), fqn
        assert len(set(rows[fqn])) == len(rows[fqn]), fqn


def moe_layers(ops) -> dict[str, list]:
    out = collections.defaultdict(list)
    for o in ops:
        if o.moe is not None:
            out[o.moe].append(o)
    return out


def train_step(model: nn.Module, tokens: torch.Tensor) -> None:
    model.train()
    out = model(input_ids=tokens, labels=tokens) if hasattr(model, "config") else model(tokens)
    loss = out.loss if hasattr(out, "loss") else F.cross_entropy(out.flatten(0, 1), tokens.flatten())
    loss.backward()


# ---- (a) real families built tiny ---------------------------------------------------------------------------

FAMILIES = {"mixtral": 2, "deepseek_v3": 1, "qwen2_moe": 2, "olmoe": 2, "gpt_oss": 2}  # type -> MoE layers


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_hf_family_operators(model_type):
    model = build_hf_model(model_type, experts=4)
    ops = discover_operators(model)
    assert_covered_once(model, ops)
    layers = moe_layers(ops)
    assert len(layers) == FAMILIES[model_type]
    for moe, group in layers.items():
        experts = sorted(o.expert for o in group if o.kind == "expert")
        routers = [o for o in group if o.kind == "router"]
        assert experts == [0, 1, 2, 3] and len(routers) == 1, moe
        assert all(o.name == f"{moe}.experts.{o.expert}" for o in group if o.kind == "expert")
        assert routers[0].name == f"{moe}.router" and routers[0].modules
        router_fqns = {pc.fqn.rsplit(".", 1)[-1] for pc in routers[0].pieces}
        expert_fqns = {pc.fqn.rsplit(".", 1)[-1] for o in group if o.kind == "expert" for pc in o.pieces}
        assert {"gate_up_proj", "down_proj"} <= expert_fqns
        if model_type == "deepseek_v3":
            assert "e_score_correction_bias" in router_fqns
        if model_type == "gpt_oss":  # 2-D expert biases sliced per expert; the router's bias is the router's
            assert {"gate_up_proj_bias", "down_proj_bias"} <= expert_fqns and "bias" in router_fqns
    dense = {pc.fqn for o in ops if o.kind == "dense" for pc in o.pieces}
    shared = {n for n in state_tensors(model) if "shared_expert" in n}
    assert shared <= dense and (shared or model_type not in ("deepseek_v3", "qwen2_moe"))
    grid = expert_grid(ops)
    assert len(grid) == 4 * FAMILIES[model_type] and len(set(grid.values())) == len(grid)


def test_harness_tinymoe_operators():
    model = TinyMoE(TinyMoEConfig(n_layers=3, num_experts=4))
    model.init_weights(0)
    ops = discover_operators(model)
    assert_covered_once(model, ops)
    layers = moe_layers(ops)
    assert list(layers) == ["layers.0.moe", "layers.1.moe", "layers.2.moe"]
    router = next(o for o in ops if o.name == "layers.1.moe.router")
    # The expert bias and the (persistent) token counter are captured; router_prob_E is not state.
    assert {pc.fqn for pc in router.pieces} == {
        "layers.1.moe.router.gate.weight",
        "layers.1.moe.expert_bias_E",
        "layers.1.moe.tokens_per_expert_E",
    }
    assert [o.name for o in ops if o.layer is None] == ["norm", "output", "tok_embeddings"]


# ---- (b) layouts that are not ours: nn.ModuleList experts, blocks under `h`, TorchTitan-style names ---------

D, E, V = 16, 4, 32


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, 24), nn.Linear(24, D)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class ListMoE(nn.Module):
    """One nn.Linear MLP per expert in an nn.ModuleList; the router returns logits only."""

    def __init__(self, k: int = 2):
        super().__init__()
        self.k = k
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(MLP() for _ in range(E))

    def forward(self, x):
        w, idx = self.gate(x).softmax(-1).topk(self.k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            hit = idx == e
            rows = hit.any(-1)
            if rows.any():
                out[rows] += (w * hit).sum(-1, keepdim=True)[rows] * expert(x[rows])
        return out


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)

    def forward(self, x, expert_bias):
        scores = self.gate(x).sigmoid()
        _, idx = (scores + expert_bias).topk(2, dim=-1)
        return scores.gather(-1, idx), idx, scores


class TitanStyleMoE(nn.Module):
    """TorchTitan's older names: moe.experts.w1/w2/w3 [E, ...], moe.router.gate, expert_bias and
    tokens_per_expert buffers (here an int64 one), shared_experts."""

    def __init__(self):
        super().__init__()
        self.experts = nn.Module()
        self.experts.w1 = nn.Parameter(torch.randn(E, 24, D) * 0.1)
        self.experts.w2 = nn.Parameter(torch.randn(E, D, 24) * 0.1)
        self.experts.w3 = nn.Parameter(torch.randn(E, 24, D) * 0.1)
        self.router = Router()
        self.shared_experts = MLP()
        self.register_buffer("expert_bias", torch.zeros(E))
        self.register_buffer("tokens_per_expert", torch.zeros(E, dtype=torch.int64))

    def forward(self, x):
        top, idx, _ = self.router(x, self.expert_bias)
        self.tokens_per_expert += torch.bincount(idx.flatten(), minlength=E)
        out = self.shared_experts(x)
        for e in range(E):
            w = (top * (idx == e)).sum(-1, keepdim=True)
            h = F.silu(x @ self.experts.w1[e].T) * (x @ self.experts.w3[e].T)
            out = out + w * (h @ self.experts.w2[e].T)
        return out


class Net(nn.Module):
    def __init__(self, moe: type, container: str):
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(V, D)
        blocks = [nn.ModuleDict({"ln": nn.LayerNorm(D), "moe": moe()}) for _ in range(2)]
        setattr(self, container, nn.ModuleList(blocks))
        self.container = container
        self.head = nn.Linear(D, V)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, tokens):
        x = self.wte(tokens)
        for b in getattr(self, self.container):
            x = x + b["moe"](b["ln"](x))
        self.seen += tokens.numel()
        return self.head(x)


@pytest.mark.parametrize("moe,container", [(ListMoE, "blocks"), (TitanStyleMoE, "h")])
def test_other_layouts_keep_layers_apart(moe, container):
    model = Net(moe, container)
    ops = discover_operators(model)
    assert_covered_once(model, ops)
    layers = moe_layers(ops)
    assert list(layers) == [f"{container}.0.moe", f"{container}.1.moe"]
    for i, (path, group) in enumerate(layers.items()):
        experts = [o for o in group if o.kind == "expert"]
        assert [o.expert for o in experts] == list(range(E)) and {o.layer for o in group} == {i}
        for o in experts:
            assert all(pc.fqn.startswith(path + ".experts.") for pc in o.pieces)
            if moe is ListMoE:  # one module per expert: whole tensors of that module only
                assert {pc.fqn for pc in o.pieces} == {
                    f"{path}.experts.{o.expert}.{n}" for n in ("up.weight", "up.bias", "down.weight", "down.bias")
                }
    assert set(expert_grid(ops)) == {(layer, e) for layer in range(2) for e in range(E)}
    assert {o.name for o in ops if o.kind == "dense"} == {
        f"{container}.0.dense",
        f"{container}.1.dense",
        "wte",
        "head",
        "seen",
    }
    if moe is TitanStyleMoE:
        router = next(o for o in ops if o.name == f"{container}.0.moe.router")
        counter = next(pc for pc in router.pieces if pc.fqn.endswith("tokens_per_expert"))
        assert counter.dtype == torch.int64 and router.buffer_bytes() == E * 4 + E * 8
        assert all("shared_experts" not in pc.fqn for o in ops if o.kind != "dense" for pc in o.pieces)
        # Slot buffers take the buffer's own dtype (an int64 counter is not squeezed through float32).
        slot = build_slot(0, (router.name,), (f"{container}.1.moe.router",), {o.name: o for o in ops}, torch.bfloat16)
        assert {(i.key.rsplit(".", 1)[-1], i.buffer.dtype) for i in slot.items if i.role == "buffer"} == {
            ("expert_bias", torch.float32),
            ("tokens_per_expert", torch.int64),
        }


class DeltaNetLike(nn.Module):
    """Qwen3.5's Gated DeltaNet: depthwise q/k convs ([C, 1, k], 3-D) beside projections to C ([C, D], gate-like)."""

    def __init__(self):
        super().__init__()
        self.in_proj_q = nn.Linear(D, E * 2, bias=False)
        self.in_proj_k = nn.Linear(D, E * 2, bias=False)
        self.conv_q = nn.Conv1d(E * 2, E * 2, 4, groups=E * 2, bias=False)
        self.conv_k = nn.Conv1d(E * 2, E * 2, 4, groups=E * 2, bias=False)
        self.out = nn.Linear(E * 2, D)


def test_convolutions_beside_a_projection_are_not_experts():
    """Sibling convs with one 3-D weight each, and a [C, D] projection, are an attention block, not an MoE: no
    expert or router operator, everything in the block's dense operator (they once became C 'experts')."""
    model = nn.ModuleList([nn.ModuleDict({"attn": DeltaNetLike(), "moe": TitanStyleMoE()}) for _ in range(2)])
    ops = discover_operators(model)
    assert_covered_once(model, ops)
    assert list(moe_layers(ops)) == ["0.moe", "1.moe"]
    conv = {o.name for o in ops for pc in o.pieces if ".attn." in pc.fqn}
    assert conv == {"0.dense", "1.dense"}, conv


# ---- (c) OperatorSpec and the two error lines -------------------------------------------------------------


def test_spec_names_what_structure_cannot_see():
    model = build_hf_model("doge")
    with pytest.raises(OperatorDiscoveryError) as err:
        discover_operators(model)
    msg = str(err.value)
    assert "\n" not in msg and "'model.layers.0.mlp'" in msg and "OperatorSpec(experts=" in msg
    ops = discover_operators(model, NEEDS_SPEC["doge"])
    assert_covered_once(model, ops)
    for group in moe_layers(ops).values():
        assert sum(o.kind == "expert" for o in group) == 4 and sum(o.kind == "router" for o in group) == 1


def test_spec_agrees_with_structure_and_refuses_a_pattern_matching_nothing():
    model = build_hf_model("mixtral")
    auto = discover_operators(model)
    spec = discover_operators(
        model, OperatorSpec(experts=("model.layers.*.mlp.experts",), routers=("model.layers.*.mlp.gate",))
    )
    assert [(o.name, o.pieces) for o in auto] == [(o.name, o.pieces) for o in spec]
    listed = Net(ListMoE, "blocks")  # a list of experts named by its elements is the same list
    by_elements = discover_operators(listed, OperatorSpec(experts=("blocks.*.moe.experts.*",)))
    assert [(o.name, o.pieces) for o in by_elements] == [(o.name, o.pieces) for o in discover_operators(listed)]
    with pytest.raises(OperatorDiscoveryError) as err:
        discover_operators(model, OperatorSpec(experts=("model.layers.*.moe.experts",)))
    assert "\n" not in str(err.value) and "'model.layers.*.moe.experts'" in str(err.value)
    with pytest.raises(ValueError, match="tuple of module-name patterns"):
        OperatorSpec(experts="model.layers.*.mlp.experts")


# ---- (d) routed-token counts from router hooks -------------------------------------------------------------


def _k(model: nn.Module) -> int:
    return next(getattr(model.config, key) for key in TOP_K_KEYS if isinstance(getattr(model.config, key, None), int))


@pytest.mark.parametrize("model_type", ["mixtral", "deepseek_v3", "qwen2_moe", "olmoe", "gpt_oss", "jetmoe"])
def test_router_counter_counts_tokens_times_k(model_type):
    model = build_hf_model(model_type)
    ops = discover_operators(model)
    counter = RouterCounter(model, ops)
    tokens = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    train_step(model, tokens)
    counts, probs = counter.take()
    assert counts.dtype == probs.dtype == torch.float64 and counts.shape == (len(moe_layers(ops)), 4)
    assert counts.sum(1).tolist() == [16.0 * _k(model)] * counts.shape[0]
    assert torch.allclose(probs.sum(1), torch.full((counts.shape[0],), 16.0, dtype=torch.float64))
    assert counter.take()[0].sum() == 0  # reset by take
    with torch.no_grad():
        model.eval()
        model(input_ids=tokens)  # evaluation is not training traffic
    assert counter.take()[0].sum() == 0
    if model.supports_gradient_checkpointing:
        # transformers >= 5.2x: activation_checkpointing_enable (gradient_... its deprecated alias); 5.17 (the GPU
        # machine's): gradient_checkpointing_enable only
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
        train_step(model, tokens)  # forwards recomputed in backward are not counted twice
        assert counter.take()[0].sum(1).tolist() == [16.0 * _k(model)] * counts.shape[0]
    counter.close()
    train_step(model, tokens)
    assert counter.take()[0].sum() == 0  # hooks removed


def test_router_counter_on_our_models():
    """k from the router module (harness), the MoE module (ListMoE.k, logits-only router) or given."""
    harness = TinyMoE(TinyMoEConfig(top_k=2, vocab_size=V))
    harness.init_weights(0)
    tokens = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(0))
    for model, k in ((harness, None), (Net(ListMoE, "blocks"), None), (Net(TitanStyleMoE, "h"), 2)):
        counter = RouterCounter(model, discover_operators(model), top_k=k)
        train_step(model, tokens)
        counts, probs = counter.take()
        assert counts.sum(1).tolist() == [32.0] * counts.shape[0] and counts.shape[0] >= 2
        assert torch.allclose(probs.sum(1), torch.full_like(probs[:, 0], 16.0))
        counter.close()


# ---- (e) every MoE model type transformers knows -----------------------------------------------------------


def check_family(model_type: str) -> None:
    try:
        model = build_hf_model(model_type)
    except Exception:
        if model_type in BROKEN_UPSTREAM:
            pytest.xfail(f"{model_type}: transformers' own default config cannot build this model")
        raise
    ops = discover_operators(model, NEEDS_SPEC.get(model_type))
    assert_covered_once(model, ops)
    layers = moe_layers(ops)
    assert layers, f"{model_type}: no MoE layer found"
    for moe, group in layers.items():
        assert sorted(o.expert for o in group if o.kind == "expert") == [0, 1, 2, 3], moe
        assert sum(o.kind == "router" for o in group) == 1, moe
    counter = RouterCounter(model, ops)
    train_step(model, torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0)))
    counts, _ = counter.take()
    assert counts.sum(1).tolist() == [16.0 * _k(model)] * len(layers)


@pytest.mark.parametrize("model_type", ["jetmoe", "nemotron_h", "zaya", "longcat_flash", "ernie4_5_moe", "llama4"])
def test_family_sample(model_type):
    check_family(model_type)


@pytest.mark.matrix
@pytest.mark.parametrize("model_type", moe_model_types())
def test_every_moe_model_type(model_type):
    check_family(model_type)


def test_builder_is_deterministic_and_refuses_what_is_not_moe():
    a, b, c = (build_hf_model("qwen2_moe", seed=s).state_dict() for s in (0, 0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a) and not all(torch.equal(a[k], c[k]) for k in a)
    assert is_moe_model_type("mixtral") and not is_moe_model_type("llama")
    for bad in ("llama", "no_such_model"):
        with pytest.raises(ValueError) as err:
            build_hf_model(bad)
        assert "\n" not in str(err.value) and repr(bad) in str(err.value)
    assert len(moe_model_types()) >= 40


def test_hf_model_under_fsdp2(one_rank_group):
    """The same operators on DTensor shards (FSDP2 on a 1-rank mesh): global shapes, local pieces, hooks."""
    from torch.distributed.fsdp import fully_shard

    model = build_hf_model("deepseek_v3", layers=3)
    plain = [
        (o.name, [(pc.fqn, pc.global_shape, pc.global_offset) for pc in o.pieces]) for o in discover_operators(model)
    ]
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    ops = discover_operators(model)
    assert [(o.name, [(pc.fqn, pc.global_shape, pc.global_offset) for pc in o.pieces]) for o in ops] == plain
    assert_covered_once(model, ops)
    counter = RouterCounter(model, ops)
    train_step(model, torch.randint(0, 128, (2, 8)))
    assert counter.take()[0].sum(1).tolist() == [32.0] * len(moe_layers(ops))
    counter.close()
