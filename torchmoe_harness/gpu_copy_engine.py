"""The copy-engine microbenchmark of the GPU check (phase 4), independent of the library: how long a small blocking
read on the training stream waits while a side stream copies, for each way the side stream can copy.

The hypothesis it settles (docs/gpu.md, "Why a side-stream copy slows the step"): all device-to-host copies of all
streams share one copy engine, which is priority-blind and runs one stream's back-to-back memcpys as one block, so
the training stream's own small device-to-host reads (`.item()`, `.tolist()`, `bincount` on CUDA) queue behind
the slot copy and the step stalls. A kernel between two memcpys (a cast, a 1-element "spacer") lets the engine
serve the other stream. Variants, each copying the same bytes on a side stream while the training stream runs
(a small matmul, then `x.sum().item()`) and every `.item()` is timed on the host:

  idle            no side-stream work (the baseline latency)
  memcpy_chunks   back-to-back device-to-host memcpys of `chunk` bytes into pinned memory (today's fp32 items)
  spaced_<MiB>    the same with a 1-element cast kernel between memcpys, at 4/8/16/32 MiB chunks (the yield fix)
  one_memcpy      one memcpy of all the bytes
  cast_items      fp32 -> bf16 items, each a cast kernel then a memcpy (today's compute-weight items)
  device_copy     device-to-device copies by kernel (no copy engine: what device staging does)

Each variant runs `repetitions` times, the order rotated per repetition; reported per variant: the `.item()`
latency p50/p95/max (ms, pooled over repetitions, with the per-repetition p95 spread), the side stream's GB/s and
how many reads overlapped the copy. On a CPU there is no copy engine: the phase says so and measures nothing.
"""

from __future__ import annotations

import statistics
import time

MiB = 1 << 20
SPACED_CHUNKS_MIB = (4, 8, 16, 32)


def variants() -> list[str]:
    return [
        "idle",
        "memcpy_chunks",
        *(f"spaced_{m}" for m in SPACED_CHUNKS_MIB),
        "one_memcpy",
        "cast_items",
        "device_copy",
    ]


class _Buffers:
    """The device sources and pinned host destinations, allocated once for every variant."""

    def __init__(self, torch, total_bytes: int, chunk_bytes: int):
        n = total_bytes // 4
        self.src = torch.randn(n, device="cuda")
        self.host = torch.empty(n, dtype=torch.float32, pin_memory=True)
        self.host_half = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
        self.dev_dst = torch.empty_like(self.src)
        self.chunk = chunk_bytes // 4
        self.spacer_src = torch.zeros(1, device="cuda")
        self.spacer_dst = torch.zeros(1, device="cuda", dtype=torch.bfloat16)


def _issue(torch, name: str, b: _Buffers) -> None:
    """Queue one variant's copies on the current (side) stream; returns at once (the copies are asynchronous)."""
    n = b.src.numel()
    if name == "idle":
        return
    if name == "one_memcpy":
        b.host.copy_(b.src, non_blocking=True)
        return
    if name == "device_copy":
        b.dev_dst.copy_(b.src, non_blocking=True)
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


def _one_turn(torch, name: str, b: _Buffers, side, max_reads: int) -> dict:
    """The side stream copies while the training stream reads; the `.item()` latencies that overlapped it."""
    x = torch.randn(4096, 4096, device="cuda")  # x @ x: ~0.2 ms on an H100/H200
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        start.record(side)
        _issue(torch, name, b)
        end.record(side)
    waits = []
    for _ in range(max_reads):
        y = x @ x  # compute, then a blocking read, as a router's token count is
        t0 = time.perf_counter()
        y.sum().item()
        waits.append(time.perf_counter() - t0)
        if name != "idle" and end.query():
            break
    torch.cuda.synchronize()
    copy_s = start.elapsed_time(end) / 1e3
    moved = 0 if name == "idle" else b.src.numel() * (2 if name == "cast_items" else 4)
    return {"waits_ms": [w * 1e3 for w in waits], "copy_s": copy_s, "bytes": moved}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] if xs else 0.0


def run(device: str, tiny: bool, repetitions: int = 3) -> dict:
    """Phase 4 of the GPU check. `tiny`: 256 MiB per variant instead of 2 GiB."""
    if device != "cuda":
        return {
            "ok": True,
            "skipped": "the copy-engine microbenchmark needs CUDA: a CPU has no copy engine to contend for "
            "(the variants are listed; nothing was measured)",
            "variants": variants(),
        }
    import torch

    total = (256 if tiny else 2048) * MiB
    b = _Buffers(torch, total, 8 * MiB)
    side = torch.cuda.Stream()
    names = variants()
    for name in names:  # warm: pinned pages touched, kernels loaded
        _one_turn(torch, name, b, side, max_reads=5)
    turns: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(repetitions):
        order = names[rep % len(names) :] + names[: rep % len(names)]  # rotated
        for name in order:
            turns[name].append(_one_turn(torch, name, b, side, max_reads=400 if name == "idle" else 4000))
    out: dict = {"ok": True, "bytes_per_variant": total, "repetitions": repetitions, "variants": {}}
    for name in names:
        waits = [w for t in turns[name] for w in t["waits_ms"]]
        per_rep_p95 = [_pct(t["waits_ms"], 0.95) for t in turns[name]]
        gbps = [t["bytes"] / t["copy_s"] / 1e9 for t in turns[name] if t["copy_s"] > 0 and t["bytes"]]
        out["variants"][name] = {
            "reads": len(waits),
            "read_ms_p50": round(_pct(waits, 0.5), 3),
            "read_ms_p95": round(_pct(waits, 0.95), 3),
            "read_ms_max": round(max(waits), 3) if waits else 0.0,
            "read_ms_p95_per_repetition": [round(x, 3) for x in per_rep_p95],
            "side_gb_per_s": round(statistics.median(gbps), 2) if gbps else None,
            "copy_ms_median": round(statistics.median(t["copy_s"] for t in turns[name]) * 1e3, 2),
        }
    idle = out["variants"]["idle"]["read_ms_p95"]
    blocked = out["variants"]["memcpy_chunks"]["read_ms_p95"]
    spaced = out["variants"]["spaced_8"]["read_ms_p95"]
    # The reading of it (docs/gpu.md): back-to-back memcpys delay a read by far more than spaced ones do.
    out["verdict"] = (
        f"read p95: idle {idle:.2f} ms, back-to-back memcpys {blocked:.2f} ms, 8 MiB chunks with a spacer "
        f"{spaced:.2f} ms: "
        + (
            "head-of-line blocking on the copy engine, and a spacer kernel lets the engine yield"
            if blocked > 4 * max(idle, 0.05) and spaced < blocked / 2
            else "no clear head-of-line blocking: the copy engine is not what delays the step"
        )
    )
    del b
    torch.cuda.empty_cache()
    return out


def markdown(res: dict) -> list[str]:
    """The phase's lines in gpu_check.md."""
    if res.get("skipped"):
        return [f"Copy-engine microbenchmark: skipped ({res['skipped']})."]
    lines = [
        f"Copy-engine microbenchmark: {res['bytes_per_variant'] / 2**30:.2f} GiB per variant on a side stream, "
        f"{res['repetitions']} repetitions (order rotated); `.item()` on the training stream while it copies:",
        "",
        "| side stream | reads | read p50 ms | read p95 ms (per repetition) | read max ms | side GB/s | copy ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, v in res["variants"].items():
        reps = ", ".join(f"{x:.2f}" for x in v["read_ms_p95_per_repetition"])
        gbps = "-" if v["side_gb_per_s"] is None else f"{v['side_gb_per_s']:.1f}"
        lines.append(
            f"| {name} | {v['reads']} | {v['read_ms_p50']:.3f} | {v['read_ms_p95']:.3f} ({reps}) | "
            f"{v['read_ms_max']:.2f} | {gbps} | {v['copy_ms_median']:.1f} |"
        )
    lines += ["", f"Verdict: {res['verdict']}."]
    return lines
