"""ETTR from a GPU check's measured figures (gpu_check.json, phase 3) through the simulator (ettr.py): how much of
its time a run of that model on that card would keep training at a given MTBF, with each system's measured cost
per iteration. Every system gets the same restart (process, groups, model: `restart_s`) plus reading one dense
snapshot's bytes at the measured pinned copy rate; a replayed iteration costs a training step (conservative: frozen
operators take no optimizer step).

  dense every iteration      its measured overhead per iteration (k = 1)
  dense at its best interval that overhead once per checkpoint, the interval ETTR-optimal at the MTBF
  ours, W = w                its measured overhead per iteration; a recovery point every W iterations (the last
                             complete window) and W - 1 iterations replayed
  DCP async at its interval  the measured overhead per iteration at the interval the check ran it at

    python -m torchmoe_harness.ettr_gpu benchmarks/results/gpu/run1_gpu_check.json
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from torchmoe_harness.ettr import SystemProfile, best_interval, ettr_exact

MTBFS_S = {"10 min": 600.0, "1 h": 3600.0}
RESTART_S = 60.0  # a job restart at scale (torchrun, process groups, model build); the same for every system


def profiles(bench: dict, restart_s: float = RESTART_S) -> dict[str, SystemProfile]:
    """The systems of a phase-3 result (`gpu_check.json`'s phases.3_bench.result), skipping rows a blocked
    start-up distorts (ours with auto W when it blocked more than half a step per iteration)."""
    rows, t = bench["systems"], bench["systems"]["none"]["step_s_device"]
    restart = restart_s + bench["dense_bytes"] / bench["pinned_copy_peak_bytes_per_s"]
    out: dict[str, SystemProfile] = {}
    for name, r in rows.items():
        over, k = r.get("overhead_s_device"), r.get("interval") or 1
        if name == "none" or over is None:
            continue
        if name.startswith("ours"):
            # a blocked start-up distorts the row; the copy path without copies is an ablation, not a system
            if r.get("blocked_s_per_iteration", 0.0) > 0.5 * t or name.endswith("_nocopy"):
                continue
            w = max(r.get("windows_W") or [k])
            out[f"{name} (W={w})"] = SystemProfile(
                name, t, interval=w, per_iter_overhead_s=over, restart_s=restart, replay_iters=w - 1
            )
        elif name == "gemini_k1":
            dense = SystemProfile("dense every iteration", t, interval=1, stall_s=over, restart_s=restart)
            out["dense every iteration"] = dense
            out["dense at its best interval"] = replace(dense, name="dense at its best interval")
        elif name.startswith("dcp_async") and k > 1:
            out[f"DCP async every {k}"] = SystemProfile(name, t, interval=k, stall_s=over * k, restart_s=restart)
    return out


def best_dense(ps: dict[str, SystemProfile], mtbf: float) -> SystemProfile:
    """The dense snapshot at its ETTR-optimal interval at `mtbf`."""
    dense = ps["dense at its best interval"]
    return replace(dense, interval=best_interval(dense, mtbf, 20000))


def table(bench: dict, mtbfs: dict[str, float] = MTBFS_S, restart_s: float = RESTART_S) -> list[str]:
    """Markdown: ETTR of every system at each MTBF (the dense snapshot's best interval in brackets)."""
    ps = profiles(bench, restart_s)
    best = {label: best_dense(ps, mtbf) for label, mtbf in mtbfs.items()}
    head = "| system | " + " | ".join(f"ETTR at MTBF {m}" for m in mtbfs) + " |"
    lines = [head, "|---|" + "---|" * len(mtbfs)]
    for name, p in ps.items():
        cells = []
        for label, mtbf in mtbfs.items():
            q = best[label] if name == "dense at its best interval" else p
            cells.append(f"{ettr_exact(q, mtbf):.4f}" + (f" (k = {q.interval})" if q is not p else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def break_even(bench: dict, windows=(4, 9), mtbfs: dict[str, float] = MTBFS_S, restart_s: float = RESTART_S):
    """{(W, MTBF label): the overhead per iteration (fraction of a step) at which ours with windows of W keeps as
    much time as the dense snapshot at its best interval}: what a sparse window may cost to win."""
    ps = profiles(bench, restart_s)
    out = {}
    for label, mtbf in mtbfs.items():
        dense = best_dense(ps, mtbf)
        target = ettr_exact(dense, mtbf)
        for w in windows:
            ours = SystemProfile("ours", dense.t_iter, interval=w, restart_s=dense.restart_s, replay_iters=w - 1)
            lo, hi = 0.0, 1.0
            if ettr_exact(ours, mtbf) < target:
                out[(w, label)] = None  # loses even at no cost
                continue
            for _ in range(50):
                mid = (lo + hi) / 2
                won = ettr_exact(replace(ours, per_iter_overhead_s=mid * dense.t_iter), mtbf) >= target
                lo, hi = (mid, hi) if won else (lo, mid)
            out[(w, label)] = lo
    return out


def report_lines(bench: dict) -> list[str]:
    """The table, then what a sparse window may cost to win at each MTBF (the GPU check's report and `main`)."""
    lines = table(bench)
    for (w, label), f in break_even(bench).items():
        say = "never" if f is None else f"below {f:.2%} of a step"
        lines.append(f"- ours with W = {w} beats the dense snapshot at its best interval at MTBF {label}: {say}")
    return lines


def main() -> None:
    report = json.loads(Path(sys.argv[1]).read_text())
    bench = report["phases"]["3_bench"]["result"]
    t = bench["systems"]["none"]["step_s_device"]
    print(f"{bench.get('device_name')}: step {t * 1e3:.1f} ms, restart {RESTART_S:.0f} s for every system")
    print("\n".join(report_lines(bench)))


if __name__ == "__main__":
    main()
