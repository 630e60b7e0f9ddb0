"""The policy sweep of `make bench` (bench_policy): its quick mode end to end under torchrun (every system on the same
failures in every cell, repeated, the three goals in its result, the plot), the goals' arithmetic on hand-made
cells, and the durable dense baseline writing its snapshot into a file a killed process leaves."""

from __future__ import annotations

import os

import pytest
import torch

from torchmoe_harness import bench, bench_policy


@pytest.mark.torchrun  # starts torchrun/gloo processes
def test_quick_mode_runs_every_system_in_every_cell_and_reports_the_three_goals(tmp_path):
    res = bench_policy.run(tmp_path, lambda _m: None, bench_policy.QUICK)
    systems = bench_policy.QUICK["systems"]
    assert set(res["cells"]) == {f"natural/{m}" for m in bench_policy.QUICK["mtbfs"]}
    for c in res["cells"].values():
        assert set(c["ettr"]) == set(systems)
        for e in c["ettr"].values():  # every repetition measured, an ETTR in (0, 1.5)
            assert len(e["values"]) == bench_policy.QUICK["reps"] and all(0 < v < 1.5 for v in e["values"])
        assert c["auto_chose"] and all(x.split()[0] in ("sparse", "dense", "undecided") for x in c["auto_chose"])
    # the same failures for every system: each run recovered from each of them
    fails = {m: len(v[1]) for m, v in res["failures"].items()}
    assert all(r["failures"] == fails[r["mtbf"]] for r in res["rows"].values())
    assert set(res["goals"]) == {"auto_vs_best_baseline", "simulator_prediction_error", "w1_cost_vs_dense_baseline"}
    assert res["w1"]["ours_bytes"] == res["w1"]["dense_bytes"]  # W = 1 copies what a dense snapshot copies
    text = "\n".join(bench_policy.markdown(res))
    assert "| goal |" in text and "auto chose" in text
    bench_policy.plot(res, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
    assert bench.SECTIONS[bench_policy.KEY] is bench_policy  # `torchmoe-ckpt bench --sections policy_sweep`


def _cell(auto: list[float], best: list[float]) -> dict:
    return {"ours_auto": bench_policy._stats(auto), "dense_best": bench_policy._stats(best)}


def test_auto_vs_best_baseline_is_judged_against_the_measured_noise():
    cells = {}
    for name, (a, b) in {"x/frequent": ([0.80, 0.82], [0.85, 0.81]), "x/rare": ([0.9, 0.9], [0.7, 0.7])}.items():
        e = _cell(a, b)
        diff = e["ours_auto"]["mean"] - e["dense_best"]["mean"]
        noise = (e["ours_auto"]["sd"] ** 2 + e["dense_best"]["sd"] ** 2) ** 0.5
        cells[name] = {
            "cell": "x",
            "mtbf": name[2:],
            "auto_minus_best": diff,
            "noise": noise,
            "best_baseline": "dense_best",
        }
    g = bench_policy.goals({"cells": cells, "predictions": {}, "w1": {"ratio": None}})["auto_vs_best_baseline"]
    assert g["cell"] == "x/frequent" and g["value"] == pytest.approx(-0.02)
    assert g["noise"] == pytest.approx((0.01**2 * 2 + 0.02**2 * 2) ** 0.5) and g["met"]  # -0.02 within the noise


def test_prediction_names_the_term_it_misses_by():
    p = {"error": 0.08, "error_own_recovery": 0.01, "error_failure_trace": 0.08}
    assert bench_policy._term(p).startswith("the recovery")
    assert bench_policy._term(dict(p, error_own_recovery=0.08, error_failure_trace=0.0)).startswith("the failure trace")
    assert bench_policy._term(dict(p, error=0.01)) == "-"


def test_the_durable_dense_baseline_writes_its_snapshot_into_a_file_that_outlives_the_process(tmp_path, one_rank_group):
    from torchmoe_harness.baselines.gemini import HostDense
    from torchmoe_harness.trainer import RunConfig, Trainer

    trainer = Trainer(RunConfig(steps=2, model={"dim": 32, "n_layers": 1, "num_experts": 4, "expert_hidden": 64}))
    dense = HostDense(trainer, every=1, shm_dir=str(tmp_path))
    dense.attach(trainer)
    res = trainer.train_step()
    dense.after_step(trainer, res)
    dense.close()
    slot = dense.latest()[0]
    path = tmp_path / f"snapshot-{trainer.rank}-0"
    assert path.stat().st_size >= slot.nbytes and dense.stats()["durable"]
    # the file's bytes are the snapshot's (read back from the file, not from the process's tensors)
    item = next(i for i in slot.items if i.buffer.numel() > 1)
    mem = torch.from_file(str(path), shared=False, size=path.stat().st_size, dtype=torch.uint8)
    data = item.buffer.view(torch.uint8).reshape(-1)
    offset = item.buffer.data_ptr() - slot.items[0].buffer.data_ptr()
    assert torch.equal(mem[offset : offset + data.numel()], data)
    assert os.path.getsize(path) % 64 == 0
