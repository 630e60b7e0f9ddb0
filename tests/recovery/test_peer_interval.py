"""`TierConfig.peer_interval`: only every k-th committed window is pushed to the peers (tiers/peer_interval.py).
A node loss then recovers from the newest window the peers hold, older than the survivors' newest host window,
and still exactly: the survivors keep their host copies from the newest pushed window on, and recovery takes one
window id for every rank (never a mix). The rule and the lag: tests/tiers/test_peer_interval_rule.py."""

from __future__ import annotations

import pytest
from test_node_replacement import OPT_OUT, RUN, run_replacement  # tests/recovery is on sys.path under pytest

from torchmoe_harness.launch import compare, load_result

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast


def test_host_lost_recovers_exactly_from_the_older_pushed_window(tmp_path, reference, fault_summary):
    """2 hosts, one rank each, W = 2, peer_interval = 3: windows 0, 1, 2 are committed when rank 1's host freezes
    in iteration 8 and is killed whole (SIGKILL); only window 0 was pushed. The survivor holds windows 0-2 of its
    own, the peers' copy only window 0: recovery takes window 0 for both ranks and replays to the end, exact."""
    reference(2, RUN)
    extra = {"window": 2, "peer_interval": 3}
    got = run_replacement(tmp_path, 1, replicas=1, store=None, env=OPT_OUT, extra=extra)
    assert got.codes == (0, 0), f"exit codes {got.codes}:\n" + "\n".join(lg[-3000:] for lg in got.logs)
    own = {int(k.split("window-")[1][:6]) for k in got.before if ".peers" not in k and "window-" in k}
    held = {int(k.split("window-")[1][:6]) for k in got.before if ".peers" in k and "window-" in k}
    assert held == {0} and max(own) >= 2 and 0 in own, (own, held)  # the survivor kept the pushed window
    run = load_result(got.out, 2, "\n".join(got.logs))
    rec = run.report["recoveries"][0]
    assert set(rec.get("pulled_from_peers", {})) == {"1"} and not rec.get("cold_start"), rec
    assert rec["window_id"] == 0 and rec["recovered_step"] == 2, rec  # the older window, for every rank
    cmp = compare(run, reference(2, RUN))
    fault_summary("host replaced, peer_interval 3", 1, "recovered exactly" if cmp.bit_exact else "silently wrong")
    assert cmp.bit_exact, cmp.mismatches[:10]
