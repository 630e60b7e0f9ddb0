"""The copy-engine microbenchmark of the GPU check (phase 4), independent of the library: how long a small blocking
read on the training stream waits while a side stream copies, for each way the side stream can copy.

The hypothesis it settles (docs/gpu.md, "Why a side-stream copy slows the step"): all device-to-host copies of all
streams share one copy engine, which is priority-blind and runs one stream's back-to-back memcpys as one block, so
the training stream's own small device-to-host reads (`.item()`, `.tolist()`, `bincount` on CUDA) queue behind
the slot copy and the step stalls. A kernel between two memcpys (a cast, a 1-element "spacer") lets the engine
serve the other stream. Variants (the points), each copying the same source bytes on a side stream while the
training stream runs (an fp32 matmul, then `x.sum().item()`):

  idle            no side-stream work (the baseline latency)
  memcpy_chunks   back-to-back device-to-host memcpys of `chunk` bytes into pinned memory (today's fp32 items)
  spaced_<MiB>    the same with a 1-element cast kernel between memcpys, at 4/8/16/32 MiB chunks (the yield fix)
  one_memcpy      one memcpy of all the bytes
  cast_items      fp32 -> bf16 items, each a cast kernel then a memcpy (today's compute-weight items)
  d2d_memcpy      one device-to-device copy of the same dtype: a `cudaMemcpyAsync` D2D (Copy.cu's memcpy path for
                  same-dtype contiguous tensors), not a kernel
  d2d_cast        one device-to-device fp32 -> bf16 cast: a kernel, no memcpy (what device staging's compute-weight
                  items do)

Only the read is timed: after the matmul and the sum, an event on the training stream is synchronized, then the
`.item()` (its 4-byte device-to-host copy, the part that can queue behind the side stream's memcpys) is timed on
the host. (Timing the matmul with it, ~2-2.5 ms in fp32 on an H200 with TF32 off, would hide a residual of 0.15 ms,
one 8 MiB chunk, which is what decides a 2% step overhead.)

Each variant runs `repetitions` times, the order rotated per repetition; reported per variant: the `.item()`
latency p50/p95/max (ms, pooled over repetitions, with the per-repetition p95 spread), the side stream's GB/s and
how many reads overlapped the copy. The phase has its own time limit (TIME_LIMIT_S): the deadline is checked
before each point, and the points not run are reported as `skipped_points`. Its pinned blocks are handed back at
the end (`_pinned_release`), so the later phases do not run with ~3 GiB of pinned memory cached. On a CPU there
is no copy engine: the phase says so and measures nothing (its copies are tested on a CPU:
tests/harness/test_gpu_check_copy_engine.py).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

MiB = 1 << 20
SPACED_CHUNKS_MIB = (4, 8, 16, 32)
TIME_LIMIT_S = 40.0  # the phase's own limit on a GPU (gpu_check.BUDGET_S["cuda"][4]); ~10-15 s expected


def variants() -> list[str]:
    return [
        "idle",
        "memcpy_chunks",
        *(f"spaced_{m}" for m in SPACED_CHUNKS_MIB),
        "one_memcpy",
        "cast_items",
        "d2d_memcpy",
        "d2d_cast",
    ]


class _Buffers:
    """The device sources and pinned host destinations, allocated once for every variant. On a CPU (the copies'
    test) the "device" tensors are host tensors and nothing is pinned."""

    def __init__(self, torch, total_bytes: int, chunk_bytes: int, device: str = "cuda"):
        n = total_bytes // 4
        pin = device == "cuda"
        self.src = torch.randn(n, device=device)
        self.host = torch.empty(n, dtype=torch.float32, pin_memory=pin)
        self.host_half = torch.empty(n, dtype=torch.bfloat16, pin_memory=pin)
        self.dev_dst = torch.empty_like(self.src)
        self.dev_half = torch.empty(n, dtype=torch.bfloat16, device=device)
        self.chunk = chunk_bytes // 4
        self.spacer_src = torch.zeros(1, device=device)
        self.spacer_dst = torch.zeros(1, device=device, dtype=torch.bfloat16)


def _issue(torch, name: str, b: _Buffers) -> None:
    """Queue one variant's copies on the current (side) stream; returns at once (the copies are asynchronous)."""
    n = b.src.numel()
    if name == "idle":
        return
    if name == "one_memcpy":
        b.host.copy_(b.src, non_blocking=True)
        return
    if name == "d2d_memcpy":
        b.dev_dst.copy_(b.src, non_blocking=True)  # same dtype, contiguous: cudaMemcpyAsync device-to-device
        return
    if name == "d2d_cast":
        b.dev_half.copy_(b.src, non_blocking=True)  # dtypes differ: the copy kernel casts, no memcpy
        return
    chunk = b.chunk
    if name.startswith("spaced_"):
        chunk = int(name.split("_")[1]) * MiB // 4
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        if name == "cast_items":
            b.host_half[lo:hi].copy_(b.src[lo:hi], non_blocking=True)  # a cast kernel, then the memcpy
        else:
            b.host[lo:hi].copy_(b.src[lo:hi], non_blocking=True)
            if name.startswith("spaced_"):
                b.spacer_dst.copy_(b.spacer_src, non_blocking=True)  # a 1-element cast: a kernel between memcpys


def _moved_bytes(name: str, b: _Buffers) -> int:
    """Bytes the variant writes (its destination's), for its GB/s."""
    if name == "idle":
        return 0
    return b.src.numel() * (2 if name in ("cast_items", "d2d_cast") else 4)


def _one_turn(torch, name: str, b: _Buffers, side, max_reads: int) -> dict:
    """The side stream copies while the training stream reads; the `.item()` latencies that overlapped it."""
    x = torch.randn(4096, 4096, device="cuda")  # x @ x in fp32 (TF32 off by default): ~2-2.5 ms on an H200
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    computed = torch.cuda.Event()  # the training stream's compute done: what is timed after it is the read alone
    with torch.cuda.stream(side):
        start.record(side)
        _issue(torch, name, b)
        end.record(side)
    waits = []
    for _ in range(max_reads):
        s = (x @ x).sum()  # compute, then a blocking read, as a router's token count is
        computed.record()  # on the current (training) stream, not the side one: the sync waits for compute only
        computed.synchronize()
        t0 = time.perf_counter()
        s.item()  # its 4-byte device-to-host copy: queues behind the side stream's memcpys on a shared engine
        waits.append(time.perf_counter() - t0)
        if name != "idle" and end.query():
            break
    torch.cuda.synchronize()
    copy_s = start.elapsed_time(end) / 1e3
    return {"waits_ms": [w * 1e3 for w in waits], "copy_s": copy_s, "bytes": _moved_bytes(name, b)}


def _run_points(
    names: list[str], repetitions: int, deadline: float, one: Callable[[str], dict], clock=time.monotonic
) -> tuple[dict[str, list[dict]], list[str]]:
    """Every (repetition, variant) point, the order rotated per repetition, until the deadline: checked before
    each point, so a point once started runs to its end (seconds at most). Returns the points run, by variant, and
    the skipped ones as "<variant>@<repetition>"."""
    turns: dict[str, list[dict]] = {n: [] for n in names}
    skipped: list[str] = []
    for rep in range(repetitions):
        order = names[rep % len(names) :] + names[: rep % len(names)]  # rotated
        for name in order:
            if clock() >= deadline:
                skipped.append(f"{name}@{rep}")
                continue
            turns[name].append(one(name))
    return turns, skipped


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] if xs else 0.0


def _summary(points: list[dict]) -> dict:
    waits = [w for t in points for w in t["waits_ms"]]
    per_rep_p95 = [_pct(t["waits_ms"], 0.95) for t in points]
    gbps = [t["bytes"] / t["copy_s"] / 1e9 for t in points if t["copy_s"] > 0 and t["bytes"]]
    return {
        "reads": len(waits),
        "read_ms_p50": round(_pct(waits, 0.5), 3),
        "read_ms_p95": round(_pct(waits, 0.95), 3),
        "read_ms_max": round(max(waits), 3) if waits else 0.0,
        "read_ms_p95_per_repetition": [round(x, 3) for x in per_rep_p95],
        "side_gb_per_s": round(statistics.median(gbps), 2) if gbps else None,
        "copy_ms_median": round(statistics.median(t["copy_s"] for t in points) * 1e3, 2) if points else None,
    }


def verdict(out: dict) -> str:
    """The reading of it (docs/gpu.md): back-to-back memcpys delay a read by far more than spaced ones do."""
    v = out["variants"]
    if not (v["idle"]["reads"] and v["memcpy_chunks"]["reads"] and v["spaced_8"]["reads"]):
        return "not enough points ran before the phase's time limit to judge (see skipped_points)"
    idle, blocked, spaced = (v[k]["read_ms_p95"] for k in ("idle", "memcpy_chunks", "spaced_8"))
    hol = blocked > 4 * max(idle, 0.05) and spaced < blocked / 2
    return (
        f"read p95: idle {idle:.2f} ms, back-to-back memcpys {blocked:.2f} ms, 8 MiB chunks with a spacer "
        f"{spaced:.2f} ms: "
        + (
            "head-of-line blocking on the copy engine, and a spacer kernel lets the engine yield"
            if hol
            else "no clear head-of-line blocking: the copy engine is not what delays the step"
        )
    )


def _measure(torch, b: _Buffers, side, names: list[str], repetitions: int, deadline: float):
    """The warm-up points (pinned pages touched, kernels loaded), then the measured ones, all under the deadline."""
    _, warm_skipped = _run_points(names, 1, deadline, lambda n: _one_turn(torch, n, b, side, max_reads=5))
    turns, skipped = _run_points(
        names, repetitions, deadline, lambda n: _one_turn(torch, n, b, side, max_reads=400 if n == "idle" else 4000)
    )
    return warm_skipped, turns, skipped


def _pinned_release(torch):
    """What hands the caching host allocator's free pinned blocks back (cudaFreeHost: a device sync, so once, after
    the phase): `torch._C._host_emptyCache` in CUDA builds (2.11 included), `torch.accelerator.empty_host_cache`
    in newer ones (it raises without an accelerator). None when this build has neither."""
    return getattr(torch._C, "_host_emptyCache", None) or getattr(torch.accelerator, "empty_host_cache", None)


def run(device: str, tiny: bool, repetitions: int = 3, time_limit_s: float = TIME_LIMIT_S) -> dict:
    """Phase 4 of the GPU check. `tiny`: 256 MiB per variant instead of 2 GiB. `time_limit_s`: no point starts
    after it (warm-up and allocation included)."""
    if device != "cuda":
        return {
            "ok": True,
            "skipped": "the copy-engine microbenchmark needs CUDA: a CPU has no copy engine to contend for "
            "(the variants are listed; nothing was measured)",
            "variants": variants(),
        }
    import torch

    deadline = time.monotonic() + time_limit_s
    total = (256 if tiny else 2048) * MiB
    b = _Buffers(torch, total, 8 * MiB)
    side = torch.cuda.Stream()
    names = variants()
    try:
        warm_skipped, turns, skipped = _measure(torch, b, side, names, repetitions, deadline)
    finally:
        del b
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        release = _pinned_release(torch)
        if release is not None:  # the ~3 GiB of pinned blocks back to the system, not cached for later phases
            release()
    out: dict = {
        "ok": True,
        "bytes_per_variant": total,
        "repetitions": repetitions,
        "time_limit_s": time_limit_s,
        "skipped_points": [f"warm:{p}" for p in warm_skipped] + skipped,
        "variants": {name: _summary(turns[name]) for name in names},
    }
    out["verdict"] = verdict(out)
    return out


def markdown(res: dict) -> list[str]:
    """The phase's lines in gpu_check.md."""
    if res.get("skipped"):
        return [f"Copy-engine microbenchmark: skipped ({res['skipped']})."]
    lines = [
        f"Copy-engine microbenchmark: {res['bytes_per_variant'] / 2**30:.2f} GiB per variant on a side stream, "
        f"{res['repetitions']} repetitions (order rotated); `.item()` alone (after an event on the compute) on the "
        "training stream while it copies:",
        "",
        "| side stream | reads | read p50 ms | read p95 ms (per repetition) | read max ms | side GB/s | copy ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, v in res["variants"].items():
        reps = ", ".join(f"{x:.2f}" for x in v["read_ms_p95_per_repetition"])
        gbps = "-" if v["side_gb_per_s"] is None else f"{v['side_gb_per_s']:.1f}"
        copy = "-" if v["copy_ms_median"] is None else f"{v['copy_ms_median']:.1f}"
        lines.append(
            f"| {name} | {v['reads']} | {v['read_ms_p50']:.3f} | {v['read_ms_p95']:.3f} ({reps}) | "
            f"{v['read_ms_max']:.2f} | {gbps} | {copy} |"
        )
    lines += ["", f"Verdict: {res['verdict']}."]
    if res.get("skipped_points"):
        lines += [
            "",
            f"Skipped at the phase's time limit ({res['time_limit_s']:.0f} s): {', '.join(res['skipped_points'])}.",
        ]
    return lines
