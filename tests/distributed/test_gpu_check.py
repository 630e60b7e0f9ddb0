"""The GPU check (`torchmoe-ckpt gpu-check`, docs/gpu.md) runs whole on a CPU, small, so the command a GPU machine
runs cannot rot between the sessions that have one: real torchrun processes, real kill -9s, a real refusal of an
inexact replay (the restarted attempt runs another intra-op thread count), the benchmark's every system. The test
reads what the command wrote, as the person reading a GPU run's results would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from torchmoe_harness.gpu_check import PHASES

ROOT = Path(__file__).resolve().parents[2]
SYSTEMS = ("none", "ours_auto", "ours_W4", "ours_W8", "ours_host", "gemini_k1", "dcp_async_k1", "dcp_async_best")


def run_check(tmp_path, phases: str) -> tuple[dict, Path]:
    """`gpu-check --device cpu --tiny --phases ...` as the device machine runs it: its report, checked whole."""
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torchmoe_harness.gpu_check", "--out", str(out), "--device", "cpu", "--tiny"]
    cmd += ["--work", str(tmp_path / "work"), "--phases", phases]
    # timeout: a hang guard only, above the suite's per-test limit
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=280, cwd=ROOT)
    report = json.loads((out / "gpu_check.json").read_text())
    names = [f"{n}_{PHASES[int(n)]}" for n in phases.split(",")]
    assert list(report["phases"]) == names, report["phases"].keys()
    failed = {k: (p["status"], p.get("error")) for k, p in report["phases"].items() if p["status"] != "passed"}
    assert not failed and report["ok"] and run.returncode == 0, (failed, run.stdout[-3000:], run.stderr[-3000:])
    assert len([f for f in out.rglob("*") if f.is_file()]) <= 8  # what the device tool brings back
    assert "# GPU check: PASSED" in (out / "gpu_check.md").read_text()
    return report["phases"], out


# Three tests, some phases each, so that none comes near the suite's 60 s limit (the whole check: 42-46 s).
def test_gpu_check_environment_and_exact_recovery_on_a_cpu(tmp_path):
    phases, _ = run_check(tmp_path, "0,4,1")
    assert "needs CUDA" in phases["4_copy_engine"]["result"]["skipped"]
    env_ = phases["0_environment"]["result"]
    assert env_["imports"]["imported"] > 50 and not env_["imports"]["failed"]

    exact = phases["1_exact_recovery"]["result"]
    assert exact["bit_exact"] and not exact["mismatches"]
    assert (
        exact["compared_tensors"] > 50 and exact["compared_losses"] >= 3 and "rng/cpu" in exact["rng_states_compared"]
    )
    recs = exact["recoveries"]  # the kill in the slot copy, then the kill after an update: both from a window
    assert [r["attempt"] for r in recs] == [1, 2] and all(r["recovered_step"] > 0 and r["exact"] for r in recs)
    assert recs[1]["recovered_step"] > recs[0]["recovered_step"]


def test_gpu_check_refuses_an_inexact_replay_on_a_cpu(tmp_path):
    phases, _ = run_check(tmp_path, "2")
    nondet = phases["2_nondeterministic"]["result"]
    assert nondet["exact"]["refused"] and nondet["exact"]["where"] == "resume" and nondet["exact"]["one_line"]
    assert "not bit for bit" in nondet["exact"]["line"]
    tol = nondet["tolerant"]
    assert tol["recovered"] and tol["replay_exact"] is False and nondet["nondeterminism_seen"]
    assert 0 < max(tol["max_loss_deviation"], tol["max_grad_norm_deviation"]) <= tol["replay_tolerance"]


def test_gpu_check_benchmark_runs_every_system_on_a_cpu(tmp_path):
    phases, out = run_check(tmp_path, "3")
    bench = phases["3_bench"]["result"]
    assert set(bench["systems"]) == set(SYSTEMS), bench["systems"].keys()
    assert bench["intervals"]["dcp_async_best"] >= 1
    for name in SYSTEMS[1:]:
        row = bench["systems"][name]
        assert row["turns"] >= 1 and row["step_s_device"] > 0 and "overhead_s_device" in row, (name, row)
        assert row["copy_bytes_per_iteration"] > 0 and row["d2h_bytes_per_s"] > 0, (name, row)
    raw = json.loads((out / "bench_raw.json").read_text())
    assert set(raw) == set(SYSTEMS)
    gemini = raw["gemini_k1"][-1]  # its own host-byte account: the two snapshot buffers
    assert gemini["own_host_bytes"] == 2 * gemini["stats"]["bytes_per_checkpoint"] > 0
    for name in ("ours_auto", "ours_W4", "ours_host"):  # ours: stats()["host_memory"], every part from its owner
        turn = raw[name][-1]
        assert turn["own_host_bytes"] == sum(turn["own_host_parts"].values()) > 0, (name, turn["own_host_parts"])
    assert raw["ours_host"][-1]["own_host_parts"]["slot_sets"] > 0  # the host tier's slot files
