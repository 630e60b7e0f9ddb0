"""torchrun worker of the ETTR section (bench_ettr): failure runs of every system on the same failure iterations,
at several copy regimes, in one job.

    torchrun --nproc_per_node 2 -m torchmoe_harness.bench_ettr_worker --spec spec.json --out DIR

Spec: {"run": RunConfig fields (no steps), "mtbfs": {label: iterations}, "failures": {label: [steps, [iterations]]},
       "fractions": [dense copy time / step to emulate], "natural_only": {label: [system, ...]},
       "calibration_steps": n, "base_steps": n, "max_interval": k}
Calibration first (no checkpoint; a dense snapshot every iteration; a DCP async_save every iteration): the step
time, the dense snapshot's copy time (the machine's own regime), the idle memcpy speed and DCP's per-export cost.
Then per regime point (the machine's own, then each fraction above it, emulated by a copy-bandwidth cap that
stands for a slower host link: `SnapshotEngine.throttle_bytes_per_s`) and MTBF: the dense snapshot every
iteration, the same at its best interval (ETTR-optimal from the k = 1 run's measured cost, at this MTBF) and ours,
each a runner phase (`baselines.runner.run`: the same failures, the same in-place state loss, recovery phases),
with a short no-checkpoint phase between runs for the useful time per iteration. Rank 0 writes report.json; the
analysis (measured vs simulated ETTR, goals) is bench_ettr's."""

from __future__ import annotations

import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from torchmoe_ckpt.planning.schedule import measure_copy_bandwidth
from torchmoe_harness.baselines import runner
from torchmoe_harness.ettr import SystemProfile, best_interval
from torchmoe_harness.worker import serve

# Ours across the regimes: auto W as MoEvement's Algorithm 1 has it, the smallest W whose slot copy fits in
# an iteration (90% of one: the copy must end before the next update), priced by the copies observed. At the
# machine's own regime that may be W = 1 (a dense copy fits): then ours_W4, the W the MoE-regime section's
# auto pricing settles on (overlap 0.01: a copy's CPU taken from compute), shows the replay path's costs.
# Both with sliding plans (SparseConfig.sliding): a failure loses only its own iteration.
OURS = {"kind": "ours", "window": None, "overlap": 0.9, "sliding": True}
OURS_FIXED = {"kind": "ours", "window": 4, "sliding": True}


def _phase(out: Path, name: str, spec: dict) -> dict:
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    return runner.run(dict(spec, name=name, save_state=False), d)


def _agreed(value):
    box = [value]
    dist.broadcast_object_list(box, src=0)  # rank 0's decision, for every rank
    return box[0]


def _steady(seconds: list[float]) -> float:
    return statistics.median(seconds[2:] or seconds)


def _mean_recovery(rep: dict) -> float:
    recs = rep["recoveries"]
    return statistics.mean(r["wall_seconds"] for r in recs) if recs else 0.0


def _best(t: float, a_k1: float, recovery_s: float, mtbf_iterations: float, max_interval: int) -> int:
    """The ETTR-optimal interval of a periodic system from its k = 1 run: stall per checkpoint = its iteration
    time minus the no-checkpoint one, recovery as measured (MoEvement's oracle interval for Gemini)."""
    p = SystemProfile("periodic", t, stall_s=max(1e-6, a_k1 - t), restart_s=recovery_s)
    return max(1, min(max_interval, best_interval(p, mtbf_iterations * t, max_interval=max_interval)))


def run(spec: dict, out: Path) -> dict:
    run_cfg, n_cal = spec["run"], spec["calibration_steps"]
    base = {"run": dict(run_cfg, steps=spec["base_steps"])}
    # ---- calibration ------------------------------------------------------------------------------------
    cal_none = _phase(out, "cal_none", {"run": dict(run_cfg, steps=n_cal)})
    cal_gem = _phase(out, "cal_gemini", {"run": dict(run_cfg, steps=n_cal), "system": {"kind": "gemini", "every": 1}})
    cal_dcp = _phase(out, "cal_dcp", {"run": dict(run_cfg, steps=4), "system": {"kind": "dcp_async", "every": 1}})
    bw = torch.tensor([measure_copy_bandwidth()], dtype=torch.float64)
    dist.all_reduce(bw, op=dist.ReduceOp.MIN)
    t_none = _steady(cal_none["step_seconds"])
    copy = cal_gem["checkpoint"]["copy"]
    dense_bytes = cal_gem["checkpoint"]["bytes_per_checkpoint"]
    copy_s = copy["wall_s"] / max(1, copy["copies"])
    natural = copy_s / t_none
    points = _agreed(
        [{"name": "natural", "fraction": natural, "throttle": None}]
        + [
            {"name": f"f{f:g}", "fraction": f, "throttle": dense_bytes / (f * t_none)}
            for f in spec["fractions"]
            if f > 1.15 * natural
        ][: spec["max_points"]]
    )
    dcp_stall = _agreed(max(0.0, statistics.mean(cal_dcp["step_seconds"][1:] or cal_dcp["step_seconds"]) - t_none))
    runs: dict[str, dict] = {}
    order = 0

    def measured(label: str, mtbf: str, system: dict, name: str) -> dict:
        nonlocal order
        steps, fails = spec["failures"][mtbf]
        key = f"{label}/{mtbf}/{name}"
        before = _phase(out, f"base{order}", base)
        rep = _phase(out, f"run{order}", {"run": dict(run_cfg, steps=steps), "system": system, "failures": fails})
        order += 1
        rep["t_before"] = _steady(before["step_seconds"])
        rep["system_spec"] = system
        runs[key] = rep
        return rep

    for point in points:
        throttle = {"throttle_bytes_per_s": point["throttle"]} if point["throttle"] else {}
        mtbfs = spec["mtbfs"] if point["name"] == "natural" else {k: spec["mtbfs"][k] for k in spec["sweep_mtbfs"]}
        for mtbf, m in mtbfs.items():
            k1 = measured(point["name"], mtbf, {"kind": "gemini", "every": 1, **throttle}, "gemini_k1")
            a_k1 = (k1["wall_s"] - sum(r["failed_step_s"] + r["wall_seconds"] for r in k1["recoveries"])) / len(
                k1["step_seconds"]
            )
            k = _agreed(_best(k1["t_before"], a_k1, _mean_recovery(k1), m, spec["max_interval"]))
            if k > 1:
                measured(point["name"], mtbf, {"kind": "gemini", "every": k, **throttle}, "gemini_best")
            else:  # at k = 1 its best is itself: the same run
                runs[f"{point['name']}/{mtbf}/gemini_best"] = dict(k1, same_as="gemini_k1")
            measured(point["name"], mtbf, dict(OURS, **throttle), "ours")
            if point["name"] == "natural":
                measured(point["name"], mtbf, OURS_FIXED, "ours_W4")
                kd = _agreed(_best(t_none, t_none + dcp_stall, 2 * t_none, m, spec["max_interval"]))
                measured(point["name"], mtbf, {"kind": "dcp_async", "every": kd}, "dcp_async_best")
    after = _phase(out, f"base{order}", base)
    return {
        "world_size": dist.get_world_size(),
        "t_none_s": t_none,
        "t_after_s": _steady(after["step_seconds"]),
        "dense_bytes": dense_bytes,
        "dense_copy_s": copy_s,
        "memcpy_bytes_per_s": float(bw),
        "dcp_stall_s": dcp_stall,
        "points": points,
        "runs": runs,
    }


def main() -> None:
    serve(run)


if __name__ == "__main__":
    main()
