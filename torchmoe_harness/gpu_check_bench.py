"""Phase 3 of the GPU check (gpu_check.py): the systems side by side on one rank (gpu_check_bench_worker), on a MoE
model sized to the card and the host (>= 0.5 B parameters on a GPU; tiny on a CPU), and the figures a GPU run is
judged by: paired step overhead (CUDA events and wall) with its spread over repetitions, training-thread blocked
time, device-to-host throughput against the pinned-copy peak, host memory, host syncs per iteration; per slot index
the update's stall, ready-to-start delay, copy time and bytes (gpu_check_slots.py); a profiler window of `none`
against ours (gpu_check_profile.py).

Systems (SYSTEMS, WHAT): none; ours as it is (W = 4, auto W); the ablations of issue #35 at W = 4, each fix switch
on alone, and the copy path without copies (the GIL and Python alone); auto W priced by a step-overhead target;
every fix at once with that target; the dense snapshot every iteration (Gemini-style, pinned double buffers on a
side stream); DCP `async_save` with pinned async staging at its best interval (ETTR-optimal for an MTBF of
`MTBF_ITERATIONS` iterations from the stall of a first turn at `PROBE_EVERY`, at most 8). A fix switch this tree's
SparseConfig lacks skips its turn with one line (`missing_switch`)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import shutil
import statistics
import tempfile
from pathlib import Path

from torchmoe_harness.launch import launch

CHUNK_BYTES = 8 << 20  # the yielding copy's chunk: phase 4's spaced_8 point
TARGET_OVERHEAD = 0.02  # auto W's step-overhead target in the turns that set it (the 2%)
# Issue #35's fix switches (SparseConfig fields) and the value each is switched on with.
FIXES = {
    "copy_chunk_bytes": CHUNK_BYTES,
    "reads_on_copy_stream": True,
    "copy_phase": "backward",
    "device_staging": True,
}
W = 4  # the ablations' window: run 1's W = 4 row (+19%), a fixed point to compare the switches at
# Run 1's copy path, the ablations' baseline: the checkpointer's own reads on the training stream (the default is
# now the copy stream, so without this `ours_W4` would be `ours_W4_reads`).
RUN1_PATH = {"reads_on_copy_stream": False}
FIXED_OVERLAP = 0.4  # auto W by the fixed-overlap rule (the copy priced as 40% hidden), not by the device loss
SYSTEMS: dict[str, dict] = {
    "ours_W4": {"kind": "ours", "window": W, "config": dict(RUN1_PATH)},
    **{
        f"ours_W4_{short}": {"kind": "ours", "window": W, "config": {**RUN1_PATH, k: v}}
        for short, (k, v) in zip(("chunked", "reads", "backward"), FIXES.items())
    },
    "ours_W4_staging_chunked": {
        "kind": "ours",
        "window": W,
        "config": {**RUN1_PATH, "device_staging": True, "copy_chunk_bytes": CHUNK_BYTES},
    },
    "ours_W4_nocopy": {"kind": "ours", "window": W, "skip_copies": True, "config": dict(RUN1_PATH)},
    # auto W (policy "sparse": the windows whose cost is measured; the simulator prices the dense alternative, and
    # what policy "auto" would choose, from these turns: ettr_gpu.py)
    "ours_auto_target": {"kind": "ours", "window": None, "config": {"policy": "sparse"}},  # priced by the device loss
    "ours_auto_fixed": {"kind": "ours", "window": None, "fixes": "all"},  # every switch this tree has, sparse
    "gemini_k1": {"kind": "gemini", "every": 1},
}
# Turns a `--turns` list may name, left out of the default run: their answer is settled or belongs to a later run
# (docs/gpu.md, "The GPU check"): the fixed-overlap rule, staging without chunking (the worst case for head-of-line
# blocking: the whole slot back to back during the next forward), the host tier (~13 s of pinning, ~35 GB of shm).
OPTIONAL_SYSTEMS: dict[str, dict] = {
    # the fixed-overlap rule: on this benchmark it gives W = 9 as the device-loss rule does (run 2's log, review 7)
    "ours_auto": {"kind": "ours", "window": None, "overlap": FIXED_OVERLAP, "config": {"policy": "sparse"}},
    "ours_W4_staging": {"kind": "ours", "window": W, "config": {**RUN1_PATH, "device_staging": True}},
    "ours_host": {"kind": "ours_host", "window": None},  # auto W with the host tier (policy "sparse")
}
WHAT = {
    "none": "no checkpoint: the step every overhead is paired with",
    "ours_W4": "run 1's path, W = 4: the checkpointer's own reads on the training stream",
    "ours_W4_chunked": f"+ copy_chunk_bytes={CHUNK_BYTES >> 20} MiB: the side stream yields the copy engine",
    "ours_W4_reads": "+ reads_on_copy_stream (the default): the checkpointer's own reads off the training stream",
    "ours_W4_backward": "+ copy_phase=backward: the copy held until the forward's host reads are done",
    "ours_W4_staging": "+ device_staging alone: the whole slot back to back during the next forward (worst case)",
    "ours_W4_staging_chunked": f"+ device_staging + copy_chunk_bytes={CHUNK_BYTES >> 20} MiB: staged, then chunked",
    "ours_W4_nocopy": "the whole copy path without copying (skip_copies): the copy thread's Python and GIL alone",
    "ours_auto": f"auto W by the fixed-overlap rule (overlap={FIXED_OVERLAP}), not by the device loss",
    "ours_auto_target": f"auto W as it is by default: priced by the measured device loss, target {TARGET_OVERHEAD:.0%}",
    "ours_auto_fixed": "every fix switch of this tree at once, auto W with the target: the candidate default",
    "ours_host": "auto W with the host tier (persist thread, shared-memory files)",
    "gemini_k1": "dense pinned snapshot every iteration (side stream, double buffer)",
    "dcp_async_best": "DCP async_save, pinned staging, at its ETTR-best interval",
}
# The two regimes of one call (issue 45): `stress` is the benchmark as run 1 ran it (an 82 ms step for 6.1 GB of
# state: state / (step x copy bandwidth) ~ 1.4); `representative` is the same model with enough accumulated
# micro-batches for a step of at least MIN_STEP_S (ratio ~ 0.1, nearer MoEvement's ~0.03 and DeepSeek-V3's
# ~0.01), with the turns that answer the 2% question there. A CPU uses REPRESENTATIVE_CPU_MICRO_BATCHES.
MIN_STEP_S = 1.0
MAX_MICRO_BATCHES = 64
REPRESENTATIVE_CPU_MICRO_BATCHES = 2
REGIMES: dict[str, tuple[str, ...] | None] = {  # None: every turn asked for
    "stress": None,
    "representative": ("ours_W4", "ours_auto_fixed", "gemini_k1"),
}
# The representative regime's steps last ~13x longer: fewer repetitions, one measured window of W = 4 (or 4 steps)
REPRESENTATIVE_GPU = {"reps": 2, "measure": W, "windows": 1}
REGIME_SHARE = {"stress": 0.55, "representative": 0.45}  # of the repetitions' time, when both run (the estimate's)


def all_turns() -> dict[str, dict]:
    """Every turn `--turns` may name: the default ones, then the optional ones."""
    return {**SYSTEMS, **OPTIONAL_SYSTEMS}


def effective(sp: dict, device: str = "cuda") -> tuple:
    """What a turn runs, every default applied: its kind, window, interval, skip_copies, each SparseConfig field's
    value, and how auto W is priced on `device` (the device loss on CUDA when `overlap` is None). Two turns with the
    same value measure the same thing (tests/harness/test_gpu_check_units.py refuses that)."""
    from torchmoe_ckpt.core.sparse_config import SparseConfig

    sp = resolved({"t": sp})["t"]
    cfg = SparseConfig(window=sp.get("window"), overlap=sp.get("overlap"), **(sp.get("config") or {}))
    fields = tuple((f.name, repr(getattr(cfg, f.name))) for f in dataclasses.fields(cfg))
    device_loss = sp["kind"] in ("ours", "ours_host") and device == "cuda" and cfg.overlap is None
    return (sp["kind"], sp.get("every"), bool(sp.get("skip_copies")), device_loss, fields)


PROBE_EVERY = 8  # the periodic system's first turn (its stall sets the interval of the next ones); tiny: 2
PERIODIC = {"dcp_async_best": {"kind": "dcp_async", "probe_every": PROBE_EVERY, "params": {"keep": 1}}}
PROFILED = ("none", "ours_W4")  # the profiler window's systems, in this order (the stress regime's)
MTBF_ITERATIONS = 100
TARGET_PARAMS = 0.5e9
# Host bytes per parameter at the peak, as a multiple of the dense state (fp32 master + two AdamW moments, 12 B):
# one system at a time, the largest (ours: two windows of pinned slots at a power-of-two block each) plus pinned
# blocks torch's host allocator keeps cached from the turn before it (a turn of the same footprint).
HOST_DENSE_FACTOR = 8.0
SHM_DENSE_FACTOR = 3.0  # shared memory: DCP's staging segment and its files
GPU_BYTES_PER_PARAM = 24.0  # fp32 param, grad, two moments, bf16 copies, activations and workspace


def sparse_fields() -> set[str]:
    from torchmoe_ckpt.core.sparse_config import SparseConfig

    return {f.name for f in dataclasses.fields(SparseConfig)}


def missing_switch(sp: dict) -> str | None:
    """Why a turn cannot run in this tree ("switch X not in this tree"), or None: every SparseConfig field its
    `config` sets exists, and `skip_copies` is a SnapshotEngine knob here."""
    have = sparse_fields()
    for key in sp.get("config") or {}:
        if key not in have:
            return f"switch {key} not in this tree"
    if sp.get("skip_copies"):
        from torchmoe_ckpt.capture.snapshot import SnapshotEngine

        if "skip_copies" not in inspect.getsource(SnapshotEngine):
            return "switch skip_copies not in this tree"
    return None


def resolved(systems: dict[str, dict]) -> dict[str, dict]:
    """`fixes: "all"` made concrete: every switch of FIXES this tree has, and the auto-W target where it exists."""
    have, out = sparse_fields(), {}
    for name, sp in systems.items():
        sp = dict(sp)
        if sp.pop("fixes", None) == "all":
            wanted = {**FIXES, "max_step_overhead": TARGET_OVERHEAD, "policy": "sparse"}
            sp["config"] = {k: v for k, v in wanted.items() if k in have}
        out[name] = sp
    return out


def pin_class(sp: dict | None) -> tuple | None:
    """Turns of one class hold pinned blocks of the same sizes (the next reuses them); None: holds none."""
    if sp is None or sp.get("kind") == "none":
        return None
    if sp["kind"] in ("ours", "ours_host"):
        return (sp["kind"], sp.get("window") or "auto")
    return (sp["kind"],)


def tiny_model() -> dict:
    return {
        "model": {
            "vocab_size": 256,
            "dim": 64,
            "n_layers": 2,
            "n_heads": 2,
            "num_experts": 8,
            "top_k": 2,
            "expert_hidden": 128,
            "max_seq_len": 64,
        },
        "batch_size": 2,
        "seq_len": 32,
    }


def gpu_model(experts: int) -> dict:
    """4 layers of `experts` experts of 3 x 2048 x 1024 (8 MiB fp32 per expert matrix: whole pinned blocks), top-2,
    a 32768-token vocabulary; 4 x 512 tokens per step."""
    return {
        "model": {
            "vocab_size": 32768,
            "dim": 1024,
            "n_layers": 4,
            "n_heads": 8,
            "num_experts": experts,
            "top_k": 2,
            "expert_hidden": 2048,
            "max_seq_len": 512,
        },
        "batch_size": 4,
        "seq_len": 511,
    }


def params_of(model: dict) -> int:
    d, h, e, L, v = (model[k] for k in ("dim", "expert_hidden", "num_experts", "n_layers", "vocab_size"))
    return L * (3 * e * h * d + 4 * d * d + d * e + 2 * d) + 2 * v * d + d


def size_for(host_free: float, shm_free: float, gpu_total: float) -> dict:
    """The smallest expert count reaching TARGET_PARAMS, fewer if host, shared memory or the GPU cannot hold it."""
    need = next(e for e in range(2, 257) if params_of(gpu_model(e)["model"]) >= TARGET_PARAMS)
    experts, reason = need, None
    while experts > 2:
        p = params_of(gpu_model(experts)["model"])
        checks = {
            "host memory": p * 12 * HOST_DENSE_FACTOR <= 0.6 * host_free,
            "/dev/shm": p * 12 * SHM_DENSE_FACTOR <= 0.8 * shm_free,
            "GPU memory": p * GPU_BYTES_PER_PARAM <= 0.6 * gpu_total,
        }
        limit = next((k for k, ok in checks.items() if not ok), None)
        if limit is None:
            break
        reason = reason or limit
        experts -= 1
    p = params_of(gpu_model(experts)["model"])
    return dict(
        gpu_model(experts),
        params=p,
        below_target=None if p >= TARGET_PARAMS else f"{p / 1e9:.2f} B parameters: {reason} holds no more",
    )


def host_meminfo() -> dict[str, int]:
    """MemTotal and MemAvailable of this machine in bytes (/proc/meminfo; {} where there is none)."""
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def plan(device: str, tiny: bool) -> dict:
    if tiny or device != "cuda":
        return dict(tiny_model(), params=params_of(tiny_model()["model"]), below_target=None)
    import torch

    shm = shutil.disk_usage("/dev/shm").free if Path("/dev/shm").is_dir() else 0
    return size_for(float(host_meminfo().get("MemAvailable", 0)), shm, torch.cuda.get_device_properties(0).total_memory)


def regime_specs(turns: list[str], periodic: list[str], small: bool, regimes: list[str], reps_s: float) -> list[dict]:
    """The worker's regimes: each with the turns of `turns` it runs (REGIMES), its micro-batches and its deadline
    (a share of the repetitions' time, in the order given)."""
    out, end = [], 0.0
    share = sum(REGIME_SHARE[r] for r in regimes)
    for r in regimes:
        end += reps_s * REGIME_SHARE[r] / share
        mine = REGIMES[r]
        spec: dict = {
            "name": r,
            "systems": [n for n in turns if mine is None or n in mine],
            "periodic": [n for n in periodic if mine is None],  # the periodic system's probe: stress only
            "deadline_s": end,
        }
        if r == "representative":
            spec.update(
                {"micro_batches": REPRESENTATIVE_CPU_MICRO_BATCHES, "reps": 1}  # make test's 60 s per test
                if small
                else {
                    "min_step_s": MIN_STEP_S,
                    "max_micro_batches": MAX_MICRO_BATCHES,
                    **REPRESENTATIVE_GPU,
                }
            )
        out.append(spec)
    return out


def run_bench(
    device: str,
    tiny: bool,
    work: Path,
    budget_s: float,
    turns: list[str] | None = None,
    regimes: list[str] | None = None,
) -> dict:
    """Phase 3; `turns`: only these (and `none`, which every overhead is paired with), None: the default ones
    (SYSTEMS); `regimes`: only these (REGIMES), None: both. A worker killed mid-phase still gives every turn it
    finished (partial.json), reported with `partial` and not ok."""
    p = plan(device, tiny)
    shm = Path("/dev/shm")
    need_shm = p["params"] * 12 * SHM_DENSE_FACTOR
    base = shm if shm.is_dir() and shutil.disk_usage(shm).free * 0.8 >= need_shm else Path(tempfile.gettempdir())
    workdir = Path(tempfile.mkdtemp(prefix="tmoe-gpucheck-bench-", dir=base))
    small = tiny or device != "cuda"
    every = resolved(all_turns())
    systems = resolved(SYSTEMS) if turns is None else {n: sp for n, sp in every.items() if n in turns}
    periodic = {} if turns is None else {n: sp for n, sp in PERIODIC.items() if n in turns}
    if small:
        periodic = {n: dict(v, probe_every=2) for n, v in periodic.items()}
    regimes = list(REGIMES) if regimes is None else regimes
    profiled = [n for n in PROFILED if n == "none" or n in systems]
    reps_s = max(30.0, budget_s - 25.0 - (PROFILE_RESERVE_S if len(profiled) > 1 else 0.0))
    spec = {
        "run": {
            "model": p["model"],
            "batch_size": p["batch_size"],
            "seq_len": p["seq_len"],
            "steps": 10**6,
            "dtype": "bf16" if device == "cuda" else "fp32",
            "optimizer": "fused",
            "device": device,
        },
        "systems": systems,
        "periodic": periodic,
        "regimes": regime_specs(list(systems), list(periodic), small, regimes, reps_s),
        "reps": 2 if small else 3,  # the order rotated each repetition (tiny: 2, under make test's 60 s)
        "warmup": 1,
        "measure": 2 if small else 8,
        "windows": 1 if small else 2,  # ours: whole windows, at least this many
        "mtbf_iterations": MTBF_ITERATIONS,
        "workdir": str(workdir),
        "profile": {"systems": profiled, "steps": 2 if small else W, "start_by_s": reps_s + 15.0}
        if len(profiled) > 1
        else None,
    }
    d = work / "bench"
    failure = None
    try:
        log = launch(1, spec, d, budget_s + 30.0, module="torchmoe_harness.gpu_check_bench_worker")
        # each turn's line (RSS, pinned bytes after its release; a skipped turn's reason) in the check's console
        print("\n".join(line for line in log.splitlines() if line.startswith("[bench]")), flush=True)
    except RuntimeError as exc:  # killed (memory, a limit): what it finished is in partial.json
        if not (d / "partial.json").is_file():
            raise
        failure = str(exc).splitlines()[0]
        print(f"[bench] the worker did not finish ({failure}): reporting the turns it finished", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    rep = json.loads((d / ("report.json" if failure is None else "partial.json")).read_text())
    res = analyse_regimes(rep)
    res.update(model=p["model"], params=rep["params"], below_target=p["below_target"], workdir_on=str(base))
    res["switches"] = {n: sp.get("config") or {} for n, sp in spec["systems"].items()}
    res["partial"] = failure
    wanted = {r["name"]: ("none", *r["systems"], *r["periodic"]) for r in spec["regimes"]}
    res["ok"] = failure is None and all(
        r in res["regimes"]
        and all(n in res["regimes"][r]["systems"] or n in res["regimes"][r]["skipped_turns"] for n in names)
        for r, names in wanted.items()
    )
    return res


def analyse_regimes(rep: dict) -> dict:
    """`analyse` per regime: the first regime's figures at the top (the stress regime's when it ran, as before
    regimes existed), every regime's under `regimes` with its micro-batches; the raw turns per regime."""
    regimes = {}
    for name, r in rep["regimes"].items():
        if "turns" not in r:  # killed before its first turn
            continue
        row = analyse({**rep, **r, "skipped": list(r.get("skipped", [])) + list(rep.get("skipped", []))})
        row["micro_batches"] = r["micro_batches"]
        regimes[name] = row
    if not regimes:
        raise RuntimeError("the benchmark worker finished no turn")
    first = next(iter(regimes.values()))
    res = dict(first, regimes=regimes, profile=rep.get("profile"), worker_s=rep.get("seconds"))
    res["raw_turns"] = {name: r["turns"] for name, r in rep["regimes"].items() if "turns" in r}
    return res


PROFILE_RESERVE_S = 25.0  # the profiler window after the repetitions (2 systems, pinning, a window each, summaries)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def _spread(xs: list[float]) -> list[float] | None:
    return [min(xs), statistics.median(xs), max(xs)] if xs else None


def analyse(rep: dict) -> dict:
    """Per system, medians over repetitions of what each turn measured, paired with the same repetition's `none`
    (with the min / median / max over repetitions of the overhead), and ours' per-slot figures."""
    from torchmoe_harness.gpu_check_slots import per_slot

    turns = rep["turns"]
    base = {t["rep"]: t for t in turns.get("none", [])}
    none_dev = statistics.median(_mean(t["device_s"]) for t in turns["none"]) if turns.get("none") else math.nan
    peak = rep["pinned_copy_peak_bytes_per_s"]
    systems, slots = {}, {}
    for name, ts in turns.items():
        if not ts:
            continue
        steps = sum(len(t["wall_s"]) for t in ts)
        paired = [t for t in ts if t["rep"] in base]
        row = {
            "turns": len(ts),
            "steps_per_turn": [len(t["wall_s"]) for t in ts],
            "step_s_device": statistics.median(_mean(t["device_s"]) for t in ts),
            "step_s_wall": statistics.median(t["turn_wall_s"] / len(t["wall_s"]) for t in ts),
            "blocked_s_per_iteration": statistics.median(t["blocked_s"] / len(t["wall_s"]) for t in ts),
            "rss_bytes_max": max(t["rss_bytes"] for t in ts),
            "build_s_median": statistics.median(t["build_s"] for t in ts),
            "turn_s_median": statistics.median(t["total_s"] for t in ts),
        }
        if name != "none" and paired:
            dev = [_mean(t["device_s"]) - _mean(base[t["rep"]]["device_s"]) for t in paired]
            wall = [
                t["turn_wall_s"] / len(t["wall_s"]) - base[t["rep"]]["turn_wall_s"] / len(base[t["rep"]]["wall_s"])
                for t in paired
            ]
            row.update(
                overhead_s_device=statistics.median(dev),
                overhead_s_device_spread=_spread(dev),
                overhead_s_device_per_rep=dev,
                overhead_s_wall=statistics.median(wall),
                overhead_fraction_device=statistics.median(dev) / none_dev if none_dev else math.nan,
                rss_over_none_bytes=statistics.median(t["rss_bytes"] - base[t["rep"]]["rss_bytes"] for t in paired),
            )
        pinned = [t["pinned_in_use_bytes"] for t in ts if t.get("pinned_in_use_bytes") is not None]
        if pinned:
            row["pinned_in_use_bytes_max"] = max(pinned)
        after = [t["after_release"] for t in ts if t.get("after_release")]
        if after:
            row["after_release_rss_bytes_max"] = max(a["rss_bytes"] for a in after)
            held = [a["pinned_reserved_bytes"] for a in after if a.get("pinned_reserved_bytes") is not None]
            row["after_release_pinned_held_bytes_max"] = max(held) if held else None
        if any(t.get("syncs") is not None for t in ts):
            row["syncs_per_iteration"] = sum(t["syncs"] or 0 for t in ts) / steps
            row["sync_sites"] = ts[-1].get("sync_sites")
        cb, cs = sum(t.get("copy_bytes") or 0 for t in ts), sum(t.get("copy_s") or 0.0 for t in ts)
        if cb:
            moved = not any(t.get("copies_skipped") for t in ts)  # skip_copies: the bytes a copy would move
            row.update(
                copy_bytes_per_iteration=cb / steps,
                d2h_bytes_per_s=cb / cs if cs and moved else None,
                d2h_vs_peak=cb / cs / peak if cs and peak and moved else None,
                copies_skipped=not moved,
            )
        copies = sum(t.get("copies") or 0 for t in ts)
        if copies:  # only the measured steps' copies (the warm-up's last one lands before the measurement)
            row.update(copies=copies, copy_bytes_per_copy=cb / copies, copy_s_per_copy=cs / copies)
        last = ts[-1]
        for key in ("own_host_bytes", "own_host_parts", "windows_W"):
            if last.get(key) is not None:
                row[key] = last[key]
        row["interval"] = (last.get("stats") or {}).get("interval", 1 if name != "none" else None)
        systems[name] = row
        if any(t.get("slots") for t in ts):
            slots[name] = per_slot(ts)
    if "none" in systems and "syncs_per_iteration" in systems["none"]:
        for row in systems.values():
            if "syncs_per_iteration" in row:
                row["added_syncs_per_iteration"] = row["syncs_per_iteration"] - systems["none"]["syncs_per_iteration"]
    return {
        "device": rep["device"],
        "device_name": rep["device_name"],
        "dense_bytes": rep["dense_bytes"],
        "pinned_copy_peak_bytes_per_s": peak,
        "setup_s": rep["setup_s"],
        "rep_s": rep["rep_s"],
        "worker_s": rep.get("seconds"),
        "skipped": rep["skipped"],
        "skipped_turns": rep.get("skipped_turns", {}),
        "intervals": rep["intervals"],
        "systems": systems,
        "slots": slots,
        "profile": rep.get("profile"),
    }


def markdown(res: dict) -> list[str]:
    gb = 1e9
    lines = [
        f"Model: {res['params'] / 1e6:.1f} M parameters ({res['model']['num_experts']} experts x "
        f"{res['model']['n_layers']} layers), dense state {res['dense_bytes'] / gb:.2f} GB; "
        f"device {res['device_name']}; copy peak (pinned device-to-host; on a CPU a memcpy) "
        f"{res['pinned_copy_peak_bytes_per_s'] / gb:.1f} GB/s."
        + (f" Below the 0.5 B target: {res['below_target']}." if res.get("below_target") else ""),
        "",
        "| system | interval | step (device) | overhead (device) | overhead (wall) | blocked/iter | D2H GB/s (vs peak)"
        " | copied/iter | RSS | pinned in use | own host bytes | syncs/iter (added) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def ms(x):
        return "-" if x is None or x != x else f"{x * 1e3:.1f} ms"

    for name, r in res["systems"].items():
        d2h = "-"
        if r.get("d2h_bytes_per_s"):
            d2h = f"{r['d2h_bytes_per_s'] / gb:.1f} ({r['d2h_vs_peak']:.0%})"
        own = "-" if r.get("own_host_bytes") is None else f"{r['own_host_bytes'] / gb:.2f} GB"
        syncs = "-"
        if r.get("syncs_per_iteration") is not None:
            syncs = f"{r['syncs_per_iteration']:.2f} ({r.get('added_syncs_per_iteration', 0.0):+.2f})"
        lines.append(
            f"| {name} | {r.get('interval') or '-'} | {ms(r['step_s_device'])} | {ms(r.get('overhead_s_device'))} | "
            f"{ms(r.get('overhead_s_wall'))} | {ms(r['blocked_s_per_iteration'])} | {d2h} | "
            f"{(r.get('copy_bytes_per_iteration') or 0) / gb:.2f} GB | {r['rss_bytes_max'] / gb:.1f} GB | "
            f"{(r.get('pinned_in_use_bytes_max') or 0) / gb:.1f} GB | {own} | {syncs} |"
        )
    if res.get("skipped"):
        lines += ["", f"Skipped: {'; '.join(res['skipped'])}."]
    if "none" in res["systems"] and "gemini_k1" in res["systems"]:
        from torchmoe_harness.ettr_gpu import RESTART_S, report_lines

        lines += ["", f"ETTR from these costs (simulated; the same {RESTART_S:.0f} s restart for every system):", ""]
        lines += report_lines(res)
    return lines
