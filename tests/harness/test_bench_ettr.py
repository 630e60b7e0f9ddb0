"""The ETTR section's arithmetic (bench_ettr, ettr.simulate_iterations, ettr_regime) on hand-made inputs: the
failure iterations are shared and conditioned on their count, the iteration-based simulator loses what a
recovery point rule says (a periodic interval, a commit lag, a sliding window), measured vs simulated ETTR is
judged, and the papers' regime model crosses over where the arithmetic says."""

from __future__ import annotations

import pytest

from torchmoe_ckpt.ops.status import PHASES, recovery_line
from torchmoe_harness.bench_ettr import analyse_run, goals
from torchmoe_harness.ettr import SystemProfile, failure_iterations, simulate_iterations
from torchmoe_harness.ettr_regime import crossover, curves, sparse_window


def test_failure_iterations_are_the_same_for_every_caller_and_distinct():
    steps, fails = failure_iterations(20, 8, seed=3)
    assert steps == 160 and len(fails) == 8 == len(set(fails))
    assert fails == sorted(fails) and 2 <= fails[0] and fails[-1] <= steps
    assert failure_iterations(20, 8, seed=3) == (steps, fails)
    assert failure_iterations(20, 8, seed=4) != (steps, fails)


def test_simulate_iterations_loses_back_to_the_recovery_point():
    p = SystemProfile("k4", 1.0, interval=4, restart_s=0.5)
    # failure in iteration 7 (first execution): points 0, 4 exist; 5 and 6 are redone
    sim = simulate_iterations(p, 8, [7], fail_fraction=0.5)
    assert sim.failures == 1 and sim.lost_iterations == 2
    assert sim.wall_s == pytest.approx(6 + 0.5 + 0.5 + 2 + 2)  # 6 done, half of 7, recovery, 5-6 again, 7-8
    # the same failure with a sliding window (every iteration a recovery point): nothing redone
    assert simulate_iterations(p, 8, [7], 0.5, sliding=True).lost_iterations == 0
    # a point usable only 1.6 s after its iteration (an async write): iteration 4's is not durable at 5.5 s
    lag = SystemProfile("lag", 1.0, interval=4, restart_s=0.0, commit_lag_s=1.6)
    assert simulate_iterations(lag, 8, [6], 0.5).lost_iterations == 5
    assert simulate_iterations(lag, 8, [7], 0.5).lost_iterations == 2
    # each checkpoint's own lag, in order: iteration 2's slow (5 s), iteration 4's at once
    two = SystemProfile("two", 1.0, interval=2, commit_lag_s=5.0)
    assert simulate_iterations(two, 8, [6], 0.5).lost_iterations == 5  # 2 and 4 not durable at 5.5 s: from 0
    assert simulate_iterations(two, 8, [6], 0.5, commit_lags=[5.0, 0.0]).lost_iterations == 1  # 4 is
    # the run's own pace: after iteration 4's async write (lag 1.6 s) the iterations took 1.5 s (the write shared
    # the cores), so at the failure in iteration 6 more time had passed than a mean pace of 1 s says
    assert simulate_iterations(lag, 8, [6], 0.5).lost_iterations == 5  # mean pace: 4 is not durable, from 0
    paced = simulate_iterations(lag, 8, [6], 0.5, iter_times=[1, 1, 1, 1, 1.5], failed_s=[0.5])
    assert paced.lost_iterations == 1 and paced.wall_s == pytest.approx(5.5 + 0.5 + 1 + 3)  # 4 durable at 5.6


def _run(system: str, wall: float, recs: list[dict], steps: int = 10, interval: int = 1) -> dict:
    n_exec = steps + sum(r["lost_iterations"] for r in recs)
    return {
        "system": system,
        "steps": steps,
        "wall_s": wall,
        "step_seconds": [0.1] * n_exec,
        "recoveries": recs,
        "checkpoint": {"interval": interval},
        "last_loss": 1.5,
    }


def test_measured_and_simulated_ettr_agree_when_the_run_follows_the_model():
    # 10 iterations of 0.1 s (no checkpoint: 0.08 s), one failure in iteration 6 after 0.05 s, recovery 0.2 s,
    # interval 4: iteration 5 redone. Wall = 11 executed x 0.1 + 0.05 + 0.2
    rec = {"failed_step_s": 0.05, "wall_seconds": 0.2, "lost_iterations": 1, "recovered_step": 4, "failed_at": 6}
    rec["phases"] = {"load": 0.05, "replay": 0.15, "redo": 0.1}
    row = analyse_run(_run("gemini", 1.35, [rec], interval=4), 0.08, [6], 1e9)
    assert row["measured_ettr"] == pytest.approx(10 * 0.08 / 1.35)
    assert row["simulated_lost_iterations"] == 1 and row["relative_error"] < 1e-9
    assert row["phases_s"]["replay"] == pytest.approx(0.15) and row["phases_s"]["failed"] == pytest.approx(0.05)
    assert set(PHASES) <= set(row["phases_s"])


def _row(system, mtbf, ettr, err=0.0, **kw) -> dict:
    return {"system": system, "point": "natural", "mtbf": mtbf, "measured_ettr": ettr, "relative_error": err, **kw}


def test_goals_are_judged_on_the_natural_regime():
    ours = dict(recovery_over_floor=1.1, lost_iterations_per_failure=0.25)
    rows = {
        "natural/f/ours": _row("ours", "f", 0.80, 0.03, **ours),
        "natural/f/gemini_best": _row("gemini_best", "f", 0.78),
        "natural/f/dcp_async_best": _row("dcp_async_best", "f", 0.60),
        "natural/r/ours": _row("ours", "r", 0.90, 0.01, **ours),
        "natural/r/gemini_best": _row("gemini_best", "r", 0.91),
    }
    predictions = {
        "ours: f -> r": {"predicted": 0.88, "measured": 0.90, "relative_error": 0.02 / 0.90},
        "gemini_best: r -> f": {"predicted": 0.80, "measured": 0.78, "relative_error": 0.02 / 0.78},
    }
    g = goals({"rows": rows, "predictions": predictions}, {})
    assert g["recovery_floor"]["met"] and g["redone_per_failure"]["met"]
    # judged on the cross-MTBF predictions, not on a run replayed against itself (its relative_error: 0.03)
    assert g["ettr_prediction_error"]["met"] and g["ettr_prediction_error"]["value"] == pytest.approx(0.02 / 0.78)
    assert not g["ettr_vs_periodic"]["met"] and g["ettr_vs_periodic"]["value"] == pytest.approx(-0.01)
    predictions["ours: f -> r"] = {"predicted": 0.84, "measured": 0.90, "relative_error": 0.06 / 0.90}
    assert not goals({"rows": rows, "predictions": predictions}, {})["ettr_prediction_error"]["met"]


def test_regime_model_windows_and_crossover():
    # fp32-like (compute = 1/3 of full): a copy of 2 iterations needs W = 6 to hide behind 0.9 of one
    # (W = 5: 2 x (1/5 + 4/5 x 1/3) = 0.93 > 0.9; W = 6: 0.89)
    assert sparse_window(2.0, 1 / 3, 0.9, 16) == (6, 0.0)
    assert sparse_window(0.5, 1 / 3, 0.9, 16) == (1, 0.0)
    w, stall = sparse_window(6.0, 1 / 3, 0.9, 16)  # never hidden: the floor is a third of the copy
    assert w == 16 and stall > 0
    assert crossover([0.5, 1.0, 2.0], [{"ettr": 0.8}, {"ettr": 0.9}, {"ettr": 0.9}], [{"ettr": 0.9}] * 3) == 1.0
    assert crossover([0.5, 1.0], [{"ettr": 0.7}, {"ettr": 0.8}], [{"ettr": 0.9}] * 2) is None
    c = curves([0.25, 1.0, 2.0, 4.0])
    for m in c["mtbfs"].values():
        assert m["crossover_vs_every_iteration"] is not None and m["crossover_vs_every_iteration"] < 1.0
        # a dense copy of 4 iterations at every iteration stalls 3.1 of them: sparse far ahead
        assert m["systems"]["sparse (ours)"][-1]["ettr"] > 2 * m["systems"]["dense every iteration"][-1]["ettr"]


def test_recovery_line_says_where_the_time_went():
    rep = {"recovered_step": 6, "window_id": 1, "source": "host", "replayed_iterations": 2, "seconds": 0.5}
    plain = recovery_line(rep)
    assert "(find" not in plain
    rep["phases"] = {"find": 0.01, "rebuild": 0.0, "load": 0.03, "replay": 0.46}
    text = recovery_line(rep)
    assert text.startswith(plain) and text.endswith("(find 0.01 s, rebuild 0.00 s, load 0.03 s, replay 0.46 s)")


def test_prediction_terms_find_the_term_that_moved_between_the_two_runs():
    from torchmoe_harness.ettr_predict import prediction_terms, verdict

    fails = {"frequent": (40, [9, 23]), "rare": (60, [30])}

    def row(overhead: float, restart: float) -> dict:
        p = SystemProfile("ours", 0.1, interval=4, per_iter_overhead_s=0.1 * overhead, restart_s=restart)
        return {"profile": p.to_dict(), "fail_fraction": 0.5, "overhead_fraction": overhead, "sim_options": {}}

    # the same system, the same failure model; only its per-iteration cost differed between the two runs
    rows = {"natural/frequent/ours": row(0.10, 1.0), "natural/rare/ours": row(0.30, 1.0)}
    measured = simulate_iterations(SystemProfile(**rows["natural/rare/ours"]["profile"]), *fails["rare"], 0.5).ettr
    pred = simulate_iterations(SystemProfile(**rows["natural/frequent/ours"]["profile"]), *fails["rare"], 0.5).ettr
    preds = {
        "ours: frequent -> rare": {
            "predicted": pred,
            "measured": measured,
            "relative_error": abs(pred - measured) / measured,
        }
    }
    t = prediction_terms(rows, {"failures": fails}, preds)["ours: frequent -> rare"]
    assert t["error"] > 0.1  # 10% vs 30% overhead: far off
    w = t["with_destination"]
    assert w["pace"] < 1e-9 and w["all"] < 1e-9 and w["recovery"] == pytest.approx(t["error"])
    assert "the measured pace, not the failure model" in verdict({"ours: frequent -> rare": t}, 0.05)
