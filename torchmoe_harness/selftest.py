"""`torchmoe-ckpt selftest`: a fault-free reference run and a run that fails and recovers, both under real
torchrun/gloo processes, compared tensor by tensor with torch.equal."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from torchmoe_harness.launch import compare, run_torchrun


def selftest(
    nproc: int = 2,
    experts: int = 4,
    layers: int = 2,
    steps: int = 12,
    fail_at: int = 8,
    hsdp: int = 1,
    dtype: str = "fp32",
    window: int | None = 3,
    seed: int = 0,
    phase: str = "update",
    out_dir: str | None = None,
    timeout: float = 600.0,
    verbose: bool = True,
) -> dict:
    if not 1 <= fail_at <= steps:
        raise ValueError(f"--fail-at {fail_at} must be within 1..--steps {steps}")
    if nproc < 1 or hsdp < 1 or nproc % hsdp:
        raise ValueError(f"--hsdp {hsdp} must divide --nproc {nproc}")
    n_ops = layers * experts + 2 * layers + 3  # experts, routers, dense blocks, embeddings/norm/head
    if window is not None and not 1 <= window <= n_ops:
        raise ValueError(f"--window {window} is impossible: this model has {n_ops} operators; use 1..{n_ops} or auto")
    top_k = min(2, experts)
    run = {
        "steps": steps,
        "hsdp": hsdp,
        "dtype": dtype,
        "seed": seed,
        "model": {"num_experts": experts, "n_layers": layers, "top_k": top_k},
    }
    out = Path(out_dir or tempfile.mkdtemp(prefix="tmoe-selftest-"))

    def say(msg: str) -> None:
        if verbose:
            print(f"[selftest] {msg}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    say(
        f"reference run: {nproc} ranks, {f'HSDP {hsdp}x{nproc // hsdp}' if hsdp > 1 else 'FSDP2'}, "
        f"{layers} layers x {experts} experts, {dtype}, {steps} steps"
    )
    ref = run_torchrun(nproc, {"run": run}, out / "reference", timeout=timeout)
    say(f"failing run: failure in iteration {fail_at} ({phase}), window {window or 'auto'}")
    bad = run_torchrun(
        nproc,
        {"run": run, "checkpoint": {"window": window}, "failures": [{"step": fail_at, "phase": phase}]},
        out / "recovered",
        timeout=timeout,
    )
    cmp = compare(ref, bad)
    recs = bad.report.get("recoveries", [])
    rec = recs[0] if recs else {}
    result = {
        "bit_exact": cmp.bit_exact,
        "compared_tensors": cmp.compared_tensors,
        "compared_losses": cmp.compared_losses,
        "mismatches": cmp.mismatches[:20],
        "window": rec.get("window"),
        "replayed_iterations": rec.get("replayed_iterations"),
        "recovered_from_step": rec.get("start_step", 0 if rec.get("cold_start") else None),
        "recovered_to_step": rec.get("recovered_step"),
        "failed_at": rec.get("failed_at"),
        "cold_start": bool(rec.get("cold_start", False)),
        "recovery_seconds": rec.get("seconds"),
        "nproc": nproc,
        "hsdp": hsdp,
        "experts": experts,
        "layers": layers,
        "dtype": dtype,
        "steps": steps,
        "seed": seed,
        "wall_seconds": round(time.perf_counter() - t0, 2),
        "out_dir": str(out),
    }
    say(f"bit_exact={cmp.bit_exact} over {cmp.compared_tensors} tensors and {cmp.compared_losses} losses")
    return result
