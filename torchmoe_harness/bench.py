"""`torchmoe-ckpt bench` / `make bench`: measured costs of sparse checkpointing, side by side with a run
without checkpointing and with dense per-iteration snapshots, in the same invocation on the same machine.

Ratios reported per model:
  slot_bytes_ratio   mean bytes copied per slot / bytes of one dense snapshot (goal <= 0.45)
  wait_fraction      training-thread wait / step time, checkpointing every iteration (goal <= 0.02)
  overhead_fraction  step time with checkpointing / step time without - 1
  replay_cost_ratio  recovery time / (W x normal step time) (goal <= 1.0)

Sections (`SECTIONS`): modules with `run(out, say)` / `markdown(res)` run after the per-model tables; the
MoE-regime section (bench_moe: every system checkpointing every iteration, interleaved in the same
processes, with its goals) supersedes the per-model baselines table below (off by default).

Baselines (torchmoe_harness.baselines, one torchrun start per model, same model, ranks and data, one injected
failure each; see docs/benchmarks.md): dense DCP sync / async every k, Gemini-style host-memory snapshots
every k, PEC/MoC (K experts per iteration, Dynamic-K), MoEtion selective (top-S within a byte budget), and
ours through the same runner. Per system: bytes per checkpoint, training-thread wait per iteration,
step-time overhead vs no checkpointing, recovery seconds, iterations lost, tokens lost (lossy) and whether
the final state equals the fault-free run's (torch.equal on every tensor of every rank).
"""

from __future__ import annotations

import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from torchmoe_harness import (
    bench_ettr,
    bench_families,
    bench_moe,
    bench_peer,
    bench_policy,
    bench_restart,
    bench_tiers,
)
from torchmoe_harness.launch import run_torchrun

# Sections after the per-model tables: modules with `run(out, say) -> dict`, `markdown(res) -> list[str]`
# and optionally `plot(res, path)`; each result is stored under its key.
SECTIONS = {
    "moe_regime": bench_moe,
    "ettr": bench_ettr,
    "tiers": bench_tiers,
    "restart": bench_restart,
    "peer_tier": bench_peer,  # 2 namespace nodes at tc tbf link rates; skips in one line without namespaces
    "families": bench_families,
    "policy_sweep": bench_policy,  # what policy="auto" chooses per regime against the dense alternatives (689 s)
}

MODELS = {
    # tiny: mixed precision (bf16 compute, fp32 master) as in the paper; cpu-large: fp32 (bf16 GEMMs are
    # very slow on this AVX2-only CPU), where compute weights cost 4 bytes/parameter instead of 2.
    "tiny": {"model": {}, "batch_size": 2, "seq_len": 16, "steps": 30, "dtype": "bf16"},
    "cpu-large": {
        "model": {
            "vocab_size": 1024,
            "dim": 128,
            "n_layers": 4,
            "n_heads": 4,
            "num_experts": 8,
            "expert_hidden": 256,
            "max_seq_len": 64,
        },
        "batch_size": 4,
        "seq_len": 64,
        "steps": 16,
        "dtype": "fp32",
    },
}
WARMUP = 3
FORCED_W = 4
BASELINE_EVERY = 5  # k for the periodic dense baselines
BASELINES = {  # name -> runner system spec
    "dcp_sync": {"kind": "dcp_sync", "every": BASELINE_EVERY},
    "dcp_async": {"kind": "dcp_async", "every": BASELINE_EVERY},
    "gemini": {"kind": "gemini", "every": BASELINE_EVERY},
    "pec_k1": {"kind": "pec", "k": 1, "selection": "sequential", "dynamic_k": True, "plt_limit": 0.05},
    "moetion_30pct": {"kind": "moetion", "budget_fraction": 0.3},
    f"ours_W{FORCED_W}": {"kind": "ours", "window": FORCED_W},
}


def _median_step(report: dict) -> float:
    return statistics.median(report["step_seconds"][WARMUP:])


def bench_model(name: str, nproc: int, overlap: float, out: Path, say, baselines: bool = True) -> dict:
    m = MODELS[name]
    run = {
        "steps": m["steps"],
        "batch_size": m["batch_size"],
        "seq_len": m["seq_len"],
        "model": m["model"],
        "dtype": m["dtype"],
    }
    fail = [{"step": m["steps"] - 1, "phase": "update"}]  # one failure late in the run, to time recovery
    shm = Path(tempfile.mkdtemp(prefix="tmoe-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    runs = {
        "baseline": {"run": run},
        "baseline_repeat": {"run": run},  # run-to-run noise of this machine, same config
        "dense_W1": {"run": run, "checkpoint": {"window": 1}, "failures": fail},
        "sparse_auto": {"run": run, "checkpoint": {"window": None, "overlap": overlap}, "failures": fail},
        f"sparse_W{FORCED_W}": {"run": run, "checkpoint": {"window": FORCED_W}, "failures": fail},
        # host tier + one peer copy per rank; each rank its own emulated node, so copies cross "nodes"
        f"sparse_W{FORCED_W}_tiers": {
            "run": run,
            "checkpoint": {"window": FORCED_W},
            "host_tier": {
                "root": str(shm),
                "run_id": name,
                "ranks_per_node": 1,
                "replicas": 1,
                "object_store": {"uri": f"file://{shm}/store"},
            },
        },
    }
    reports = {}
    for key, spec in runs.items():
        say(f"{name}: {key}")
        reports[key] = run_torchrun(nproc, spec, out / name / key, timeout=600).report
    say(f"{name}: object-store formats (dcp vs tensorstore) on the newest window of rank 0")
    formats = bench_formats(shm, name, nproc)
    shutil.rmtree(shm, ignore_errors=True)
    t_base = _median_step(reports["baseline"])
    systems = {}
    for key, rep in reports.items():
        t = _median_step(rep)
        row = {"step_s": t, "overhead_fraction": t / t_base - 1.0}
        ck = rep.get("checkpoint")
        if ck:
            rec = (rep.get("recoveries") or [{}])[0]
            w = rec.get("window") or ck["windows"][-1]["W"]
            row.update(
                window=w,
                wait_fraction=ck["wait_seconds_total"] / sum(rep["step_seconds"]),
                dense_bytes=ck["dense_bytes"],
                slot_bytes_ratio=ck["mean_slot_bytes"] / ck["dense_bytes"],
                worst_slot_bytes_ratio=ck["max_slot_bytes"] / ck["dense_bytes"],
            )
            if rec:
                # against this run's own normal step time: separate runs differ by the machine's noise
                row.update(
                    recovery_s=rec["seconds"],
                    replayed_iterations=rec["replayed_iterations"],
                    replay_cost_ratio=rec["seconds"] / (w * t),
                )
            if ck.get("host_tier"):
                ht = ck["host_tier"]
                row.update(
                    host_persist_lag_s=ht["lag_seconds_max"],
                    host_bytes_per_iteration=ht["bytes_written"] / len(rep["step_seconds"]),
                )
            if ck.get("object_store"):
                row.update(
                    upload_lag_s=ck["object_store"]["upload_lag_s_max"],
                    upload_lag_s_per_window=ck["object_store"]["upload_lag_s"],
                    upload_bytes_per_window=ck["object_store"]["bytes"]
                    / max(1, ck["object_store"]["windows_uploaded"]),
                )
            if ck.get("peers"):
                row.update(
                    replication_lag_s=ck["peers"]["replication_lag_s_max"],
                    replication_lag_s_per_window=ck["peers"]["replication_lag_s"],
                    peer_bytes_sent_per_window=ck["peers"]["bytes_sent"] / max(1, ck["peers"]["windows_replicated"]),
                )
        systems[key] = row
    main = systems[f"sparse_W{FORCED_W}"]
    return {
        "model": name,
        "nproc": nproc,
        "dtype": m["dtype"],
        "steps": m["steps"],
        "baseline_step_s": t_base,
        "noise_fraction": abs(systems["baseline_repeat"]["step_s"] / t_base - 1.0),
        "auto_window": systems["sparse_auto"]["window"],
        "overlap": overlap,
        "window": FORCED_W,
        "slot_bytes_ratio": main["slot_bytes_ratio"],
        "worst_slot_bytes_ratio": main["worst_slot_bytes_ratio"],
        "wait_fraction": main["wait_fraction"],
        "replay_cost_ratio": main["replay_cost_ratio"],
        "replication_lag_s": systems[f"sparse_W{FORCED_W}_tiers"].get("replication_lag_s"),
        "upload_lag_s": systems[f"sparse_W{FORCED_W}_tiers"].get("upload_lag_s"),
        "goals": {
            "slot_bytes_ratio<=0.45": main["slot_bytes_ratio"] <= 0.45,
            "wait_fraction<=0.02": main["wait_fraction"] <= 0.02,
            "replay_cost_ratio<=1.0": main["replay_cost_ratio"] <= 1.0,
        },
        "systems": systems,
        "object_store_formats": formats,
        "baselines": bench_baselines(name, nproc, out, say) if baselines else None,
    }


def bench_jit(out: Path, say) -> dict:
    """Iterations lost to one failure with and without the just-in-time checkpoint (jit.py): 2 plain
    data-parallel replicas (hsdp=2 on 2 ranks), window 4, rank 0 killed as iteration 8's backward starts.
    Lost = the failed iteration - the step the restart resumes from (the window alone: 8 - 4)."""
    from torchmoe_harness.launch import compare

    run, fail_at = {"steps": 10, "dtype": "fp32", "hsdp": 2}, 8
    shm = Path(tempfile.mkdtemp(prefix="tmoe-bench-jit-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    say("jit: fault-free reference, then one kill with and without JIT")
    ref = run_torchrun(2, {"run": run}, out / "jit" / "reference", timeout=600)
    res = {"failed_iteration": fail_at, "window": FORCED_W}
    for key, on in (("with_jit", True), ("without_jit", False)):
        (shm / key / "faults").mkdir(parents=True)
        spec = {
            "run": run,
            "checkpoint": {"window": FORCED_W},
            "resume": True,
            "jit": on,
            "timeout_s": 60,
            "watchdog_timeout_s": 30,
            "host_tier": {"root": str(shm / key), "run_id": "jit"},
        }
        r = run_torchrun(
            2,
            spec,
            out / "jit" / key,
            timeout=600,
            max_restarts=1,
            extra_env={
                "TORCHMOE_FAULT": f"kill:point=backward:rank=0:step={fail_at}",
                "TORCHMOE_FAULT_STATE": str(shm / key / "faults"),
            },
        )
        rec = r.report["recoveries"][-1]
        res[key] = {
            "iterations_lost": fail_at - rec["recovered_step"],
            "source": rec.get("source"),
            "recovered_step": rec["recovered_step"],
            "restart_seconds": round(rec["restart_seconds"], 4),
            "exact": compare(r, ref).bit_exact,
        }
    shutil.rmtree(shm, ignore_errors=True)
    return res


def bench_formats(shm: Path, run_id: str, nproc: int) -> dict:
    """Both on-store formats for the same window (rank 0's newest, from the tiers run), on file:// and on S3
    (a moto server started here): bytes and objects written per window, upload time, bytes read to
    recover the rank and to fetch 2 of its experts."""
    from torchmoe_ckpt.tiers.host_tier import HostTier
    from torchmoe_harness.format_compare import compare_formats
    from torchmoe_harness.servers import create_bucket, moto_server

    tier = HostTier(shm / "node-0", run_id, 0, nproc)
    wid = tier.window_ids()[-1]
    res = {"window_id": wid, "file": compare_formats(tier, wid, f"file://{shm}/formats")}
    with moto_server() as server:
        create_bucket(server.storage_options, "tmoe-bench")
        res["s3"] = compare_formats(tier, wid, "s3://tmoe-bench/formats", server.storage_options)
    return res


def bench_baselines(name: str, nproc: int, out: Path, say) -> dict:
    """All baselines and ours in one torchrun start (phases), plus a fault-free reference for exactness."""
    from torchmoe_harness.baselines.runner import run_system
    from torchmoe_harness.launch import compare

    m = MODELS[name]
    run = {
        "steps": m["steps"],
        "batch_size": m["batch_size"],
        "seq_len": m["seq_len"],
        "model": m["model"],
        "dtype": m["dtype"],
    }
    fail = [m["steps"] - 1]
    # no checkpointing first (exactness reference) and last: the first phase of a process runs colder
    phases = (
        [{"name": "none", "run": run}]
        + [{"name": k, "run": run, "system": v, "failures": fail} for k, v in BASELINES.items()]
        + [{"name": "none_end", "run": run}]
    )
    say(f"{name}: baselines ({', '.join(BASELINES)})")
    res = run_system(nproc, {"phases": phases}, out / name / "baselines", timeout=900)
    ref = res["none"]
    t_ref = min(_median_step(ref.report), _median_step(res["none_end"].report))
    rows = {"none": {"step_s": t_ref, "overhead_fraction": 0.0, "exact": True}}
    for key in BASELINES:
        rep = res[key].report
        ck, rec = rep["checkpoint"], rep["recoveries"][0]
        n = len(rep["step_seconds"])
        t = _median_step(rep)
        cmp = compare(ref, res[key])
        rows[key] = {
            "step_s": t,
            "overhead_fraction": t / t_ref - 1.0,
            "interval": ck.get("interval"),
            "bytes_per_checkpoint": ck.get("bytes_per_checkpoint"),
            "checkpoints": ck.get("checkpoints"),
            "wait_per_iteration_s": ck["wait_seconds_total"] / max(1, n),
            "wait_max_s": ck["wait_seconds_max"],
            "recovery_s": rec["wall_seconds"],
            "recovered_step": rec["recovered_step"],
            "failed_at": rec["failed_at"],
            "iterations_lost": rec["lost_iterations"],
            "replayed_iterations": rec.get("replayed_iterations", 0),
            "tokens_lost": ck.get("tokens_lost", 0.0),
            "plt": ck.get("plt", 0.0),
            "exact": cmp.bit_exact,
            "mismatched_tensors": len(cmp.mismatches),
        }
        for extra in ("k", "k_history", "s_total", "export_s_max", "dense_bytes"):
            if extra in ck:
                rows[key][extra] = ck[extra]
    return rows


def report_markdown(res: dict) -> str:
    lines = [f"# torchmoe-ckpt bench ({res['machine']}, {res['nproc']} ranks)", ""]
    for r in res["models"]:
        lines += [
            f"## {r['model']} ({r['dtype']} compute, {r['steps']} steps, baseline "
            f"{r['baseline_step_s'] * 1000:.1f} ms/step, run-to-run noise {r['noise_fraction']:.1%})",
            "",
            f"W={r['window']}: slot_bytes_ratio **{r['slot_bytes_ratio']:.3f}** (worst slot "
            f"{r['worst_slot_bytes_ratio']:.3f}), wait_fraction **{r['wait_fraction']:.4f}**, "
            f"replay_cost_ratio **{r['replay_cost_ratio']:.3f}**; auto W on this machine: {r['auto_window']}",
            "",
            "| system | W | step ms | overhead | wait fraction | slot/dense bytes | worst slot/dense | "
            "recovery s | replayed | replay cost ratio | host persist lag s | replication lag s | upload lag s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for key, s in r["systems"].items():

            def f(k, fmt):
                return format(s[k], fmt) if k in s else "-"  # noqa: B023

            lines.append(
                f"| {key} | {s.get('window', '-')} | {s['step_s'] * 1000:.1f} | {s['overhead_fraction']:+.3f} | "
                f"{f('wait_fraction', '.4f')} | {f('slot_bytes_ratio', '.3f')} | "
                f"{f('worst_slot_bytes_ratio', '.3f')} | {f('recovery_s', '.3f')} | "
                f"{s.get('replayed_iterations', '-')} | {f('replay_cost_ratio', '.3f')} | "
                f"{f('host_persist_lag_s', '.3f')} | {f('replication_lag_s', '.3f')} | "
                f"{f('upload_lag_s', '.3f')} |"
            )
        lines.append("")
        if r.get("object_store_formats"):
            lines += formats_markdown(r["object_store_formats"])
        if r.get("baselines"):
            lines += baselines_markdown(r["baselines"])
    if res.get("jit_iterations_lost"):
        j = res["jit_iterations_lost"]
        lines += [
            f"## Just-in-time checkpoint (2 data-parallel replicas, W={j['window']}, one kill in iteration "
            f"{j['failed_iteration']})",
            "",
            "| | resumes from step | iterations lost | restart s | exact |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {k.replace('_', ' ')} | {j[k]['recovered_step']} | {j[k]['iterations_lost']} | "
            f"{j[k]['restart_seconds']:.3f} | {'yes' if j[k]['exact'] else 'NO'} |"
            for k in ("with_jit", "without_jit")
        ] + [""]
    if res.get("pipeline"):
        p = res["pipeline"]
        lines += [
            f"## Pipeline parallel (PP={p['stages']}, {p['microbatches']} micro-batches, W={p['window']}; "
            f"stage 1 lost after iteration {p['failed_after_iteration']})",
            "",
            f"boundary log: **{p['log_bytes_per_iteration']} bytes per iteration** (all stages)",
            "",
            "| recovery | seconds (median) | iterations recomputed per stage |",
            "|---|---|---|",
            f"| localized | {p['pp_recovery_s_localized']:.3f} | {p['localized_recomputed_iterations']} |",
            f"| global rollback | {p['pp_recovery_s_global']:.3f} | {p['global_recomputed_iterations']} |",
            "",
            f"both exact: {'yes' if p['exact'] else 'NO'}",
            "",
        ]
    for key, section in SECTIONS.items():
        if res.get(key):
            lines += ["", *section.markdown(res[key])]
        elif key in res.get("not_measured", {}):  # a section built after these results, named with the reason
            lines += [
                "",
                f"## Section `{key}`: not measured in these results",
                "",
                f"{res['not_measured'][key]} Run it: `torchmoe-ckpt bench --sections {key} --out benchmarks/results`.",
            ]
    text = "\n".join(lines)
    while "\n\n\n" in text:  # sections end with or without a blank line: one between each
        text = text.replace("\n\n\n", "\n\n")
    return text.rstrip("\n") + "\n"


def formats_markdown(res: dict) -> list[str]:
    lines = [
        f"Object-store formats, window {res['window_id']} of rank 0 (same bytes, both formats):",
        "",
        "| store | format | bytes written | objects | upload s | bytes read to recover the rank | "
        "bytes read for 2 experts |",
        "|---|---|---|---|---|---|---|",
    ]
    for store in ("file", "s3"):
        for fmt in ("dcp", "tensorstore"):
            row = res[store][fmt]
            lines.append(
                f"| {store} | {fmt} | {row['bytes_written']} | {row['objects_written']} | "
                f"{row['upload_s']:.3f} | {row['bytes_read_recover_rank']} | "
                f"{row.get('bytes_read_experts', '-')} |"
            )
    return lines + [""]


def baselines_markdown(rows: dict) -> list[str]:
    dense = next((s["bytes_per_checkpoint"] for k, s in rows.items() if k == "gemini"), None)
    lines = [
        f"Baselines (one failure before the optimizer step of the last-but-one iteration; dense k = "
        f"{BASELINE_EVERY}; same runner for all):",
        "",
        "| system | interval | step ms | overhead | bytes/ckpt | bytes/ckpt vs dense | wait/iter ms | "
        "recovery s | iterations lost | replayed | tokens lost | PLT | exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def num(v, scale=1.0, fmt=".3f", unit=""):
        return "-" if v is None else f"{v * scale:{fmt}}{unit}"

    for key, s in rows.items():
        b = s.get("bytes_per_checkpoint")
        lines.append(
            f"| {key} | {s.get('interval', '-')} | {s['step_s'] * 1000:.1f} | {s['overhead_fraction']:+.3f} | "
            f"{num(b, 1e-6, '.3f', ' MB')} | {num(b / dense if b and dense else None)} | "
            f"{num(s.get('wait_per_iteration_s'), 1000, '.2f')} | {num(s.get('recovery_s'))} | "
            f"{s.get('iterations_lost', '-')} | {s.get('replayed_iterations', '-')} | "
            f"{s.get('tokens_lost', 0):.0f} | {s.get('plt', 0):.3f} | {'yes' if s['exact'] else 'no'} |"
        )
    return lines + [""]


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(res["models"]), figsize=(5 * len(res["models"]), 3.6))
    for ax, r in zip(axes if len(res["models"]) > 1 else [axes], res["models"]):
        keys = [k for k, s in r["systems"].items() if "slot_bytes_ratio" in s]
        x = range(len(keys))
        ax.bar(
            [i - 0.2 for i in x],
            [r["systems"][k]["slot_bytes_ratio"] for k in keys],
            0.4,
            label="bytes per iteration / dense",
        )
        ax.bar(
            [i + 0.2 for i in x],
            [max(0.0, r["systems"][k]["overhead_fraction"]) for k in keys],
            0.4,
            label="step-time overhead",
        )
        ax.set_xticks(list(x), [k.replace("_", "\n") for k in keys], fontsize=7)
        ax.set_title(f"{r['model']} (noise {r['noise_fraction']:.0%})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_baselines(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [r for r in res["models"] if r.get("baselines")]
    if not models:
        return
    metrics = [
        ("bytes_per_checkpoint", "bytes per checkpoint (MB)", 1e-6),
        ("wait_per_iteration_s", "training-thread wait per iteration (ms)", 1e3),
        ("recovery_s", "recovery (s)", 1.0),
        ("iterations_lost", "iterations lost", 1.0),
        ("plt", "portion of lost tokens", 1.0),
    ]
    fig, axes = plt.subplots(len(models), len(metrics), figsize=(3.2 * len(metrics), 3.0 * len(models)), squeeze=False)
    for row, r in zip(axes, models):
        keys = [k for k in r["baselines"] if k != "none"]
        for ax, (m, title, scale) in zip(row, metrics):
            vals = [(r["baselines"][k].get(m) or 0) * scale for k in keys]
            ax.bar(
                range(len(keys)), vals, color=["tab:green" if r["baselines"][k]["exact"] else "tab:red" for k in keys]
            )
            ax.set_xticks(range(len(keys)), [k.replace("_", "\n") for k in keys], fontsize=6)
            ax.set_title(f"{r['model']}: {title}", fontsize=7)
    fig.suptitle("green: exact (final state == fault-free run), red: lossy", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def bench_pipeline(work: Path, say) -> dict:
    """PP=3 (tiny MoE, one rank per stage, 1F1B): boundary-log bytes per iteration, and in the same run
    the recovery time of stage 1 localized (its window + neighbours' logs, others wait) vs a global
    rollback of every stage to the window (docs/pipeline-parallel.md)."""
    from torchmoe_harness.launch import launch, load_result

    out = work / "pipeline"
    spec = {
        "run": {"steps": 14, "model": {"n_layers": 3}, "batch_size": 4},  # lost mid-window: W-1 + 2 replayed
        "pipeline": {"stages": 3, "microbatches": 2, "schedule": "1f1b"},
        "checkpoint": {"window": 4, "bandwidth_bytes_per_s": 1e9},
        "host_tier": {"root": str(work / "pipeline-shm"), "run_id": "bench"},
        "timeout_s": 60,
        "bench_recovery": {"stage": 1},
    }
    say("pipeline PP=3: boundary log and localized vs global recovery")
    rep = load_result(out, 3, launch(3, spec, out, 300, module="torchmoe_harness.pipeline_worker")).report
    b = rep["bench_recovery"]
    return {
        "stages": 3,
        "microbatches": 2,
        "window": 4,
        "log_bytes_per_iteration": rep["log_bytes_per_iteration"],
        "pp_recovery_s_localized": b["pp_recovery_s_localized"],
        "pp_recovery_s_global": b["pp_recovery_s_global"],
        "localized_recomputed_iterations": b["localized_recomputed_iterations"],
        "global_recomputed_iterations": b["global_recomputed_iterations"],
        "failed_after_iteration": b["target_step"],
        "localized_s_all": b["localized_s_all"],
        "global_s_all": b["global_s_all"],
        "exact": b["localized_exact"] and b["global_exact"],
    }


def merge_section(out: Path, key: str, res: dict, seconds: float) -> dict:
    """Put one section's result into `out`/bench.json beside the others, then write the whole report anew
    (bench.md from every stored result, this section's plot). Returns the merged results."""
    bench = out / "bench.json"
    full = json.loads(bench.read_text()) if bench.exists() else {}
    if "models" not in full:
        raise SystemExit(f"{bench}: no full bench results to merge into; fix: run `make bench` once first")
    full[key] = res
    full.setdefault("section_seconds", {})[key] = seconds
    if key in full.get("not_measured", {}):  # measured now: the reason it was not is gone
        del full["not_measured"][key]
        if not full["not_measured"]:
            del full["not_measured"]
    bench.write_text(json.dumps(full, indent=1))
    (out / "bench.md").write_text(report_markdown(full))
    section = SECTIONS[key]
    if hasattr(section, "plot"):
        try:
            section.plot(res, out / f"bench_{key}.png")
        except ImportError:
            pass  # matplotlib missing: the report has the figures, no plot
    return full


def run_sections(out_dir: str, keys: list[str], verbose: bool = True) -> dict:
    """Run only the sections `keys` (of `SECTIONS`) and merge each into `out_dir`'s results: a section redone
    after a change without the whole bench's ~25 minutes. The other sections' figures stay as they were
    measured (their run is named in bench.json's `section_seconds`)."""
    unknown = [k for k in keys if k not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown bench section(s) {unknown}; fix: choose from {sorted(SECTIONS)}")
    out = Path(out_dir)
    work = Path(tempfile.mkdtemp(prefix="tmoe-bench-"))
    say = _progress(verbose)
    full: dict = {}
    try:
        for key in keys:
            ts = time.perf_counter()
            res = SECTIONS[key].run(work, say)
            full = merge_section(out, key, res, time.perf_counter() - ts)
            say(f"{key}: merged into {out / 'bench.json'}, {out / 'bench.md'}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return full


def _progress(verbose: bool):
    """The bench's progress lines, on stderr (`verbose` False: none)."""

    def say(msg: str) -> None:
        if verbose:
            print(f"[bench] {msg}", file=sys.stderr, flush=True)

    return say


def run_bench(
    out_dir: str = "benchmarks/results",
    models=("tiny",),
    nproc: int = 2,
    overlap: float = 0.05,
    verbose: bool = True,
    baselines: bool = False,
) -> dict:
    """`baselines`: the old per-model baselines table (dense at k = 5 on small models), superseded by the
    MoE-regime section; off by default to keep `make bench` within its time."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tmoe-bench-"))
    say = _progress(verbose)
    t0 = time.perf_counter()
    res = {
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, {platform.processor() or 'cpu'}, "
        f"torch {torch.__version__}",
        "nproc": nproc,
        "models": [bench_model(m, nproc, overlap, work, say, baselines) for m in models],
        "jit_iterations_lost": bench_jit(work, say),
    }
    res["pipeline"] = bench_pipeline(work, say)
    for k in ("log_bytes_per_iteration", "pp_recovery_s_localized", "pp_recovery_s_global"):
        res[k] = res["pipeline"][k]
    res["section_seconds"] = {"models_jit_pipeline": time.perf_counter() - t0}
    for key, section in SECTIONS.items():
        ts = time.perf_counter()
        res[key] = section.run(work, say)
        res["section_seconds"][key] = time.perf_counter() - ts
    res["wall_seconds"] = time.perf_counter() - t0
    (out / "bench.json").write_text(json.dumps(res, indent=1))
    (out / "bench.md").write_text(report_markdown(res))
    try:
        plot(res, out / "bench.png")
        plot_baselines(res, out / "bench_baselines.png")
        for key, section in SECTIONS.items():
            if hasattr(section, "plot"):
                section.plot(res[key], out / f"bench_{key}.png")
    except ImportError:
        say("matplotlib missing: no plot")
    say(f"wrote {out / 'bench.json'}, {out / 'bench.md'}")
    return res
