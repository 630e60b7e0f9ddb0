"""The GPU check's wall time on an H200, estimated from run 1's and run 2's timings (benchmarks/results/gpu/), for the
check as it is now: it must fit one device call of at most 9 minutes and leave room for a `--turns` rerun in the
session's 15 minutes of device time (docs/gpu.md, "The GPU check", which re-derives the figure by hand).

    python -m torchmoe_harness.gpu_check_budget      # the estimate, phase by phase, regime by regime, turn by turn

Inputs, each from a measurement:
- phases 0-2: the mean of run 1's and run 2's seconds (unchanged since); phase 4: CUDA's start, its pinned buffer
  and every point's copies at run 1's pinned peak, at most its own limit;
- the step of each system class at the stress regime: run 1's device step (`none` 82 ms; ours W = 4; ours auto W
  from the host-tier row; the dense snapshot);
- auto W's window: run 2's log ("slot 2 of W=9"), for every auto turn (later repetitions start lower and grow back
  to 9, pinning again: counted as a pin per repetition), and its worst slot's bytes: the review's 1.29 GB;
- pinning: run 1's rate (an 8 GiB slot set on the training thread in 3.3 s), two slot sets per footprint class of
  a power-of-two size each, paid when the turn before had another footprint (torch's host cache emptied then);
- steps per turn as gpu_check_bench_worker.turn runs them: warm-up until two windows started and the second full
  (2W + 1), calibration without copies for auto W (WARMUP_STEPS + CALIBRATION_STEPS), then whole windows;
- the representative regime: micro-batches for a step of MIN_STEP_S (82 ms each: 13, so ~1.07 s), each system's
  step that plus its stress overhead.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from torchmoe_ckpt.planning.calibration import CALIBRATION_STEPS, WARMUP_STEPS
from torchmoe_harness.gpu_check_bench import (
    MAX_MICRO_BATCHES,
    MIN_STEP_S,
    PROFILE_RESERVE_S,
    PROFILED,
    REGIME_SHARE,
    REGIMES,
    REPRESENTATIVE_GPU,
    SYSTEMS,
    W,
    pin_class,
    resolved,
)
from torchmoe_harness.gpu_copy_engine import variants

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "gpu"
PIN_BYTES_PER_S = 8 * 2**30 / 3.3  # run 1: ours_auto's second 8 GiB slot set, pinned in 3.3 s
CLOSE_S = 0.5  # a system's close, the release (gc, caches) and the turn's bookkeeping
AUTO_W = 9  # run 2's log: "slot 2 of W=9 ... copies 1287809640 bytes"
AUTO_SLOT_BYTES = 1.29e9  # the review's worst slot at W = 9 (gpu-check-review.md, part B)
# gpu_check_bench.run_bench on a GPU, per regime: (repetitions, measured steps, whole windows at least)
PLAN = {"stress": (3, 8, 2), "representative": tuple(REPRESENTATIVE_GPU[k] for k in ("reps", "measure", "windows"))}
TORCHRUN_S = 15.0  # torchrun's start, the worker's imports and CUDA's start
LIMIT_S = 9 * 60  # one device call
PHASE4_LIMIT_S = 40.0  # gpu_copy_engine's own limit


def _pow2(n: float) -> float:
    return 2 ** math.ceil(math.log2(max(n, 1.0)))


def _runs() -> list[dict]:
    return [json.loads((RESULTS / f"run{i}_gpu_check.json").read_text()) for i in (1, 2)]


def steps_of(sp: dict | None, measure: int, windows: int) -> tuple[int, int, int]:
    """(copy-free steps, warm-up steps with copies, measured steps) of one turn on a GPU."""
    if sp is None or sp["kind"] == "none":
        return 1 + measure, 0, 0
    if sp["kind"] == "gemini":
        return 0, 1, measure
    w = sp.get("window") or AUTO_W
    calib = WARMUP_STEPS + CALIBRATION_STEPS if sp.get("window") is None else 0
    return calib, 2 * w + 1, w * max(math.ceil(measure / w), windows)


def estimate(runs: list[dict] | None = None, regimes: tuple[str, ...] = tuple(REGIMES)) -> dict:
    """Seconds per phase, per regime and per turn (see the module's docstring); `runs`: run 1's and run 2's reports."""
    runs = runs or _runs()
    run1 = runs[0]["phases"]
    b = run1["3_bench"]["result"]
    rows, peak = b["systems"], b["pinned_copy_peak_bytes_per_s"]
    t_none = rows["none"]["step_s_device"]
    over = {  # each class's overhead per step at the stress regime (run 1)
        ("ours", 4): rows["ours_W4"]["step_s_device"] - t_none,
        ("ours", "auto"): rows["ours_host"]["step_s_device"] - t_none,
        ("ours_host", "auto"): rows["ours_host"]["step_s_device"] - t_none,
        ("gemini",): rows["gemini_k1"]["step_s_device"] - t_none,
    }
    raw = json.loads((RESULTS / "run1_bench_raw.json").read_text())
    w4_slot = raw["ours_W4"][-1]["stats"]["bytes_per_checkpoint"]  # the W = 4 window's largest slot, 1.98 GB
    set_bytes = {("ours", 4): _pow2(W * w4_slot), ("ours", "auto"): _pow2(AUTO_W * AUTO_SLOT_BYTES)}
    set_bytes[("ours_host", "auto")] = set_bytes[("ours", "auto")]
    set_bytes[("gemini",)] = _pow2(b["dense_bytes"])  # its double buffer: two dense sets
    micro = min(MAX_MICRO_BATCHES, math.ceil(MIN_STEP_S / t_none))
    step = {"stress": t_none, "representative": micro * t_none}
    systems = resolved(SYSTEMS)
    out_regimes: dict[str, dict] = {}
    for regime in regimes:
        wanted, (reps, measure, windows) = REGIMES[regime], PLAN[regime]
        names = ["none", *(n for n in systems if wanted is None or n in wanted)]
        turns, pins = {}, {}
        for name in names:
            sp = None if name == "none" else systems[name]
            free, warm, measured = steps_of(sp, measure, windows)
            c = pin_class(sp)
            turns[name] = free * step[regime] + (warm + measured) * (step[regime] + over.get(c, 0.0)) + CLOSE_S
            if c is not None:
                pins[name] = 2 * set_bytes[c] / PIN_BYTES_PER_S
        # a repetition pins once per run of same-footprint turns (gpu_check_bench_worker.rotation keeps each run
        # whole); in a later repetition auto W may start lower and grow back to 9, pinning its sets once more
        classes = [pin_class(None if n == "none" else systems[n]) for n in names]
        firsts = [n for i, n in enumerate(names) if classes[i] is not None and (i == 0 or classes[i - 1] != classes[i])]
        regrow = max((pins[n] for n in firsts if classes[names.index(n)][-1] == "auto"), default=0.0)
        rep_s = sum(turns.values()) + sum(pins[n] for n in firsts)
        out_regimes[regime] = {
            "micro_batches": 1 if regime == "stress" else micro,
            "step_s": step[regime],
            "turn_s": turns,
            "pin_s": {n: pins[n] for n in firsts},
            "repetition_s": rep_s,
            "repetitions": reps,
            "regrow_pin_s": regrow,
            "seconds": reps * rep_s + (reps - 1) * regrow + (3 * step[regime] if regime == "representative" else 0.0),
        }
    stress = out_regimes.get("stress") or next(iter(out_regimes.values()))
    profile_s = sum(
        stress["turn_s"].get(n, 0.0) + (max(stress["pin_s"].values(), default=0.0) if n != "none" else 0.0) + 3.0
        for n in PROFILED
    )
    phase3 = b["setup_s"] + TORCHRUN_S + sum(r["seconds"] for r in out_regimes.values()) + profile_s
    reads_s = 400 * 0.4e-3  # idle: 400 reads of a matmul and .item()
    phase4 = min(PHASE4_LIMIT_S, 10.0 + 3 * 2**31 / peak + 4 * len(variants()) * (2**31 / peak + 0.05) + reads_s * 4)

    def mean_s(phase: str) -> float:
        return sum(r["phases"][phase]["seconds"] for r in runs) / len(runs)

    out = {
        "phases_s": {
            "0_environment": mean_s("0_environment"),
            "4_copy_engine": phase4,
            "1_exact_recovery": mean_s("1_exact_recovery"),
            "3_bench": phase3,
        },
        "optional_phases_s": {"2_nondeterministic": mean_s("2_nondeterministic")},
        "regimes": out_regimes,
        "profile_s": profile_s,
        "regime_share": REGIME_SHARE,
    }
    out["total_s"] = sum(out["phases_s"].values())
    out["fits"] = out["total_s"] <= LIMIT_S
    return out


def main() -> None:
    e = estimate()
    print(f"GPU check on an H200, estimated from runs 1 and 2: {e['total_s']:.0f} s of {LIMIT_S} s")
    for k, v in e["phases_s"].items():
        print(f"  phase {k}: {v:.0f} s")
    for k, v in e["optional_phases_s"].items():
        print(f"  (phase {k}, not in the default run: {v:.0f} s)")
    for name, r in e["regimes"].items():
        print(
            f"  phase 3, regime {name} ({r['micro_batches']} micro-batches, step {r['step_s'] * 1e3:.0f} ms): "
            f"{r['repetitions']} repetitions of {r['repetition_s']:.0f} s"
        )
        for n, t in r["turn_s"].items():
            pin = r["pin_s"].get(n)
            print(f"    {n}: {t:.1f} s" + (f" (+{pin:.1f} s pinning the sets of its footprint)" if pin else ""))
    print(f"  phase 3, profiler window: {e['profile_s']:.0f} s (reserve {PROFILE_RESERVE_S:.0f} s)")


if __name__ == "__main__":
    main()
