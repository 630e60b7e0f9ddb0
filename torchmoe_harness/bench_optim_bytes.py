"""What each optimizer's state costs a slot, on the MoE-regime bench model: slot bytes / dense snapshot bytes at
forced W and the auto W a fixed copy budget gives, from the optimizer state as the checkpointer describes it
(torchmoe_ckpt.model.optim_state). Sizes, not timings: deterministic, computed in one process on the meta device (no
memory, no training), for the whole model (a rank's share under expert parallelism has the same ratios).

Kinds: AdamW (fp32 states), AdamW with bf16 states (fp32 masters: TorchTitan's "fused_opt_states_bf16"), Muon +
AdamW as torch.optim.Muon takes it (2-D matrices on Muon; the grouped 3-D experts on AdamW), the same recipe with
the experts on Muon too (TorchTitan's DistMuon, CUDA only: priced with its layout, one momentum buffer per
parameter, which SGD with momentum has too), SGD with momentum, and the two whose update couples a whole grouped
tensor, so that each MoE layer's experts are ONE operator (torchmoe_ckpt/model/granularity.py): Adafactor on
everything, and Muon with the grouped experts on it as one matrix each (momentum layout; as gpt-oss's 2-D expert
biases on torch's Muon do to their layer). Operators are discovered with the optimizers, as the checkpointer does.
"""

from __future__ import annotations

import torch

from torchmoe_ckpt.model.operators import discover_operators
from torchmoe_ckpt.model.optim_state import attach_optimizer_state
from torchmoe_ckpt.model.update_rules import UpdateRule, register_update_rule
from torchmoe_ckpt.planning.schedule import choose_window, plan_window
from torchmoe_harness.model import TinyMoE, TinyMoEConfig
from torchmoe_harness.optimizers import build_optimizers

KINDS = ("adamw", "adamw-bf16", "muon-adamw", "distmuon-adamw", "sgd", "adafactor", "muon-merged")
LABELS = {
    "adamw": "AdamW",
    "adamw-bf16": "AdamW, bf16 states",
    "muon-adamw": "Muon (2-D) + AdamW",
    "distmuon-adamw": "Muon (2-D and experts, DistMuon layout) + AdamW",
    "sgd": "SGD + momentum",
    "adafactor": "Adafactor (experts merged per layer)",
    "muon-merged": "Muon, experts as one matrix (merged per layer) + AdamW",
}


class _WholeTensorMuon(torch.optim.SGD):
    """Priced, never stepped: Muon's state (one momentum buffer) on an update that couples the whole tensor."""


register_update_rule(
    _WholeTensorMuon,
    UpdateRule(
        "tensor",
        lambda g, p, dt: {"momentum_buffer": torch.zeros_like(p, dtype=dt)},
        "orthogonalises a grouped expert tensor as one matrix",
    ),
)


def _optimizers(kind: str, model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    if kind not in ("distmuon-adamw", "muon-merged"):
        return build_optimizers(kind, model, lr=1e-3)[0]
    named = [(n, p) for n, p in model.named_parameters()]
    mats = [p for n, p in named if p.dim() >= 2 and not any(k in n for k in ("tok_embeddings", "output"))]
    rest = [p for n, p in named if not any(p is q for q in mats)]
    if kind == "muon-merged":  # the grouped experts on a whole-tensor Muon, the other matrices on a per-matrix one
        grouped = [p for p in mats if p.dim() >= 3]
        flat = [p for p in mats if p.dim() < 3]
        return [
            _WholeTensorMuon(grouped, lr=1e-3, momentum=0.9),
            torch.optim.SGD(flat, lr=1e-3, momentum=0.9),
            torch.optim.AdamW(rest, lr=1e-3),
        ]
    # DistMuon's state is one momentum buffer shaped like its parameter: SGD's layout (priced, not trained).
    return [torch.optim.SGD(mats, lr=1e-3, momentum=0.9), torch.optim.AdamW(rest, lr=1e-3)]


def byte_ratios(model_cfg: dict, windows=(2, 4, 8), budget_fraction: float = 0.3) -> dict:
    """Per compute dtype and kind: bytes per parameter of a full copy, dense snapshot bytes, mean and worst slot
    bytes / dense bytes at each forced W, and the auto W (Algorithm 1, real sizes) for a copy budget of
    `budget_fraction` x AdamW's fp32 dense snapshot, the same budget for every kind."""
    with torch.device("meta"):
        model = TinyMoE(TinyMoEConfig(**model_cfg))
    params = sum(p.numel() for p in model.parameters())
    out: dict = {"params": params, "budget_fraction": budget_fraction, "windows": list(windows), "compute": {}}
    sizes = {}
    for kind in KINDS:
        opts = _optimizers(kind, model)
        ops = {o.name: o for o in discover_operators(model, optimizer=opts)}  # as fine as the optimizer allows
        attach_optimizer_state(model, ops, opts)
        sizes[kind] = ops
    budget = None
    for compute in (torch.float32, torch.bfloat16):
        rows = {}
        for kind, ops in sizes.items():
            full = {n: o.full_bytes() for n, o in ops.items()}
            comp = {n: o.compute_bytes(compute.itemsize) for n, o in ops.items()}
            rank = {"expert": 0, "router": 1, "dense": 2}
            order = [o.name for o in sorted(ops.values(), key=lambda o: rank[o.kind])]  # experts, routers, dense
            dense = sum(full.values())
            if budget is None:
                budget = budget_fraction * dense  # AdamW, fp32: the first row
            row = {
                "dense_bytes": dense,
                "bytes_per_param": dense / params,
                "operators": len(ops),
                "largest_operator": max(full.values()) / dense,  # the floor of a slot's full-state part
                "forced": {},
            }
            for w in windows:
                plan = plan_window(order, full, comp, float("inf"), forced_window=w, warn=False)
                row["forced"][w] = {
                    "mean": sum(s.bytes for s in plan.slots) / w / dense,
                    "worst": plan.worst_slot_bytes / dense,
                }
            auto = choose_window(order, full, comp, budget)
            plan = plan_window(order, full, comp, budget, auto_window=auto, warn=False)
            row["auto"] = {"W": auto, "mean": sum(s.bytes for s in plan.slots) / auto / dense, "fits": plan.fits}
            rows[kind] = row
        out["compute"][str(compute).replace("torch.", "")] = rows
    out["budget_bytes"] = budget
    return out


def markdown(res: dict) -> list[str]:
    ws = res["windows"]
    lines = [
        f"### Optimizer state in a slot ({res['params'] / 1e6:.1f} M parameters; sizes, not timings)",
        "",
        "Mean slot bytes / dense snapshot bytes at forced W, and the auto W (Algorithm 1 on the real per-operator "
        f"sizes) for one copy budget, {res['budget_fraction']:.0%} of AdamW's fp32 dense snapshot "
        f"({res['budget_bytes'] / 1e6:.1f} MB), the same for every optimizer.",
        "",
    ]
    for compute, rows in res["compute"].items():
        lines += [
            f"| optimizer ({compute} compute) | full copy B/param | dense MB | operators | largest / dense | "
            + " | ".join(f"W={w} mean (worst)" for w in ws)
            + " | auto W | auto mean |",
            "|---|---|---|---|---|" + "---|" * len(ws) + "---|---|",
        ]
        for kind, r in rows.items():
            by_w = {int(w): v for w, v in r["forced"].items()}  # read back from bench.json the keys are strings
            forced = " | ".join(f"{by_w[w]['mean']:.3f} ({by_w[w]['worst']:.3f})" for w in ws)
            # results measured before these two columns existed read back as "-"
            largest = f"{r['largest_operator']:.3f}" if "largest_operator" in r else "-"
            lines.append(
                f"| {LABELS[kind]} | {r['bytes_per_param']:.2f} | {r['dense_bytes'] / 1e6:.1f} | "
                f"{r.get('operators', '-')} | {largest} | {forced} | "
                f"{r['auto']['W']} | {r['auto']['mean']:.3f} |"
            )
        lines.append("")
    return lines
