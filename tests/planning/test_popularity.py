"""Popularity policies, expert order and the reorder rule (>10% frequency change for >=25% of experts)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchmoe_ckpt.planning.popularity import POLICIES, PopularityTracker, order_experts, reorder_needed


def freq(values):
    return torch.tensor([values], dtype=torch.float64)


def test_change_threshold_is_strict():
    old = freq([0.25, 0.25, 0.25, 0.25])
    # one of four experts (25%) changes by exactly 10% (0.275 is 10.000000000000009% in float64): no reorder
    assert not reorder_needed(old, freq([0.275, 0.25, 0.25, 0.25]))
    assert not reorder_needed(old, freq([0.225, 0.25, 0.25, 0.25]))  # decreases count the same way
    # 10.01% does fire, up or down
    assert reorder_needed(old, freq([0.25 * 1.1001, 0.25, 0.25, 0.25]))
    assert reorder_needed(old, freq([0.25 * 0.8999, 0.25, 0.25, 0.25]))
    # integer-ish frequencies, exact in binary: 10 -> 11 is exactly 10%
    assert not reorder_needed(freq([10.0, 10.0]), freq([11.0, 9.0]))
    assert reorder_needed(freq([10.0, 10.0]), freq([11.001, 8.999]))


def test_fraction_threshold_is_inclusive():
    old8 = torch.full((2, 4), 0.25, dtype=torch.float64)  # 8 experts over two layers, counted together
    one, two = old8.clone(), old8.clone()
    one[0, 0] = 0.5
    two[0, 0] = 0.5
    two[1, 3] = 0.5
    assert not reorder_needed(old8, one)  # 1/8 = 12.5% < 25%
    assert reorder_needed(old8, two)  # 2/8 = exactly 25%
    old100 = torch.full((1, 100), 0.01, dtype=torch.float64)
    new = old100.clone()
    new[0, :24] = 0.02
    assert not reorder_needed(old100, new)  # 24% < 25%
    new[0, 24] = 0.02
    assert reorder_needed(old100, new)  # 25%
    # 0.3 * 10 is 3.0000000000000004 in float: three of ten is still "at least 30%"
    old10 = torch.full((1, 10), 0.1, dtype=torch.float64)
    new10 = old10.clone()
    new10[0, :3] = 0.2
    assert reorder_needed(old10, new10, fraction=0.3)
    assert not reorder_needed(old10, new10, fraction=0.31)


def test_thresholds_are_configurable_and_edge_cases():
    old = freq([0.25, 0.25, 0.25, 0.25])
    new = freq([0.3, 0.25, 0.25, 0.25])  # 20% change on 25% of experts
    assert reorder_needed(old, new)
    assert not reorder_needed(old, new, change=0.2)  # exactly 20% is not over 20%
    assert reorder_needed(old, new, change=0.19)
    assert not reorder_needed(old, new, fraction=0.26)
    assert reorder_needed(None, old)  # no order yet
    # zero -> nonzero is an infinite change; zero -> zero is none
    assert reorder_needed(freq([0.0, 0.5, 0.5, 0.0]), freq([0.1, 0.45, 0.45, 0.0]), change=1e6)
    assert not reorder_needed(freq([0.0, 0.5, 0.5, 0.0]), freq([0.0, 0.5, 0.5, 0.0]))
    with pytest.raises(ValueError, match="shape"):
        reorder_needed(old, torch.zeros(2, 2))
    with pytest.raises(ValueError, match="fraction"):
        reorder_needed(old, old, fraction=1.5)
    with pytest.raises(ValueError, match="change"):
        reorder_needed(old, old, change=-0.1)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.floats(0.0, 1.0), min_size=1, max_size=12),
    st.lists(st.floats(0.0, 1.0), min_size=12, max_size=12),
    st.floats(0.0, 1.0),
    st.floats(0.01, 1.0),
)
def test_reorder_rule_matches_a_plain_count(old_l, new_l, change, fraction):
    old, new = freq(old_l), freq(new_l[: len(old_l)])
    assert not reorder_needed(old, old, change, fraction)  # nothing moved
    rel = [abs(n - o) / o if o > 0 else (float("inf") if n > 0 else 0.0) for o, n in zip(old_l, new_l)]
    # away from the float-rounding band at the thresholds, the rule is a plain count
    if all(abs(r - change) > 1e-6 for r in rel):
        k = sum(r > change for r in rel)
        if abs(k / len(rel) - fraction) > 1e-6:
            assert reorder_needed(old, new, change, fraction) == (k / len(rel) >= fraction)


def test_policies_compute_what_they_claim():
    c1 = torch.tensor([[4.0, 0.0], [1.0, 3.0]])
    c2 = torch.tensor([[2.0, 2.0], [0.0, 4.0]])
    p1 = torch.tensor([[0.7, 0.3], [0.5, 0.5]])
    p2 = torch.tensor([[0.1, 0.9], [0.2, 0.8]])
    capacity = torch.tensor([[2.0, 4.0], [1.0, 16.0]])
    hard = PopularityTracker(2, 2, "hard")
    soft = PopularityTracker(2, 2, "soft")
    dec = PopularityTracker(2, 2, "decayed", decay=0.5)
    cap = PopularityTracker(2, 2, "capacity", capacity=capacity)
    for t in (hard, soft, dec, cap):
        t.update(c1, p1)
        t.update(c2, p2)
        assert t.scores().dtype == torch.float64 and t.scores().shape == (2, 2)
    assert torch.equal(hard.scores(), (c1 + c2).double())  # probs ignored
    assert torch.equal(soft.scores(), (p1.double() + p2.double()))  # counts ignored
    assert torch.equal(dec.scores(), (0.5 * (0.5 * c1) + 0.5 * c2).double())  # A(t) = a A(t-1) + (1-a) c
    assert torch.equal(cap.scores(), ((c1 + c2) / capacity).double())
    # capacity changes the order: expert (1,1) saw the most tokens but has the lowest relative utilisation
    assert order_experts(hard.scores())[-1] == (1, 1) and order_experts(cap.scores())[0] == (1, 1)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.integers(0, 1000), min_size=6, max_size=6), min_size=1, max_size=8), st.floats(0.05, 0.95))
def test_decayed_and_hard_match_their_formulas(steps, a):
    hard, dec = PopularityTracker(2, 3, "hard"), PopularityTracker(2, 3, "decayed", decay=a)
    ref_h, ref_d = torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.float64)
    for s in steps:
        c = torch.tensor(s, dtype=torch.int64).view(2, 3)  # integer counts as a router produces them
        hard.update(c)
        dec.update(c)
        ref_h += c.double()
        ref_d = a * ref_d + (1 - a) * c.double()
    assert torch.equal(hard.scores(), ref_h)
    assert torch.equal(dec.scores(), ref_d)  # same float operations in the same order: bit-identical
    f = hard.frequencies()
    for layer in range(2):
        if ref_h[layer].sum() > 0:
            assert torch.equal(f[layer], ref_h[layer] / ref_h[layer].sum()) and abs(float(f[layer].sum()) - 1) < 1e-12
        else:
            assert torch.equal(f[layer], torch.full((3,), 1 / 3, dtype=torch.float64))


def test_frequencies_are_per_layer_and_uniform_when_empty():
    t = PopularityTracker(2, 4)
    assert torch.equal(t.frequencies(), torch.full((2, 4), 0.25, dtype=torch.float64))
    t.update(torch.tensor([[1.0, 3.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    assert torch.equal(t.frequencies(), torch.tensor([[0.25, 0.75, 0.0, 0.0], [0.25] * 4], dtype=torch.float64))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(1, 5), st.data())
def test_order_is_ascending_with_deterministic_ties(n_layers, n_experts, data):
    vals = data.draw(st.lists(st.integers(0, 3), min_size=n_layers * n_experts, max_size=n_layers * n_experts))
    s = torch.tensor(vals, dtype=torch.float64).view(n_layers, n_experts)  # small range: many ties
    order = order_experts(s)
    assert sorted(order) == [(layer, e) for layer in range(n_layers) for e in range(n_experts)]
    keys = [(float(s[layer, e]), layer, e) for layer, e in order]
    assert keys == sorted(keys)  # ascending score, ties by (layer, expert)


def test_order_example():
    s = torch.tensor([[5.0, 1.0, 1.0], [0.0, 9.0, 1.0]])
    assert order_experts(s) == [(1, 0), (0, 1), (0, 2), (1, 2), (0, 0), (1, 1)]
    with pytest.raises(ValueError, match="shape"):
        order_experts(torch.zeros(3))


@pytest.mark.parametrize("policy", POLICIES)
def test_state_round_trip_continues_identically(policy):
    kw = {"capacity": torch.tensor([[2.0, 4.0, 1.0]])} if policy == "capacity" else {"decay": 0.7}
    c, p = torch.tensor([[3.0, 1.0, 2.0]]), torch.tensor([[0.5, 0.2, 0.3]])
    t = PopularityTracker(1, 3, policy, **kw)
    t.update(c, p)
    u = PopularityTracker(1, 3, policy, **kw)
    u.load_state_dict(t.state_dict())
    assert torch.equal(u.scores(), t.scores())
    t.update(2 * c, p)
    u.update(2 * c, p)
    assert torch.equal(u.scores(), t.scores())
    other = "soft" if policy != "soft" else "hard"
    with pytest.raises(ValueError, match="policy"):
        PopularityTracker(1, 3, other).load_state_dict(t.state_dict())


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="hard, soft, decayed, capacity"):
        PopularityTracker(1, 2, "popular")
    with pytest.raises(ValueError, match="capacity"):
        PopularityTracker(1, 2, "capacity")
    with pytest.raises(ValueError, match="shape"):
        PopularityTracker(1, 2, "capacity", capacity=torch.ones(2, 2))
    with pytest.raises(ValueError, match="positive"):
        PopularityTracker(1, 2, "capacity", capacity=torch.tensor([[1.0, 0.0]]))
    for d in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="decay"):
            PopularityTracker(1, 2, "decayed", decay=d)
    with pytest.raises(ValueError, match="layer"):
        PopularityTracker(0, 2)
    with pytest.raises(ValueError, match="shape"):
        PopularityTracker(1, 2).update(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="gating probabilities"):
        PopularityTracker(1, 2, "soft").update(torch.zeros(1, 2))
    with pytest.raises(ValueError, match="gating probabilities"):
        PopularityTracker(1, 2, "soft").update(torch.zeros(1, 2), torch.zeros(2, 1))
