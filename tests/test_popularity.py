"""Popularity policies and the reorder rule (>10% frequency change for >=25% of experts)."""
import pytest
import torch

from torchmoe_ckpt.popularity import PopularityTracker, order_experts, reorder_needed


def freq(values):
    return torch.tensor([values], dtype=torch.float64)


def test_reorder_rule_fires_exactly_at_the_thresholds():
    old = freq([0.25, 0.25, 0.25, 0.25])
    # one of four experts (25%) changes by exactly 10%: not more than 10% -> no reorder
    assert not reorder_needed(old, freq([0.275, 0.25, 0.25, 0.25]))
    # one of four (25%) changes by just over 10% -> reorder
    assert reorder_needed(old, freq([0.27503, 0.25, 0.25, 0.25]))
    # 1 of 8 experts (12.5% < 25%) changing a lot -> no reorder; 2 of 8 (exactly 25%) -> reorder
    old8 = torch.full((1, 8), 0.125, dtype=torch.float64)
    one = old8.clone(); one[0, 0] = 0.5
    two = old8.clone(); two[0, 0] = 0.5; two[0, 1] = 0.5
    assert not reorder_needed(old8, one)
    assert reorder_needed(old8, two)
    # thresholds are configurable
    assert not reorder_needed(old8, two, fraction=0.3)
    assert not reorder_needed(old, freq([0.3, 0.25, 0.25, 0.25]), change=0.25)
    assert reorder_needed(None, old)
    # zero -> nonzero is an infinite change; zero -> zero is none
    assert reorder_needed(freq([0.0, 0.5, 0.5, 0.0]), freq([0.1, 0.45, 0.45, 0.0]))
    assert not reorder_needed(freq([0.0, 0.5, 0.5, 0.0]), freq([0.0, 0.5, 0.5, 0.0]))


def test_policies_compute_what_they_claim():
    c1 = torch.tensor([[4.0, 0.0], [1.0, 3.0]])
    c2 = torch.tensor([[2.0, 2.0], [0.0, 4.0]])
    p = torch.tensor([[0.7, 0.3], [0.5, 0.5]])
    hard = PopularityTracker(2, 2, "hard")
    soft = PopularityTracker(2, 2, "soft")
    dec = PopularityTracker(2, 2, "decayed", decay=0.5)
    cap = PopularityTracker(2, 2, "capacity", capacity=torch.tensor([[2.0, 4.0], [1.0, 1.0]]))
    for t in (hard, soft, dec, cap):
        t.update(c1, p)
        t.update(c2, p)
    assert torch.equal(hard.scores(), (c1 + c2).double())
    assert torch.equal(soft.scores(), (2 * p).double())
    assert torch.allclose(dec.scores(), (0.5 * (0.5 * c1) + 0.5 * c2).double())
    assert torch.equal(cap.scores(), ((c1 + c2) / torch.tensor([[2.0, 4.0], [1.0, 1.0]])).double())
    f = hard.frequencies()
    assert torch.allclose(f.sum(1), torch.ones(2, dtype=torch.float64))
    assert torch.equal(PopularityTracker(1, 4).frequencies(), torch.full((1, 4), 0.25, dtype=torch.float64))


def test_order_is_ascending_with_deterministic_ties_and_state_round_trips():
    s = torch.tensor([[5.0, 1.0, 1.0], [0.0, 9.0, 1.0]])
    assert order_experts(s) == [(1, 0), (0, 1), (0, 2), (1, 2), (0, 0), (1, 1)]
    t = PopularityTracker(2, 3)
    t.update(s)
    u = PopularityTracker(2, 3)
    u.load_state_dict(t.state_dict())
    assert torch.equal(u.scores(), t.scores())


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="hard, soft, decayed, capacity"):
        PopularityTracker(1, 2, "popular")
    with pytest.raises(ValueError, match="capacity"):
        PopularityTracker(1, 2, "capacity")
    with pytest.raises(ValueError, match="decay"):
        PopularityTracker(1, 2, "decayed", decay=1.5)
    with pytest.raises(ValueError, match="shape"):
        PopularityTracker(1, 2).update(torch.zeros(2, 2))
