"""The GPU check's profiler window (phase 3, after the repetitions): a few steps of `none` and of ours under
torch.profiler, summarised (the raw trace is read here and dropped: the device tool brings back a few files only).

Per system, per step where it is a rate:

- the compute stream's idle gaps over 50 us, each with what it waited on: a device-to-host memcpy of another stream
  running through the gap (the copy engine), else the training thread inside a runtime call (a host sync, named),
  else the host (launches not there yet); grouped with their count and time, and the op that ended each gap;
- busy time per stream (the union of its kernels, memcpys and memsets) over the window;
- memcpy count, bytes and sizes per stream and direction;
- the kernels launched on streams other than the compute stream (the copy path's casts and spacers);
- CPU time per call on the training thread: the checkpointer's hooks (`tmoe.*` ranges this module opens), runtime
  calls and the heaviest ops, count and mean.

On a CPU the profiler records CPU activities only: the training thread's part is there, and the summary names the
parts that need CUDA. The chrome trace's fields are what is read (`traceEvents`: `cat`, `ts`, `dur`, `tid`,
`args.stream`, `args.bytes`), the same on every torch that writes one."""

from __future__ import annotations

import gc
import json
import math
import os
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

import torch

GAP_US = 50.0  # compute-stream idle shorter than this is launch jitter, not a wait
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cuda_runtime", "cuda_driver")
# The ops on the training thread that read to the host or copy (the syncs and copies the step waits in).
HOST_OPS = ("aten::item", "aten::_local_scalar_dense", "aten::tolist", "aten::bincount", "aten::to", "aten::_to_copy")
HOST_OPS += ("aten::copy_", "aten::_foreach_copy_", "aten::record_stream", "aten::clone")
NEEDS_CUDA = "compute-stream idle gaps, busy time per stream, memcpys per stream, the copy path's kernels"


def e_is_runtime(name: str) -> bool:
    return name.startswith("cuda") or name.startswith("cu")


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _stream(e: dict) -> int:
    return int((e.get("args") or {}).get("stream", e.get("tid", -1)))


def _bucket(n: int) -> str:
    for limit, label in ((1 << 10, "<1 KiB"), (1 << 20, "<1 MiB"), (64 << 20, "<64 MiB")):
        if n < limit:
            return label
    return ">=64 MiB"


def _direction(name: str) -> str:
    for d in ("DtoH", "HtoD", "DtoD", "HtoH"):
        if d in name:
            return d
    return name.split(" ")[0]


def summarise(trace: dict, training_tid: int, steps: int, cuda: bool) -> dict:
    """The summary of one system's window (see the module's docstring); `steps` profiled steps."""
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    host = [e for e in evs if e.get("tid") == training_tid and e.get("cat") not in GPU_CATS]
    calls: dict[str, list[float]] = defaultdict(list)
    for e in host:
        if e.get("cat") in HOST_CATS or e["name"].startswith("tmoe.") or e["name"] in HOST_OPS:
            calls[e["name"]].append(float(e["dur"]))
    ranked = sorted(calls.items(), key=lambda kv: -sum(kv[1]))
    runtime = [kv for kv in ranked if e_is_runtime(kv[0])][:12]  # the heaviest runtime calls
    keep = [kv for kv in ranked if not e_is_runtime(kv[0])] + runtime
    out: dict = {
        "steps": steps,
        "cpu_calls": {
            n: {"calls_per_step": len(d) / steps, "mean_us": sum(d) / len(d), "per_step_us": sum(d) / steps}
            for n, d in keep
        },
    }
    gpu = [e for e in evs if e.get("cat") in GPU_CATS]
    if not cuda or not gpu:
        out["needs_cuda"] = NEEDS_CUDA
        return out
    by_stream: dict[int, list[dict]] = defaultdict(list)
    for e in gpu:
        by_stream[_stream(e)].append(e)
    t0 = min(float(e["ts"]) for e in gpu)
    t1 = max(float(e["ts"]) + float(e["dur"]) for e in gpu)
    compute = max(by_stream, key=lambda s: sum(float(e["dur"]) for e in by_stream[s] if e.get("cat") == "kernel"))
    out["window_us"] = t1 - t0
    out["compute_stream"] = compute
    out["busy_us_per_step"] = {
        str(s): _union([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in es]) / steps
        for s, es in by_stream.items()
    }
    memcpy: dict[str, dict] = {}
    for s, es in by_stream.items():
        for e in es:
            if e.get("cat") != "gpu_memcpy":
                continue
            n = int((e.get("args") or {}).get("bytes", 0))
            m = memcpy.setdefault(f"{s} {_direction(e['name'])}", {"count": 0, "bytes": 0, "us": 0.0, "sizes": {}})
            m["count"] += 1
            m["bytes"] += n
            m["us"] += float(e["dur"])
            m["sizes"][_bucket(n)] = m["sizes"].get(_bucket(n), 0) + 1
    out["memcpy_per_step"] = {
        k: dict(v, count=v["count"] / steps, bytes=v["bytes"] / steps, us=v["us"] / steps) for k, v in memcpy.items()
    }
    side_kernels: dict[str, list[float]] = defaultdict(list)
    for s, es in by_stream.items():
        if s != compute:
            for e in es:
                if e.get("cat") == "kernel":
                    side_kernels[f"{s} {e['name'][:80]}"].append(float(e["dur"]))
    out["side_kernels_per_step"] = {
        k: {"count": len(v) / steps, "us": sum(v) / steps}
        for k, v in sorted(side_kernels.items(), key=lambda kv: -sum(kv[1]))[:10]
    }
    out["gaps"] = _gaps(by_stream, compute, host, steps)
    return out


def _gaps(by_stream: dict[int, list[dict]], compute: int, host: list[dict], steps: int) -> dict:
    """The compute stream's idle gaps over GAP_US, grouped by what each waited on and the op that ended it."""
    mine = sorted(by_stream[compute], key=lambda e: float(e["ts"]))
    others = [e for s, es in by_stream.items() if s != compute for e in es if e.get("cat") == "gpu_memcpy"]
    runtime = [e for e in host if e.get("cat") in HOST_CATS]
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    end = float(mine[0]["ts"]) + float(mine[0]["dur"]) if mine else 0.0
    for e in mine[1:]:
        start = float(e["ts"])
        if start - end > GAP_US:
            groups[(_waited_on(end, start, others, runtime), e["name"][:60])].append(start - end)
        end = max(end, start + float(e["dur"]))
    rows = [
        {"waited_on": w, "ended_by": op, "count": len(d), "us_per_step": sum(d) / steps, "max_us": max(d)}
        for (w, op), d in groups.items()
    ]
    rows.sort(key=lambda r: -r["us_per_step"])
    return {"total_us_per_step": sum(r["us_per_step"] for r in rows), "groups": rows[:10]}


def _overlap(a: float, b: float, e: dict) -> float:
    return max(0.0, min(b, float(e["ts"]) + float(e["dur"])) - max(a, float(e["ts"])))


def _waited_on(a: float, b: float, memcpys: list[dict], runtime: list[dict]) -> str:
    best = max(memcpys, key=lambda e: _overlap(a, b, e), default=None)
    if best is not None and _overlap(a, b, best) > 0.5 * (b - a):
        return f"copy engine: {best['name'][:40]} on stream {_stream(best)}"
    call = max(runtime, key=lambda e: _overlap(a, b, e), default=None)
    if call is not None and _overlap(a, b, call) > 0.5 * (b - a):
        return f"host in {call['name']}"
    return "host (launches late)"


class _Ranged:
    """A before-update hook inside a profiler range."""

    def __init__(self, hook):
        self.hook = hook

    def __call__(self, *args, **kwargs):
        with torch.profiler.record_function("tmoe.before_update"):
            return self.hook(*args, **kwargs)


def profile_systems(trainer, systems: dict[str, dict | None], steps: int, warmup: int, workdir: Path, build) -> dict:
    """Each system built, warmed up as a benchmark turn is, then `steps` steps under torch.profiler; summarised.
    `build(kind, params, trainer, dir)` makes a system (the bench worker's)."""
    from torchmoe_harness.bench_moe_worker import _detach, _engine
    from torchmoe_harness.gpu_check_bench_worker import MAX_WARMUP, _warm

    cuda = trainer.device.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    out: dict = {"steps": steps, "cuda": cuda, "systems": {}}
    if not cuda:
        out["needs_cuda"] = NEEDS_CUDA
    tid = threading.get_native_id()
    for name, sp in systems.items():
        sp = dict(sp or {"kind": "none"})
        kind = sp.pop("kind")
        system = None if kind == "none" else build(kind, sp, trainer, workdir / f"profile-{name}")
        before = list(trainer.before_update)
        if system is not None:
            system.attach(trainer)
        added = [h for h in trainer.before_update if h not in before]
        trainer.before_update[:] = before + [_Ranged(h) for h in added]
        warmed = 0
        while warmed < warmup or (warmed < MAX_WARMUP and system is not None and not _warm(system)):
            res = trainer.train_step()
            if system is not None:
                system.after_step(trainer, res)
            warmed += 1
        eng = _engine(system)
        if eng is not None:
            eng.wait_done()
        if cuda:
            torch.cuda.synchronize(trainer.device)
        fd, path = tempfile.mkstemp(suffix=".json", prefix="tmoe-trace-")
        os.close(fd)
        try:
            with torch.profiler.profile(activities=acts) as prof:
                for _ in range(steps):
                    with torch.profiler.record_function("tmoe.step"):
                        res = trainer.train_step()
                    if system is not None:
                        with torch.profiler.record_function("tmoe.after_step"):
                            system.after_step(trainer, res)
                if cuda:
                    torch.cuda.synchronize(trainer.device)
            prof.export_chrome_trace(path)
            trace = json.loads(Path(path).read_text())
            out["systems"][name] = summarise(trace, tid, steps, cuda)
            out["systems"][name]["trace_bytes"] = os.path.getsize(path)
            del trace, prof
        finally:
            os.unlink(path)
        trainer.before_update[:] = before + added
        _detach(system, trainer)
        trainer.before_update[:] = before
        if system is not None:
            system.close()
        del system
        gc.collect()
    return out


def markdown(prof: dict | None) -> list[str]:
    """The profiler summary's lines in gpu_check.md."""
    if not prof:
        return []
    lines = [f"Profiler window: {prof['steps']} steps per system ({', '.join(prof['systems'])}), per step:", ""]
    if prof.get("needs_cuda"):
        lines += [
            f"On this device only the training thread's CPU time is recorded; needs CUDA: {prof['needs_cuda']}.",
            "",
        ]
    names = list(prof["systems"])
    calls = sorted({c for s in prof["systems"].values() for c in s["cpu_calls"]})
    lines += [
        "CPU time on the training thread (calls per step x mean us):",
        "",
        "| call | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for c in calls:
        cells = []
        for n in names:
            v = prof["systems"][n]["cpu_calls"].get(c)
            cells.append("-" if v is None else f"{v['calls_per_step']:.1f} x {v['mean_us']:.0f}")
        lines.append(f"| `{c}` | " + " | ".join(cells) + " |")
    lines.append("")
    for n, s in prof["systems"].items():
        if "gaps" not in s:
            continue
        busy = ", ".join(f"stream {k} {v / 1e3:.1f} ms" for k, v in s["busy_us_per_step"].items())
        lines += [
            f"**{n}**: compute stream {s['compute_stream']}; busy per stream {busy}; idle gaps over {GAP_US:.0f} us "
            f"{s['gaps']['total_us_per_step'] / 1e3:.2f} ms",
            "",
            "| waited on | ended by | gaps/step | ms/step | max ms |",
            "|---|---|---|---|---|",
        ]
        for g in s["gaps"]["groups"]:
            lines.append(
                f"| {g['waited_on']} | `{g['ended_by']}` | {g['count'] / s['steps']:.1f} | "
                f"{g['us_per_step'] / 1e3:.2f} | {g['max_us'] / 1e3:.2f} |"
            )
        mc = "; ".join(
            f"{k}: {v['count']:.0f} x, {v['bytes'] / 1e6:.1f} MB, {v['us'] / 1e3:.1f} ms ({v['sizes']})"
            for k, v in s["memcpy_per_step"].items()
        )
        sk = "; ".join(
            f"`{k}` {v['count']:.0f} x {v['us'] / 1e3:.2f} ms" for k, v in s["side_kernels_per_step"].items()
        )
        lines += [
            "",
            f"- memcpys per stream and direction: {mc or 'none'}",
            f"- kernels off the compute stream: {sk or 'none'}",
            "",
        ]
    return lines
