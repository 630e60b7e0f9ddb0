"""The MoE-regime bench's statistics (issue 19) on a synthetic worker report: pairing by repetition cancels
drift that hits every system alike, bootstrap intervals cover the median, goals are judged and printed."""

from __future__ import annotations

import random

from torchmoe_harness.bench_moe import FORCED, analyse, bootstrap, goals
from torchmoe_harness.bench_moe_report import markdown

DENSE = 150e6


def _turn(rep, step, proc, copy_cpu=None, nbytes=0):
    t = {
        "rep": rep,
        "wall_s": [step, step],
        "thread_cpu_s": [0.5, 0.5],
        "process_cpu_s": [proc, proc],
        "hook_cpu_s": [0.001, 0.001],
    }
    if copy_cpu is not None:
        t.update(copy_cpu_s=2 * copy_cpu, copy_wall_s=4 * copy_cpu, copy_bytes=2 * nbytes)
    return t


def _report(reps=5):
    rnd = random.Random(1)
    cost = {
        "ours_auto": 0.010,
        **{f"ours_W{w}": 0.012 for w in FORCED},
        "gemini_k1": 0.040,
        "dcp_async_k1": 0.300,
        "pec_k1": 0.015,
        "moetion_30pct": 0.020,
    }
    turns = {"none": [], "memcpy_ref": [], **{k: [] for k in cost}}
    for r in range(reps):
        drift = rnd.uniform(0.0, 0.5)  # other users' load: moves every turn of a repetition alike
        turns["none"].append(_turn(r, 1.0 + drift, 0.8))
        for k, c in cost.items():
            copies = k != "dcp_async_k1"
            turns[k].append(_turn(r, 1.0 + drift + c, 0.8 + c, c if copies else None, DENSE * c / 0.04))
        turns["ours_auto"][-1]["wait_s"] = 0.002  # waits inside the 2 timed steps (the turn's closing flush is not)
        # the plain memcpy beside training: twice the copy path's bytes per CPU second (one turn faulted pages)
        turns["memcpy_ref"].append(_turn(r, 1.0 + drift, 0.8, 0.010 if r else 0.5, DENSE / 2))
    stats = {
        k: {
            "interval": 1,
            "checkpoints": 2 * reps,
            "wait_seconds_total": 0.0,
            "bytes_per_checkpoint": DENSE * (0.4 if k.startswith("ours") else 1.0),
        }
        for k in cost
    }
    for k in cost:
        if k.startswith("ours"):
            stats[k].update(window=4, interval=4, windows_W=[1, 4, 4, 4])
    return {"turns": turns, "stats": stats, "memcpy_bytes_per_s": 10e9, "intervals": {}}


def test_bootstrap_interval_contains_the_median():
    med, lo, hi = bootstrap([1.0, 2.0, 3.0, 4.0, 100.0])
    assert med == 3.0 and lo <= med <= hi and hi <= 100.0


def test_pairing_cancels_drift_and_goals_are_judged():
    v = analyse(_report())
    s = v["systems"]
    assert abs(s["gemini_k1"]["overhead_s"][0] - 0.040) < 1e-9  # drift up to 0.5 s cancelled exactly
    assert s["gemini_k1"]["overhead_s"][1] - 1e-9 <= 0.040 <= s["gemini_k1"]["overhead_s"][2] + 1e-9
    assert abs(s["ours_auto"]["ckpt_cpu_s"][0] - 0.011) < 1e-9  # copy thread + training-thread hook
    assert abs(s["dcp_async_k1"]["ckpt_cpu_s"][0] - 0.300) < 1e-9  # no engine: process CPU above `none`
    assert s["ours_W4"]["bytes_per_iteration"] == 0.4 * DENSE  # ours: a slot every iteration, not every W
    assert abs(s["ours_auto"]["wait_per_iteration_s"] - 0.001) < 1e-12  # from the timed steps, not stats' total
    assert v["noise"]["spread_fraction"] > 0.05
    bf16 = analyse(_report())
    g = goals(dict(v, dtype="fp32"), dict(bf16, dtype="bf16"))
    assert g["overhead_ratio_vs_dense"]["met"] and abs(g["overhead_ratio_vs_dense"]["wall_value"] - 0.25) < 1e-9
    assert g["overhead_ratio_vs_dcp_async"]["met"] and g["auto_window"]["value"] == 4
    assert g["auto_vs_best_forced"]["met"]  # ettr_relative_error: the ETTR section's (test_bench_ettr.py)
    assert g["slot_bytes_ratio_fp32"]["met"]
    # judged against the memcpy under the same training (per-turn median: the faulting turn does not count)
    assert abs(g["copy_throughput_ratio"]["value"] - 0.5) < 1e-9 and not g["copy_throughput_ratio"]["met"]
    assert abs(g["copy_throughput_ratio"]["vs_idle_memcpy"] - DENSE / 0.04 / 10e9) < 1e-9
    res = {
        "model": {"n_layers": 4, "num_experts": 32},
        "run": {"seq_len": 33},
        "reps": 5,
        "wall_seconds": 1.0,
        "mtbf_iterations": 10,
        "fp32": dict(v, dtype="fp32"),
        "bf16": dict(bf16, dtype="bf16"),
        "goals": g,
    }
    text = "\n".join(markdown(res))
    assert "| ours_auto |" in text and "met" in text and "noise of the no-checkpoint turns" in text


def test_optimizer_byte_ratios_follow_the_real_state_sizes():
    """The bench's per-optimizer slot bytes (sizes, deterministic) on a small MoE: a full copy's bytes per parameter
    are the real state's (12 AdamW, 8 bf16 states / SGD / DistMuon layout), and one copy budget gives a smaller
    optimizer state a smaller auto W (fewer bytes per full copy fit more operators per slot)."""
    from torchmoe_harness.bench_optim_bytes import byte_ratios
    from torchmoe_harness.bench_optim_bytes import markdown as opt_markdown

    model = {"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 2, "num_experts": 16, "expert_hidden": 64}
    r = byte_ratios(model, windows=(2, 4))
    for compute in ("float32", "bfloat16"):
        rows = r["compute"][compute]
        bpp = {k: row["bytes_per_param"] for k, row in rows.items()}  # + buffers and step counters: a little over
        assert 12 < bpp["adamw"] < 12.01 and 8 < bpp["sgd"] < 8.01 and 8 < bpp["adamw-bf16"] < 8.01
        assert bpp["sgd"] < bpp["distmuon-adamw"] < bpp["muon-adamw"] < bpp["adamw"]
        assert bpp["adafactor"] < bpp["sgd"]  # a factored second moment: rows + columns per matrix
        for row in rows.values():
            assert 0 < row["forced"][4]["mean"] < row["forced"][2]["mean"] < 1
        assert rows["sgd"]["auto"]["W"] <= rows["adamw"]["auto"]["W"]
    assert r["compute"]["float32"]["sgd"]["auto"]["W"] < r["compute"]["float32"]["adamw"]["auto"]["W"]
    # Adafactor and a whole-tensor Muon make each layer's experts one operator (granularity.py): fewer, larger
    # operators. The merged Muon has DistMuon's state layout (8 B/param), so the difference is the granularity's.
    for compute in ("float32", "bfloat16"):
        rows = r["compute"][compute]
        assert rows["adafactor"]["operators"] == rows["muon-merged"]["operators"] == rows["adamw"]["operators"] - 30
        assert rows["muon-merged"]["bytes_per_param"] == rows["distmuon-adamw"]["bytes_per_param"]
        assert rows["muon-merged"]["largest_operator"] > 10 * rows["distmuon-adamw"]["largest_operator"]
        assert rows["muon-merged"]["forced"][4]["worst"] > rows["distmuon-adamw"]["forced"][4]["worst"]
    text = "\n".join(opt_markdown(r))
    assert (
        "| AdamW, bf16 states | 8.00 |" in text and "| SGD + momentum | 8.00 |" in text and "| AdamW | 12.00 |" in text
    )
