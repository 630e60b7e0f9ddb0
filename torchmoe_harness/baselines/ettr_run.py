"""Measured vs simulated ETTR of a short CPU run with injected failures (issue #8's acceptance check).

One torchrun start, two phases in the same processes:
  base   no checkpointing: t_iter, the useful time per iteration
  run    `steps` iterations with our checkpointer and failures at Poisson wall-clock times (MTBF: `mtbf_iterations`
         mean iterations of `base`, i.e. scaled down to seconds)
Measured ETTR = steps x t_iter / wall time of `run`. Simulated ETTR: `ettr.simulate` with the same t_iter
and failure-time trace, fed with the run's measured figures (mean iteration time with checkpointing, mean
recovery seconds, window): the simulator decides how much work each failure loses and how many failures
land before the run ends. The inputs come from the run itself because this 2-core machine is shared:
step times of separate phases differ by up to 2x under other users' load, which no model can predict."""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from torchmoe_harness.baselines.runner import run_system
from torchmoe_harness.ettr import SystemProfile, ettr_exact, ettr_paper, simulate

TINY = {"batch_size": 2, "seq_len": 16, "dtype": "bf16"}


def measure_and_simulate(
    steps: int = 120,
    mtbf_iterations: float = 25,
    window: int = 4,
    seed: int = 1,
    nproc: int = 2,
    out_dir: str | None = None,
    run: dict | None = None,
) -> dict:
    run = dict(TINY, **(run or {}))
    ours = {"kind": "ours", "window": window, "bandwidth_bytes_per_s": 1e9}
    spec = {
        "phases": [
            {"name": "base", "run": dict(run, steps=25)},
            {
                "name": "run",
                "run": dict(run, steps=steps),
                "system": ours,
                "poisson_failures": {"mtbf_iterations": mtbf_iterations, "seed": seed},
            },
        ]
    }
    res = run_system(nproc, spec, Path(out_dir or tempfile.mkdtemp(prefix="tmoe-ettr-")), timeout=300)
    base, meas = (res[k].report for k in ("base", "run"))
    return dict(compare_run(base, meas, steps, window, "ours"), window=window)


def compare_run(base: dict, meas: dict, steps: int, interval: int, name: str) -> dict:
    """Measured ETTR of a run with injected failures (runner report `meas`) next to the simulator's, fed with
    the run's own figures (`base`: the same model without checkpointing, for t_iter)."""
    trace, mtbf_s = meas["failure_times_s"], meas["mtbf_s"]
    t_iter = statistics.mean(base["step_seconds"][5:] or base["step_seconds"])
    recs = meas["recoveries"]
    # A failure is injected at the first step boundary after its Poisson time and crashes that step before
    # its update: replay the failures as they happened, each at the middle of the step it interrupted, and
    # count from there to training resuming as its recovery time.
    lost_s = [r["failed_step_s"] + r["wall_seconds"] for r in recs]
    a = (meas["wall_s"] - sum(lost_s)) / len(meas["step_seconds"])  # the loop's time per iteration
    happened = [r["at_s"] - r["failed_step_s"] + a / 2 for r in recs]
    r_mean = statistics.mean(lost_s) - a / 2 if recs else 0.0
    profile = SystemProfile(
        name, t_iter, interval=interval, per_iter_overhead_s=a - t_iter, restart_s=r_mean, note="measured in the run"
    )
    # each failure's own recovery time, as it happened (from the middle of the failed step to training again):
    # recoveries differ (a sparse window replays W-1 iterations, the first windows of a run are smaller)
    sim = simulate(profile, iterations=steps, trace=happened, recoveries=[x - a / 2 for x in lost_s])
    sim_ettr = sim.ettr
    # the planned Poisson times instead, averaged over 16 phases (their phase to iterations is not known)
    seg = profile.segment_s()
    planned = statistics.mean(
        simulate(profile, iterations=steps, trace=[t + seg * j / 16 for t in trace]).ettr for j in range(16)
    )
    measured = steps * t_iter / meas["wall_s"]
    return {
        "steps": steps,
        "mtbf_s": mtbf_s,
        "interval": interval,
        "t_iter": t_iter,
        "iter_with_ckpt_s": a,
        "recovery_s": r_mean,
        "trace": [t for t in trace if t < meas["wall_s"]],
        "failures_at_s": happened,
        "ettr_planned_trace": planned,
        "measured": {
            "wall_s": meas["wall_s"],
            "ettr": measured,
            "failures": len(meas["recoveries"]),
            "lost_iterations": sum(r["lost_iterations"] for r in meas["recoveries"]),
            "replayed_iterations": sum(r.get("replayed_iterations", 0) for r in meas["recoveries"]),
            "recovery_s": sum(r["wall_seconds"] for r in meas["recoveries"]),
        },
        "simulated": {
            "wall_s": steps * t_iter / sim_ettr,
            "ettr": sim_ettr,
            "failures": sim.failures,
            "lost_iterations": sim.lost_iterations,
            "recovery_s": sim.recovery_s,
        },
        "ettr_exact": ettr_exact(profile, mtbf_s),
        "ettr_formula": ettr_paper(profile, mtbf_s),
        "relative_error": abs(sim_ettr - measured) / measured,
        "profile": profile.to_dict(),
    }
