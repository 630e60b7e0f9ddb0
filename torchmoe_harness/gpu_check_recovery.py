"""Phases 1 and 2 of the GPU check (gpu_check.py), each a pair of torchrun jobs of `gpu_check_worker` on one rank,
run side by side (two processes on one GPU, or on two cores):

1. exact recovery: a reference run of the plain loop (no checkpointer), and a checkpointed run with deterministic
   kernels that is killed with `kill -9` twice -- first while a slot copy is in flight (the copy thread, half-way
   through the slot), then after an optimizer step -- and recovers from the host tier after each restart. Every
   tensor of the final state (model, optimizer, scheduler, CPU and device RNG states) and every loss after the last
   recovery must be `torch.equal` to the reference. The training thread's host syncs per steady-state iteration are
   counted in both (CUDA sync debug mode) and compared: what the checkpointer adds.
2. non-deterministic kernels: with `replay_check="exact"` the job must refuse in one line (on CUDA at the start,
   since deterministic kernels are off; on a CPU at recovery, where the restarted attempt runs with another intra-op
   thread count: a real change of reduction order); with `"tolerant"` the same run recovers and reports how far its
   replay deviated.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from torchmoe_harness.gpu_check_syncs import added_syncs
from torchmoe_harness.launch import torchrun

DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
W = 3
# Phase 1: windows 1-3 and 4-6 are committed when the first kill comes (in step 8's slot copy); the second (after
# step 13's update) lands in the restarted attempt, which recovered to step 3 or 6.
EXACT_STEPS, COPY_KILL, UPDATE_KILL = 16, 8, 13
# Phase 2: one kill after step 8's update; the restart replays a window with other kernels / another thread count.
NONDET_STEPS, NONDET_KILL = 10, 8


def model_spec(device: str, tiny: bool) -> dict:
    """The recovery phases' model: small (exactness does not need size), top-4 of 8 experts, so the MoE combine adds
    four expert outputs per token (with atomics, the order of four additions changes the sum; of two it cannot),
    and a 50257-token vocabulary (a 3.2M-element embedding whose L2 penalty is one large reduction)."""
    model = {
        "vocab_size": 50257,
        "dim": 64 if tiny else 128,
        "n_layers": 2,
        "n_heads": 2,
        "num_experts": 8,
        "top_k": 4,
        "expert_hidden": 64 if tiny else 256,
        "max_seq_len": 64,
    }
    return {
        "device": device,
        "dtype": "bf16" if device == "cuda" else "fp32",
        "model": model,
        "batch_size": 2,
        "seq_len": 32,
        "seed": 0,
        "dropout": 0.1,
        "l2": 2e-4,  # ~2x the cross entropy at the start: the penalty's last bits are the loss's
        "window": W,
    }


def run_job(name: str, spec: dict, work: Path, env: dict, max_restarts: int, timeout_s: float) -> dict:
    """One torchrun job of the worker; what it wrote (attempts, refusal, final state) whether it passed or failed."""
    d = work / name
    d.mkdir(parents=True, exist_ok=True)
    spec = dict(spec, host_dir=str(d / "shm"), run_id=name)
    (d / "spec.json").write_text(json.dumps(spec, indent=1))
    t0 = time.perf_counter()
    program = ["-m", "torchmoe_harness.gpu_check_worker", "--spec", str(d / "spec.json"), "--out", str(d)]
    env = {"TORCHMOE_FAULT": "", **env}
    try:
        torchrun(1, program, d / "torchrun.log", timeout_s, env, max_restarts)
        ok, error = True, None
    except RuntimeError as exc:
        ok, error = False, " ".join(str(exc).split("\n")[0].split())
    log = (d / "torchrun.log").read_text() if (d / "torchrun.log").exists() else ""
    attempts = [json.loads(p.read_text()) for p in sorted(d.glob("attempt*.json"))]
    refused = json.loads((d / "refused.json").read_text()) if (d / "refused.json").exists() else None
    final = torch.load(d / "rank0.pt", weights_only=True) if ok and (d / "rank0.pt").exists() else None
    return {
        "ok": ok,
        "error": error,
        "seconds": round(time.perf_counter() - t0, 2),
        "attempts": attempts,
        "refused": refused,
        "final": final,
        "log_tail": log[-1500:] if not ok else "",
    }


def _both(jobs: dict[str, tuple]) -> dict[str, dict]:
    """Run the jobs side by side (two processes)."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(run_job, name, *args) for name, args in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


def compare_states(ref: dict, got: dict) -> dict:
    """torch.equal on every state tensor and every loss `got` has (the steps after its last recovery)."""
    mismatches = []
    a, b = ref["state"], got["state"]
    if a.keys() != b.keys():
        mismatches.append(f"different keys: {sorted(set(a) ^ set(b))[:5]}")
    keys = sorted(set(a) & set(b))
    for k in keys:
        if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k]):
            mismatches.append(k)
    steps = sorted(got["losses"])
    for s in steps:
        if s not in ref["losses"] or not torch.equal(ref["losses"][s], got["losses"][s]):
            mismatches.append(f"loss at step {s}")
    return {
        "bit_exact": not mismatches and bool(keys) and bool(steps),
        "compared_tensors": len(keys),
        "compared_losses": len(steps),
        "rng_states_compared": sorted(k for k in keys if k.startswith("rng/")),
        "mismatches": mismatches[:20],
    }


def _recoveries(job: dict) -> list[dict]:
    keys = ("window", "start_step", "recovered_step", "replayed_iterations", "source", "exact", "replay_check")
    out = []
    for a in job["attempts"][1:]:
        r = a.get("recovery") or {}
        out.append({"attempt": a["attempt"], "resume_s": a.get("resume_seconds"), **{k: r.get(k) for k in keys}})
    return out


def exact_recovery(device: str, tiny: bool, work: Path, timeout_s: float) -> dict:
    base = dict(model_spec(device, tiny), steps=EXACT_STEPS, deterministic=True)
    faults = f"kill:point=snapshot_copy:step={COPY_KILL}:attempt=0;kill:point=optimizer:step={UPDATE_KILL}:attempt=1"
    env = DETERMINISTIC_ENV if device == "cuda" else {}
    jobs = _both(
        {
            "reference": (dict(base, mode="plain"), work, env, 0, timeout_s),
            "killed": (
                dict(base, mode="checkpointed", replay_check="exact"),
                work,
                dict(env, TORCHMOE_FAULT=faults),
                2,
                timeout_s,
            ),
        }
    )
    ref, got = jobs["reference"], jobs["killed"]
    res: dict = {"jobs": {n: {k: j[k] for k in ("ok", "error", "seconds", "log_tail")} for n, j in jobs.items()}}
    res["kills"] = faults
    res["recoveries"] = _recoveries(got)
    if ref["final"] is not None and got["final"] is not None:
        res.update(compare_states(ref["final"], got["final"]))
    else:
        res["bit_exact"] = False
    # host syncs: the killed run's first attempt (before its first kill) against the reference, same iterations
    steady = list(range(3, COPY_KILL))
    plain = ref["attempts"][0].get("syncs", {}) if ref["attempts"] else {}
    ours = got["attempts"][0].get("syncs", {}) if got["attempts"] else {}
    res["syncs"] = dict(added_syncs(plain, ours, steady), enabled=bool(plain.get("enabled")), plain=plain, ours=ours)
    res["syncs"]["window_starts"] = [s for s in steady if (s - 1) % W == 0]  # windows start at steps 1, 1 + W, ...
    if got["attempts"] and got["attempts"][-1].get("waits_s") is not None:
        waits = got["attempts"][-1]["waits_s"]
        res["training_thread_wait_s"] = {"mean": sum(waits) / max(1, len(waits)), "max": max(waits, default=0.0)}
    recovered = [r for r in res["recoveries"] if r.get("recovered_step")]
    res["ok"] = bool(res.get("bit_exact")) and len(recovered) == 2 and all(r.get("exact") for r in recovered)
    return res


def nondeterministic(device: str, tiny: bool, work: Path, timeout_s: float) -> dict:
    """Kernels that are not deterministic: on CUDA, deterministic algorithms off (atomics in the MoE combine and
    attention backward); on a CPU, the restarted attempt runs 2 intra-op threads instead of 1."""
    base = dict(model_spec(device, tiny), steps=NONDET_STEPS, deterministic=False, mode="checkpointed")
    if device == "cpu":
        base["threads"] = [1, 2]
    kill = {"TORCHMOE_FAULT": f"kill:point=optimizer:step={NONDET_KILL}:attempt=0"}
    jobs = _both(
        {
            "exact": (dict(base, replay_check="exact"), work, kill, 1, timeout_s),
            "tolerant": (dict(base, replay_check="tolerant"), work, kill, 1, timeout_s),
        }
    )
    exact, tol = jobs["exact"], jobs["tolerant"]
    refused = exact["refused"] or {}
    res: dict = {"jobs": {n: {k: j[k] for k in ("ok", "error", "seconds", "log_tail")} for n, j in jobs.items()}}
    res["exact"] = {
        "refused": bool(refused) and not exact["ok"],
        "where": refused.get("where"),
        "one_line": bool(refused.get("line")) and "\n" not in refused.get("line", ""),
        "line": refused.get("line"),
        "seconds_since_process_start": refused.get("seconds_since_start"),
    }
    rec = tol["attempts"][1].get("recovery") if len(tol["attempts"]) > 1 else None
    rec = rec or {}
    res["tolerant"] = {
        "recovered": tol["ok"] and bool(rec.get("recovered_step")),
        "refused": (tol["refused"] or {}).get("line"),  # why not, when it did not recover
        "replay_exact": rec.get("exact"),
        "max_loss_deviation": rec.get("max_loss_deviation"),
        "max_grad_norm_deviation": rec.get("max_grad_norm_deviation"),
        "replay_tolerance": rec.get("replay_tolerance"),
        "recovered_step": rec.get("recovered_step"),
        "replayed_iterations": rec.get("replayed_iterations"),
    }
    res["nondeterminism_seen"] = rec.get("exact") is False
    res["ok"] = res["exact"]["refused"] and res["exact"]["one_line"] and res["tolerant"]["recovered"]
    return res
