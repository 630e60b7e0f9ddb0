"""The peer push interval's rule (tiers/peer_interval.py) and the lag in pushes missed with an interval
(tiers/peer_lag.py); the node-loss case is tests/recovery/test_peer_interval.py."""

from __future__ import annotations

import pytest

from torchmoe_ckpt.config import ConfigError, TierConfig
from torchmoe_ckpt.tiers.peer_interval import AUTO_MAX, PeerInterval, interval_for
from torchmoe_ckpt.tiers.peer_lag import PeerLag


def test_auto_rule_keeps_the_push_within_its_share_of_link_time():
    # one push takes 2 s, a window 10 s: every window would take 20 % of the link; 5 % needs every 4th
    assert interval_for(2.0, 10.0, 0.05) == 4
    assert 2.0 / (4 * 10.0) <= 0.05 < 2.0 / (3 * 10.0)  # 4 is the smallest that fits
    assert interval_for(0.5, 10.0, 0.05) == 1  # exactly 5 %: every window
    assert interval_for(0.51, 10.0, 0.05) == 2
    assert interval_for(100.0, 1.0, 0.05) == AUTO_MAX  # bounded: the host keeps at most that many more windows
    assert interval_for(0.0, 1.0, 0.05) == interval_for(1.0, 0.0, 0.05) == 1  # nothing measured yet: every window


def test_auto_interval_is_the_agreed_value_and_follows_new_measurements():
    iv = PeerInterval("auto", share=0.05)
    for w in range(3):  # nothing measured yet: every window is due (k = 1)
        assert iv.due(w)
        iv.advance(w, lambda wanted: wanted)
    iv.measured(push_s=1.0, window_s=5.0)  # this rank wants 4
    iv.advance(2, lambda wanted: max(wanted, 6))  # another rank's link is slower: the agreed value wins
    assert iv.k == 6 and [w for w in range(3, 20) if iv.due(w)] == [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    iv.measured(push_s=0.1, window_s=5.0)  # the link got faster
    iv.advance(8, lambda wanted: wanted)
    assert iv.k == 1 and iv.due(9) and not iv.due(8)


def test_lag_counts_pushes_missed_not_windows_outside_the_interval():
    said: list[str] = []
    iv = PeerInterval(3)
    lag = PeerLag(1, lambda text, warn: said.append(text), iv)
    lag.committed(0)
    assert iv.due(0) and lag.lag == 1  # the due window in flight
    iv.advance(0)
    lag.replicated(0)
    for w in (1, 2):  # not due: no lag, the peer copy (window 0) is durable
        lag.committed(w)
        assert not iv.due(w) and lag.lag == 0 and lag.durable
    lag.committed(3)
    assert lag.lag == 1 and lag.durable  # due, not pushed yet
    for w in range(4, 7):  # the link is busy: window 6 is the second due window missed
        lag.committed(w)
    assert lag.lag == 2 and not lag.durable and "2 push(es) missed" in said[0] and "every 3" in said[0], said
    assert iv.due(3)
    iv.advance(3)
    lag.skipped()  # window 3 superseded by the queued window 6
    assert lag.lag == 2 and iv.due(6)
    iv.advance(6)
    lag.replicated(6)
    assert lag.lag == 0 and lag.durable and lag.stats()["newest_replicated"] == 6 and lag.stats()["peer_interval"] == 3


@pytest.mark.parametrize("bad", [0, -1, "3", 2.5, "fast", True])
def test_peer_interval_refuses_what_is_no_interval(bad):
    with pytest.raises(ConfigError, match="peer_interval must be an integer >= 1"):
        TierConfig(peer_interval=bad)
    with pytest.raises(ConfigError, match=r"peer_link_share must be a number in \(0, 1\]"):
        TierConfig(peer_interval="auto", peer_link_share=0)


def test_training_pace_is_measured_from_the_commits_made_while_a_push_ran():
    iv = PeerInterval("auto")
    iv.newest_commit = (2, 13.0)  # windows 1 and 2 were committed while window 0 (committed at 10.0) was pushed
    assert iv.window_seconds(0, 10.0) == 1.5  # so the first push is measured against training's pace already
    iv.newest_commit = (5, 20.0)
    assert iv.window_seconds(5, 20.0) == pytest.approx((20.0 - 10.0) / 5)  # else since the previous due window
