"""Markdown and plot of the MoE-regime bench section (bench_moe.run's result)."""

from __future__ import annotations

from pathlib import Path

from torchmoe_harness.bench_optim_bytes import markdown as optimizer_markdown


def _ci(t, scale=1000.0, fmt=".1f") -> str:
    m, lo, hi = t
    return f"{m * scale:{fmt}} [{lo * scale:{fmt}}, {hi * scale:{fmt}}]"


def _num(v, fmt=".3f", scale=1.0) -> str:
    return "-" if v is None else f"{v * scale:{fmt}}"


def variant_markdown(v: dict) -> list[str]:
    n = v["noise"]
    lines = [
        f"### {v['dtype']} compute: no checkpoint {v['t_none_s'] * 1000:.0f} ms/step; noise of the "
        f"no-checkpoint turns: spread {n['spread_fraction']:.1%}, cv {n['cv']:.1%}; dense snapshot "
        f"{v['dense_bytes'] / 1e6:.1f} MB/rank, its copy {v['dense_copy_fraction']:.1%} of an iteration; "
        f"idle memcpy {v['memcpy_bytes_per_s'] / 1e9:.1f} GB/s; peak RSS of both ranks with every system's "
        f"buffers alive {(v.get('peak_rss_bytes_all_ranks') or 0) / 2**30:.1f} GiB",
        "",
        "| system | interval | step ms [95% CI] | overhead ms/iter [95% CI] | overhead | checkpoint CPU ms/iter "
        "[95% CI] | copy-thread CPU ms/iter | process CPU ms/iter [95% CI] | bytes/iter vs dense | wait fraction "
        "| W chosen |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in v["systems"].items():
        ws = s.get("windows_W")
        if name == "none":
            lines.append(f"| none | - | {_ci(s['step_s'])} | 0 | 0 | 0 | - | 0 | - | - | - |")
            continue
        bpi = s.get("bytes_per_iteration")
        lines.append(
            f"| {name} | {s['interval']} | {_ci(s['step_s'])} | {_ci(s['overhead_s'])} | "
            f"{s['overhead_fraction']:+.3f} | {_ci(s['ckpt_cpu_s'])} | "
            f"{_num(s.get('copy_cpu_s_per_iteration'), '.2f', 1000)} | {_ci(s['cpu_overhead_s'])} | "
            f"{_num(bpi / v['dense_bytes'] if bpi else None)} | {_num(s.get('wait_fraction'), '.4f')} | "
            f"{'-' if not ws else sorted(set(ws))} |"
        )
    return lines + [""]


def markdown(res: dict) -> list[str]:
    lines = [
        f"## MoE regime: every system checkpoints every iteration ({res['model']['n_layers']} layers x "
        f"{res['model']['num_experts']} experts, top-2, {res['run']['seq_len'] - 1} tokens per rank and step, "
        f"2 ranks; {res['reps']} interleaved repetitions; {res['wall_seconds']:.0f} s)",
        "",
        "Overheads are paired with the no-checkpoint turn of the same repetition; medians over repetitions "
        "with 95% bootstrap intervals. Checkpoint CPU: the copy thread's CPU (time.thread_time) plus the "
        "checkpointer's CPU on the training thread, per iteration; for DCP (writer threads not ours to time) the "
        "process CPU above the paired no-checkpoint turn, shown for every system as process CPU.",
        "",
    ]
    lines += variant_markdown(res["fp32"]) + variant_markdown(res["bf16"])
    if res.get("optimizers"):  # sizes per optimizer (bench_optim_bytes), not timed
        lines += optimizer_markdown(res["optimizers"])
    if res["fp32"].get("intervals"):
        lines += [
            "Periodic baselines at their best interval (ETTR-optimal at MTBF = "
            f"{res['mtbf_iterations']} iterations, from their k = 1 cost): "
            + ", ".join(f"{k} k = {v}" for k, v in res["fp32"]["intervals"].items()),
            "",
        ]
    lines += [
        f"### Real runs with failures (Poisson, MTBF = {res['mtbf_iterations']} iterations)",
        "",
        "| system | interval | failures | iterations lost / failure | recovery s / failure | "
        "recovery / (W x step) | measured ETTR | simulated ETTR | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in res["ettr"].items():
        lines.append(
            f"| {name} | {r['interval']} | {r['measured']['failures']} | "
            f"{_num(r.get('iterations_lost_per_failure'), '.2f')} | {_num(r.get('recovery_s_per_failure'))} | "
            f"{_num(r.get('recovery_over_W_steps'))} | {r['measured']['ettr']:.3f} | "
            f"{r['simulated']['ettr']:.3f} | {r['relative_error']:.1%} |"
        )
    lines += ["", "### Goals", "", "| goal | measured | bound | |", "|---|---|---|---|"]
    for g in res["goals"].values():
        extra = (
            f" (wall clock: {g['wall_value']:.3g})"
            if "wall_value" in g
            else (f" (W = 4: {g['w4_value']:.3f})" if "w4_value" in g else "")
        )
        if "vs_idle_memcpy" in g:
            extra = (
                f" (dense snapshot's copy: {g['dense_value']:.3g}; against an idle memcpy: ours "
                f"{g['vs_idle_memcpy']:.3g}, the plain memcpy under training {g['reference_vs_idle_memcpy']:.3g})"
            )
        lines.append(f"| {g['what']} | {g['value']:.4g}{extra} | {g['goal']} | {'met' if g['met'] else 'MISSED'} |")
    return lines + [""]


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = res["fp32"]["systems"]
    names = [k for k in s if k != "none"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title, scale in (
        (axes[0], "overhead_s", "wall overhead ms/iteration (95% CI)", 1000),
        (axes[1], "ckpt_cpu_s", "checkpoint CPU ms/iteration (95% CI)", 1000),
    ):
        med = [s[n][key][0] * scale for n in names]
        err = [
            [(s[n][key][0] - s[n][key][1]) * scale for n in names],
            [(s[n][key][2] - s[n][key][0]) * scale for n in names],
        ]
        ax.bar(
            range(len(names)), med, yerr=err, color=["tab:green" if n.startswith("ours") else "tab:gray" for n in names]
        )
        ax.set_xticks(range(len(names)), [n.replace("_", "\n") for n in names], fontsize=6)
        ax.set_title(title, fontsize=8)
    axes[1].set_yscale("symlog", linthresh=1.0)  # DCP's hundreds of ms next to ours' few
    g = res["goals"]
    keys = [k for k in g if k not in ("auto_window", "auto_vs_best_forced")]
    vals = [g[k]["value"] / float(g[k]["goal"].split()[1]) for k in keys]
    axes[2].barh(range(len(keys)), vals, color=["tab:green" if g[k]["met"] else "tab:red" for k in keys])
    axes[2].axvline(1.0, color="k", lw=0.8)
    axes[2].set_yticks(range(len(keys)), keys, fontsize=6)
    axes[2].set_title("measured / goal bound (green: met)", fontsize=8)
    fig.suptitle(f"MoE regime (fp32, noise spread {res['fp32']['noise']['spread_fraction']:.0%})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
