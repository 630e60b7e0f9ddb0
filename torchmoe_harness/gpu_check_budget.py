"""The GPU check's wall time on an H200, estimated from run 1's timings (benchmarks/results/gpu/run1_*), for the
check as it is now: it must fit one device call of at most 9 minutes (docs/gpu.md, "The GPU check").

    python -m torchmoe_harness.gpu_check_budget      # the estimate, phase by phase and turn by turn

Phases 0-2 cost what run 1 measured (they have not changed since). Phase 4 is estimated (never run yet): CUDA's
start, its pinned buffer, and every variant's copies at run 1's pinned peak. Phase 3, turn by turn: pinning the
turn's slot sets when the turn before it had another footprint (torch's host cache is emptied then), at the rate
run 1 showed (an 8 GiB set pinned on the training thread in 3.3 s), its warm-up and measured steps at run 1's step
time of that system, and its close; the profiler window after the repetitions; the worker's set-up as measured.
Auto W's window is taken as run 1's (W = 2) for every auto turn; one that picks a larger W pins a larger set."""

from __future__ import annotations

import json
import math
from pathlib import Path

from torchmoe_harness.gpu_check_bench import MTBF_ITERATIONS, PROFILED, SYSTEMS, W, pin_class, resolved
from torchmoe_harness.gpu_copy_engine import variants

RUN1 = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "gpu"
PIN_BYTES_PER_S = 8 * 2**30 / 3.3  # run 1: ours_auto's second 8 GiB slot set, pinned in 3.3 s
CLOSE_S = 0.5  # a system's close, the release (gc, caches) and the turn's bookkeeping
REPS, MEASURE, WINDOWS = 3, 8, 2  # gpu_check_bench.run_bench on a GPU
LIMIT_S = 9 * 60


def _pow2(n: float) -> float:
    return 2 ** math.ceil(math.log2(max(n, 1.0)))


def estimate(check: dict | None = None, raw: dict | None = None) -> dict:
    """Seconds per phase and per turn of phase 3 (see the module's docstring); `check`/`raw`: run 1's reports."""
    check = check or json.loads((RUN1 / "run1_gpu_check.json").read_text())
    raw = raw or json.loads((RUN1 / "run1_bench_raw.json").read_text())
    ph = check["phases"]
    b = ph["3_bench"]["result"]
    rows = b["systems"]
    peak = b["pinned_copy_peak_bytes_per_s"]
    slot = {w: raw[n][-1]["stats"]["bytes_per_checkpoint"] for n, w in (("ours_W4", 4), ("ours_auto", 2))}
    steps_s = {  # run 1's device step per system (auto W: the host-tier row; ours_auto's blocked 3.3 s once)
        ("ours", 4): rows["ours_W4"]["step_s_device"],
        ("ours", "auto"): rows["ours_host"]["step_s_device"],
        ("ours_host", "auto"): rows["ours_host"]["step_s_device"],
        ("gemini",): rows["gemini_k1"]["step_s_device"],
    }
    turns: dict[str, float] = {"none": (1 + MEASURE) * rows["none"]["step_s_device"] + CLOSE_S}
    pins: dict[str, float] = {}
    for name, sp in resolved(SYSTEMS).items():
        c = pin_class(sp)
        assert c is not None
        if c[0] == "gemini":  # run 1's build: its two pinned buffers, item by item
            pins[name] = rows["gemini_k1"]["build_s_median"] * 2
            turns[name] = (1 + MEASURE) * steps_s[c] + CLOSE_S
            continue
        w = sp.get("window") or 2
        pins[name] = 2 * _pow2(w * slot[4 if w == 4 else 2]) / PIN_BYTES_PER_S  # two slot sets
        warm, measured = 2 * w + 1, w * max(math.ceil(MEASURE / w), WINDOWS)
        turns[name] = (warm + measured) * steps_s[c] + CLOSE_S
    # one interval of 8 and its export as run 1 measured, and its pinned staging pinned again (run 1 kept it)
    turns["dcp_async_best"] = max(t["total_s"] for t in raw["dcp_async_best"])
    pins["dcp_async_best"] = _pow2(rows["dcp_async_k1"]["copy_bytes_per_iteration"]) / PIN_BYTES_PER_S
    # a repetition pins once per run of same-footprint turns (rotation keeps them together but one)
    classes = [pin_class(sp) for sp in resolved(SYSTEMS).values()] + [("dcp_async",)]
    names = [*resolved(SYSTEMS), "dcp_async_best"]
    firsts = [n for i, (n, c) in enumerate(zip(names, classes)) if i == 0 or classes[i - 1] != c]
    pins = {n: pins[n] for n in firsts}
    rep_s = sum(turns.values()) + sum(pins.values()) + max(pins.values())  # + the wrap's extra pin
    profile_s = sum(
        turns[n] + (max(pins.values()) if n != "none" else 0.0) + 3.0 for n in PROFILED
    )  # + the trace's export and summary
    phase3 = b["setup_s"] + REPS * rep_s + profile_s + 15.0  # + torchrun's start and the analysis
    reads_s = 400 * 0.4e-3  # idle: 400 reads of a ~0.4 ms matmul and .item()
    phase4 = 10.0 + 3 * 2**31 / peak + 4 * len(variants()) * (2**31 / peak + 0.05) + reads_s * 4
    out = {
        "phases_s": {
            "0_environment": ph["0_environment"]["seconds"],
            "4_copy_engine": phase4,
            "1_exact_recovery": ph["1_exact_recovery"]["seconds"],
            "2_nondeterministic": ph["2_nondeterministic"]["seconds"],
            "3_bench": phase3,
        },
        "turn_s": turns,
        "pin_s": pins,
        "repetition_s": rep_s,
        "profile_s": profile_s,
        "mtbf_iterations": MTBF_ITERATIONS,
        "window": W,
    }
    out["total_s"] = sum(out["phases_s"].values())
    out["fits"] = out["total_s"] <= LIMIT_S
    return out


def main() -> None:
    e = estimate()
    print(f"GPU check on an H200, estimated from run 1: {e['total_s']:.0f} s of {LIMIT_S} s")
    for k, v in e["phases_s"].items():
        print(f"  phase {k}: {v:.0f} s")
    print(f"  phase 3: {REPS} repetitions of {e['repetition_s']:.0f} s, profiler window {e['profile_s']:.0f} s")
    for n, t in e["turn_s"].items():
        print(
            f"    {n}: {t:.1f} s"
            + (f" (+{e['pin_s'][n]:.1f} s pinning the sets of its footprint)" if n in e["pin_s"] else "")
        )


if __name__ == "__main__":
    main()
