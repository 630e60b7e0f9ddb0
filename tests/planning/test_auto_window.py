"""Auto W priced by what copies cost under training (issue 19): controlled inputs, no timing."""

from __future__ import annotations

import math

import pytest

from torchmoe_ckpt.planning.schedule import CopyCost, choose_window, plan_window

# The trial: 4 MoE layers x 32 experts (153 MB of full state per rank), 12 B/param full, 4 B compute.
ORDER = [f"e{i}" for i in range(128)] + ["router", "dense"]
FULL = {o: 1_179_648 for o in ORDER}
COMP = {o: 393_216 for o in ORDER}
DENSE = sum(FULL.values())


def test_prior_until_a_copy_is_observed_then_the_observed_cost():
    c = CopyCost(prior_bytes_per_s=11e9)
    c.observe_step(1.5)
    assert c.bytes_per_s == 11e9 and c.budget_bytes(1.0) == pytest.approx(1.5 * 11e9)
    # idle memcpy says a dense slot "fits" in 14 ms of a 1.5 s step: W = 1 at a 1% budget
    assert choose_window(ORDER, FULL, COMP, c.budget_bytes(0.01)) == 1
    c.observe_copy(DENSE, 0.070)  # what the copy thread measured under training: 70 ms per dense slot
    assert c.bytes_per_s == pytest.approx(DENSE / 0.070)
    w = choose_window(ORDER, FULL, COMP, c.budget_bytes(0.03))  # a slot may cost 3% of an iteration
    assert w == 2  # slot 0: 60 operators in full + the rest compute weights; slot 1: the other 70 in full
    plan = plan_window(ORDER, FULL, COMP, c.budget_bytes(0.03), auto_window=w)
    assert plan.fits and plan.window == w and plan.worst_slot_bytes <= c.budget_bytes(0.03)


def test_an_impossible_budget_stops_the_window_near_the_least_possible_worst_slot():
    floor = FULL["e0"] + sum(COMP.values()) - COMP["e0"]  # slot 0 alone: its full state + everyone's compute
    w = choose_window(ORDER, FULL, COMP, 1.0)
    plan = plan_window(ORDER, FULL, COMP, 1.0, auto_window=w, warn=False)
    assert not plan.fits and plan.worst_slot_bytes <= 1.25 * floor
    assert w < len(ORDER) // 4  # not one operator per slot


def test_a_wait_prices_the_copy_at_least_at_the_wait():
    c = CopyCost(prior_bytes_per_s=1e10)
    c.observe_copy(1000, seconds=0.001, waited_s=0.004)
    assert c.seconds_per_byte == pytest.approx(0.004 / 1000)


def test_window_adapts_when_the_cost_changes_with_hysteresis():
    c = CopyCost(prior_bytes_per_s=1e10, alpha=1.0)  # alpha 1: the newest observation alone, for exact checks
    c.observe_step(1.0)
    c.observe_copy(DENSE, 0.010)
    w_cheap = choose_window(ORDER, FULL, COMP, c.budget_bytes(0.01))
    c.observe_copy(DENSE, 0.050)  # copies got 5x dearer (other load on the cores): W grows at once
    w_dear = choose_window(ORDER, FULL, COMP, c.budget_bytes(0.01), current=w_cheap)
    assert w_dear > w_cheap
    # slightly cheaper again (within the hysteresis): W stays, so slot buffers are not rebuilt every window
    c.observe_copy(DENSE, 0.048)
    assert choose_window(ORDER, FULL, COMP, c.budget_bytes(0.01), current=w_dear) == w_dear
    c.observe_copy(DENSE, 0.010)  # back to cheap: W shrinks back
    assert choose_window(ORDER, FULL, COMP, c.budget_bytes(0.01), current=w_dear) == w_cheap


def test_longer_iterations_give_a_smaller_window():
    c = CopyCost(prior_bytes_per_s=1e10, alpha=1.0)
    c.observe_copy(DENSE, 0.030)
    c.observe_step(1.0)
    w_fast = choose_window(ORDER, FULL, COMP, c.budget_bytes(0.01))
    c.observe_step(4.0)
    assert choose_window(ORDER, FULL, COMP, c.budget_bytes(0.01)) < w_fast


def test_auto_window_split_is_the_forced_split_and_bad_values_are_refused():
    budget = 0.5 * DENSE
    w = choose_window(ORDER, FULL, COMP, budget)
    auto = plan_window(ORDER, FULL, COMP, budget, auto_window=w)
    forced = plan_window(ORDER, FULL, COMP, math.inf, forced_window=w)
    assert auto.slots == forced.slots and auto.budget_bytes == budget and auto.fits
    for bad in (0, len(ORDER) + 1):
        with pytest.raises(ValueError, match="auto window"):
            plan_window(ORDER, FULL, COMP, budget, auto_window=bad)
    with pytest.raises(ValueError, match="prior bandwidth"):
        CopyCost(0.0)
