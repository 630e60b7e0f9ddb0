"""Sparse-to-dense recovery is bit-exact: multi-process (torchrun/gloo) runs with injected failures end in a
state torch.equal to a run that never failed, with identical losses. FSDP2 and HSDP, world size 2 and 4,
fp32 and bf16 compute, gradient clipping on, skewed routing."""

import pytest

from torchmoe_harness.launch import compare, run_torchrun

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast

STEPS = 16
W = 3
# Failures chosen so that, across one run, they hit the in-flight window at every slot position
# (0, 1 and 2 slots captured), plus a copy torn half-way through the window's last slot.
# Windows start right after the recovered iteration r, so a failure in iteration f meets (f-1-r) mod W
# captured slots: 6 -> 2 (r=0), 7 -> 0 (r=3), 11 -> 1 (r=6); 15's copy is torn (r=9) and surfaces in 16.
FAILURES = [
    {"step": 6, "phase": "update"},
    {"step": 7, "phase": "update"},
    {"step": 11, "phase": "update"},
    {"step": 15, "phase": "copy"},
]
CASES = [(2, 1, "fp32"), (2, 2, "bf16"), (4, 1, "bf16"), (4, 2, "fp32")]
IDS = [f"ws{w}-{'hsdp' if h > 1 else 'fsdp'}-{d}" for w, h, d in CASES]


def spec(hsdp, dtype, checkpoint=None, failures=(), steps=STEPS):
    s = {"run": {"steps": steps, "hsdp": hsdp, "dtype": dtype}}
    if checkpoint is not None:
        s["checkpoint"] = checkpoint
        s["failures"] = list(failures)
    return s


@pytest.mark.parametrize(
    "world,hsdp,dtype",
    [pytest.param(*c, id=i, marks=[pytest.mark.matrix] if i.startswith("ws4") else []) for c, i in zip(CASES, IDS)],
)
def test_failures_at_every_slot_position_recover_bit_exactly(world, hsdp, dtype, tmp_path, reference):
    ref = reference(world, spec(hsdp, dtype)["run"])
    run = run_torchrun(world, spec(hsdp, dtype, {"window": W}, FAILURES), tmp_path / "fail")
    recs = run.report["recoveries"]
    assert [r["failed_at"] for r in recs] == [6, 7, 11, 16]  # the torn copy of 15 surfaces in iteration 16
    assert [r["recovered_step"] for r in recs] == [3, 6, 9, 12]
    assert all(not r.get("cold_start") for r in recs)
    assert {r["slot_position"] for r in recs} == set(range(W)), recs
    assert all(r["replayed_iterations"] == W - 1 for r in recs)
    torn = recs[3]
    assert torn["window_id"] < torn["inflight_window_id"], "a torn window must never be used"
    cmp = compare(ref, run)
    assert cmp.bit_exact, cmp.mismatches[:10]
    assert cmp.compared_losses == world * STEPS


def test_checkpointing_does_not_change_training_and_auto_window(tmp_path, reference):
    """Auto W (Algorithm 1 from the measured iteration time and copy bandwidth): a tight overlap budget makes
    the planner spread the state over several slots; checkpointing leaves training untouched and recovery
    from the auto-sized window is exact."""
    # The budget is t_iter x bandwidth x overlap. The bandwidth is fixed here and the overlap so small that
    # even a 20x slower iteration (a loaded machine) leaves the budget under one dense snapshot: W >= 2 always;
    # on a fast iteration it may not fit at all (one operator per slot), so the run is long enough for any W.
    ref = reference(2, spec(1, "fp32", steps=36)["run"])
    run = run_torchrun(
        2,
        spec(
            1,
            "fp32",
            {"window": None, "policy": "sparse", "overlap": 2e-5, "bandwidth_bytes_per_s": 2.5e10},
            [{"step": 35, "phase": "update"}],
            steps=36,
        ),
        tmp_path / "auto",
    )
    rec = run.report["recoveries"][0]
    assert not rec.get("cold_start") and rec["window"] >= 2, rec
    assert rec["replayed_iterations"] == rec["window"] - 1
    cmp = compare(ref, run)
    assert cmp.bit_exact, cmp.mismatches[:10]


def test_failure_before_first_window_cold_starts_exactly_and_impossible_budget_reported_once(tmp_path, reference):
    """An impossible copy budget (even one operator per slot does not fit) is reported once, clearly, and
    training goes on with one-operator slots; a failure before any window committed cold-starts exactly."""
    ref = reference(2, spec(1, "fp32", steps=8)["run"])
    run = run_torchrun(
        2,
        spec(
            1, "fp32", {"window": None, "policy": "sparse", "overlap": 1e-12}, [{"step": 3, "phase": "update"}], steps=8
        ),
        tmp_path / "cold",
    )
    assert run.report["recoveries"][0]["cold_start"] == "the initialisation"
    assert run.log.count("do not fit the copy budget") == 2  # once per training start (initial + after restart)
    assert run.report["checkpoint"]["windows"][0]["fits"] is False
    cmp = compare(ref, run)
    assert cmp.bit_exact, cmp.mismatches[:10]
