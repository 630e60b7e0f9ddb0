"""`torchmoe-ckpt bench` / `make bench`: measured costs of sparse checkpointing, side by side with a run
without checkpointing and with dense per-iteration snapshots, in the same invocation on the same machine.

Ratios reported per model:
  slot_bytes_ratio   mean bytes copied per slot / bytes of one dense snapshot (goal <= 0.45)
  wait_fraction      training-thread wait / step time, checkpointing every iteration (goal <= 0.02)
  overhead_fraction  step time with checkpointing / step time without - 1
  replay_cost_ratio  recovery time / (W x normal step time) (goal <= 1.0)
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

from .harness.launch import run_torchrun

MODELS = {
    "tiny": {"model": {}, "batch_size": 2, "seq_len": 16, "steps": 14},
    "cpu-large": {"model": {"vocab_size": 1024, "dim": 128, "n_layers": 4, "n_heads": 4, "num_experts": 8,
                            "expert_hidden": 256, "max_seq_len": 64},
                  "batch_size": 4, "seq_len": 64, "steps": 12},
}
WARMUP = 3


def _median_step(report: dict) -> float:
    return statistics.median(report["step_seconds"][WARMUP:])


def bench_model(name: str, nproc: int, overlap: float, out: Path, say) -> dict:
    m = MODELS[name]
    run = {"steps": m["steps"], "batch_size": m["batch_size"], "seq_len": m["seq_len"], "model": m["model"]}
    say(f"{name}: baseline (no checkpointing)")
    base = run_torchrun(nproc, {"run": run}, out / name / "baseline", timeout=600)
    say(f"{name}: sparse window (auto W, overlap {overlap}), with one failure to time recovery")
    fail_at = m["steps"] - 1
    sparse = run_torchrun(nproc, {"run": run, "checkpoint": {"window": None, "overlap": overlap},
                                  "failures": [{"step": fail_at, "phase": "update"}]},
                          out / name / "sparse", timeout=600)
    say(f"{name}: sparse window persisted to the host-memory tier (DCP files in /dev/shm)")
    shm = Path(tempfile.mkdtemp(prefix="tmoe-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    host = run_torchrun(nproc, {"run": run, "checkpoint": {"window": None, "overlap": overlap},
                                "host_tier": {"root": str(shm), "run_id": name}}, out / name / "host", timeout=600)
    shutil.rmtree(shm, ignore_errors=True)
    say(f"{name}: dense snapshot every iteration (W=1)")
    dense = run_torchrun(nproc, {"run": run, "checkpoint": {"window": 1}}, out / name / "dense", timeout=600)
    t_base = _median_step(base.report)

    def costs(rep: dict) -> dict:
        ck = rep["checkpoint"]
        steps = rep["step_seconds"]
        t = statistics.median(steps[WARMUP:])
        return {"step_s": t, "overhead_fraction": t / t_base - 1.0,
                "wait_fraction": ck["wait_seconds_total"] / sum(steps),
                "mean_slot_bytes": ck["mean_slot_bytes"], "max_slot_bytes": ck["max_slot_bytes"],
                "dense_bytes": ck["dense_bytes"], "windows": ck["windows"]}

    s, d, h = costs(sparse.report), costs(dense.report), costs(host.report)
    host_stats = host.report["checkpoint"]["host_tier"]
    rec = sparse.report["recoveries"][0]
    w = rec.get("window", 1)
    return {
        "model": name, "nproc": nproc, "params": None, "baseline_step_s": t_base,
        "window": w, "overlap": overlap,
        "dense_bytes_per_rank": s["dense_bytes"],
        "mean_slot_bytes": s["mean_slot_bytes"], "max_slot_bytes": s["max_slot_bytes"],
        "slot_bytes_ratio": s["mean_slot_bytes"] / s["dense_bytes"],
        "worst_slot_bytes_ratio": s["max_slot_bytes"] / s["dense_bytes"],
        "wait_fraction": s["wait_fraction"], "overhead_fraction": s["overhead_fraction"],
        "dense_wait_fraction": d["wait_fraction"], "dense_overhead_fraction": d["overhead_fraction"],
        "host_tier_overhead_fraction": h["overhead_fraction"], "host_tier_wait_fraction": h["wait_fraction"],
        "host_tier_persist_lag_s": host_stats["lag_seconds_max"],
        "host_tier_bytes_per_iteration": host_stats["bytes_written"] / max(1, len(host.report["step_seconds"])),
        "recovery_s": rec.get("seconds", 0.0), "replayed_iterations": rec.get("replayed_iterations", 0),
        "replay_cost_ratio": rec.get("seconds", 0.0) / (w * t_base),
        "goals": {"slot_bytes_ratio<=0.45": s["mean_slot_bytes"] / s["dense_bytes"] <= 0.45,
                  "wait_fraction<=0.02": s["wait_fraction"] <= 0.02,
                  "replay_cost_ratio<=1.0": rec.get("seconds", 0.0) / (w * t_base) <= 1.0},
    }


def report_markdown(res: dict) -> str:
    lines = [f"# torchmoe-ckpt bench ({res['machine']})", "",
             "| model | W | slot/dense bytes | worst slot/dense | wait fraction | overhead | dense W=1 wait | "
             "dense W=1 overhead | + host tier overhead | host persist lag s | recovery s | replay cost ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["models"]:
        lines.append(f"| {r['model']} | {r['window']} | {r['slot_bytes_ratio']:.3f} | {r['worst_slot_bytes_ratio']:.3f} | "
                     f"{r['wait_fraction']:.4f} | {r['overhead_fraction']:+.3f} | {r['dense_wait_fraction']:.4f} | "
                     f"{r['dense_overhead_fraction']:+.3f} | {r['host_tier_overhead_fraction']:+.3f} | "
                     f"{r['host_tier_persist_lag_s']:.3f} | {r['recovery_s']:.3f} | {r['replay_cost_ratio']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [r["model"] for r in res["models"]]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    x = range(len(names))
    ax[0].bar([i - 0.2 for i in x], [1.0] * len(names), 0.4, label="dense snapshot")
    ax[0].bar([i + 0.2 for i in x], [r["slot_bytes_ratio"] for r in res["models"]], 0.4, label="sparse slot (mean)")
    ax[0].set_xticks(list(x), names); ax[0].set_ylabel("bytes per iteration / dense"); ax[0].legend()
    ax[1].bar([i - 0.2 for i in x], [r["dense_overhead_fraction"] * 100 for r in res["models"]], 0.4, label="dense W=1")
    ax[1].bar([i + 0.2 for i in x], [r["overhead_fraction"] * 100 for r in res["models"]], 0.4, label="sparse")
    ax[1].set_xticks(list(x), names); ax[1].set_ylabel("step-time overhead %"); ax[1].legend()
    fig.tight_layout(); fig.savefig(path, dpi=100); plt.close(fig)


def run_bench(out_dir: str = "benchmarks/results", models=("tiny", "cpu-large"), nproc: int = 2,
              overlap: float = 0.05, verbose: bool = True) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tmoe-bench-"))

    def say(msg: str) -> None:
        if verbose:
            print(f"[bench] {msg}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    res = {"machine": f"{platform.machine()} {torch.get_num_threads()} threads, {platform.processor() or 'cpu'}, "
                      f"torch {torch.__version__}",
           "nproc": nproc, "models": [bench_model(m, nproc, overlap, work, say) for m in models]}
    res["wall_seconds"] = time.perf_counter() - t0
    (out / "bench.json").write_text(json.dumps(res, indent=1))
    (out / "bench.md").write_text(report_markdown(res))
    try:
        plot(res, out / "bench.png")
    except ImportError:
        say("matplotlib missing: no plot")
    say(f"wrote {out / 'bench.json'}, {out / 'bench.md'}")
    return res
