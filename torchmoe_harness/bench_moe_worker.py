"""torchrun worker of the MoE-regime bench: one model, every checkpointing system, interleaved in the same
processes (A B C A B C ...), so slow drift and other users' load hit every system alike.

    torchrun --nproc_per_node 2 -m torchmoe_harness.bench_moe_worker --spec spec.json --out DIR

Spec: {"run": RunConfig fields, "systems": {name: {"kind": ..., params}}, "reps": R, "warmup": w, "measure": m,
       "periodic": {name: {"kind": ..., "of": k=1 system name}}, "mtbf_iterations": n, "workdir": dir}
The model is built once. Each repetition gives every system a turn (the order rotated by one per repetition):
attach, `warmup` steps discarded, `measure` steps timed, then the copy in flight is finished and the system
detached. The systems live across turns (buffers allocated once, what auto W learned kept). After the first
repetition rank 0 picks each periodic system's interval from its k = 1 twin's measured cost (the ETTR-optimal
interval at the scaled-down MTBF, as MoEvement's evaluation picks Gemini's) and they join the rotation
(unless that interval is 1: then they are their twin).
Per timed step: wall seconds, training-thread CPU (time.thread_time) and process CPU (time.process_time);
per turn: copy-thread CPU of the systems that copy through a SnapshotEngine. rank 0 writes report.json."""

from __future__ import annotations

import math
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist

from torchmoe_ckpt.planning.schedule import measure_copy_bandwidth
from torchmoe_harness.baselines import make_system
from torchmoe_harness.ettr import SystemProfile, best_interval
from torchmoe_harness.trainer import RunConfig, Trainer
from torchmoe_harness.worker import serve

MAX_INTERVAL = 8  # a periodic system's turn spans whole intervals: longer ones would not fit the bench's time


def _engine(system):
    ck = getattr(system, "ck", None)
    return ck.engine if ck is not None else getattr(system, "engine", None)


def _detach(system, trainer: Trainer) -> None:
    """Finish the checkpoint in flight and unhook the system (its buffers stay for its next turn)."""
    if system is None:
        return
    if hasattr(system, "ck"):
        system.ck.abandon_window()
        hook = system.ck.before_update
    elif getattr(system, "exporter", None) is not None:
        system.exporter.wait()
        hook = None
    elif hasattr(system, "engine"):
        system.before_update()
        hook = system.before_update
    else:
        hook = None
    if hook is not None:
        trainer.before_update[:] = [h for h in trainer.before_update if h != hook]
    if hasattr(system, "_attached"):
        system._attached = None


def _turn(trainer: Trainer, system, warmup: int, measure: int) -> dict:
    if system is not None:
        system.attach(trainer)
    for _ in range(warmup):
        res = trainer.train_step()
        if system is not None:
            system.after_step(trainer, res)
    eng = _engine(system)
    cpu0 = dict(eng.copy_totals) if eng is not None else None
    wait0 = getattr(eng, "wait_seconds_total", None)
    wall, thread_cpu, proc_cpu, hook_cpu = [], [], [], []
    for _ in range(measure):
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        res = trainer.train_step()
        h0 = time.thread_time()
        if system is not None:  # the checkpoint's own work on the training thread (capture, planning, staging)
            system.after_step(trainer, res)
        hook_cpu.append(time.thread_time() - h0)
        wall.append(time.perf_counter() - t0)
        thread_cpu.append(time.thread_time() - c0)
        proc_cpu.append(time.process_time() - p0)
    out = {"wall_s": wall, "thread_cpu_s": thread_cpu, "process_cpu_s": proc_cpu, "hook_cpu_s": hook_cpu}
    if eng is not None:  # copies finished during the timed steps (steady state: one in flight at each end)
        out["copy_cpu_s"] = eng.copy_totals["cpu_s"] - cpu0["cpu_s"]
        out["copy_wall_s"] = eng.copy_totals["wall_s"] - cpu0["wall_s"]
        out["copy_bytes"] = eng.copy_totals["bytes"] - cpu0["bytes"]
    if wait0 is not None:  # the training thread's waits in the timed steps (not the flush at the turn's end)
        out["wait_s"] = eng.wait_seconds_total - wait0
    t0 = time.perf_counter()
    _detach(system, trainer)
    out["detach_s"] = time.perf_counter() - t0
    return out


def _pick_interval(turns: list[dict], base: list[dict], mtbf_iterations: float) -> int:
    """ETTR-optimal interval for a periodic system from its k = 1 turns: stall per checkpoint = its step time
    minus the no-checkpoint step time (paired by repetition), at MTBF = mtbf_iterations x T_iter."""
    t = sum(sum(b["wall_s"]) / len(b["wall_s"]) for b in base) / len(base)
    stall = max(1e-6, sum(sum(x["wall_s"]) / len(x["wall_s"]) for x in turns) / len(turns) - t)
    p = SystemProfile("periodic", t, stall_s=stall, restart_s=t)
    return max(1, min(MAX_INTERVAL, best_interval(p, mtbf_iterations * t, max_interval=4 * MAX_INTERVAL)))


def run(spec: dict, out: Path) -> dict:
    cfg = RunConfig(**spec["run"])
    trainer = Trainer(cfg)
    for _ in range(2):  # first iterations allocate (optimizer state, FSDP buffers): not part of any turn
        trainer.train_step()
    bw = torch.tensor([measure_copy_bandwidth()], dtype=torch.float64)
    dist.all_reduce(bw, op=dist.ReduceOp.MIN)
    specs = {"none": None, **spec["systems"]}
    systems: dict = {}
    turns: dict[str, list[dict]] = {name: [] for name in list(specs) + list(spec.get("periodic", {}))}
    intervals: dict[str, int] = {}
    reps, warmup, measure = spec["reps"], spec["warmup"], spec["measure"]
    order = list(specs)
    for rep in range(reps + (1 if spec.get("periodic") else 0)):
        if rep == 1 and spec.get("periodic"):
            box = [
                {
                    name: _pick_interval(turns[p["of"]], turns["none"], spec["mtbf_iterations"])
                    for name, p in spec["periodic"].items()
                }
            ]
            dist.broadcast_object_list(box, src=0)
            intervals = box[0]
            for name, p in spec["periodic"].items():
                if intervals[name] > 1:  # at k = 1 it is its twin, measured already
                    specs[name] = {"kind": p["kind"], "every": intervals[name], **p.get("params", {})}
                    order.append(name)
        k = rep % len(order)
        for name in order[k:] + order[:k]:
            sp = specs[name]
            if name not in systems:
                params = dict(sp or {"kind": "none"})
                systems[name] = make_system(params.pop("kind"), trainer, params, str(Path(spec["workdir"]) / name))
            system = systems[name]
            every = (sp or {}).get("every", 1)
            steps = every * math.ceil(measure / every)  # whole intervals: the mean covers one checkpoint each
            turns[name].append(dict(_turn(trainer, system, warmup, steps), rep=rep))
    stats = {}
    for name, system in systems.items():
        if system is not None:
            s = system.stats()
            # bytes of every rank (ranks' shares of a global plan differ): summed, with this system's dense
            for key in ("bytes_per_checkpoint", "planned_mean_slot_bytes", "dense_bytes"):
                if s.get(key) is not None:
                    t = torch.tensor([float(s[key])], dtype=torch.float64)
                    dist.all_reduce(t)
                    s[f"{key}_all_ranks"] = float(t)
            s.pop("windows", None)
            if hasattr(system, "ck"):
                full = system.ck.stats()
                s.update(
                    {
                        k: full[k]
                        for k in (
                            "copy",
                            "priced_bytes_per_s",
                            "priced_t_iter",
                            "auto_window",
                            "plan_seconds",
                            "max_slot_bytes",
                            "mean_slot_bytes",
                        )
                    }
                )
                s["windows_W"] = [w["W"] for w in full["windows"]]
            stats[name] = s
            system.close()
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0], dtype=torch.float64)
    dist.all_reduce(rss)  # every system's buffers are alive at once here (each keeps its own across turns)
    return {
        "world_size": trainer.world,
        "memcpy_bytes_per_s": float(bw),
        "turns": turns,
        "stats": stats,
        "intervals": intervals,
        "steps": trainer.step,
        "peak_rss_bytes_all_ranks": float(rss),
    }


def main() -> None:
    serve(run)


if __name__ == "__main__":
    main()
