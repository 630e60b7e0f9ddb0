"""The ETTR section of `make bench`: useful training time of every exact system under failures, on the same
failure iterations, across copy regimes; measured, simulated, and where sparse windows win.

`run(out, say) -> dict`, `markdown(res) -> list[str]`, `plot(res, path)` (the section interface of
`bench.run_bench`); alone: `python -m torchmoe_harness.bench_ettr [--quick] [--out DIR]`.

Method (docs/benchmarks.md, "ETTR"): the MoE-regime model (bench_moe.RUN, fp32), 2 ranks, one torchrun job
(bench_ettr_worker). Failures strike the same iterations for every system: `FAILURES` per run, a Poisson
process in iterations conditioned on that count (ettr.failure_iterations), at two MTBFs. A failure throws the
state away in place, the same for every system (baselines.common.lose_state), each loads what survived into
it; per failure the phases: the failed iteration, find, rebuild, load, replay, redo. Systems: a dense snapshot
every iteration (Gemini-style host copy, k = 1), the same at its ETTR-optimal interval, a DCP async_save at its
best interval, and ours (auto W). The regime axis is the dense snapshot's copy time / step: the machine's own
(a CPU memcpy), then slower host links emulated by a copy-bandwidth cap (`SnapshotEngine.throttle_bytes_per_s`:
the copy thread sleeps, as a DMA transfer costs no CPU), measured at the frequent-failure MTBF and simulated at
the other from each point's measured profiles. Measured ETTR = iterations x no-checkpoint step / wall; the
simulator (ettr.simulate_iterations) gets each run's iteration time, mean recovery, interval and commit lag and
replays the same failure iterations. ettr_regime extends the axis to MoEvement's Table 3 setting."""

from __future__ import annotations

import json
import shutil
import statistics
import time
from pathlib import Path

from torchmoe_ckpt.ops.status import PHASES as PHASE_COLUMNS
from torchmoe_harness.bench_moe import RUN
from torchmoe_harness.ettr import SystemProfile, failure_iterations, simulate_iterations
from torchmoe_harness.ettr_predict import markdown as terms_markdown
from torchmoe_harness.ettr_predict import prediction_terms
from torchmoe_harness.ettr_regime import crossover, curves
from torchmoe_harness.launch import launch

MTBFS = {"frequent": 20, "rare": 50}  # mean iterations between failures
SWEEP_MTBFS = ("frequent",)  # measured across the regime axis (the other simulated from those profiles)
FAILURES = 8  # per run, at the same iterations for every system
FRACTIONS = (0.5, 1.0, 2.0, 3.0)  # emulated dense-copy / step points, those above the machine's own
MAX_POINTS = 3  # capped points at most
QUICK = {"mtbfs": {"frequent": 6, "rare": 10}, "failures": 2, "fractions": (1.0,), "model": {"num_experts": 8}}
SYSTEMS = ("gemini_k1", "gemini_best", "dcp_async_best", "ours", "ours_W4")
LABELS = {
    "gemini_k1": "dense snapshot every iteration",
    "gemini_best": "dense snapshot at its best interval",
    "dcp_async_best": "DCP async_save at its best interval",
    "ours": "ours (sliding, auto W: a slot fits 0.9 of an iteration)",
    "ours_W4": "ours, sliding, W = 4 (the MoE-regime section's auto W)",
}
GOALS = {
    "recovery_floor": "ours' recovery / (window bytes / its copy speed + replayed x no-ckpt step), worst of 2 configs",
    "redone_per_failure": "ours' iterations redone per failure beyond the replay, worst of auto W and W = 4",
    "ettr_vs_periodic": "ours' measured ETTR - the best periodic baseline's (at its best interval), worst MTBF",
    # A run's ETTR simulated from its own per-event durations matches by construction (~1e-15): no goal. The test of
    # the simulator is whether it predicts: one MTBF's ETTR from the profile measured under the other MTBF.
    "ettr_prediction_error": "|predicted ETTR - measured| / measured, one MTBF's run predicted from the other's "
    "profile, worst system",
}
BOUNDS = {"recovery_floor": (1.2, "<="), "redone_per_failure": (0.5, "<="), "ettr_vs_periodic": (0.0, ">=")}
BOUNDS["ettr_prediction_error"] = (0.05, "<=")


def _spec(settings: dict) -> dict:
    # replay: frozen experts compute no weight gradient (the replay check then compares losses only)
    run = dict(RUN, dtype="fp32", replay_skips_frozen=True)
    if settings.get("model"):
        run["model"] = dict(run["model"], **settings["model"])
    fails = {}
    for i, (label, m) in enumerate(settings["mtbfs"].items()):
        fails[label] = failure_iterations(m, settings["failures"], seed=11 + i)
    return {
        "run": run,
        "mtbfs": settings["mtbfs"],
        "sweep_mtbfs": [m for m in SWEEP_MTBFS if m in settings["mtbfs"]],
        "failures": fails,
        "fractions": list(settings["fractions"]),
        "max_points": MAX_POINTS,
        "calibration_steps": 8,
        "base_steps": 5,
        "max_interval": 32,
        "timeout_s": 300,
    }


# ---- one run: measured and simulated ETTR, phases ---------------------------------------------------------


def analyse_run(rep: dict, t_iter: float, fails: list[int], memcpy: float) -> dict:
    """Measured ETTR of one failure run next to the simulator's for the same failure iterations."""
    steps, recs = rep["steps"], rep["recoveries"]
    lost_s = [r["failed_step_s"] + r["wall_seconds"] for r in recs]
    a = (rep["wall_s"] - sum(lost_s)) / len(rep["step_seconds"])  # the loop's time per executed iteration
    ck = rep.get("checkpoint") or {}
    # ours: the W most of its windows had (auto W may move), windows starting again after each recovery
    ws = ck.get("windows_W") or []
    interval = int(statistics.mode(ws) if ws else ck.get("interval") or 1)
    recovery = statistics.mean(r["wall_seconds"] for r in recs) if recs else 0.0
    lags = ck.get("commit_lag_s") or []  # an async write's: the median (the first export is the slow one)
    profile = SystemProfile(
        rep["system"],
        t_iter,
        interval=interval,
        per_iter_overhead_s=a - t_iter,
        restart_s=recovery,
        commit_lag_s=statistics.median(lags) if lags else 0.0,
    )
    fail_fraction = statistics.mean(r["failed_step_s"] for r in recs) / a if recs else 1.0
    # replayed with the run's own per-event durations, as they happened (recoveries, async commit lags): what
    # the simulator decides is which iterations each failure loses and what that costs at the run's pace
    sliding = bool((rep.get("params") or {}).get("sliding"))
    sim = simulate_iterations(
        profile,
        steps,
        fails,
        fail_fraction,
        recoveries=[r["wall_seconds"] for r in recs],
        sliding=sliding,
        from_recovery=rep["system"] == "ours",
        commit_lags=lags,
        # the loop's own pace, iteration by iteration (scaled to its wall time: the step timer leaves out the
        # loop's per-iteration bookkeeping), and each failure's time in its failed iteration
        iter_times=[x * a * len(rep["step_seconds"]) / sum(rep["step_seconds"]) for x in rep["step_seconds"]]
        if sum(rep["step_seconds"]) > 0
        else None,
        failed_s=[r["failed_step_s"] for r in recs],
    )
    measured = steps * t_iter / rep["wall_s"]
    phases = {k: statistics.mean(r.get("phases", {}).get(k, 0.0) for r in recs) if recs else 0.0 for k in PHASE_COLUMNS}
    phases["failed"] = statistics.mean(r["failed_step_s"] for r in recs) if recs else 0.0
    out = {
        "steps": steps,
        "interval": interval,
        "t_iter": t_iter,
        "iter_s": a,
        "overhead_fraction": a / t_iter - 1,
        "failures": len(recs),
        "recovery_s": recovery,
        "lost_iterations_per_failure": statistics.mean(r["lost_iterations"] for r in recs) if recs else 0.0,
        "replayed_per_failure": statistics.mean(r.get("replayed_iterations", 0) for r in recs) if recs else 0.0,
        "phases_s": phases,
        "measured_ettr": measured,
        "simulated_ettr": sim.ettr,
        "simulated_lost_iterations": sim.lost_iterations,
        "relative_error": abs(sim.ettr - measured) / measured,
        "last_loss": rep.get("last_loss"),
        "profile": profile.to_dict(),
        "fail_fraction": fail_fraction,
        "sim_options": {"sliding": sliding, "from_recovery": rep["system"] == "ours"},
    }
    if recs and any("bytes_loaded" in r for r in recs):  # ours: the floor of its recovery
        # the window's bytes at the copy speed this run's own snapshot copies had (same processes, same load),
        # and, stricter, at an idle memcpy's; plus the replayed iterations at the no-checkpoint step time
        copy = ck.get("copy") or {}
        speed = copy["bytes"] / copy["wall_s"] if copy.get("wall_s") else memcpy
        for key, bw in (("recovery_floor_s", speed), ("recovery_floor_idle_s", memcpy)):
            out[key] = statistics.mean(r["bytes_loaded"] / bw + r.get("replayed_iterations", 0) * t_iter for r in recs)
        out["copy_bytes_per_s"] = speed
        out["recovery_over_floor"] = recovery / out["recovery_floor_s"] if out["recovery_floor_s"] else None
        out["recovery_over_idle_floor"] = recovery / out["recovery_floor_idle_s"]
    return out


def _simulate_at(row: dict, k1: dict, mtbf_label: str, spec: dict, name: str) -> float:
    """Simulated ETTR at another MTBF from a point's measured profile (the periodic system's interval chosen
    anew for that MTBF from its k = 1 run)."""
    from dataclasses import replace

    from torchmoe_harness.bench_ettr_worker import _best

    steps, fails = spec["failures"][mtbf_label]
    p = SystemProfile(**row["profile"])
    if name == "gemini_best":
        t, a1 = k1["t_iter"], k1["iter_s"]
        k = _best(t, a1, k1["recovery_s"], spec["mtbfs"][mtbf_label], spec["max_interval"])
        p = replace(SystemProfile(**k1["profile"]), interval=k, per_iter_overhead_s=(a1 - t) / k)
    return simulate_iterations(p, steps, fails, row["fail_fraction"], **row.get("sim_options", {})).ettr


def _predictions(rows: dict, spec: dict) -> dict:
    """The simulator as a predictor: each system's ETTR at the machine's regime under one MTBF's failures,
    simulated from its run under the other MTBF's (its iteration time, mean recovery, interval), against what
    was measured there."""
    out = {}
    labels = list(spec["mtbfs"])
    for src, dst in ((a, b) for a in labels for b in labels if a != b):
        for name in ("gemini_k1", "gemini_best", "ours", "ours_W4", "dcp_async_best"):
            have, want = rows.get(f"natural/{src}/{name}"), rows.get(f"natural/{dst}/{name}")
            k1 = rows.get(f"natural/{src}/gemini_k1")
            if have is None or want is None or k1 is None or name == "dcp_async_best":
                continue  # DCP's durability lags are its run's own: not predicted across MTBFs
            pred = _simulate_at(have, k1, dst, spec, name)
            out[f"{name}: {src} -> {dst}"] = {
                "predicted": pred,
                "measured": want["measured_ettr"],
                "relative_error": abs(pred - want["measured_ettr"]) / want["measured_ettr"],
            }
    return out


def analyse(rep: dict, spec: dict) -> dict:
    runs, keys = rep["runs"], list(rep["runs"])
    befores = [runs[k].get("t_before") for k in keys if "same_as" not in runs[k]]
    t_after = rep["t_after_s"]
    out: dict = {"points": rep["points"], "rows": {}}
    i = 0
    for key in keys:
        r = runs[key]
        point, mtbf, name = key.split("/")
        if "same_as" in r:  # gemini's best interval was 1 at this point: the k = 1 run's row
            out["rows"][key] = dict(out["rows"][f"{point}/{mtbf}/{r['same_as']}"], same_as=r["same_as"])
            continue
        nxt = befores[i + 1] if i + 1 < len(befores) else t_after
        t_iter = (r["t_before"] + nxt) / 2  # the no-checkpoint phases right before and after this run
        i += 1
        row = analyse_run(r, t_iter, spec["failures"][mtbf][1], rep["memcpy_bytes_per_s"])
        row.update(point=point, mtbf=mtbf, system=name, spec=r.get("system_spec"))
        out["rows"][key] = row
    out["sweep"] = _sweep(out, spec)
    out["predictions"] = _predictions(out["rows"], spec)
    # where the predictions miss: each term from the destination run in turn (ettr_predict.py), and how much the
    # no-checkpoint step every ETTR is measured against moved between the job's reference phases
    out["prediction_terms"] = prediction_terms(out["rows"], spec, out["predictions"])
    refs = [r["t_iter"] for r in out["rows"].values() if not r.get("same_as")]
    out["reference_step_s"] = [min(refs), max(refs)] if refs else None
    return out


def _sweep(res: dict, spec: dict) -> dict:
    """Per MTBF: ETTR of every system at each regime point (measured where run, else simulated from the point's
    measured profiles), and the crossover of ours against the dense snapshot every iteration and at its best."""
    rows, pts = res["rows"], res["points"]
    fractions = [p["fraction"] for p in pts]
    sweep: dict = {}
    for mtbf in spec["mtbfs"]:
        series: dict[str, list] = {}
        for p in pts:
            for name in ("gemini_k1", "gemini_best", "ours"):
                key = f"{p['name']}/{mtbf}/{name}"
                if key in rows:
                    series.setdefault(name, []).append({"ettr": rows[key]["measured_ettr"], "measured": True})
                else:
                    src = next(m for m in spec["sweep_mtbfs"])
                    base, k1 = rows[f"{p['name']}/{src}/{name}"], rows[f"{p['name']}/{src}/gemini_k1"]
                    e = _simulate_at(base, k1, mtbf, spec, name)
                    series.setdefault(name, []).append({"ettr": e, "measured": False})
        sweep[mtbf] = {
            "fractions": fractions,
            "series": series,
            "crossover_vs_every_iteration": crossover(fractions, series["ours"], series["gemini_k1"]),
            "crossover_vs_best_interval": crossover(fractions, series["ours"], series["gemini_best"]),
        }
    return sweep


def goals(res: dict, spec: dict) -> dict:
    rows = res["rows"]
    ours = [r for k, r in rows.items() if r["system"] == "ours" and r["point"] == "natural"]
    both = [r for k, r in rows.items() if r["system"] in ("ours", "ours_W4") and r["point"] == "natural"]
    vals = {  # the recovery's own goals on both configurations of ours; ETTR on the one it is run with
        "recovery_floor": max((r.get("recovery_over_floor") or 0.0) for r in both),
        "redone_per_failure": max(r["lost_iterations_per_failure"] for r in both),
        "ettr_vs_periodic": min(
            r["measured_ettr"]
            - max(
                rows[f"natural/{r['mtbf']}/{n}"]["measured_ettr"]
                for n in ("gemini_best", "dcp_async_best")
                if f"natural/{r['mtbf']}/{n}" in rows
            )
            for r in ours
        ),
        "ettr_prediction_error": max(
            (v["relative_error"] for v in (res.get("predictions") or {}).values()), default=0.0
        ),
    }
    out = {}
    for k, v in vals.items():
        bound, op = BOUNDS[k]
        out[k] = {
            "what": GOALS[k],
            "value": v,
            "goal": f"{op} {bound}",
            "met": v <= bound if op == "<=" else v >= bound,
        }
    return out


def run(out: Path, say, settings: dict | None = None) -> dict:
    t0 = time.perf_counter()
    st = {"mtbfs": MTBFS, "failures": FAILURES, "fractions": FRACTIONS, **(settings or {})}
    spec = _spec(st)
    d = out / "ettr"
    shutil.rmtree(d, ignore_errors=True)
    say(
        f"ettr: same {st['failures']} failure iterations for every system, MTBF {st['mtbfs']} iterations, "
        f"copy regimes {st['fractions']}"
    )
    launch(2, spec, d, 3600, module="torchmoe_harness.bench_ettr_worker")
    rep = json.loads((d / "report.json").read_text())
    res = analyse(rep, spec)
    res.update(
        {k: rep[k] for k in ("t_none_s", "dense_bytes", "dense_copy_s", "memcpy_bytes_per_s", "dcp_stall_s")},
        settings={k: v for k, v in st.items()},
        failures=spec["failures"],
        papers=curves([0.1, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0]),
    )
    res["goals"] = goals(res, spec)
    res["wall_seconds"] = time.perf_counter() - t0
    return res


# ---- report -----------------------------------------------------------------------------------------------


def _f(v, fmt=".3f") -> str:
    return "-" if v is None else format(v, fmt)


def markdown(res: dict) -> list[str]:
    st = res["settings"]
    lines = [
        f"## ETTR under failures: the same {st['failures']} failure iterations for every system "
        f"({res['wall_seconds']:.0f} s)",
        "",
        f"MoE-regime model (fp32), 2 ranks; no-checkpoint step {res['t_none_s'] * 1000:.0f} ms; dense snapshot "
        f"{res['dense_bytes'] / 1e6:.0f} MB/rank, its copy {res['dense_copy_s'] * 1000:.0f} ms "
        f"({res['dense_copy_s'] / res['t_none_s']:.0%} of a step); idle memcpy "
        f"{res['memcpy_bytes_per_s'] / 1e9:.1f} GB/s. MTBF "
        + ", ".join(f"{k}: {v} iterations" for k, v in st["mtbfs"].items())
        + ". Failure iterations: "
        + "; ".join(f"{k}: {v[1]} of {v[0]}" for k, v in res["failures"].items()),
        "",
        "| regime | MTBF | system | interval | failures | step overhead | recovery s | "
        + " | ".join(PHASE_COLUMNS + ("failed",))
        + " | redone / failure | replayed / failure | measured ETTR | simulated | error |",
        "|---|---|---|---|---|---|---|" + "---|" * (len(PHASE_COLUMNS) + 1) + "---|---|---|---|---|",
    ]
    for r in res["rows"].values():
        ph = r["phases_s"]
        lines.append(
            f"| {r['point']} | {r['mtbf']} | {r['system']}{' (= k1)' if r.get('same_as') else ''} | "
            f"{r['interval']} | {r['failures']} | {r['overhead_fraction']:+.1%} | {r['recovery_s']:.3f} | "
            + " | ".join(f"{ph.get(k, 0.0):.3f}" for k in PHASE_COLUMNS + ("failed",))
            + f" | {r['lost_iterations_per_failure']:.2f} | {r['replayed_per_failure']:.2f} | "
            f"{r['measured_ettr']:.3f} | {r['simulated_ettr']:.3f} | {r['relative_error']:.1%} |"
        )
    if res.get("predictions"):
        lines += [
            "",
            "The simulator as a predictor (machine's regime): ETTR under one MTBF's failures simulated from the "
            "run under the other's, against the measured one:",
            "",
            "| system: from -> to | predicted | measured | error |",
            "|---|---|---|---|",
        ]
        for k, v in res["predictions"].items():
            lines.append(f"| {k} | {v['predicted']:.3f} | {v['measured']:.3f} | {v['relative_error']:.1%} |")
        lines += [""] + terms_markdown(res.get("prediction_terms") or {}, BOUNDS["ettr_prediction_error"][0])
        if res.get("reference_step_s"):
            lo, hi = res["reference_step_s"]
            lines.append(
                f"The no-checkpoint step each run's ETTR is measured against moved from {lo * 1e3:.1f} to "
                f"{hi * 1e3:.1f} ms ({hi / lo - 1:.0%}) between the job's reference phases: a measured ETTR is no "
                "steadier than that."
            )
    lines += ["", "Regime sweep (ETTR; `*` simulated from the point's measured profiles):", ""]
    for mtbf, s in res["sweep"].items():
        lines += [f"MTBF {mtbf} ({st['mtbfs'][mtbf]} iterations):", ""]
        lines += ["| system | " + " | ".join(f"{f:.2f}" for f in s["fractions"]) + " |"]
        lines += ["|---|" + "---|" * len(s["fractions"])]
        for name, pts in s["series"].items():
            cells = " | ".join(f"{p['ettr']:.3f}{'' if p['measured'] else '*'}" for p in pts)
            lines.append(f"| {LABELS[name]} | {cells} |")
        lines += [
            "",
            f"crossover (ours >= dense every iteration) at a dense copy of "
            f"{_crossover_text(s['crossover_vs_every_iteration'])} of a step; against the dense snapshot at its "
            f"best interval: {_crossover_text(s['crossover_vs_best_interval'])}",
            "",
        ]
    pap = res["papers"]
    lines += [f"Simulated, {pap['setting']} (ettr_regime):", ""]
    for label, m in pap["mtbfs"].items():
        lines.append(
            f"- MTBF {label}: ours >= dense every iteration from a copy of "
            f"{_crossover_text(m['crossover_vs_every_iteration'])} of a step, >= the dense snapshot at its best "
            f"interval from {_crossover_text(m['crossover_vs_best_interval'])}"
        )
    lines += ["", "| goal | measured | bound | |", "|---|---|---|---|"]
    for g in res["goals"].values():
        lines.append(f"| {g['what']} | {g['value']:.4g} | {g['goal']} | {'met' if g['met'] else 'MISSED'} |")
    return lines + [""]


def _crossover_text(x: float | None) -> str:
    if x is None:
        return "never in the range measured"
    return "every point (0%)" if x == 0 else f"{x:.0%}"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    colors = {"gemini_k1": "tab:red", "gemini_best": "tab:orange", "ours": "tab:green"}
    for ls, (mtbf, s) in zip(("-", "--"), res["sweep"].items()):
        for name, pts in s["series"].items():
            xs, ys = s["fractions"], [p["ettr"] for p in pts]
            axes[0].plot(xs, ys, ls, color=colors[name], label=f"{LABELS[name]}, MTBF {mtbf}")
            axes[0].scatter(
                [x for x, p in zip(xs, pts) if p["measured"]],
                [p["ettr"] for p in pts if p["measured"]],
                color=colors[name],
                s=18,
            )
        if s["crossover_vs_every_iteration"]:  # where ours overtakes the dense snapshot every iteration
            axes[0].axvline(s["crossover_vs_every_iteration"], color="tab:green", ls=ls, lw=0.7)
    axes[0].set_xlabel("dense snapshot copy time / no-checkpoint step (>natural: emulated host-link cap)")
    axes[0].set_ylabel("ETTR")
    axes[0].set_title("this machine (dots measured, lines through simulated points)", fontsize=9)
    axes[0].legend(fontsize=6)
    pap = res["papers"]
    names = {
        "dense every iteration": "tab:red",
        "dense at its best interval": "tab:orange",
        "sparse (ours)": "tab:green",
    }
    for ls, (label, m) in zip(("-", "--"), pap["mtbfs"].items()):
        for name, rows in m["systems"].items():
            axes[1].plot(pap["fractions"], [r["ettr"] for r in rows], ls, color=names[name], label=f"{name}, {label}")
        if m["crossover_vs_every_iteration"]:
            axes[1].axvline(m["crossover_vs_every_iteration"], color="tab:green", ls=ls, lw=0.7)
    axes[1].set_xlabel("dense snapshot copy time / iteration")
    axes[1].set_title(f"simulated: {pap['setting']}", fontsize=9)
    axes[1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="the ETTR section of make bench, alone")
    ap.add_argument("--out", default="/tmp/tmoe-bench-ettr")
    ap.add_argument("--quick", action="store_true", help="tiny settings: a check that it runs end to end")
    a = ap.parse_args()
    out = Path(a.out)
    res = run(out, lambda m: print(f"[bench] {m}", flush=True), QUICK if a.quick else None)
    (out / "ettr.json").write_text(json.dumps(res, indent=1))
    print("\n".join(markdown(res)))
    try:
        plot(res, out / "bench_ettr.png")
    except ImportError:
        pass


if __name__ == "__main__":
    main()
