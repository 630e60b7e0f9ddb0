"""The GPU check (`torchmoe-ckpt gpu-check`, docs/gpu.md) runs whole on a CPU, small, so the command a GPU machine
runs cannot rot between the sessions that have one: real torchrun processes, real kill -9s, a real refusal of an
inexact replay (the restarted attempt runs another intra-op thread count), the benchmark's every system. The test
reads what the command wrote, as the person reading a GPU run's results would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchmoe_harness.gpu_check import PHASES
from torchmoe_harness.gpu_check_bench import (
    CHUNK_BYTES,
    OPTIONAL_SYSTEMS,
    PERIODIC,
    REGIMES,
    REPRESENTATIVE_CPU_MICRO_BATCHES,
    SYSTEMS,
    W,
    all_turns,
    missing_switch,
)

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast

ROOT = Path(__file__).resolve().parents[2]


def check_command(tmp_path, phases: str, turns: str | None = None, regimes: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "torchmoe_harness.gpu_check", "--out", str(tmp_path / "out"), "--device", "cpu"]
    cmd += ["--tiny", "--work", str(tmp_path / "work"), "--phases", phases] + (["--turns", turns] if turns else [])
    return cmd + (["--regimes", regimes] if regimes else [])


ENV = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")


def run_check(tmp_path, phases: str, turns: str | None = None, regimes: str | None = None) -> tuple[dict, Path]:
    """`gpu-check --device cpu --tiny --phases ...` as the device machine runs it: its report, checked whole."""
    out = tmp_path / "out"
    env = ENV
    cmd = check_command(tmp_path, phases, turns, regimes)
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


# Four tests, some phases (phase 3: some turns) each, so that none comes near the suite's 60 s limit.
def test_gpu_check_environment_and_exact_recovery_on_a_cpu(tmp_path):
    phases, _ = run_check(tmp_path, "0,4,1")
    assert "needs CUDA" in phases["4_copy_engine"]["result"]["skipped"]
    env_ = phases["0_environment"]["result"]
    assert env_["imports"]["imported"] > 50 and not env_["imports"]["failed"]
    assert env_["foreach_copy_mixed_dtype"]["result"] == "ok"  # the probe ran (on a CPU: per-item, trivially)

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


ABLATIONS = ("ours_W4", "ours_W4_chunked", "ours_W4_nocopy")  # with the per-slot table and the profile
ABLATIONS_B = tuple(n for n in all_turns() if n.startswith("ours_W4") and n not in ABLATIONS)
SYSTEMS_B = (*(n for n in all_turns() if not n.startswith("ours_W4") and n != "gemini_k1"), *PERIODIC)
BOTH_REGIMES = ("ours_W4", "gemini_k1")


def test_every_turn_runs_in_make_test():
    """The benchmark tests below between them run every turn `--turns` may name, and both regimes."""
    named = {*ABLATIONS, *ABLATIONS_B, *SYSTEMS_B, *BOTH_REGIMES}
    assert named == {*SYSTEMS, *OPTIONAL_SYSTEMS, *PERIODIC} and set(REGIMES) == {"stress", "representative"}


def _turns_ran(bench: dict, wanted: tuple[str, ...]) -> list[str]:
    """Every turn asked for ran, or says in one line that this tree lacks its switch (and only then)."""
    skipped = bench["skipped_turns"]
    ran = [n for n in ("none", *wanted) if n not in skipped]
    assert set(bench["systems"]) == set(ran), (bench["systems"].keys(), skipped)
    turns = all_turns()
    assert skipped == {n: why for n in wanted if n in turns and (why := missing_switch(turns[n]))}
    assert all(why.startswith("switch ") and why.endswith(" not in this tree") for why in skipped.values())
    for name in ran[1:]:
        row = bench["systems"][name]
        assert row["turns"] >= 1 and row["step_s_device"] > 0 and "overhead_s_device" in row, (name, row)
        assert row["copy_bytes_per_iteration"] > 0, (name, row)
        assert (row["d2h_bytes_per_s"] is None) == row["copies_skipped"] == name.endswith("_nocopy"), (name, row)
        lo, mid, hi = row["overhead_s_device_spread"]
        assert lo <= mid <= hi
    return ran


def test_gpu_check_ablation_turns_per_slot_and_profile_on_a_cpu(tmp_path):
    phases, out = run_check(tmp_path, "3", ",".join(ABLATIONS), "stress")
    bench = phases["3_bench"]["result"]
    assert list(bench["regimes"]) == ["stress"] and bench["partial"] is None
    ran = _turns_ran(bench, ABLATIONS)
    assert {"ours_W4", "ours_W4_chunked", "ours_W4_nocopy"} <= set(ran)
    md = (out / "gpu_check.md").read_text()
    assert all(f"| {n} |" in md and f"skipped: {why}" in md for n, why in bench["skipped_turns"].items())
    for name in ("ours_W4", "ours_W4_chunked", "ours_W4_nocopy"):  # 2 repetitions, whole windows each
        row = bench["systems"][name]
        assert row["turns"] == 2 and len(row["overhead_s_device_per_rep"]) == 2 and row["steps_per_turn"] == [W, W]
    assert bench["switches"]["ours_W4_chunked"] == {"reads_on_copy_stream": False, "copy_chunk_bytes": CHUNK_BYTES}
    # per slot index: every slot of the window, its bytes (a chunked copy's runs bounded by the chunk)
    slots = bench["slots"]
    assert sorted(int(i) for i in slots["ours_W4"]) == list(range(W))  # (JSON keys)
    for name in ("ours_W4", "ours_W4_chunked", "ours_W4_nocopy"):
        for idx, r in slots[name].items():
            assert r["copies"] == 2 and r["bytes"] > 0 and r["copy_s"] and r["ready_to_start_s"], (name, idx)
            assert r["copy_s"][0] >= 0 and r["ready_to_start_s"][0] >= 0
            assert int(idx) == W - 1 or r["stall_s"] is not None  # the last copy of a turn has no update after it
    assert all(0 < r["lead_bytes"] and r["longest_bytes"] <= r["bytes"] for r in slots["ours_W4"].values())
    assert all(r["longest_bytes"] <= CHUNK_BYTES for r in slots["ours_W4_chunked"].values())
    assert max(r["copy_s"][1] for r in slots["ours_W4_nocopy"].values()) < max(
        r["copy_s"][1] for r in slots["ours_W4"].values()
    )  # the ablation without copies really copies nothing
    # the profiler window: on a CPU the training thread's calls, and what needs CUDA named
    prof = bench["profile"]
    assert list(prof["systems"]) == ["none", "ours_W4"] and "idle gaps" in prof["needs_cuda"]
    calls = prof["systems"]["ours_W4"]["cpu_calls"]
    assert calls["tmoe.after_step"]["mean_us"] > 0 and calls["tmoe.step"]["calls_per_step"] == 1
    assert "tmoe.after_step" not in prof["systems"]["none"]["cpu_calls"]
    assert "Profiler window" in md and "Per slot index" in md and "Host memory after each turn" in md
    raw = json.loads((out / "bench_raw.json").read_text())["stress"]
    assert set(raw) == set(ran)
    for name, ts in raw.items():  # every turn released and measured what it left; rotated repetitions
        assert [t["rep"] for t in ts] == [0, 1] and all(t["after_release"]["rss_bytes"] > 0 for t in ts), name


def test_gpu_check_benchmark_systems_on_a_cpu(tmp_path):
    phases, out = run_check(tmp_path, "3", ",".join(SYSTEMS_B), "stress")
    bench = phases["3_bench"]["result"]
    ran = _turns_ran(bench, SYSTEMS_B)
    assert {"ours_auto", "ours_auto_target", "ours_auto_fixed", "ours_host", "dcp_async_best"} <= set(ran)
    assert bench["intervals"]["dcp_async_best"] >= 1 and bench["profile"] is None  # no ours_W4 turn to profile
    assert "copy_chunk_bytes" in bench["switches"]["ours_auto_fixed"]  # every fix this tree has
    raw = json.loads((out / "bench_raw.json").read_text())["stress"]
    assert set(raw) == set(ran)
    assert all(t["every"] == bench["intervals"]["dcp_async_best"] for t in raw["dcp_async_best"])
    for name in ("ours_auto", "ours_host"):  # ours: stats()["host_memory"], every part from its owner
        turn = raw[name][-1]
        assert turn["own_host_bytes"] == sum(turn["own_host_parts"].values()) > 0, (name, turn["own_host_parts"])
    assert raw["ours_host"][-1]["own_host_parts"]["slot_sets"] > 0  # the host tier's slot files


def test_gpu_check_other_ablations_on_a_cpu(tmp_path):
    """The switches not above, each a turn of its own: the reads on the copy stream, the copy in the backward,
    device staging with and without chunking."""
    phases, _ = run_check(tmp_path, "3", ",".join(ABLATIONS_B), "stress")
    bench = phases["3_bench"]["result"]
    ran = _turns_ran(bench, ABLATIONS_B)
    assert set(ABLATIONS_B) <= set(ran)
    sw = bench["switches"]
    assert sw["ours_W4_reads"] == {"reads_on_copy_stream": True}
    assert sw["ours_W4_staging_chunked"] == {
        "reads_on_copy_stream": False,
        "device_staging": True,
        "copy_chunk_bytes": CHUNK_BYTES,
    }
    for name in ("ours_W4_staging", "ours_W4_staging_chunked"):  # every staged copy timed, slot by slot
        assert sorted(int(i) for i in bench["slots"][name]) == list(range(W)), name


def test_gpu_check_runs_both_regimes_in_one_call_with_the_simulators_etr_for_each(tmp_path):
    """The default regimes, stress then representative, in one worker: the second with accumulated micro-batches
    (a longer step, the same model), its own turns, and the simulator's ETTR table of its own."""
    phases, out = run_check(tmp_path, "3", ",".join(BOTH_REGIMES))
    bench = phases["3_bench"]["result"]
    assert list(bench["regimes"]) == ["stress", "representative"]
    stress, rep = bench["regimes"]["stress"], bench["regimes"]["representative"]
    assert stress["micro_batches"] == 1 and rep["micro_batches"] == REPRESENTATIVE_CPU_MICRO_BATCHES
    assert set(rep["systems"]) == set(stress["systems"]) == {"none", *BOTH_REGIMES}
    for row in (stress, rep):
        assert row["systems"]["none"]["step_s_device"] > 0 and "overhead_s_device" in row["systems"]["gemini_k1"]
    raw = json.loads((out / "bench_raw.json").read_text())
    assert set(raw) == {"stress", "representative"}
    gemini = raw["stress"]["gemini_k1"][-1]  # its own host-byte account: the two snapshot buffers
    assert gemini["own_host_bytes"] == 2 * gemini["stats"]["bytes_per_checkpoint"] > 0
    md = (out / "gpu_check.md").read_text()
    assert "### Regime stress: 1 micro-batch(es)" in md and "### Regime representative: 2 micro-batch(es)" in md
    assert md.count("ETTR from these costs") == 2  # the simulator's table per regime


def test_a_killed_benchmark_worker_still_reports_every_turn_it_finished(tmp_path):
    """kill -9 of phase 3's worker once two turns are done (as an out-of-memory kill or a time limit would):
    the phase fails, says so in one line, and reports the turns from the partial report written after each."""
    cmd = check_command(tmp_path, "3", "ours_W4,gemini_k1", "stress")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=ROOT)
    partial = tmp_path / "work" / "bench" / "partial.json"
    deadline = time.monotonic() + 150
    try:
        while time.monotonic() < deadline:
            if partial.is_file():
                done = json.loads(partial.read_text())["regimes"].get("stress", {}).get("turns", {})
                if sum(len(v) for v in done.values()) >= 2:
                    break
            time.sleep(0.05)
        else:
            pytest.fail("no partial report with two turns")
        spec = str(tmp_path / "work" / "bench" / "spec.json")
        workers = subprocess.run(["pgrep", "-f", f"gpu_check_bench_worker.*{spec}"], capture_output=True, text=True)
        pids = [int(p) for p in workers.stdout.split()]
        assert pids, "the worker process was not found"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        log, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, log[-2000:]
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    entry = report["phases"]["3_bench"]
    bench = entry["result"]
    assert entry["status"] == "failed" and bench["partial"] and not bench["ok"]
    assert "none" in bench["systems"] and len(bench["systems"]) >= 2
    assert "the worker did not finish" in log and "**Partial**" in (tmp_path / "out" / "gpu_check.md").read_text()
