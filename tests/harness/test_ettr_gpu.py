"""ETTR from the GPU check's measured costs (torchmoe_harness/ettr_gpu.py), on the H200 run kept in
benchmarks/results/gpu: the break-even cost a sparse window must stay under is where the simulator says ours and the
dense snapshot at its best interval keep the same time, and a blocked start-up row is left out."""

import json
from dataclasses import replace
from pathlib import Path

from torchmoe_harness.ettr import best_interval, ettr_exact
from torchmoe_harness.ettr_gpu import MTBFS_S, break_even, profiles, table

RUN = Path(__file__).resolve().parents[2] / "benchmarks/results/gpu/run1_gpu_check.json"


def bench() -> dict:
    return json.loads(RUN.read_text())["phases"]["3_bench"]["result"]


def test_profiles_and_break_even_on_the_h200_run():
    b = bench()
    ps = profiles(b)
    assert not any(n.startswith("ours_auto") for n in ps)  # blocked 542 ms per iteration pinning memory: left out
    assert {"ours_W4 (W=4)", "dense every iteration", "dense at its best interval"} <= set(ps)
    dense = ps["dense at its best interval"]
    for (w, label), f in break_even(b).items():
        mtbf = MTBFS_S[label]
        best = ettr_exact(replace(dense, interval=best_interval(dense, mtbf, 20000)), mtbf)
        ours = replace(ps["ours_W4 (W=4)"], interval=w, replay_iters=w - 1)
        assert 0 < f < 0.05  # a few percent of a step at most
        assert ettr_exact(replace(ours, per_iter_overhead_s=0.9 * f * dense.t_iter), mtbf) > best
        assert ettr_exact(replace(ours, per_iter_overhead_s=1.1 * f * dense.t_iter), mtbf) < best
        if w == 4:  # the measured W = 4 (19% of a step) loses to the dense snapshot at its best interval
            assert ettr_exact(ps["ours_W4 (W=4)"], mtbf) < best
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table(b)[2:]}
    assert "ours_W4 (W=4)" in rows and "(k = " in rows["dense at its best interval"]
