"""What the storage tiers cost (issue 18), same model, same machine, same invocation:

  tiers_overhead_ratio  step overhead with host tier + 1 peer + object store (file://) / step overhead of the
                        same sparse checkpointer without tiers (goal <= 1.2); overhead = step time / no-checkpoint
                        step time - 1, means after warm-up, 2 ranks under torchrun; tiers_cpu_overhead_ratio the
                        same with process CPU per step; configs interleaved, adding one tier at a time, so each
                        tier's wall, CPU, bytes and thread CPU per iteration are reported (step_overhead)
  floor                 the tiers at memcpy speed vs the 0.2 x overhead the goal allows: reachable at all here?
  persist_memcpy_ratio  CPU time (time.thread_time, one thread) the host tier adds to a slot beyond the snapshot
                        copy (HostTier.write_slot of a slot whose buffers are its /dev/shm file: link, sum64b512
                        pass, per-save metadata record; plus what the copy costs more into shm) / CPU time of one
                        memcpy of the same slot into warm memory (goal <= 1.5); persist_cost says what is counted
  bytes per iteration   per tier: host (slot bytes written), peers (bytes sent), object store (bytes uploaded)

`run(out, say) -> dict` and `markdown(res) -> list[str]`; the lead wires it into `make bench`.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from torchmoe_ckpt.core.records import SlotInfo
from torchmoe_ckpt.core.slot import build_slot
from torchmoe_ckpt.model.operators import discover_operators
from torchmoe_ckpt.planning.schedule import plan_window
from torchmoe_ckpt.storage_format.checksums import tensor_block_sums
from torchmoe_ckpt.tiers.host_tier import HostTier
from torchmoe_harness.launch import run_torchrun
from torchmoe_harness.model import TinyMoE, TinyMoEConfig

WARMUP = 3
W = 4
REPEATS = 2
MODEL = {
    "model": {
        "vocab_size": 1024,
        "dim": 128,
        "n_layers": 4,
        "n_heads": 4,
        "num_experts": 8,
        "expert_hidden": 256,
        "max_seq_len": 64,
    },
    "batch_size": 4,
    "seq_len": 64,
    "steps": 16,
    "dtype": "fp32",
}  # the cpu-large model of bench.py


def _mean_after_warmup(xs: list[float]) -> float:
    # the mean, not the median: the tiers work once per window (push, upload), so their cost lands in some steps
    return statistics.fmean(xs[WARMUP:])


def _tier_spec(shm: Path, replicas: int, store: bool) -> dict:
    spec = {"root": str(shm), "run_id": "bench", "ranks_per_node": 1, "replicas": replicas}
    if store:
        spec["object_store"] = {"uri": f"file://{shm}/store"}
    return spec


# interleaved configs: each adds one tier to the one before, so the difference of two is that tier's cost
CONFIGS = (
    ("baseline", None),
    ("sparse", None),
    ("host", (0, False)),
    ("host_peer", (1, False)),
    ("host_peer_store", (1, True)),
)
TIER_OF = {
    "host": ("host_tier", "bytes_written"),
    "host_peer": ("peers", "bytes_sent"),
    "host_peer_store": ("object_store", "bytes"),
}  # config -> (its added tier's stats, its bytes counter)
PREV = {"host": "sparse", "host_peer": "host", "host_peer_store": "host_peer"}


def step_overhead(out: Path, say) -> dict:
    """Per config: wall and process CPU (every thread of the rank) per step, mean after warm-up, best of the
    repeats; per tier: its bytes and its thread's CPU (time.thread_time) per iteration, and CPU per byte."""
    run = {k: MODEL[k] for k in ("steps", "batch_size", "seq_len", "model", "dtype")}
    shm = Path(tempfile.mkdtemp(prefix="tmoe-bench-tiers-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    specs = {
        key: {"run": run}
        if key == "baseline"
        else {"run": run, "checkpoint": {"window": W}, **({} if t is None else {"host_tier": _tier_spec(shm, *t)})}
        for key, t in CONFIGS
    }
    reports, wall, cpu = {}, {k: [] for k in specs}, {k: [] for k in specs}
    try:
        for rep in range(REPEATS):  # interleaved, so a slow phase of this shared machine hits every config
            for key, spec in specs.items():
                say(f"tiers: {key} ({rep + 1}/{REPEATS})")
                if "host_tier" in spec:
                    shutil.rmtree(shm, ignore_errors=True)
                r = run_torchrun(2, spec, out / "tiers" / f"{key}-{rep}", timeout=300).report
                reports.setdefault(key, []).append(r)
                wall[key].append(_mean_after_warmup(r["step_seconds"]))
                cpu[key].append(_mean_after_warmup(r["step_cpu_s"]))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    best = {k: min(v) for k, v in wall.items()}  # the least-disturbed run of each config
    best_cpu = {k: min(v) for k, v in cpu.items()}
    base, base_cpu = best["baseline"], best_cpu["baseline"]
    over = {k: t / base - 1.0 for k, t in best.items()}
    over_cpu = {k: c / base_cpu - 1.0 for k, c in best_cpu.items()}
    noise = max(wall["baseline"]) / min(wall["baseline"]) - 1.0
    tiers = {}
    for key, (name, field) in TIER_OF.items():  # the tier each config adds, from its least-disturbed run
        r = min(reports[key], key=lambda r: _mean_after_warmup(r["step_seconds"]))
        st = r["checkpoint"].get(name) or {}
        n = len(r["step_seconds"])
        nbytes, thread_cpu = st.get(field, 0) / n, st.get("cpu_s", 0.0) / n
        tiers[key] = {
            "bytes_per_iteration": nbytes,
            "thread_cpu_s_per_iteration": thread_cpu,
            "thread_cpu_ns_per_byte": thread_cpu / nbytes * 1e9 if nbytes else None,
            "added_process_cpu_s_per_step": best_cpu[key] - best_cpu[PREV[key]],
            "added_wall_s_per_step": best[key] - best[PREV[key]],
        }
    # A ratio of two overheads means nothing when the overhead without tiers is within the machine's noise.
    full = "host_peer_store"
    ratio = over[full] / over["sparse"] if over["sparse"] > noise else None
    ratio_cpu = over_cpu[full] / over_cpu["sparse"] if over_cpu["sparse"] > 0 else None
    ck = min(reports[full], key=lambda r: _mean_after_warmup(r["step_seconds"]))["checkpoint"]
    return {
        "baseline_step_s": base,
        "baseline_cpu_s": base_cpu,
        "overhead_without_tiers": over["sparse"],
        "overhead_with_tiers": over[full],
        "overhead": over,
        "cpu_overhead": over_cpu,
        "noise_fraction": noise,
        "step_s_runs": wall,
        "cpu_s_runs": cpu,
        "tiers": tiers,
        "tiers_step_ratio": best[full] / best["sparse"],
        "tiers_overhead_ratio": ratio,
        "tiers_cpu_overhead_ratio": ratio_cpu,
        "bytes_per_iteration": {
            "host": tiers["host"]["bytes_per_iteration"],
            "peers": tiers["host_peer"]["bytes_per_iteration"],
            "object_store": tiers["host_peer_store"]["bytes_per_iteration"],
        },
        "mean_slot_bytes": ck["mean_slot_bytes"],
    }


# The least CPU a tier can add per byte, in copies: the host tier none (the snapshot copy, which the checkpointer
# without tiers makes too, can land in shared memory directly); a peer one socket copy out (this rank's slot) and
# one in (a peer's slot); a store one write.
FLOOR_COPIES = {"host": 0, "peers": 2, "object_store": 1}


def floor(persist: dict, steps: dict) -> dict:
    """Whether the goal is reachable at all here: the tiers at memcpy speed (FLOOR_COPIES x the measured memcpy
    ns/byte x their bytes per iteration) added to the CPU overhead of the checkpointer without tiers."""
    per_byte = persist["memcpy_cpu_s"] / persist["slot_bytes"]
    b = steps["bytes_per_iteration"]
    cpu = sum(FLOOR_COPIES[k] * b[k] * per_byte for k in FLOOR_COPIES)
    without = steps["cpu_overhead"]["sparse"] * steps["baseline_cpu_s"]  # CPU s/step the checkpointer adds
    allowed = 0.2 * without  # what the tiers may add for tiers_overhead_ratio <= 1.2
    return {
        "memcpy_ns_per_byte": per_byte * 1e9,
        "tiers_cpu_s_per_iteration": cpu,
        "allowed_cpu_s": allowed,
        "best_case_cpu_ratio": (without + cpu) / without if without > 0 else None,
        "measured_tier_threads_cpu_s": sum(t["thread_cpu_s_per_iteration"] for t in steps["tiers"].values()),
    }


def _cpu(fn, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best


def persist_cost(say) -> dict:
    """In this process, one thread (time.thread_time), the worst slot of a W=4 window of the cpu-large model.

    What the host tier costs beyond the snapshot copy that checkpointing does anyway. With the host tier on (CPU)
    a slot's buffers are views of its /dev/shm data file (slot_files.py), so the snapshot copy writes the bytes
    into shared memory and the persist (`HostTier.write_slot`) is: link the file into the window, one sum64b512
    pass over it, the per-save `.metadata` record (DCP metadata pickled once per layout), the file bookkeeping.

      persist_memcpy_ratio  (persist CPU + what the snapshot copy costs more into shm than into plain memory)
                            / CPU of one memcpy of the slot into warm plain memory (goal <= 1.5). Both copies
                            are SnapshotEngine's batched _foreach_copy_, into warm buffers.
      path_memcpy_ratio     (snapshot copy into shm + persist) / memcpy: the whole tier-on path in memcpys, where
                            the same checkpointer without tiers costs 1
      copy_path_ratio       the persist of a slot in plain memory (pinned CUDA buffers keep it): one more copy
                            into a kept mapping of a spare file + the same sums and record, / memcpy
    Not counted: the tier writer's commit per window (manifest, replay records), paid once per W slots.
    """
    say("tiers: host-tier persist CPU time vs memcpy")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thread_time counts this thread only: keep every copy on it
    root = Path(tempfile.mkdtemp(prefix="tmoe-persist-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        model = TinyMoE(TinyMoEConfig(**MODEL["model"]))
        ops = discover_operators(model)
        by = {o.name: o for o in ops}
        order = [o.name for o in ops]
        plan = plan_window(
            order,
            {o.name: o.full_bytes() for o in ops},
            {o.name: o.compute_bytes(4) for o in ops},
            float("inf"),
            forced_window=W,
            warn=False,
        )
        slots = [build_slot(i, s.active, s.frozen, by, torch.float32) for i, s in enumerate(plan.slots)]
        for s in slots:
            for it in s.items:
                it.buffer.normal_() if it.buffer.is_floating_point() else it.buffer.zero_()
        src = max(slots, key=lambda s: s.nbytes)  # stands for the live state the snapshot copies from
        n = src.nbytes
        sp = plan.slots[src.index]
        plain = build_slot(src.index, sp.active, sp.frozen, by, torch.float32)
        tier = HostTier(root, "bench", 0, 1)
        direct = tier.slot_files.build_slot(src.index, sp.active, sp.frozen, by, torch.float32)
        srcs = [it.buffer for it in src.items]

        def copy_into(slot):
            dst = [it.buffer for it in slot.items]
            return lambda: torch._foreach_copy_(dst, srcs)

        for fn in (copy_into(plain), copy_into(direct)):
            fn()  # warm: no first-touch faults in the timed copies
        t_memcpy = _cpu(copy_into(plain))
        t_snap_shm = _cpu(copy_into(direct))
        t_sums = _cpu(lambda: tensor_block_sums(direct.backing.t))  # the sum64b512 pass of the persist

        def persist(tier, slot) -> float:
            times = []
            for wid in range(8):  # the steady state: windows come and go (retention), as in training
                info = SlotInfo(wid, slot.index, wid * W, step=wid * W + slot.index)
                t0 = time.thread_time()
                tier.write_slot(wid, slot, info)
                times.append(time.thread_time() - t0)
                tier._written.clear()
                tier.collect(wid + (slot is direct))  # a direct slot's file is unlinked, a copied one kept as spare
            return min(times[2:])

        t_copy_path = persist(HostTier(root, "copy", 0, 1), plain)  # a tier of its own: it keeps spare files
        t_persist = persist(tier, direct)
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(root, ignore_errors=True)
    extra_copy = max(0.0, t_snap_shm - t_memcpy)
    return {
        "slot_bytes": n,
        "memcpy_cpu_s": t_memcpy,
        "snapshot_shm_cpu_s": t_snap_shm,
        "persist_cpu_s": t_persist,
        "checksum_pass_cpu_s": t_sums,
        "record_cpu_s": max(0.0, t_persist - t_sums),
        "copy_path_cpu_s": t_copy_path,
        "persist_memcpy_ratio": (t_persist + extra_copy) / t_memcpy,
        "path_memcpy_ratio": (t_snap_shm + t_persist) / t_memcpy,
        "copy_path_ratio": t_copy_path / t_memcpy,
    }


def run(out: Path, say) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    res = {"persist": persist_cost(say), "steps": step_overhead(out, say)}
    res["floor"] = floor(res["persist"], res["steps"])
    r, rc = res["steps"]["tiers_overhead_ratio"], res["steps"]["tiers_cpu_overhead_ratio"]
    res["goals"] = {
        "tiers_overhead_ratio<=1.2": None if r is None else r <= 1.2,  # None: below the noise
        "tiers_cpu_overhead_ratio<=1.2": None if rc is None else rc <= 1.2,
        "persist_memcpy_ratio<=1.5": res["persist"]["persist_memcpy_ratio"] <= 1.5,
    }
    return res


def _tier_rows(s: dict, memcpy_ns_per_byte: float) -> list[str]:
    rows = []
    for key, label in (("host", "+ host tier"), ("host_peer", "+ 1 peer"), ("host_peer_store", "+ object store")):
        t = s["tiers"][key]
        per_byte = t["thread_cpu_ns_per_byte"]
        rows.append(
            f"| {label}: step / process CPU added per iteration; bytes; tier thread CPU per iteration "
            f"(ns/byte, x memcpy) | {t['added_wall_s_per_step'] * 1e3:+.1f} / "
            f"{t['added_process_cpu_s_per_step'] * 1e3:+.1f} ms; {t['bytes_per_iteration'] / 1e6:.2f} MB; "
            f"{t['thread_cpu_s_per_iteration'] * 1e3:.2f} ms"
            + ("" if per_byte is None else f" ({per_byte:.2f} ns/B, {per_byte / memcpy_ns_per_byte:.1f}x)")
            + " | |"
        )
    return rows


def _floor_rows(f: dict | None) -> list[str]:
    if not f:
        return []
    best = "n/a" if f["best_case_cpu_ratio"] is None else f"{f['best_case_cpu_ratio']:.2f}"
    return [
        f"| reachable? tiers at memcpy speed ({'/'.join(map(str, FLOOR_COPIES.values()))} copies per byte: host/"
        f"peers/store) {f['tiers_cpu_s_per_iteration'] * 1e3:.2f} ms/iteration vs "
        f"{f['allowed_cpu_s'] * 1e3:.2f} ms allowed (0.2 x the CPU overhead without tiers): best-case CPU ratio; "
        f"tier threads measured "
        f"{f['measured_tier_threads_cpu_s'] * 1e3:.2f} ms | {best} | <= 1.2 |"
    ]


def markdown(res: dict) -> list[str]:
    p, s = res["persist"], res["steps"]
    b = s["bytes_per_iteration"]
    ratio = "n/a" if s["tiers_overhead_ratio"] is None else f"{s['tiers_overhead_ratio']:.2f}"
    cratio = "n/a" if s["tiers_cpu_overhead_ratio"] is None else f"{s['tiers_cpu_overhead_ratio']:.2f}"
    memcpy_ns = p["memcpy_cpu_s"] / p["slot_bytes"] * 1e9
    return [
        "## Storage tiers (host + 1 peer + object store), cpu-large, 2 ranks",
        "",
        f"Per config: step time and process CPU (all threads of a rank) per step, mean after {WARMUP} warm-up steps, "
        f"best of {REPEATS} interleaved runs; no checkpoint: {s['baseline_step_s'] * 1e3:.1f} ms wall, "
        f"{s['baseline_cpu_s'] * 1e3:.1f} ms CPU per step. One memcpy: {memcpy_ns:.3f} ns/byte.",
        "",
        "| measure | value | goal |",
        "|---|---|---|",
        f"| step overhead without tiers: wall / CPU | {s['overhead_without_tiers'] * 100:+.1f}% / "
        f"{s['cpu_overhead']['sparse'] * 100:+.1f}% | |",
        *_tier_rows(s, memcpy_ns),
        f"| step overhead with tiers: wall / CPU | {s['overhead_with_tiers'] * 100:+.1f}% / "
        f"{s['cpu_overhead']['host_peer_store'] * 100:+.1f}% | |",
        f"| tiers_overhead_ratio, wall (run-to-run noise of the baseline {s['noise_fraction'] * 100:.1f}%; n/a when "
        f"the overhead without tiers is below it) / CPU | {ratio} / {cratio} | <= 1.2 |",
        f"| step time with tiers / without (same checkpointer) | {s['tiers_step_ratio']:.3f} | |",
        *_floor_rows(res.get("floor")),
        f"| host persist CPU beyond the snapshot copy / memcpy CPU (slot {p['slot_bytes'] / 1e6:.2f} MB; the slot "
        f"buffers are its /dev/shm file) | {p['persist_memcpy_ratio']:.2f} ({p['persist_cpu_s'] * 1e3:.2f} ms + "
        f"{max(0.0, p['snapshot_shm_cpu_s'] - p['memcpy_cpu_s']) * 1e3:.2f} ms more copy into shm / "
        f"{p['memcpy_cpu_s'] * 1e3:.2f} ms) | <= 1.5 |",
        f"| snapshot copy into shm + persist / memcpy (no tiers: 1) | {p['path_memcpy_ratio']:.2f} | |",
        f"| persist breakdown: snapshot copy into shm / into plain memory / sum64b512 pass / link + record | "
        f"{p['snapshot_shm_cpu_s'] * 1e3:.2f} / {p['memcpy_cpu_s'] * 1e3:.2f} / {p['checksum_pass_cpu_s'] * 1e3:.2f} / "
        f"{p['record_cpu_s'] * 1e3:.2f} ms | |",
        f"| persist of a slot in plain memory (pinned CUDA buffers): copy + sums + record / memcpy | "
        f"{p['copy_path_ratio']:.2f} ({p['copy_path_cpu_s'] * 1e3:.2f} ms) | |",
        f"| bytes per iteration: host / peers / object store | {b['host'] / 1e6:.3f} / {b['peers'] / 1e6:.3f} / "
        f"{b['object_store'] / 1e6:.3f} MB | |",
        "",
    ]
