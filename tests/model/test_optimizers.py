"""Any optimizer an MoE run uses, captured generically and recovered exactly (in one process): SGD with momentum,
AdamW with amsgrad, AdamW with bf16 states, Muon + AdamW as two optimizers, Adafactor (+ AdamW for grouped experts)
on Hugging Face Mixtral (grouped [E, F, D] experts), Adafactor alone on a model with per-expert parameters; the
state its lazy init creates made up front, exactly; slot sizes from the real bytes; one-line refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import MixtralConfig, MixtralForCausalLM

import torchmoe_ckpt as tmc
from torchmoe_ckpt.core.slot import full_specs
from torchmoe_ckpt.model.operators import discover_operators
from torchmoe_ckpt.model.optim_state import attach_optimizer_state, init_optimizer_state
from torchmoe_harness.optimizers import build_optimizers, needs_bf16_params

CFG = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=32,
)


def mixtral(seed: int, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return MixtralForCausalLM(MixtralConfig(**CFG)).to(dtype)


def batch_for(step: int) -> torch.Tensor:
    return torch.randint(0, CFG["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(step))


def train(kind: str, steps: int, seed: int = 0, tiers=None, stop_after: int | None = None, build=mixtral, lam=None):
    model = build(seed, torch.bfloat16) if needs_bf16_params(kind) else build(seed)
    opts, scheds = build_optimizers(kind, model, lr=3e-3, lr_factor=lam or (lambda s: min(1.0, (s + 1) / 3)))

    def fb(tokens):
        logits = model(tokens[:, :-1])
        logits = getattr(logits, "logits", logits)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss

    cfg = tmc.CheckpointConfig(tiers=tiers, window=tmc.SparseConfig(window=3), max_grad_norm=0.5)
    losses = {}
    ckpt = tmc.Checkpointer(model, opts, fb, scheds, cfg, seed=0)  # the run's seed: `seed` varies the init only
    for step in range(ckpt.resume() + 1, steps + 1):
        losses[step] = ckpt.step(batch_for(step))
        if step == stop_after:
            break
    ckpt.close()
    return model, opts, scheds, losses, ckpt


def assert_same(a, b) -> int:
    """torch.equal on every model tensor, every optimizer's state dict and LRs; returns tensors compared."""
    n = 0
    for (k, x), (k2, y) in zip(a[0].state_dict().items(), b[0].state_dict().items()):
        assert k == k2 and x.dtype == y.dtype and torch.equal(x, y), k
        n += 1
    for oa, ob in zip(a[1], b[1]):
        sa, sb = oa.state_dict(), ob.state_dict()
        assert sa["param_groups"] == sb["param_groups"]
        assert sa["state"].keys() == sb["state"].keys()
        for i in sa["state"]:
            assert sa["state"][i].keys() == sb["state"][i].keys()
            for key, x in sa["state"][i].items():
                y = sb["state"][i][key]
                assert x.dtype == y.dtype and torch.equal(x, y), (type(oa).__name__, i, key)
                n += 1
    for s, loss in b[3].items():
        assert torch.equal(loss, a[3][s]), s
    return n


CASES = ["sgd", "amsgrad", "adamw-bf16", "muon-adamw", "adafactor-adamw"]


@pytest.mark.parametrize("kind", CASES)
def test_recovers_exactly(kind, tmp_path):
    ref = train(kind, 10)
    tiers = tmc.TierConfig(root=str(tmp_path), run_id=kind)
    train(kind, 10, tiers=tiers, stop_after=7)  # "dies" after iteration 7: windows 1-3, 4-6 committed
    got = train(kind, 10, seed=123, tiers=tiers)  # another init: only recovery can make it equal
    assert got[4].resumed.recovered_step == 6 and sorted(got[3]) == [7, 8, 9, 10]
    assert assert_same(ref, got) > 40
    keys = {k for o in got[1] for st in o.state.values() for k in st}
    want = {
        "sgd": {"momentum_buffer"},
        "amsgrad": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
        "adamw-bf16": {"step", "exp_avg", "exp_avg_sq"},
        "muon-adamw": {"momentum_buffer", "step", "exp_avg", "exp_avg_sq"},
        "adafactor-adamw": {"step", "row_var", "col_var", "variance", "exp_avg", "exp_avg_sq"},
    }[kind]
    assert keys == want


def test_logged_lrs_of_every_optimizer_are_replayed(tmp_path):
    """A run extended with a longer cosine schedule: the replayed iterations used the old schedule's LRs, Muon's
    and AdamW's (another base LR each), which only the log still knows."""
    import math

    def cosine(total):
        return lambda s: 0.1 + 0.5 * (1 + math.cos(math.pi * min(s, total) / total))

    old, new = cosine(12), cosine(18)
    ref = train("muon-adamw", 18, lam=lambda s: old(s) if s <= 11 else new(s))  # iterations 1..12 on the old one
    tiers = tmc.TierConfig(root=str(tmp_path), run_id="extend")
    train("muon-adamw", 12, tiers=tiers, lam=old)
    got = train("muon-adamw", 18, seed=5, tiers=tiers, lam=new)
    assert got[4].resumed.recovered_step == 12 and sorted(got[3]) == list(range(13, 19))
    assert assert_same(ref, got) > 40


def test_replay_sets_every_groups_logged_hyper_parameters():
    from torchmoe_ckpt.recovery.replay_log import Replay, group_hyper

    a, b = nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(3))
    muon, adamw = torch.optim.Muon([a], lr=0.02, momentum=0.95), torch.optim.AdamW([b], lr=1e-3, betas=(0.9, 0.95))
    logged = Replay(None, None, None, (0.02, 1e-3), hyper=group_hyper(muon.param_groups + adamw.param_groups))
    muon.param_groups[0].update(lr=5.0, momentum=0.5)  # what another schedule would say now
    adamw.param_groups[0].update(lr=7.0, betas=(0.5, 0.5), weight_decay=0.3)
    logged.apply_lrs([muon, adamw])
    assert (muon.param_groups[0]["lr"], muon.param_groups[0]["momentum"]) == (0.02, 0.95)
    g = adamw.param_groups[0]
    assert (g["lr"], g["betas"], g["weight_decay"]) == (1e-3, (0.9, 0.95), 1e-2)


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 24), nn.Linear(24, 16)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class ListMoE(nn.Module):
    """Per-expert parameters (an nn.ModuleList of experts): every tensor belongs to one operator whole."""

    def __init__(self, seed: int, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(64, 16)
        self.router = nn.Linear(16, 4, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(4))
        self.head = nn.Linear(16, 64)

    def forward(self, tokens):
        x = self.embed(tokens)
        w, idx = self.router(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            hit = idx == e
            rows = hit.any(-1)
            if rows.any():
                out[rows] += (w * hit).sum(-1, keepdim=True)[rows] * expert(x[rows])
        return self.head(x + out)


def test_adafactor_alone_on_per_expert_parameters(tmp_path):
    """Adafactor's factored row/col statistics of whole per-expert matrices, its vector variances, its steps."""
    ref = train("adafactor-adamw", 10, build=ListMoE)
    assert len(ref[1]) == 1 and isinstance(ref[1][0], torch.optim.Adafactor)  # no grouped tensor: no AdamW
    tiers = tmc.TierConfig(root=str(tmp_path), run_id="adafactor")
    train("adafactor-adamw", 10, tiers=tiers, stop_after=7, build=ListMoE)
    got = train("adafactor-adamw", 10, seed=123, tiers=tiers, build=ListMoE)
    assert got[4].resumed.recovered_step == 6
    assert assert_same(ref, got) > 20


@pytest.mark.parametrize("kind", ["adamw", "amsgrad", "sgd", "muon-adamw", "adafactor-adamw"])
def test_state_made_up_front_is_what_lazy_init_makes(kind):
    """Two identical runs, one with the state created up front (init_optimizer_state) and one left to the
    optimizers' own lazy init, stay equal bit for bit: the up-front state is exactly the lazy one."""
    runs = []
    for early in (False, True):
        model = mixtral(0)
        opts, _ = build_optimizers(kind, model, lr=3e-3)
        if early:
            init_optimizer_state(opts)
            assert all(len(o.state) == sum(len(g["params"]) for g in o.param_groups) for o in opts) or kind == "sgd"
        for step in range(1, 4):
            tokens = batch_for(step)
            F.cross_entropy(model(tokens[:, :-1]).logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
            for o in opts:
                o.step()
                o.zero_grad()
        runs.append((model, opts, None, {}))
    assert assert_same(runs[0], runs[1]) > 20


def test_slot_bytes_are_the_real_state_bytes():
    """An operator's full copy holds its parameters and every byte of their optimizer state, sliced per expert:
    AdamW fp32 12 B/param, bf16 states 8, SGD 8, Adafactor's factored statistics (rows + columns per matrix)."""
    per_param = {}
    for kind in ("adamw", "adamw-bf16", "sgd", "muon-adamw", "adafactor-adamw"):
        model = mixtral(0)  # fp32 masters; with bf16 states: TorchTitan's layout (8 B/param)
        opts, _ = build_optimizers(kind, model, lr=1e-3)
        ops = {o.name: o for o in discover_operators(model)}
        attach_optimizer_state(model, ops, opts)
        e1 = ops["model.layers.0.mlp.experts.1"]
        items, scalars = full_specs(e1)
        assert sum(it[2].numel * it[4].itemsize for it in items) + sum(
            d.itemsize for _, _, s in scalars for _, d in s
        ) == (e1.full_bytes())
        per_param[kind] = (e1.full_bytes() - 4 * len(scalars) * (kind != "sgd")) / e1.param_numel()
        if kind == "adafactor-adamw":  # the router [E, D] on Adafactor: master + one row value per expert + D cols
            r = ops["model.layers.0.mlp.router"]
            e, d = r.pieces[0].shape
            assert r.full_bytes() == 4 * (e * d + e + d) + 4  # + its step
        # every piece of expert 1 is the [1, ...] slice at offset 1 of the grouped tensor, for its state too
        assert all(it[2].global_offset[0] == 1 for it in items)
    assert per_param["adamw"] == 12 and per_param["adamw-bf16"] == 8 and per_param["sgd"] == 8
    assert per_param["muon-adamw"] == 12  # the grouped expert tensors are on AdamW


def test_factored_state_is_cut_along_the_dims_it_keeps():
    """A factored state of a grouped tensor (what Adafactor keeps per matrix, on a per-matrix optimizer) is cut
    along the expert dim it keeps; a state that reduces the expert dim cannot be cut per operator: refused."""
    from torchmoe_ckpt.model.optim_state import UpdateRule, register_update_rule

    class RowScaled(torch.optim.SGD):
        """SGD whose state is one value per row of each matrix (factored over the last dim)."""

        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        st = self.state[p]
                        st["row"] = st.get("row", torch.zeros(*p.shape[:-1], 1)) + p.grad.pow(2).sum(-1, keepdim=True)
                        p.data.add_(p.grad / (st["row"].sqrt() + 1), alpha=-g["lr"])

    def init(group, p, dtype):
        return {"row": torch.zeros(*p.shape[:-1], 1)} if p.dim() > 1 else {"row": torch.zeros(1)}

    register_update_rule(RowScaled, UpdateRule("matrix", init, "scales rows"))
    model = mixtral(0)
    opt = RowScaled(model.parameters(), lr=0.1)
    ops = {o.name: o for o in discover_operators(model)}
    attach_optimizer_state(model, ops, opt)
    (row,) = [s for s in ops["model.layers.1.mlp.experts.2"].state["model.layers.1.mlp.experts.down_proj"]]
    assert (
        row.piece.global_shape == (4, 16, 1) and row.piece.global_offset == (2, 0, 0) and row.piece.shape == (1, 16, 1)
    )

    def init_cols(group, p, dtype):  # one value per column over all experts: shared by every expert
        return {"row": torch.zeros(1, *p.shape[1:])} if p.dim() > 1 else {"row": torch.zeros(1)}

    register_update_rule(RowScaled, UpdateRule("element", init_cols))
    other = mixtral(0)
    with pytest.raises(tmc.UncapturedStateError, match=r"reduces dim 0, along which .*experts.0 is cut") as exc:
        attach_optimizer_state(other, discover_operators(other), RowScaled(other.parameters(), lr=0.1))
    assert "\n" not in str(exc.value)


def test_refusals_are_one_line_each():
    model = mixtral(0)
    params = list(model.parameters())

    def refused(opt, match, m=model):
        with pytest.raises(tmc.UncapturedStateError, match=match) as exc:
            tmc.Checkpointer(m, opt, lambda b: b)
        assert "\n" not in str(exc.value), exc.value

    refused(torch.optim.LBFGS(params), "LBFGS keeps one state for all its parameters and steps through a closure")
    refused(torch.optim.RMSprop(params), "RMSprop has an update rule the checkpointer does not know")

    class MyAdam(torch.optim.AdamW):
        def step(self, closure=None):
            return super().step(closure)

    refused(MyAdam(params), "MyAdam has an update rule the checkpointer does not know")
    refused(torch.optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.1), r"SGD\(dampening=0.1\) starts its momentum")
    refused(
        [torch.optim.AdamW(params), torch.optim.SGD(params[:2], lr=0.1)],
        "parameter model.embed_tokens.weight is in two optimizers",
    )
    refused([torch.optim.AdamW(params[1:])], "parameter model.embed_tokens.weight is not in the optimizer")
    # Adafactor on the grouped experts is not refused: each layer's experts become one operator
    # (tests/model/test_granularity.py). Operators discovered WITHOUT the optimizer that cut a tensor it updates as
    # a whole are: Muon (torch takes 2-D tensors only) on a 2-D tensor cut into experts, inside its matrix.
    grouped2d = mixtral(0)
    with torch.no_grad():
        for layer in grouped2d.model.layers:
            w = layer.mlp.experts.down_proj
            layer.mlp.experts.down_proj = nn.Parameter(w.reshape(4, -1))  # [E, D*F]: still one row per expert
    two_d = [p for n, p in grouped2d.named_parameters() if p.dim() == 2]
    rest = [p for n, p in grouped2d.named_parameters() if p.dim() != 2]
    with pytest.raises(
        tmc.UncapturedStateError,
        match=r"Muon orthogonalises each 2-D parameter as a whole.*"
        r"discover_operators\(model, optimizer=...\)",
    ) as exc:
        ops = discover_operators(grouped2d)
        attach_optimizer_state(grouped2d, ops, [torch.optim.Muon(two_d), torch.optim.AdamW(rest)])
    assert "\n" not in str(exc.value)
    # state that is not a tensor, or that changes after the first step
    opt = torch.optim.AdamW(params)
    opt.state[params[0]]["note"] = "x"
    refused(opt, "optimizer state 'note' of model.embed_tokens.weight is a str, not a tensor")


def test_state_changed_after_the_first_step_is_refused(tmp_path):
    model = mixtral(0)
    opt = torch.optim.AdamW(model.parameters())

    def fb(tokens):
        loss = F.cross_entropy(model(tokens[:, :-1]).logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss

    opt.register_step_post_hook(lambda o, a, k: o.state[next(model.parameters())].update(extra=torch.zeros(1)))
    ck = tmc.Checkpointer(model, opt, fb)
    ck.resume()
    with pytest.raises(tmc.UncapturedStateError, match=r"optimizer state of model.embed_tokens.weight changed") as exc:
        ck.step(batch_for(1))
    assert "\n" not in str(exc.value)
    ck.close()


@pytest.mark.parametrize("kind", ["muon-adamw", pytest.param("sgd", marks=pytest.mark.matrix)])
def test_dcp_user_path_holds_any_optimizer_state(kind, tmp_path, one_rank_group):
    """A DCP user's loop (SparseSchedule(optimizer=...), dcp.save/load with our planners) with Muon + AdamW: the
    slots carry `optim.state.<fqn>.<key>` for every key (momentum_buffer, exp_avg, step, ...), and a fresh trainer
    rebuilt from them by sparse-to-dense equals the trained one bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from torchmoe_ckpt.core.records import IterationRecord
    from torchmoe_harness.trainer import RunConfig, Trainer

    cfg = RunConfig(steps=4, optimizer_kind=kind)
    t = Trainer(cfg)
    sch = tmc.SparseSchedule(t.model, 3, t.compute_dtype, optimizer=t.optimizer)
    keys = set()
    for step in (1, 2, 3):
        res = t.train_step()
        rec = IterationRecord(
            res.step, res.tokens, res.grad_norm, res.lr, res.loss, res.rng_state, lrs=res.lrs, hyper=res.hyper
        )
        m, o = get_state_dict(t.model, tmc.optimizer_list(t.optimizer))
        dcp.save(
            {"model": m, "optim": o},
            planner=tmc.SparseSavePlanner(sch, step, rec),
            storage_writer=tmc.HostWriter(tmp_path / sch.slot_name(step)),
        )
        keys |= {it.role for it in sch.slot_items(step - 1).items if it.key.startswith("optim.")}
    assert "momentum_buffer" in keys and (kind == "sgd" or {"exp_avg", "step"} <= keys)
    want = t.export_state()
    fresh = Trainer(cfg, init_seed=123)
    sch2 = tmc.SparseSchedule(fresh.model, 3, fresh.compute_dtype, optimizer=fresh.optimizer)
    win = tmc.load_sparse_window(sch2, 0, lambda s: tmc.HostReader(tmp_path / sch2.slot_name(s)))
    rep = tmc.sparse_to_dense(fresh, win)
    assert rep.recovered_step == 3
    got = fresh.export_state()
    assert got.keys() == want.keys() and any("momentum_buffer" in k for k in got)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def test_dense_export_holds_every_optimizer(tmp_path):
    """export_dense / load_dense with Muon + AdamW: one flat FQN-keyed optimizer entry (as TorchTitan's container
    saves it) with both optimizers' state; a fresh model and pair of optimizers load it back exactly."""
    from torchmoe_ckpt.dcp.dense_export import export_dense, load_dense

    ref = train("muon-adamw", 4)
    uri = f"file://{tmp_path}/export"
    export_dense(ref[0], ref[1], uri, step=4)
    model = mixtral(123)
    opts, _ = build_optimizers("muon-adamw", model, lr=3e-3)
    assert load_dense(model, opts, uri) == 4
    assert assert_same(ref, (model, opts, None, {})) > 40
    assert any("momentum_buffer" in st for st in opts[0].state.values())
