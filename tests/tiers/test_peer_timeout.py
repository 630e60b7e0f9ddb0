"""A peer that never answers: every peer message waits at most TierConfig.peer_timeout_s, then the peer tier stops
(one warning, `stats()['peers']['stopped']`), and later pushes return at once instead of blocking the persist
thread on a pair gloo has closed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchmoe_ckpt import ConfigError, TierConfig
from torchmoe_harness.launch import torchrun

PROBE = Path(__file__).resolve().parent / "peer_timeout_probe.py"


@pytest.mark.torchrun
def test_a_peer_that_never_answers_ends_the_push_within_the_timeout(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    torchrun(2, [str(PROBE), str(tmp_path / "shm")], out / "torchrun.log", 45, {"PEER_TIMEOUT_OUT": str(out)})
    r = json.loads((out / "rank0.json").read_text())
    first, second = r["took_s"]
    # the first push waits for its partner once, for the timeout (plus gloo's wake-up), not the group's 30 min
    assert r["timeout_s"] <= first < r["timeout_s"] + 3.0, r
    assert second < 0.5, r  # stopped: no second wait on a closed pair
    assert r["stopped"] and "rank 1 did not answer within peer_timeout_s=2 s" in r["stopped"], r


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), "60", True])
def test_a_bad_peer_timeout_is_refused_naming_the_field(bad):
    with pytest.raises(ConfigError, match="peer_timeout_s must be a finite number of seconds > 0"):
        TierConfig(peer_timeout_s=bad)
