"""torchrun worker of the policy sweep (bench_policy): every system on the same failure iterations in every cell
(dense copy / step x MTBF), repeated and interleaved, in one job.

    torchrun --nproc_per_node 2 -m torchmoe_harness.bench_policy_worker --spec spec.json --out DIR

Spec: {"run": RunConfig fields (no steps), "mtbfs": {label: iterations}, "failures": {label: [steps, [iterations]]},
       "fractions": [dense copy / step to emulate above the machine's own], "reps": n, "calibration_steps": n,
       "base_steps": n, "max_interval": k, "w1_steps": n, "shm": a /dev/shm directory}
Calibration (no checkpoint; a dense snapshot every iteration into /dev/shm with one failure; a DCP async_save every
iteration): the step, the dense copy's time (the machine's own cell), the restart every system pays here (the
in-place recovery of the dense snapshot), DCP's per-export stall. Then per repetition, per cell, the systems in
an order rotated each repetition, each run after a short no-checkpoint phase (the cell's reference step). The
dense snapshot's best interval is chosen in rep 0 of each cell from its k = 1 run (the interval swept through the
simulator on that run's measured stall and recovery) and kept for the other repetitions. Then the W = 1 pair: ours
forced to W = 1 and a dense snapshot every iteration, both into /dev/shm files, no failure, interleaved. Rank 0
writes report.json; the analysis is bench_policy's."""

from __future__ import annotations

import shutil
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from torchmoe_ckpt.planning.schedule import measure_copy_bandwidth
from torchmoe_harness.bench_ettr_worker import _agreed, _best, _mean_recovery, _phase, _steady
from torchmoe_harness.worker import serve


def _iter_s(rep: dict) -> float:
    """The loop's time per executed iteration, failures' lost partial iterations and recoveries left out."""
    lost = sum(r["failed_step_s"] + r["wall_seconds"] for r in rep["recoveries"])
    return (rep["wall_s"] - lost) / max(1, len(rep["step_seconds"]))


def run(spec: dict, out: Path) -> dict:
    run_cfg, n_cal = spec["run"], spec["calibration_steps"]
    shm = Path(spec["shm"])
    rank = dist.get_rank()
    base = {"run": dict(run_cfg, steps=spec["base_steps"])}

    def shm_dir(name: str) -> str:
        d = shm / name  # every rank's files under one directory per run (removed after it)
        return str(d)

    def clean(name: str) -> None:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(shm / name, ignore_errors=True)
        dist.barrier()

    # ---- calibration ------------------------------------------------------------------------------------
    cal_none = _phase(out, "cal_none", {"run": dict(run_cfg, steps=n_cal)})
    cal_gem = _phase(
        out,
        "cal_dense",
        {
            "run": dict(run_cfg, steps=n_cal),
            "system": {"kind": "gemini", "every": 1, "shm_dir": shm_dir("cal_dense")},
            "failures": [n_cal - 1],
        },
    )
    clean("cal_dense")
    with_dcp = "dcp_async_best" in spec["systems"]
    cal_dcp = (
        _phase(out, "cal_dcp", {"run": dict(run_cfg, steps=4), "system": {"kind": "dcp_async", "every": 1}})
        if with_dcp
        else cal_none
    )
    bw = torch.tensor([measure_copy_bandwidth()], dtype=torch.float64)
    dist.all_reduce(bw, op=dist.ReduceOp.MIN)
    t_none = _agreed(_steady(cal_none["step_seconds"]))
    copy = cal_gem["checkpoint"]["copy"]
    dense_bytes = cal_gem["checkpoint"]["bytes_per_checkpoint"]
    copy_s = _agreed(copy["wall_s"] / max(1, copy["copies"]))
    restart_s = _agreed(_mean_recovery(cal_gem))
    natural = copy_s / t_none
    cells_f = _agreed(
        [{"name": "natural", "fraction": natural, "throttle": None}]
        + [
            {"name": f"f{f:g}", "fraction": f, "throttle": dense_bytes / (f * t_none)}
            for f in spec["fractions"]
            if f > 1.15 * natural
        ]
    )
    dcp_stall = _agreed(max(0.0, statistics.mean(cal_dcp["step_seconds"][1:] or cal_dcp["step_seconds"]) - t_none))
    runs: dict[str, dict] = {}
    bases: dict[str, list[float]] = {}
    best_k: dict[str, int] = {}
    order = 0

    def measured(rep_i: int, cell: str, mtbf: str, system: dict, name: str) -> dict:
        nonlocal order
        steps, fails = spec["failures"][mtbf]
        key = f"{rep_i}/{cell}/{mtbf}/{name}"
        before = _phase(out, f"base{order}", base)
        tag = f"run{order}"
        sysspec = dict(system)
        if sysspec.pop("durable", False):
            sysspec["shm_dir" if sysspec["kind"] == "gemini" else "host_root"] = shm_dir(tag)
        rep = _phase(out, tag, {"run": dict(run_cfg, steps=steps), "system": sysspec, "failures": fails})
        clean(tag)
        order += 1
        bases.setdefault(f"{rep_i}/{cell}/{mtbf}", []).append(_steady(before["step_seconds"]))
        rep["system_spec"] = system
        rep["iter_s"] = _iter_s(rep)
        runs[key] = rep
        return rep

    def systems_of(cell: dict, mtbf: str) -> dict[str, dict]:
        throttle = {"throttle_bytes_per_s": cell["throttle"]} if cell["throttle"] else {}
        m_s = spec["mtbfs"][mtbf] * t_none
        ours = {"kind": "ours", "window": None, "durable": True, "restart_s": restart_s, **throttle}
        out_ = {
            "ours_auto": dict(ours, config={"policy": "auto", "mtbf": m_s}),
            "ours_sparse": dict(ours, config={"policy": "sparse", "mtbf": m_s}),
            "dense_k1": {"kind": "gemini", "every": 1, "durable": True, **throttle},
            "dense_best": {"kind": "gemini", "every": None, "durable": True, **throttle},
        }
        if cell["name"] == "natural":  # the copy throttle stands for a slower host link of the snapshot engine
            kd = _agreed(_best(t_none, t_none + dcp_stall, 2 * t_none, spec["mtbfs"][mtbf], spec["max_interval"]))
            out_["dcp_async_best"] = {"kind": "dcp_async", "every": kd}
        return {k: v for k, v in out_.items() if k in spec["systems"]}

    for rep_i in range(spec["reps"]):
        for cell in cells_f:
            for mtbf, m in spec["mtbfs"].items():
                systems = systems_of(cell, mtbf)
                names = list(systems)
                ck = f"{cell['name']}/{mtbf}"
                if ck in best_k:  # rotated after rep 0 (rep 0 needs the k = 1 run before the best interval)
                    shift = rep_i % len(names)
                    names = names[shift:] + names[:shift]
                elif "dense_k1" in names:
                    names.remove("dense_k1")
                    names.insert(0, "dense_k1")
                for name in names:
                    s = systems[name]
                    if name == "dense_best":
                        if ck not in best_k:
                            k1 = runs[f"{rep_i}/{ck}/dense_k1"]
                            t_ref = bases[f"{rep_i}/{ck}"][0]
                            best_k[ck] = _agreed(
                                _best(t_ref, k1["iter_s"], _mean_recovery(k1), m, spec["max_interval"])
                            )
                        s = dict(s, every=best_k[ck])
                    measured(rep_i, cell["name"], mtbf, s, name)
    # ---- ours at W = 1 against a dense snapshot every iteration: same bytes, both into /dev/shm ----------
    w1: dict[str, list[dict]] = {"ours_w1": [], "dense_k1": []}
    pair = {
        "ours_w1": {"kind": "ours", "window": 1, "config": {"policy": "sparse"}, "durable": True},
        "dense_k1": {"kind": "gemini", "every": 1, "durable": True},
    }
    for rep_i in range(spec["w1_reps"]):
        for name in list(pair) if rep_i % 2 == 0 else list(pair)[::-1]:
            tag = f"w1_{rep_i}_{name}"
            sysspec = dict(pair[name])
            sysspec.pop("durable")
            sysspec["shm_dir" if sysspec["kind"] == "gemini" else "host_root"] = shm_dir(tag)
            r = _phase(out, tag, {"run": dict(run_cfg, steps=spec["w1_steps"]), "system": sysspec})
            clean(tag)
            w1[name].append(
                {
                    "step_seconds": r["step_seconds"],
                    "wall_s": r["wall_s"],
                    "bytes": r["checkpoint"]["bytes_per_checkpoint"],
                    "dense_bytes": r["checkpoint"].get("dense_bytes"),
                }
            )
    after = _phase(out, f"base{order}", base)
    return {
        "world_size": dist.get_world_size(),
        "t_none_s": t_none,
        "t_after_s": _steady(after["step_seconds"]),
        "dense_bytes": dense_bytes,
        "dense_copy_s": copy_s,
        "restart_s": restart_s,
        "memcpy_bytes_per_s": float(bw),
        "dcp_stall_s": dcp_stall,
        "cells": cells_f,
        "best_k": best_k,
        "bases": bases,
        "runs": runs,
        "w1": w1,
    }


def main() -> None:
    serve(run)


if __name__ == "__main__":
    main()
