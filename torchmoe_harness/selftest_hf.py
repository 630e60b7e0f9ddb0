"""`torchmoe-ckpt selftest --model hf:<model_type>`: any transformers MoE model type, built tiny from code,
trained under torchrun with the public `Checkpointer`; one run never fails, the other is killed with a real
SIGKILL in iteration `fail_at`, restarted by torchrun and recovered from host memory. Every entry of the
model, optimizer and scheduler state dicts and every loss after the restart are compared with torch.equal."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from torchmoe_harness.hf_models import is_moe_model_type
from torchmoe_harness.launch import compare, launch, load_result

WORKER = "torchmoe_harness.hf_worker"


def selftest_hf(
    model_type: str,
    nproc: int = 2,
    experts: int = 4,
    layers: int = 2,
    steps: int = 10,
    fail_at: int = 7,
    dtype: str = "fp32",
    window: int | None = 3,
    seed: int = 0,
    out_dir: str | None = None,
    timeout: float = 300.0,
    verbose: bool = True,
) -> dict:
    if not is_moe_model_type(model_type):
        raise ValueError(
            f"hf:{model_type} is not a Mixture-of-Experts model type of transformers (no expert count "
            "in its config): pick an MoE type such as hf:mixtral, hf:deepseek_v3, hf:qwen2_moe"
        )
    if not 2 <= fail_at <= steps:
        raise ValueError(f"--fail-at {fail_at} must be within 2..--steps {steps}")
    out = Path(out_dir or tempfile.mkdtemp(prefix=f"tmoe-selftest-{model_type}-"))
    spec = {
        "model": {"type": model_type, "experts": experts, "layers": layers, "top_k": min(2, experts)},
        "steps": steps,
        "dtype": dtype,
        "window": window,
        "seed": seed,
        "host_root": str(out / "shm"),
    }

    def say(msg: str) -> None:
        if verbose:
            print(f"[selftest] {msg}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    say(
        f"reference run: hf:{model_type}, {nproc} ranks FSDP2, {layers} layers x {experts} experts, {dtype}, "
        f"{steps} steps"
    )
    launch(nproc, dict(spec, run_id="reference"), out / "reference", timeout, module=WORKER)
    ref = load_result(out / "reference", nproc)
    say(
        f"failing run: kill -9 of rank {nproc - 1} in iteration {fail_at}, torchrun restarts, window {window or 'auto'}"
    )
    fault = {"TORCHMOE_FAULT": f"kill:point=optimizer:rank={nproc - 1}:step={fail_at}"}
    log = launch(
        nproc,
        dict(spec, run_id="recovered"),
        out / "recovered",
        timeout,
        extra_env=fault,
        max_restarts=1,
        module=WORKER,
    )
    bad = load_result(out / "recovered", nproc, log)
    cmp = compare(bad, ref)  # the recovered run's losses are those trained after the restart
    rec = bad.report.get("recovery") or {}
    result = {
        "bit_exact": cmp.bit_exact and "event=fault_injected" in log and bool(rec),
        "compared_tensors": cmp.compared_tensors,
        "compared_losses": cmp.compared_losses,
        "mismatches": cmp.mismatches[:20],
        "model": f"hf:{model_type}",
        "model_class": ref.report.get("model_class"),
        "experts_per_moe_layer": ref.report.get("experts_per_moe_layer"),
        "operators": ref.report.get("operators"),
        "window": rec.get("window"),
        "replayed_iterations": rec.get("replayed_iterations"),
        "recovered_from_step": rec.get("start_step"),
        "recovered_to_step": rec.get("recovered_step"),
        "recovery_source": rec.get("source"),
        "recovery_seconds": rec.get("seconds"),
        "failed_at": fail_at,
        "nproc": nproc,
        "dtype": dtype,
        "steps": steps,
        "seed": seed,
        "wall_seconds": round(time.perf_counter() - t0, 2),
        "out_dir": str(out),
    }
    say(
        f"bit_exact={result['bit_exact']} over {cmp.compared_tensors} tensors and {cmp.compared_losses} losses; "
        f"experts per MoE layer {result['experts_per_moe_layer']}"
    )
    return result
