"""The GPU check's phase 4 (torchmoe_harness/gpu_copy_engine.py) on a CPU: what it does not need a copy engine
for. Every variant's copies write what they say (torch.equal), the phase's own time limit skips the points past
it and says which, and the report reads when points were skipped. The timing itself needs CUDA."""

from __future__ import annotations

import time

import torch

from torchmoe_harness import gpu_copy_engine as ce


def test_every_variant_copies_what_its_name_says():
    b = ce._Buffers(torch, 3 * ce.MiB + 40, ce.MiB, device="cpu")  # a ragged last chunk
    want32, want16 = b.src.clone(), b.src.to(torch.bfloat16)
    names = ce.variants()
    assert "device_copy" not in names and {"d2d_memcpy", "d2d_cast"} <= set(names)  # the memcpy, and a kernel copy
    for name in names:
        for t in (b.host, b.host_half, b.dev_dst, b.dev_half):
            t.fill_(7)
        ce._issue(torch, name, b)
        if name == "idle":
            assert ce._moved_bytes(name, b) == 0
            continue
        dst, want = {
            "cast_items": (b.host_half, want16),
            "d2d_memcpy": (b.dev_dst, want32),
            "d2d_cast": (b.dev_half, want16),
        }.get(name, (b.host, want32))
        assert torch.equal(dst, want), name
        assert ce._moved_bytes(name, b) == dst.numel() * dst.element_size(), name
    assert torch.equal(b.src, want32)  # the source untouched


def test_the_phase_time_limit_skips_the_points_past_it_and_says_which():
    names = ce.variants()
    ran: list[str] = []

    def one(name: str) -> dict:
        ran.append(name)
        time.sleep(0.05)
        return {"waits_ms": [0.1, 0.2], "copy_s": 0.01, "bytes": 10**6}

    t0 = time.monotonic()
    turns, skipped = ce._run_points(names, 3, t0 + 0.12, one)  # checked before each point: 1 to 3 points start
    assert 1 <= len(ran) <= 3 and len(ran) + len(skipped) == 3 * len(names)
    assert ran == names[: len(ran)] and skipped[0] == f"{names[len(ran)]}@0" and skipped[-1].endswith("@2")
    assert sum(len(v) for v in turns.values()) == len(ran)
    # nothing starts after the deadline, and the report says so instead of a verdict from too few points
    turns, skipped = ce._run_points(names, 2, time.monotonic(), one)
    assert len(ran) <= 3 and len(skipped) == 2 * len(names)
    res = {
        "ok": True,
        "bytes_per_variant": 2**28,
        "repetitions": 2,
        "time_limit_s": 40.0,
        "skipped_points": skipped,
        "variants": {n: ce._summary(turns[n]) for n in names},
    }
    res["verdict"] = ce.verdict(res)
    assert "not enough points" in res["verdict"]
    md = "\n".join(ce.markdown(res))
    assert "Skipped at the phase's time limit (40 s): idle@0" in md and "| d2d_cast | 0 |" in md


def test_on_a_cpu_the_phase_measures_nothing_and_says_why():
    res = ce.run("cpu", tiny=True)
    assert res["ok"] and "needs CUDA" in res["skipped"] and res["variants"] == ce.variants()


def test_the_phase_finds_what_hands_its_pinned_blocks_back_on_this_torch():
    assert callable(ce._pinned_release(torch))  # (called on CUDA only: a CPU build raises without an accelerator)
