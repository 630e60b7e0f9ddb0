"""The GPU check's new pieces that run the same on a CPU: the ablation turns' switch detection, the per-slot block
accounting on the real chunked copy lists, and the profiler summary on a trace in the chrome-trace layout a CUDA
run writes (the CUDA fields are read the same way; tests/harness/test_gpu_check.py runs the whole check)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from torchmoe_ckpt.capture.copy_chunks import chunk_copy_lists
from torchmoe_harness.gpu_check_bench import (
    FIXES,
    PERIODIC,
    SYSTEMS,
    all_turns,
    effective,
    missing_switch,
    pin_class,
    resolved,
    sparse_fields,
)
from torchmoe_harness.gpu_check_profile import GAP_US, summarise
from torchmoe_harness.gpu_check_slots import SlotRecord, SlotTimer, same_dtype_blocks


def test_a_turn_whose_switch_this_tree_lacks_says_so_in_one_line():
    assert (
        missing_switch({"kind": "ours", "config": {"no_such_switch": True}}) == "switch no_such_switch not in this tree"
    )
    assert missing_switch({"kind": "ours", "config": {"copy_chunk_bytes": 1 << 20}}) is None
    assert missing_switch({"kind": "ours", "skip_copies": True}) is None  # SnapshotEngine.skip_copies exists
    have = sparse_fields()
    for name, sp in SYSTEMS.items():  # each ablation turn runs exactly when its switch exists here
        keys = set((sp.get("config") or {}).keys())
        assert (missing_switch(sp) is None) == keys.issubset(have), name
    every = resolved(SYSTEMS)["ours_auto_fixed"]["config"]  # "every fix": the switches this tree has, no other
    assert set(every) <= have and "copy_chunk_bytes" in every and set(every) <= {*FIXES, "max_step_overhead", "policy"}
    # the W = 4 ablations share one pinned footprint (their blocks reused); none holds none
    assert pin_class(SYSTEMS["ours_W4"]) == pin_class(SYSTEMS["ours_W4_nocopy"]) != pin_class(SYSTEMS["gemini_k1"])
    assert pin_class(None) is None


def test_no_two_turns_measure_the_same_thing_on_cuda():
    """Every default applied (SparseConfig's, and auto W's device-loss pricing on CUDA when `overlap` is None), each
    turn runs a configuration no other turn runs: the review found `ours_W4` = `ours_W4_reads` and `ours_auto` =
    `ours_auto_target` once the defaults changed under them."""
    turns = all_turns()
    seen: dict[tuple, str] = {}
    for name, sp in turns.items():
        key = effective(sp, "cuda")
        assert key not in seen, f"{name} runs what {seen[key]} runs"
        seen[key] = name
    # run 1's path is a turn of its own: the checkpointer's reads on the training stream
    assert dict(effective(SYSTEMS["ours_W4"])[-1])["reads_on_copy_stream"] == "False"
    assert dict(effective(SYSTEMS["ours_W4_reads"])[-1])["reads_on_copy_stream"] == "True"
    assert effective(turns["ours_auto"])[3] is False and effective(SYSTEMS["ours_auto_target"])[3] is True
    staged = dict(effective(SYSTEMS["ours_W4_staging_chunked"])[-1])
    assert staged["device_staging"] == "True" and staged["copy_chunk_bytes"] != "None"
    assert not set(PERIODIC) & set(SYSTEMS)  # DCP async at its best interval: only when --turns names it


def test_the_per_slot_timer_finds_a_staged_copy_by_its_staged_event():
    """The update waits on a staged copy's `staged` event (the device copy), recorded before its host copy's end:
    the stall belongs to that copy (the match on the last end alone lost it)."""
    timer = SlotTimer.__new__(SlotTimer)
    staged, end, other = object(), object(), object()
    a, b = SlotRecord(0, 1, 5), SlotRecord(1, 1, 6)
    a.ends, b.ends = [other], [staged, end]
    b.end = end
    timer.records = [a, b]
    assert timer.record_for(staged) is b and timer.record_for(end) is b and timer.record_for(other) is a
    assert timer.record_for(object()) is None


def test_leading_and_longest_same_dtype_blocks_of_a_slot_copy():
    f32 = [torch.zeros(1000), torch.zeros(3000), torch.zeros(500)]
    srcs = f32[:2] + [torch.zeros(800)] + f32[2:]
    dsts = [torch.empty(1000), torch.empty(3000), torch.empty(800, dtype=torch.bfloat16), torch.empty(500)]
    whole = chunk_copy_lists(srcs, dsts, None)  # as a slot is issued today: fp32 items back to back, then a cast
    assert same_dtype_blocks(whole.srcs, whole.dsts) == (16000, 16000)
    chunked = chunk_copy_lists(srcs, dsts, 4096)  # 4 KiB chunks with a spacer kernel between memcpys
    lead, longest = same_dtype_blocks(chunked.srcs, chunked.dsts)
    assert lead == 4000 and longest == 4096 and chunked.spacers > 0
    assert same_dtype_blocks(dsts[:1], dsts[:1]) == (4000, 4000)  # nothing but a memcpy: the whole is the lead


def _x(cat, name, ts, dur, tid, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "args": args}


def test_profile_summary_names_what_each_compute_stream_gap_waited_on():
    main = 4242
    evs = [
        _x("kernel", "gemm", 0, 100, 7, stream=7),
        # a 300 us gap while stream 20 copies to the host: the copy engine
        _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 90, 400, 20, stream=20, bytes=64 << 20),
        _x("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 400, 5, 7, stream=7, bytes=8),
        _x("kernel", "gemm", 405, 100, 7, stream=7),
        # a 200 us gap while the training thread sits in a host sync
        _x("cuda_runtime", "cudaStreamSynchronize", 510, 190, main),
        _x("kernel", "gemm", 705, 100, 7, stream=7),
        _x("kernel", "direct_copy_kernel_cuda", 600, 2, 20, stream=20),  # a spacer on the copy stream
        # the training thread's own calls, and another thread's that do not count
        _x("user_annotation", "tmoe.after_step", 810, 40, main),
        _x("cpu_op", "aten::item", 500, 10, main),
        _x("cpu_op", "aten::item", 500, 10, 99),
    ]
    s = summarise({"traceEvents": evs}, main, steps=1, cuda=True)
    assert s["compute_stream"] == 7 and "needs_cuda" not in s
    groups = {g["waited_on"]: g for g in s["gaps"]["groups"]}
    eng = next(g for w, g in groups.items() if w.startswith("copy engine"))
    assert eng["ended_by"].startswith("Memcpy DtoH (Device -> Pageable)") and eng["max_us"] == pytest.approx(300)
    assert groups["host in cudaStreamSynchronize"]["max_us"] == pytest.approx(200)
    assert s["gaps"]["total_us_per_step"] == pytest.approx(500) and all(g["max_us"] > GAP_US for g in groups.values())
    assert s["memcpy_per_step"]["20 DtoH"]["bytes"] == 64 << 20 and s["memcpy_per_step"]["7 DtoH"]["count"] == 1
    assert s["busy_us_per_step"]["7"] == pytest.approx(305) and s["busy_us_per_step"]["20"] == pytest.approx(402)
    assert list(s["side_kernels_per_step"]) == ["20 direct_copy_kernel_cuda"]
    assert s["cpu_calls"]["aten::item"]["calls_per_step"] == 1 and s["cpu_calls"]["tmoe.after_step"]["mean_us"] == 40
    # on a CPU the same trace reader keeps the training thread's calls and names what needs CUDA
    cpu = summarise({"traceEvents": evs[-3:]}, main, steps=1, cuda=False)
    assert "gaps" not in cpu and "idle gaps" in cpu["needs_cuda"] and "aten::item" in cpu["cpu_calls"]


def test_the_whole_check_fits_one_nine_minute_device_call_by_run_1_and_2s_timings():
    from torchmoe_harness.gpu_check import BUDGET_S, DEFAULT_PHASES, PHASES
    from torchmoe_harness.gpu_check_bench import PROFILE_RESERVE_S, REGIMES
    from torchmoe_harness.gpu_check_budget import LIMIT_S, estimate

    e = estimate()  # a turn added to phase 3 without room for it fails here, not on the lent GPU
    assert e["fits"] and e["total_s"] <= LIMIT_S
    assert [f"{n}_{PHASES[int(n)]}" for n in DEFAULT_PHASES.split(",")] == list(e["phases_s"])
    for name, r in e["regimes"].items():
        wanted = REGIMES[name]
        assert set(r["turn_s"]) == {"none", *(n for n in SYSTEMS if wanted is None or n in wanted)}, name
        assert all(t > 0 for t in r["turn_s"].values())
    assert e["phases_s"]["3_bench"] <= BUDGET_S["cuda"][3]  # phase 3's own limit holds it
    assert e["profile_s"] <= PROFILE_RESERVE_S
    # within 15% of the figure docs/gpu.md re-derives by hand from the same runs
    doc = (Path(__file__).resolve().parents[2] / "docs" / "gpu.md").read_text()
    by_hand = float(re.search(r"re-derived by hand: \*\*(\d+) s\*\*", doc).group(1))
    assert abs(e["total_s"] - by_hand) <= 0.15 * by_hand, (e["total_s"], by_hand)


def test_the_rotation_moves_every_turn_and_keeps_each_footprint_together():
    from torchmoe_harness.gpu_check_bench_worker import rotation

    order = ["none", "a1", "a2", "a3", "b1", "b2", "g"]
    classes = {"none": None, "a1": "A", "a2": "A", "a3": "A", "b1": "B", "b2": "B", "g": "G"}
    seen = set()
    for rep in range(3):
        got = rotation(order, classes, rep)
        assert sorted(got) == sorted(order)
        runs = [classes[n] for i, n in enumerate(got) if i == 0 or classes[got[i - 1]] != classes[n]]
        assert len(runs) == len(set(runs)), got  # each footprint pinned once per repetition
        seen.add(tuple(got))
    assert len(seen) == 3 and rotation(order, classes, 0) == order
