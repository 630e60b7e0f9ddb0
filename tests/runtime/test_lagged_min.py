"""The retention floor's agreement (runtime.agreement.LaggedMin): each commit starts a MIN over the ranks and uses
the previous commit's, so the training thread never waits on the slowest rank's copy; an older floor only keeps
more windows. Real gloo ranks under torchrun, and one rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchmoe_ckpt.runtime.agreement import LaggedMin
from torchmoe_harness.launch import torchrun

ROOT = Path(__file__).resolve().parents[2]


def test_one_rank_gets_its_own_values_one_call_late(one_rank_group):
    lag = LaggedMin()
    assert lag.exchange(7.0, first=-1.0) == -1.0
    assert lag.exchange(3.0, first=-1.0) == 7.0
    assert lag.settle() == 3.0 and lag.settle() is None


@pytest.mark.torchrun
def test_each_exchange_returns_the_previous_minimum_over_the_ranks(tmp_path):
    log = torchrun(2, [str(ROOT / "tests" / "runtime" / "lagged_min_probe.py")], tmp_path / "torchrun.log", 55.0)
    got = {d["rank"]: d["got"] for d in (json.loads(x) for x in log.splitlines() if x.startswith('{"rank"'))}
    assert got == {r: [-1.0, 10.0, 20.0, 2.0, None] for r in (0, 1)}, log[-2000:]
