"""torchrun entry point of the harness: train per a JSON spec, optionally with sparse checkpointing and an
injected failure, and write each rank's final state and losses for comparison.

    torchrun --nproc_per_node N -m torchmoe_harness.worker --spec spec.json --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from torchmoe_ckpt.runtime.distributed import init_process_group
from torchmoe_harness.trainer import RunConfig, Trainer


def run(spec: dict, out: Path) -> dict:
    cfg = RunConfig(**spec["run"])
    trainer = Trainer(cfg, init_seed=spec.get("init_seed"))  # another init shows what a load restores
    losses: dict[int, torch.Tensor] = {}
    report: dict = {"world_size": trainer.world, "steps": cfg.steps}
    if spec.get("initial_load"):  # start from a user-given dense export instead of the initialisation
        from torchmoe_ckpt.dcp.dense_export import load_dense

        trainer.set_step(load_dense(trainer.model, trainer.optimizer, **spec["initial_load"]))
        report["initial_load"] = {"uri": spec["initial_load"]["uri"], "step": trainer.step}
    if spec.get("checkpoint") is None:
        from torchmoe_ckpt.dcp.dense_export import DenseExporter

        exporter = DenseExporter(**spec["dense_export"]) if spec.get("dense_export") else None
        step_seconds, step_cpu = [], []  # wall and process CPU (every thread) per step
        while trainer.step < cfg.steps:
            t0, c0 = time.perf_counter(), time.process_time()
            res = trainer.train_step()
            if exporter is not None:
                exporter.maybe_export(trainer.model, trainer.optimizer, trainer.step)
            step_seconds.append(time.perf_counter() - t0)
            step_cpu.append(time.process_time() - c0)
            losses[res.step] = res.loss
        if exporter is not None:
            exporter.wait()
            report["dense_export"] = exporter.stats()
        report["step_seconds"], report["step_cpu_s"] = step_seconds, step_cpu
    else:
        from torchmoe_harness.scenario import run_with_checkpointing  # the checkpointing + failure scenario

        trainer, extra = run_with_checkpointing(trainer, spec, losses)
        report.update(extra)
    # Host copies (read once, at the end): results compare on any machine, whatever device trained them.
    host_losses = {step: loss.detach().to("cpu") for step, loss in losses.items()}
    torch.save({"state": trainer.export_state(), "losses": host_losses}, out / f"rank{trainer.rank}.pt")
    return report


def start() -> tuple[dict, Path]:
    """Parse `--spec/--out` and join the process group: the start of every torchrun entry point here."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    spec = json.loads(Path(args.spec).read_text())
    init_process_group(timeout_s=spec.get("timeout_s", 120))  # gloo; with CUDA NCCL for GPU tensors, gloo for CPU
    return spec, Path(args.out)


def write_report(path: Path, report: dict) -> None:
    """Rank 0 writes `report` once every rank got here."""
    dist.barrier()
    if dist.get_rank() == 0:
        path.write_text(json.dumps(report, indent=1))
    dist.barrier()


def leave() -> None:
    # Leave without tearing the gloo groups down: their C++ threads occasionally abort the process at exit
    # ("terminate called without an active exception"), after all results are safely written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def serve(run_fn: Callable[[dict, Path], dict]) -> None:
    """A torchrun entry point of the harness: start, `run_fn(spec, out)`, its report written by rank 0, leave."""
    spec, out = start()
    write_report(out / "report.json", run_fn(spec, out))
    leave()


def main() -> None:
    serve(run)


if __name__ == "__main__":
    main()
