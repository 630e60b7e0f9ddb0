"""Where the ETTR simulator's cross-MTBF predictions go wrong (`make bench`'s goal `ettr_prediction_error`,
bench_ettr.py): each prediction's error split by term.

A prediction simulates one MTBF's run from the profile measured under the other MTBF: the no-checkpoint step
`t_iter`, the per-iteration overhead, the mean recovery, the share of its failed iteration a failure takes, the
interval. The measured ETTR it is compared with comes from the destination run's own values of those terms. So
the miss is either a term the model lacks (what a failure costs beyond recovery and lost iterations, a warm-up
after a restart, a stall during recovery) or a term measured differently in the two runs. Each prediction is
redone with the destination run's value of one term put in, then with every term's (the model's own error, its
inputs right):

  pace       the per-iteration overhead as a share of the step (a / t_iter - 1): the checkpoint's cost per step
  recovery   the mean recovery per failure
  failed     the share of its failed iteration a failure takes
  all        every term above from the destination run (and its interval, t_iter): what the model itself misses

A prediction whose error falls under the goal with `pace` alone, while `all` stays small, misses nothing in the
failure model: the per-iteration cost it was given differed from the one the destination run paid."""

from __future__ import annotations

from dataclasses import replace

from torchmoe_harness.ettr import SystemProfile, simulate_iterations

TERMS = ("pace", "recovery", "failed", "all")


def _swapped(src: dict, dst: dict, term: str) -> tuple[SystemProfile, float]:
    """The source run's profile with `term` from the destination run; (profile, fail fraction)."""
    p, d = SystemProfile(**src["profile"]), SystemProfile(**dst["profile"])
    frac = src["fail_fraction"]
    if term == "pace":  # the destination's overhead share, on the source's step time
        p = replace(p, per_iter_overhead_s=p.t_iter * dst["overhead_fraction"])
    elif term == "recovery":
        p = replace(p, restart_s=d.restart_s)
    elif term == "failed":
        frac = dst["fail_fraction"]
    elif term == "all":
        p, frac = d, dst["fail_fraction"]
    return p, frac


def prediction_terms(rows: dict, spec: dict, predictions: dict) -> dict:
    """For each prediction of `bench_ettr._predictions` (key "name: src -> dst"): its error, and its error with
    each term of TERMS taken from the destination run (the gemini_best rows use their own profile, as measured)."""
    out = {}
    for key, pred in predictions.items():
        name, _, route = key.partition(": ")
        src_l, _, dst_l = route.partition(" -> ")
        src, dst = rows.get(f"natural/{src_l}/{name}"), rows.get(f"natural/{dst_l}/{name}")
        if src is None or dst is None:
            continue
        steps, fails = spec["failures"][dst_l]
        entry = {"error": pred["relative_error"], "measured": pred["measured"], "with_destination": {}}
        for term in TERMS:
            p, frac = _swapped(src, dst, term)
            e = simulate_iterations(p, steps, fails, frac, **src.get("sim_options", {})).ettr
            entry["with_destination"][term] = abs(e - pred["measured"]) / pred["measured"]
        entry["overhead_fraction"] = {"source": src["overhead_fraction"], "destination": dst["overhead_fraction"]}
        out[key] = entry
    return out


def verdict(terms: dict, bound: float) -> str:
    """One line: which term carries the worst prediction's error."""
    if not terms:
        return "no predictions"
    key, worst = max(terms.items(), key=lambda kv: kv[1]["error"])
    w = worst["with_destination"]
    best = min(("pace", "recovery", "failed"), key=lambda t: w[t])
    oh = worst["overhead_fraction"]
    return (
        f"worst {key}: {worst['error']:.1%} off; with the destination run's {best} {w[best]:.1%}, with all its "
        f"terms {w['all']:.1%} (the model's own error); its per-iteration overhead was {oh['source']:+.1%} in the "
        f"source run and {oh['destination']:+.1%} in the destination"
        + (": the term that moves is the measured pace, not the failure model" if w["all"] <= bound else "")
    )


def markdown(terms: dict, bound: float) -> list[str]:
    if not terms:
        return []
    lines = [
        "The predictions' error by term (the prediction redone with the destination run's value of one term; "
        "`all`: every term from the destination run, what the model itself misses):",
        "",
        "| system: from -> to | error | with its pace | with its recovery | with its failed share | with all | "
        "overhead/step source -> destination |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, e in terms.items():
        w, oh = e["with_destination"], e["overhead_fraction"]
        lines.append(
            f"| {key} | {e['error']:.1%} | {w['pace']:.1%} | {w['recovery']:.1%} | {w['failed']:.1%} | "
            f"{w['all']:.1%} | {oh['source']:+.1%} -> {oh['destination']:+.1%} |"
        )
    return lines + ["", verdict(terms, bound), ""]
