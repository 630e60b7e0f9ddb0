"""What sparse checkpointing costs on each TorchTitan MoE family: slot bytes over dense bytes, and the auto W.

    python -m titan_integration.family_costs          # a markdown table, one row per family flavour

Sizes, not timings: each family's model is built on the meta device (no memory, no training) at TorchTitan's
own debug flavour and at our tiny one, its operators discovered as a run discovers them, and the window planned by
the library's Algorithm 1 (torchmoe_ckpt.planning.schedule) with AdamW's state layout (fp32 master + 2 moments)
and bf16 compute weights for frozen operators, as on a GPU. The auto W is the one a copy budget of
``budget_fraction`` x the dense snapshot gives (the same rule as bench_optim_bytes's); MoE shapes differ (experts'
share of the state, shared experts, vision towers), so the ratio differs by family.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

__all__ = ["FamilyCost", "family_cost", "family_costs", "markdown"]

FLAVORS = (
    ("deepseek_v3", "debugmodel"),
    ("qwen3", "debugmodel_moe"),
    ("gpt_oss", "debugmodel"),
    ("kimi_k2_7", "debugmodel"),
    ("qwen3_5", "debugmodel_moe"),
    ("deepseek_v3", "tiny"),
    ("qwen3", "tiny"),
    ("gpt_oss", "tiny"),
    ("kimi_k2_7", "tiny"),
    ("qwen3_5", "tiny"),
)


@dataclass(frozen=True)
class FamilyCost:
    family: str
    flavor: str
    params: int
    experts_per_layer: int
    moe_layers: int
    expert_share: float  # experts' bytes / dense bytes
    dense_bytes: int  # a full copy of every operator (what a dense snapshot copies)
    forced: dict[int, float]  # W -> mean slot bytes / dense bytes
    auto_window: int
    auto_ratio: float  # mean slot bytes / dense bytes at the auto W


def family_cost(family: str, flavor: str, windows=(2, 4, 8), budget_fraction: float = 0.3) -> FamilyCost:
    """Call after :func:`titan_integration.cpu_mode.enable_cpu_mode` (it imports TorchTitan)."""
    import torch

    from titan_integration import families
    from torchmoe_ckpt.model.operators import discover_operators
    from torchmoe_ckpt.planning.schedule import choose_window, plan_window

    spec = families.family_module(family).model_registry(flavor, **dict(families.family(family).cpu_kwargs))
    with torch.device("meta"):
        model = spec.model.build()
    ops = discover_operators(model)
    full = {o.name: o.full_bytes() for o in ops}
    comp = {o.name: o.compute_bytes(torch.bfloat16.itemsize) for o in ops}
    rank = {"expert": 0, "router": 1, "dense": 2}
    order = [o.name for o in sorted(ops, key=lambda o: rank[o.kind])]
    dense = sum(full.values())
    forced = {}
    for w in windows:
        plan = plan_window(order, full, comp, float("inf"), forced_window=w, warn=False)
        forced[w] = sum(s.bytes for s in plan.slots) / w / dense
    budget = budget_fraction * dense
    auto = choose_window(order, full, comp, budget)
    plan = plan_window(order, full, comp, budget, auto_window=auto, warn=False)
    experts = [o for o in ops if o.kind == "expert"]
    return FamilyCost(
        family=family,
        flavor=flavor,
        params=sum(p.numel() for p in model.parameters()),
        experts_per_layer=1 + max(o.expert or 0 for o in experts),
        moe_layers=len({o.moe for o in experts}),
        expert_share=sum(full[o.name] for o in experts) / dense,
        dense_bytes=dense,
        forced=forced,
        auto_window=auto,
        auto_ratio=sum(s.bytes for s in plan.slots) / auto / dense,
    )


def family_costs(flavors=FLAVORS) -> list[FamilyCost]:
    from titan_integration.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    return [family_cost(f, v) for f, v in flavors]


def markdown(rows: list[FamilyCost]) -> list[str]:
    ws = sorted(rows[0].forced) if rows else []
    head = "| family | flavour | params | E x MoE layers | experts' share | " + " | ".join(f"W={w}" for w in ws)
    lines = [head + " | auto W (budget 0.3 x dense) |", "|" + "---|" * (6 + len(ws))]
    for r in rows:
        lines.append(
            f"| {r.family} | {r.flavor} | {r.params / 1e6:.2f} M | {r.experts_per_layer} x {r.moe_layers} | "
            f"{r.expert_share:.2f} | "
            + " | ".join(f"{r.forced[w]:.3f}" for w in ws)
            + f" | {r.auto_window} ({r.auto_ratio:.3f}) |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m titan_integration.family_costs", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="one JSON object per family flavour instead of a table")
    args = p.parse_args(argv)
    rows = family_costs()
    if args.json:
        import json

        for r in rows:
            print(json.dumps(asdict(r)))
    else:
        print("\n".join(markdown(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
