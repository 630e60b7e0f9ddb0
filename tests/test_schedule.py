"""Window planning: every operator active exactly once, minimal W, W moves the right way with bandwidth and
iteration time, forced W, impossible budgets."""
import itertools
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchmoe_ckpt.schedule import WindowPlan, copy_budget, plan_window


def ops_and_sizes(draw_sizes):
    order = [f"op{i}" for i in range(len(draw_sizes))]
    full = {o: f for o, (f, _) in zip(order, draw_sizes)}
    comp = {o: c for o, (_, c) in zip(order, draw_sizes)}
    return order, full, comp


sizes = st.lists(st.integers(1, 60).flatmap(lambda c: st.tuples(st.integers(c, 8 * c), st.just(c))),
                 min_size=1, max_size=9)


def all_splits(n):
    for k in range(n):
        for cuts in itertools.combinations(range(1, n), k):
            yield list(cuts) + [n]


def cost(order, full, comp, ends):
    start, worst = 0, 0
    for end in ends:
        worst = max(worst, sum(full[o] for o in order[start:end]) + sum(comp[o] for o in order[end:]))
        start = end
    return worst


def check_structure(plan: WindowPlan, order, full, comp):
    seen = [o for s in plan.slots for o in s.active]
    assert sorted(seen) == sorted(order) and len(seen) == len(set(seen))  # each operator active exactly once
    pos = 0
    for s in plan.slots:
        assert s.active and list(s.active) == order[pos:pos + len(s.active)]
        pos += len(s.active)
        assert list(s.frozen) == order[pos:]
        assert s.bytes == sum(full[o] for o in s.active) + sum(comp[o] for o in s.frozen)
    assert plan.slots[-1].frozen == ()
    for i, s in enumerate(plan.slots):
        for o in s.active:
            assert plan.slot_of(o) == i


@settings(max_examples=150, deadline=None)
@given(sizes, st.integers(1, 800))
def test_auto_window_is_minimal_and_well_formed(sz, budget):
    order, full, comp = ops_and_sizes(sz)
    plan = plan_window(order, full, comp, budget)
    check_structure(plan, order, full, comp)
    feasible = [e for e in all_splits(len(order)) if cost(order, full, comp, e) <= budget]
    if feasible:
        assert plan.fits and plan.window == min(len(e) for e in feasible)
    else:
        assert not plan.fits


@settings(max_examples=100, deadline=None)
@given(sizes, st.integers(1, 9))
def test_forced_window_minimises_the_worst_slot(sz, w):
    order, full, comp = ops_and_sizes(sz)
    if w > len(order):
        with pytest.raises(ValueError, match="impossible"):
            plan_window(order, full, comp, float("inf"), forced_window=w)
        return
    plan = plan_window(order, full, comp, float("inf"), forced_window=w)
    check_structure(plan, order, full, comp)
    assert plan.window == w
    best = min(cost(order, full, comp, e) for e in all_splits(len(order)) if len(e) == w)
    assert plan.worst_slot_bytes == best


@settings(max_examples=100, deadline=None)
@given(sizes, st.floats(0.01, 1.0), st.floats(1e2, 1e4), st.floats(1.0, 4.0))
def test_window_shrinks_with_more_bandwidth_or_longer_iterations(sz, t_iter, bw, factor):
    order, full, comp = ops_and_sizes(sz)
    w = plan_window(order, full, comp, copy_budget(t_iter, bw)).window
    assert plan_window(order, full, comp, copy_budget(t_iter, bw * factor)).window <= w
    assert plan_window(order, full, comp, copy_budget(t_iter * factor, bw)).window <= w
    assert plan_window(order, full, comp, copy_budget(t_iter, bw / factor)).window >= w


def test_impossible_budget_is_reported_once_and_uses_single_operator_slots(caplog):
    order = ["a", "b", "c"]
    full, comp = {o: 100 for o in order}, {o: 10 for o in order}
    with caplog.at_level(logging.WARNING, logger="torchmoe_ckpt.schedule"):
        plan = plan_window(order, full, comp, 5)
    assert not plan.fits and plan.window == 3 and all(len(s.active) == 1 for s in plan.slots)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "budget" in warnings[0].getMessage()


def test_plan_round_trips_through_json_and_rejects_bad_input():
    order = ["a", "b"]
    plan = plan_window(order, {"a": 12, "b": 12}, {"a": 2, "b": 2}, float("inf"), forced_window=2)
    assert WindowPlan.from_dict(plan.to_dict()) == plan
    with pytest.raises(ValueError):
        plan_window([], {}, {}, 10)
    with pytest.raises(ValueError):
        copy_budget(0.0, 1e9)
    with pytest.raises(ValueError, match="impossible"):
        plan_window(order, {"a": 1, "b": 1}, {"a": 1, "b": 1}, 10, forced_window=0)
