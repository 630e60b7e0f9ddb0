"""The GPU check's pieces that need no GPU to be checked: the benchmark model's sizing against host, shared and
GPU memory, the sync counter's bookkeeping (fed the warning torch's CUDA sync debug mode issues), and the
subcommand's registration."""

from __future__ import annotations

import argparse
import threading
import warnings

import pytest

from torchmoe_harness.commands import register_gpu_check
from torchmoe_harness.gpu_check_bench import TARGET_PARAMS, gpu_model, params_of, size_for
from torchmoe_harness.gpu_check_syncs import MESSAGE, SyncCounter, added_syncs

GB = 1e9


def test_the_benchmark_model_reaches_half_a_billion_parameters_where_memory_allows():
    got = size_for(host_free=120 * GB, shm_free=60 * GB, gpu_total=80 * GB)  # the H100 machine
    assert got["below_target"] is None and got["params"] >= TARGET_PARAMS
    smaller = params_of(gpu_model(got["model"]["num_experts"] - 1)["model"])
    assert smaller < TARGET_PARAMS  # the smallest such model: the time budget pays for every byte


@pytest.mark.parametrize(
    "host, shm, gpu, limit",
    [
        (20 * GB, 60 * GB, 80 * GB, "host memory"),
        (120 * GB, 4 * GB, 80 * GB, "/dev/shm"),
        (120 * GB, 60 * GB, 8 * GB, "GPU memory"),
    ],
)
def test_the_benchmark_model_shrinks_to_fit_and_says_why(host, shm, gpu, limit):
    got = size_for(host_free=host, shm_free=shm, gpu_total=gpu)
    assert got["params"] < TARGET_PARAMS and limit in got["below_target"]


def test_sync_counter_counts_the_training_threads_syncs_per_iteration_and_where():
    counter = SyncCounter(enabled=False)  # no CUDA here: feed its handler what the debug mode would raise
    counter._show, seen = warnings.showwarning, []
    counter.step = 3
    counter._seen(UserWarning(f"called a {MESSAGE}"), UserWarning, "model.py", 143)
    counter._seen(UserWarning(f"called a {MESSAGE}"), UserWarning, "model.py", 143)
    counter.step = 4
    counter._seen(UserWarning(f"called a {MESSAGE}"), UserWarning, "loop.py", 7)
    t = threading.Thread(target=counter._seen, args=(UserWarning(MESSAGE), UserWarning, "copy.py", 1))
    t.start()
    t.join()
    counter._show = lambda *a: seen.append(a)
    counter._seen(UserWarning("something else"), UserWarning, "x.py", 1)  # other warnings pass through
    rep = counter.report()
    assert rep["by_step"] == {"3": 2, "4": 1} and rep["other_threads"] == 1 and len(seen) == 1
    assert rep["sites"] == {"model.py:143": 2, "loop.py:7": 1}
    plain = {"by_step": {"3": 2, "4": 0}}
    assert added_syncs(plain, rep, [3, 4]) == {
        "steps": [3, 4],
        "plain_per_iteration": 1.0,
        "checkpointed_per_iteration": 1.5,
        "added_per_iteration": 0.5,
        "iterations_with_added_syncs": [4],
    }


def test_gpu_check_is_a_subcommand_and_refuses_unknown_phases():
    ap = argparse.ArgumentParser()
    register_gpu_check(ap.add_subparsers(dest="cmd"))
    a = ap.parse_args(["gpu-check", "--out", "x", "--device", "cpu", "--tiny", "--phases", "1,7"])
    assert a.tiny and a.device == "cpu"
    with pytest.raises(ValueError, match="--phases '1,7': use numbers 0-4"):
        a.fn(a)


def test_phase0_probes_a_mixed_dtype_foreach_copy_against_per_item_copies():
    """On a CPU the call takes the per-item path: ok (on CUDA before pytorch#173531: "wrong values")."""
    from torchmoe_harness.gpu_check import foreach_copy_probe

    got = foreach_copy_probe("cpu")
    assert got["result"] == "ok", got
    assert foreach_copy_probe("no-such-device")["result"] == "error"  # a refused call is reported, not raised
