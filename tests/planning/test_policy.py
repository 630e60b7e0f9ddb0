"""The checkpoint policy's chooser (planning/policy.py) on given inputs: dense when its copy hides behind a step,
sparse windows when a dense copy would stall the step; hysteresis keeps a decision against noise; and the config's
policy, dense_interval and mtbf refuse bad values in one line naming the fix."""

from __future__ import annotations

from dataclasses import replace

import pytest

from torchmoe_ckpt.config import ConfigError, SparseConfig
from torchmoe_ckpt.planning.policy import (
    HYSTERESIS,
    PolicyChooser,
    PolicyInputs,
    dense_candidate,
    ettr,
    resolved_mtbf_s,
    sparse_candidate,
)

GB = 1e9
# A 1 s step, 10 GB of dense state, copies at 10 GB/s (a dense copy takes one step), W = 8 windows of 2 GB slots.
BASE = PolicyInputs(
    step_s=1.0,
    copy_s_per_byte=1 / (10 * GB),
    added_s_per_byte=0.0,
    dense_bytes=int(10 * GB),
    sparse_window=8,
    sparse_slot_bytes=2 * GB,
    restart_s=30.0,
    mtbf_s=3 * 3600.0,
)


def test_cheap_dense_copies_choose_dense():
    """The dense copy (0.5 s) hides behind a 1 s step: a snapshot costs nothing, so dense wins (it replays nothing
    and ships fewer bytes); its interval is then 1."""
    x = replace(BASE, copy_s_per_byte=1 / (20 * GB))
    d = PolicyChooser(None, None, None).decide(x)
    assert d.policy == "dense" and d.interval_or_W == 1, d
    assert d.predicted_ettr["dense k=1"] > d.predicted_ettr["sparse W=8"]
    assert "hides behind a step" in d.reason and not d.forced


def test_a_dense_copy_that_stalls_chooses_sparse():
    """A dense copy of 3 steps stalls the update 2 steps at every snapshot, and it contends with the step (0.2 s
    per GB copied); a 2 GB slot hides behind the step: the window keeps more useful time at a short MTBF."""
    x = replace(BASE, copy_s_per_byte=3 / (10 * GB), added_s_per_byte=0.02 / GB, mtbf_s=1200.0)
    d = PolicyChooser(None, None, None).decide(x)
    assert d.policy == "sparse" and d.interval_or_W == 8, d
    sp, de = sparse_candidate(x), dense_candidate(x)
    assert de.stall_s == pytest.approx(2.0) and sp.per_iter_s == pytest.approx(0.04)
    assert sp.predicted_ettr > de.predicted_ettr and de.interval > 1  # dense's best interval spreads its stalls
    assert "adds 2.00 steps" in d.reason


def test_the_dense_interval_is_the_best_one():
    x = replace(BASE, copy_s_per_byte=3 / (10 * GB), mtbf_s=1200.0)
    de = dense_candidate(x)
    for k in (de.interval - 1, de.interval + 1):
        assert dense_candidate(x, k).predicted_ettr <= de.predicted_ettr


def test_hysteresis_keeps_the_policy_in_force():
    """Dense chosen; then the inputs drift so that sparse is predicted a little better, by less than HYSTERESIS:
    no switch. Far better: the switch is taken and counted."""
    ch = PolicyChooser(None, None, None)
    assert ch.decide(replace(BASE, copy_s_per_byte=1 / (20 * GB))).policy == "dense"
    near = None
    for per_gb in (1.1, 1.2, 1.4, 1.6, 2.0, 2.5, 3.0):
        x = replace(BASE, copy_s_per_byte=per_gb / (10 * GB), mtbf_s=1200.0)
        gap = sparse_candidate(x).predicted_ettr - dense_candidate(x).predicted_ettr
        if 0 < gap < HYSTERESIS:
            near = x
            break
    assert near is not None
    assert ch.decide(near).policy == "dense" and ch.switches == 0
    far = replace(BASE, copy_s_per_byte=3 / (10 * GB), mtbf_s=1200.0)
    assert ch.decide(far).policy == "sparse" and ch.switches == 1


def test_a_fixed_policy_is_kept_and_says_so():
    d = PolicyChooser("dense", None, 5).decide(BASE)
    assert (d.policy, d.interval_or_W, d.forced, d.reason) == ("dense", 5, True, "set in the config")
    d = PolicyChooser("sparse", 3, None).decide(BASE)
    assert (d.policy, d.interval_or_W) == ("sparse", 3) and set(d.predicted_ettr) == {"sparse W=3", "dense k=1"}
    assert d.line().startswith("policy sparse W=3 (")


def test_ettr_formula_matches_the_simulator():
    """The library's formula is the harness simulator's ettr_exact (moved, not rewritten)."""
    from torchmoe_harness.ettr import SystemProfile, ettr_exact

    p = SystemProfile("x", 0.5, interval=7, per_iter_overhead_s=0.03, stall_s=0.4, restart_s=20.0)
    assert ettr(7, 0.5, 900.0, 0.03, 0.4, 20.0) == pytest.approx(ettr_exact(p, 900.0), rel=1e-12)


def test_mtbf_default_scales_llama3s_rate_to_the_job():
    assert resolved_mtbf_s(None, 16384) == 3 * 3600.0
    assert resolved_mtbf_s(None, 1024) == 3 * 3600.0 * 16
    assert resolved_mtbf_s(600.0, 8) == 600.0


@pytest.mark.parametrize(
    "given,seconds", [("3h", 10800.0), ("90m", 5400.0), ("2d", 172800.0), ("45 min", 2700.0), (600, 600.0)]
)
def test_mtbf_takes_seconds_or_a_duration(given, seconds):
    assert SparseConfig(mtbf=given).mtbf == seconds


@pytest.mark.parametrize(
    "kwargs,fix",
    [
        ({"policy": "fast"}, 'use "auto"'),
        ({"mtbf": "3 hours"}, 'a duration such as "3h"'),
        ({"mtbf": -5}, "seconds > 0"),
        ({"mtbf": True}, "seconds > 0"),
        ({"dense_interval": 0}, "integer >= 1"),
        ({"dense_interval": 2.5}, "integer >= 1"),
        ({"policy": "sparse", "dense_interval": 4}, 'set policy="dense"'),
        ({"policy": "dense", "window": 3}, 'set policy="sparse"'),
        ({"window": 3, "dense_interval": 4}, "set one"),
        ({"policy": "dense", "sliding": True}, 'set policy="sparse"'),
    ],
)
def test_bad_policy_values_get_one_line_naming_the_fix(kwargs, fix):
    with pytest.raises(ConfigError) as exc:
        SparseConfig(**kwargs)
    msg = str(exc.value)
    assert fix in msg and "\n" not in msg, msg


def test_auto_resolves_to_the_policy_a_forced_size_names():
    assert SparseConfig().fixed_policy is None
    assert SparseConfig(window=3).fixed_policy == "sparse"
    assert SparseConfig(dense_interval=4).fixed_policy == "dense"
    assert SparseConfig(policy="dense").fixed_policy == "dense"
