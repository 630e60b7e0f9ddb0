"""The peer-tier bench section's arithmetic (bench_peer) on hand-made job figures: the dense snapshot's effective
interval comes from the windows it shipped, its best interval is priced from the measured cost of one shipped
snapshot, every system sees the same node-loss trace and the same restart, and the report names the link rate and
the state size."""

from __future__ import annotations

import pytest

from torchmoe_harness import bench_peer


def _job(name, step_s, committed, replicated, window_bytes=0, dense=2 << 20, lag=0.5):
    return {
        "job": name,
        "step_s": step_s,
        "dense_bytes": dense,
        "windows_committed": committed,
        "windows_replicated": replicated,
        "windows_superseded": committed - replicated if replicated else 0,
        "window_bytes": window_bytes,
        "link_bytes_per_s": 5e6 if replicated else None,
        "replication_lag_s": lag,
    }


def _point():
    jobs = {
        "host": _job("host", 0.5, 4, 0),
        "sparse": _job("sparse", 0.6, 4, 4, window_bytes=3 << 20),
        "dense": _job("dense", 1.0, 12, 6, window_bytes=2 << 20),  # every other snapshot skipped on the link
    }
    return {"rate": "40mbit", "jobs": jobs}


def test_profiles_price_the_measured_costs_and_treat_restarts_alike():
    p = bench_peer.profiles(_point())
    assert p["sparse"].interval == bench_peer.WINDOW and p["sparse"].overhead_fraction() == pytest.approx(0.2)
    assert p["dense_k1"].interval == 2  # 12 snapshots taken, 6 shipped
    assert p["dense_k1"].overhead_fraction() == pytest.approx(1.0)
    # one shipped snapshot costs (1.0 - 0.5) x 2 s of training; at its best interval k that is spread over k
    best = p["dense_best"]
    assert best.stall_s == pytest.approx(1.0) and best.interval >= 2
    assert best.overhead_fraction() == pytest.approx(1.0 / best.interval / 0.5)
    # the same restart for all; each adds its own pull (bytes / the link's rate) and replication lag
    for name, nbytes in (("sparse", 3 << 20), ("dense_k1", 2 << 20), ("dense_best", 2 << 20)):
        assert p[name].restart_s == pytest.approx(bench_peer.RESTART_S + nbytes / 5e6 + 0.5)
    assert p["sparse"].replay_iters == bench_peer.WINDOW and p["dense_k1"].replay_iters == 0


def test_analyse_uses_one_trace_and_the_report_names_rate_and_state_size():
    point = bench_peer.analyse(_point(), {"step_s": 0.25})
    assert point["collective_share"] == pytest.approx(0.5)
    fails = {s["failures"] for s in point["systems"].values()}
    assert len(fails) == 1 and fails.pop() > 0  # the same node losses for every system
    res = {
        "model": bench_peer.MODEL,
        "window": bench_peer.WINDOW,
        "trace": bench_peer.TRACE,
        "trace_failures": 19,
        "restart_s": bench_peer.RESTART_S,
        "points": [point],
    }
    text = "\n".join(bench_peer.markdown(res))
    assert "| 40mbit | 500 ms | 50% |" in text and "dense snapshot 2.00 MiB" in text and "3.00 MiB" in text
    assert bench_peer.markdown({"skipped": "not root"})[-1] == "Skipped: not root."


def test_interval_row_is_priced_from_its_mean_step_and_the_windows_it_pushed():
    """peer_interval auto: 6 windows committed, 2 pushed (k = 3 at the end); its overhead is its mean step against
    its own session's base, and a node loss goes back to the newest pushed window: W x 3 iterations apart."""
    point = _point()
    auto = dict(_job("sparse_auto", 0.5, 6, 2, window_bytes=3 << 20), step_s_mean=0.55, peer_interval=3)
    point["jobs"]["sparse_auto"] = dict(auto, base_step_s_mean=0.5)
    p = bench_peer.profiles(point)["sparse_auto"]
    assert p.interval == 3 * bench_peer.WINDOW and p.replay_iters == bench_peer.WINDOW
    assert p.overhead_fraction() == pytest.approx(0.1)
    s = bench_peer.analyse(point, {"step_s": 0.25})["systems"]["sparse_auto"]
    assert s["overhead"] == pytest.approx(0.1) and s["link_s_per_iter"] == pytest.approx((3 << 20) / 5e6 / 9)


def test_steady_state_prices_each_auto_job_against_the_host_jobs_around_it():
    """Host, auto, host, auto, host: each auto job's mean step (from iteration start + 1) over the mean of the two
    host jobs beside it; the host jobs' spread is the noise the result is read against; CPU per step likewise."""

    def job(steps, cpu, replicated=0, k=1):
        return {
            "step_seconds": [9.0] * 4 + steps,  # the first 4 (start-up) are left out
            "step_cpu_s": [9.0] * 4 + cpu,
            "windows_replicated": replicated,
            "windows_committed": 8,
            "peer_interval": k,
            "bytes_sent": 6e6 if replicated else 0,
            "link_bytes_per_s": 5e6 if replicated else None,
        }

    hosts = [job([1.0, 1.0], [0.5, 0.5]), job([1.2, 1.2], [0.5, 0.5]), job([1.0, 1.0], [0.5, 0.5])]
    autos = [job([1.21, 1.21], [0.6, 0.6], 2, 7), job([1.1, 1.1], [0.6, 0.6], 2, 7)]
    p = bench_peer._steady_point("40mbit", hosts, autos, 4)
    assert p["overheads"] == pytest.approx([1.21 / 1.1 - 1, 0.0])
    assert p["noise"] == pytest.approx(0.2) and p["cpu_overhead"] == pytest.approx(0.2)
    assert p["link_s_per_iter"] == pytest.approx(6e6 / 5e6 / 6)
    st = {"steps": 6, "from": 4, "repeats": 2, "points": [p]}
    row = bench_peer.steady_markdown(st)[-1]
    assert row.startswith("| 40mbit | 1000 / 1200 / 1000 ms | 1210 / 1100 ms | +5.0% (+10.0%, +0.0%) | 20.0% |")
    assert "2 / 8, k = 7" in row
