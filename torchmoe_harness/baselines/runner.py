"""Drive the harness Trainer with one checkpointing system under torchrun, inject failures, recover in
process, and report what each system costs and loses.

    python -m torchmoe_harness.baselines.runner --spec spec.json --out DIR     (under torchrun)

Spec: {"phases": [spec, ...]} runs several systems one after the other in the same processes (one torchrun
start; each phase "name" writes under DIR/<name>/), or one phase:
      {"run": RunConfig fields, "system": {"kind": "dcp_sync|dcp_async|gemini|pec|moetion|ours|none", ...params},
       "failures": [iteration, ...]            a failure before the optimizer step of these iterations, or
       "failure_times_s": [seconds, ...]       at these wall-clock times since the loop started (rank 0's
                                               clock, agreed every step; for the ETTR validation), or
       "poisson_failures": {"mtbf_iterations": n, "seed": s}   Poisson times at an MTBF of n mean step
                                               times of the previous phase, or of the phase named "of_phase"
                                               (reported as failure_times_s)}
A failure throws the live state away: the system rebuilds a trainer with *different* initial weights from
what survives (host memory, files). Writes rank{r}.pt (final state and losses, as the harness worker does,
so `launch.compare` checks exactness against a fault-free run) and rank 0's report.json."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from torchmoe_harness.baselines import make_system

_last_step_mean = 0.05  # mean step seconds of the previous phase in this process
_step_means: dict[str, float] = {}  # by phase name, for an MTBF taken from a named phase ("of_phase")


class Crash(RuntimeError):
    pass


def _crash() -> None:
    raise Crash("injected failure before the optimizer step")


def run(spec: dict, out: Path) -> dict:
    global _last_step_mean
    from torchmoe_harness.trainer import RunConfig, Trainer

    cfg = RunConfig(**spec["run"])
    trainer = Trainer(cfg)
    sysspec = dict(spec.get("system") or {"kind": "none"})
    kind = sysspec.pop("kind")
    system = make_system(kind, trainer, sysspec, str(out / "ckpt"))
    if system is not None:
        system.attach(trainer)
    by_step = sorted(spec.get("failures", []))
    by_time = sorted(spec.get("failure_times_s", []))
    mtbf_s = None
    if spec.get("poisson_failures"):  # MTBF in iterations of the previous phase, made seconds on rank 0's clock
        from torchmoe_harness.ettr import poisson_trace

        pf = spec["poisson_failures"]
        t_ref = _step_means[pf["of_phase"]] if pf.get("of_phase") else _last_step_mean
        mtbf_s = pf["mtbf_iterations"] * t_ref
        box = [poisson_trace(mtbf_s, 20 * cfg.steps * t_ref, pf.get("seed", 0))]
        dist.broadcast_object_list(box, src=0)
        by_time = box[0]
    trace = list(by_time)
    losses, step_seconds, recoveries = {}, [], []
    flag = torch.zeros(1)
    dist.barrier()
    t_start = time.perf_counter()
    while trainer.step < cfg.steps:
        nxt = trainer.step + 1
        fail = False
        if by_step and by_step[0] == nxt:
            by_step.pop(0)
            fail = True
        if by_time:
            flag.fill_(1.0 if time.perf_counter() - t_start >= by_time[0] else 0.0)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():  # one failure per time; one that passed during a recovery fires at the next step
                by_time.pop(0)
                fail = True
        if fail and system is not None:
            trainer.before_update.append(_crash)
        t0 = time.perf_counter()
        try:
            res = trainer.train_step()
            losses[res.step] = res.loss
            if system is not None:
                system.after_step(trainer, res)
            step_seconds.append(time.perf_counter() - t0)
        except Crash:
            t_fail = time.perf_counter()
            trainer, rep = system.recover(trainer, nxt)
            system.attach(trainer)
            rep.update(
                failed_at=nxt,
                at_s=t_fail - t_start,
                wall_seconds=time.perf_counter() - t_fail,
                failed_step_s=t_fail - t0,
                lost_iterations=nxt - 1 - rep["recovered_step"],
            )
            recoveries.append(rep)
    if system is not None:
        system.close()
    wall = time.perf_counter() - t_start
    steady = step_seconds[5:] or step_seconds[1:] or step_seconds  # a short phase: all but its first step
    _last_step_mean = sum(steady) / max(1, len(steady))
    _step_means[spec.get("name", "")] = _last_step_mean
    report = {
        "system": kind,
        "params": sysspec,
        "steps": cfg.steps,
        "world_size": trainer.world,
        "wall_s": wall,
        "step_seconds": step_seconds,
        "recoveries": recoveries,
        "checkpoint": system.stats() if system is not None else None,
        "exact_by_design": getattr(system, "exact", True),
        "failure_times_s": trace,
        "mtbf_s": mtbf_s,
    }
    host_losses = {step: loss.detach().cpu() for step, loss in losses.items()}  # read once, at the end
    torch.save({"state": trainer.export_state(), "losses": host_losses}, out / f"rank{trainer.rank}.pt")
    return report


def main() -> None:
    from torchmoe_harness.worker import leave, start, write_report

    spec, out = start()
    phases = spec.get("phases") or [dict(spec, name=".")]
    for phase in phases:
        sub = out / phase["name"]
        sub.mkdir(parents=True, exist_ok=True)
        write_report(sub / "report.json", run(phase, sub))
    if spec.get("phases"):
        write_report(out / "report.json", {"phases": [p["name"] for p in phases]})
    leave()


def run_system(nproc: int, spec: dict, out_dir, timeout: float = 300.0):
    """Launch `runner` under torchrun and load every phase's results."""
    from torchmoe_harness.launch import launch, load_result

    out = Path(out_dir)
    log = launch(nproc, spec, out, timeout, module="torchmoe_harness.baselines.runner")
    if "phases" in spec:
        return {p["name"]: load_result(out / p["name"], nproc, log) for p in spec["phases"]}
    return load_result(out, nproc, log)


if __name__ == "__main__":
    main()
