"""torchrun entry point for pipeline-parallel training with per-stage sparse checkpoints, boundary logs
and localized recovery (one rank per stage, DP=1):

    torchrun --nproc_per_node P --max-restarts R -m torchmoe_harness.pipeline_worker --spec S --out D

Spec: "run" (RunConfig), "pipeline" (PipelineConfig), "checkpoint" (SparseConfig; `window` required),
"host_tier" {"root", "run_id"}, "timeout_s". Failures are real: TORCHMOE_FAULT kills a stage (faults.py).
"bench_recovery" {"stage", "repeat"}: after training, time a localized and a global recovery of that stage
(same run, both checked exact against the live state) for `torchmoe-ckpt bench`.

torchrun restarts *every* worker when one dies, whereas the system modelled here keeps healthy stages
running. So a healthy stage that sees a peer fail (a gloo error, or torchrun's SIGTERM at an iteration
boundary) discards the aborted iteration (nothing was updated yet), writes its live state to host memory
(`<root>/<run_id>/live/stage-S.pt`, /dev/shm in practice) and exits; its restarted process loads it back
in place: no rollback, no recomputation. Its boundary log is already in host memory. A stage without a
live state (killed) recovers from its window and its neighbours' logs (pipeline.recovery).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from torchmoe_ckpt.config import SparseConfig, TierConfig
from torchmoe_ckpt.model.operators import discover_operators
from torchmoe_ckpt.persist.build_tiers import Tiers
from torchmoe_ckpt.pipeline.boundary_log import BoundaryLog, LogReader
from torchmoe_ckpt.pipeline.recovery import StageStatus, plan_recovery, recover_global, recover_in_segment
from torchmoe_ckpt.recovery.resume import ResumeResult
from torchmoe_ckpt.recovery.sparse_to_dense import ReplayDivergence
from torchmoe_ckpt.sparse_checkpointer import PlanningGroups, RunContext, SparseCheckpointer
from torchmoe_ckpt.tiers.host_tier import HostTier
from torchmoe_harness.pipeline_trainer import PipelineConfig, StageTrainer
from torchmoe_harness.trainer import RunConfig
from torchmoe_harness.worker import serve

log = logging.getLogger("torchmoe_ckpt.pipeline_worker")
_TERM = {"flag": False}


class Paths:
    def __init__(self, host: dict, stages: int):
        # No shared default: the spec's run id, else torchrun's (new for every launch), else an error.
        self.run_id = TierConfig(root=host["root"], run_id=host.get("run_id")).resolved_run_id()
        self.root = Path(host["root"]) / self.run_id
        self.logs = [self.root / "pplog" / f"stage-{s}" for s in range(stages)]
        self.live = [self.root / "live" / f"stage-{s}.pt" for s in range(stages)]
        self.tier_root = Path(host["root"]) / "node-0"
        self.recoveries = self.root / "recoveries.jsonl"


def _windows(tier: HostTier) -> dict[int, int]:
    out = {}
    for w in tier.window_ids():
        if not tier.verify(w):
            out[w] = tier.manifest(w).start_step
    return out


def _window_starts(tier: HostTier) -> dict[int, int]:
    """Committed windows on this stage's host tier (manifests only: cheap, once per iteration)."""
    out = {}
    for w in tier.window_ids():
        try:
            out[w] = tier.manifest(w).start_step
        except (FileNotFoundError, ValueError):
            pass  # being collected right now
    return out


def _dump_live(path: Path, trainer: StageTrainer, losses: dict, extra: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(
        {"state": trainer.export_state(), "losses": losses, "replayed": trainer.replayed_iterations, "extra": extra},
        tmp,
    )
    tmp.rename(path)  # written last: a half-written live state is never taken for a healthy one


def _append(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def _on_term(signum, frame) -> None:
    # torchrun's SIGTERM after a peer died: finish or abort the current iteration cleanly, then leave.
    _TERM["flag"] = True


def run(spec: dict, out: Path) -> dict:
    cfg = RunConfig(**spec["run"])
    pp = PipelineConfig(**spec["pipeline"])
    ck_cfg = SparseConfig(**spec["checkpoint"])
    if ck_cfg.window is None:
        raise ValueError("pipeline runs need a fixed window: set checkpoint.window (stages must share window bounds)")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != pp.stages:
        raise ValueError(f"world size {world} != pipeline.stages {pp.stages}: run one rank per stage (DP=1)")
    pp.validate(cfg)
    stage = rank
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    paths = Paths(spec["host_tier"], pp.stages)
    signal.signal(signal.SIGTERM, _on_term)
    blog = BoundaryLog(paths.logs[stage], pp.log_max_bytes)
    tier = HostTier(paths.tier_root, paths.run_id, rank, world)
    for r in range(world):  # one single-rank group per stage: the checkpointer's per-stage plan agreement
        g = dist.new_group([r], backend="gloo")
        if r == rank:
            stage_group = g

    # ---- who survived, and recovery ------------------------------------------------------------------
    live = None
    if paths.live[stage].exists():
        live = torch.load(paths.live[stage], weights_only=True)
        paths.live[stage].unlink()  # consumed: if this process dies now, it is a failed stage next time
    status = StageStatus(stage, live is not None, int(live["state"]["step"]) if live else None, _windows(tier))
    statuses = [None] * world
    dist.all_gather_object(statuses, status)
    first_start = attempt == 0 and not any(s.healthy or s.windows for s in statuses)
    plan = plan_recovery(statuses, paths.logs, pp.microbatches) if not first_start else None
    if plan is not None and stage == 0:
        log.warning(
            "event=pp_recovery mode=%s attempt=%d reason=%r plan=%s",
            plan.mode,
            attempt,
            plan.reason,
            json.dumps(plan.to_dict()),
        )
        _append(paths.recoveries, {"event": "planned", "attempt": attempt, "plan": plan.to_dict()})
    losses: dict[int, torch.Tensor] = {}
    rec: dict = {"attempt": attempt, "stage": stage}
    t_rec = time.perf_counter()
    recovering = False
    if plan is None or plan.mode == "cold":
        trainer = StageTrainer(cfg, pp, stage, blog)
        if plan is not None:
            blog.clear()
            log.warning("event=pp_recovery mode=cold attempt=%d reason=%r", attempt, plan.reason)
            rec.update(role="cold")
    elif plan.mode in ("none", "local") and status.healthy:
        trainer = StageTrainer(cfg, pp, stage, blog)
        trainer.load_state(live["state"])
        trainer.replayed_iterations = live["replayed"]
        losses = dict(live["losses"])
        rec.update(role="healthy", step=trainer.step)
    else:
        recovering = True
        trainer = StageTrainer(cfg, pp, stage, blog, init_seed=cfg.seed + 7777)  # other weights: forgetting shows
        ops = {o.name: o for o in discover_operators(trainer.model, optimizer=trainer.optimizer)}
        if live is not None:
            trainer.replayed_iterations = live["replayed"]
        if plan.mode == "local":
            seg = plan.segment_of(stage)
            window = tier.load_window(seg.window_id, ops, trainer.compute_dtype)
            rec.update(role="recovered", **recover_in_segment(trainer, window, seg, plan.target_step, paths.logs))
        else:
            log.warning("event=pp_recovery mode=global attempt=%d stage=%d reason=%r", attempt, stage, plan.reason)
            window = tier.load_window(plan.window_id, ops, trainer.compute_dtype)
            losses = dict(live["losses"]) if live is not None else {}
            rec.update(role="global", **recover_global(trainer, window))
            blog.flush()  # the joint replay re-logged each iteration's loss: the history from the window on
            own = LogReader(paths.logs[stage])
            losses.update(
                {
                    t: own.meta(t)["loss"]
                    for t in range(window.start_step + 1, trainer.step + 1)
                    if own.has([t], 0, None)
                }
            )  # not where the log bound stopped logging
    try:
        if plan is not None and status.healthy and plan.mode in ("none", "local"):
            from torchmoe_ckpt.runtime import faults

            faults.set_iteration(trainer.step)
            faults.point("recovery")  # a healthy stage waiting for its neighbours' recovery
        dist.barrier()  # recovery complete everywhere: only now does a recovered stage count as healthy
    except Exception as exc:  # a failure during recovery: widen / restart it next attempt
        if not recovering:
            trainer.reset_iteration()
            blog.flush()
            _dump_live(paths.live[stage], trainer, losses, {})
        log.warning(
            "event=pp_failure_during_recovery stage=%d attempt=%d recovering=%s error=%s",
            stage,
            attempt,
            recovering,
            str(exc).splitlines()[0][:200],
        )
        _exit(1)
    rec["wait_or_recovery_s"] = time.perf_counter() - t_rec
    recs = [None] * world
    try:  # past the barrier every stage holds its exact state at trainer.step: all count as healthy now
        losses = _merge_losses(losses, trainer.step)
        dist.all_gather_object(recs, rec)
    except ReplayDivergence:
        raise
    except RuntimeError as exc:
        blog.flush()
        _dump_live(paths.live[stage], trainer, losses, {})
        log.warning(
            "event=pp_peer_failure stage=%d attempt=%d step=%d error=%s: live state kept in host memory",
            stage,
            attempt,
            trainer.step,
            str(exc).splitlines()[0][:200],
        )
        _exit(1)
    if rank == 0 and plan is not None:
        _append(paths.recoveries, {"event": "done", "attempt": attempt, "plan": plan.to_dict(), "stages": recs})

    # ---- training --------------------------------------------------------------------------------------
    # Window ids stay aligned across stages after any restart: all start after the newest one on any tier.
    nxt = torch.tensor([max(tier.window_ids(require_manifest=False), default=-1) + 1], dtype=torch.float64)
    dist.all_reduce(nxt, op=dist.ReduceOp.MAX)
    # Plans per stage (its own operators); the scalar agreements (retention floor, copy bandwidth) span the
    # whole pipeline, so every stage keeps every window from the newest one *all* stages persisted: the
    # window a joint recovery of any segment needs.
    ck = SparseCheckpointer(
        trainer.model,
        trainer.optimizer,
        trainer.compute_dtype,
        ck_cfg,
        RunContext(tiers=Tiers(tier, None, None), resumed=ResumeResult(None, None, next_window_id=int(nxt.item()))),
        PlanningGroups(group=stage_group, agree_group=None),
    )
    ck.attach(trainer)
    gc_floor = None
    step_seconds = []
    try:
        while trainer.step < cfg.steps:
            if _TERM["flag"]:
                raise RuntimeError("SIGTERM from torchrun: a peer failed")
            t0 = time.perf_counter()
            res = trainer.train_step()
            losses[res.step] = res.global_loss
            ck.after_step(res)
            step_seconds.append(time.perf_counter() - t0)
            windows = _window_starts(tier)
            floor = min(windows.values()) if windows else None
            if floor is not None and floor != gc_floor:  # a newer window committed: collect older log entries
                blog.collect(floor)
                gc_floor = floor
        ck.close()
        blog.flush()
    except ReplayDivergence:
        raise
    except RuntimeError as exc:  # gloo's errors (DistBackendError) and our SIGTERM: a peer failed
        trainer.reset_iteration()
        ck.flush(commit=False)  # the copy in flight and what the host tier has queued; nothing collective
        blog.flush()
        _dump_live(paths.live[stage], trainer, losses, {})
        log.warning(
            "event=pp_peer_failure stage=%d attempt=%d step=%d error=%s: live state kept in host memory",
            stage,
            attempt,
            trainer.step,
            str(exc).splitlines()[0][:200],
        )
        _exit(1)
    torch.save({"state": trainer.export_state(), "losses": losses}, out / f"rank{rank}.pt")
    bench = _bench_recovery(trainer, spec["bench_recovery"], paths, tier, blog) if spec.get("bench_recovery") else None
    report = {
        "stage": stage,
        "replayed_iterations": trainer.replayed_iterations,
        "log": blog.stats(),
        "checkpoint": {
            k: v
            for k, v in ck.stats().items()
            if k in ("slots_captured", "windows_committed", "mean_slot_bytes", "dense_bytes")
        },
        "step_seconds": step_seconds,
    }
    reports = [None] * world
    dist.all_gather_object(reports, report)
    records = []
    if paths.recoveries.exists():
        records = [json.loads(line) for line in paths.recoveries.read_text().splitlines() if line]
    return {
        "world_size": world,
        "steps": cfg.steps,
        "stages": reports,
        "recoveries": [r for r in records if r["event"] == "done"],  # completed recoveries
        "recovery_plans": [r for r in records if r["event"] == "planned"],  # incl. interrupted ones
        "log_bytes_per_iteration": sum(r["log"]["bytes_per_iteration"] for r in reports),
        "bench_recovery": bench,
    }


def _bench_recovery(trainer: StageTrainer, bench: dict, paths: Paths, tier: HostTier, blog: BoundaryLog) -> dict:
    """Same run, after training: stage `bench["stage"]` loses its state and recovers (1) localized, from
    its window and its neighbours' logs while the others wait, (2) by a global rollback of every stage to
    the window and joint re-execution up to the same iteration. Both must reproduce the live state exactly."""
    cfg, pp, stage, world = trainer.cfg, trainer.pp, trainer.stage, dist.get_world_size()
    victim, target = int(bench.get("stage", 1)), trainer.step
    saved = trainer.export_state()
    windows = _windows(tier)
    statuses = [None] * world
    dist.all_gather_object(statuses, StageStatus(stage, stage != victim, target, windows))
    plan = plan_recovery(statuses, paths.logs, pp.microbatches)
    gplan = plan_recovery([StageStatus(s.stage, False, None, s.windows) for s in statuses], paths.logs, pp.microbatches)
    out: dict = {"failed_stage": victim, "target_step": target, "plan": plan.mode, "global_window": gplan.window_id}
    ops = {o.name: o for o in discover_operators(trainer.model, optimizer=trainer.optimizer)}

    def exact(t: StageTrainer) -> bool:
        got = t.export_state()
        return got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in saved)

    local_s, global_s = [], []
    flags = [None] * world
    for _ in range(int(bench.get("repeat", 3))):  # median of a few: single timings on shared cores are noisy
        dist.barrier()
        t0 = time.perf_counter()
        local_exact, recomputed = True, 0
        if stage == victim:
            fresh = StageTrainer(cfg, pp, stage, blog, init_seed=cfg.seed + 7777)
            seg = plan.segment_of(stage)
            recover_in_segment(
                fresh, tier.load_window(seg.window_id, ops, fresh.compute_dtype), seg, target, paths.logs
            )
            local_exact, recomputed = exact(fresh), fresh.replayed_iterations
        dist.barrier()
        local_s.append(time.perf_counter() - t0)
        dist.all_gather_object(flags, (local_exact, recomputed))
        out["localized_exact"] = all(f[0] for f in flags) and out.get("localized_exact", True)
        out["localized_recomputed_iterations"] = [f[1] for f in flags]
        t0 = time.perf_counter()
        fresh = StageTrainer(cfg, pp, stage, blog, init_seed=cfg.seed + 7777)
        recover_global(fresh, tier.load_window(gplan.window_id, ops, fresh.compute_dtype))
        rerun = 0
        while fresh.step < target:  # everyone re-executes the iterations after the window, live
            fresh.train_step()
            rerun += 1
        dist.barrier()
        global_s.append(time.perf_counter() - t0)
        dist.all_gather_object(flags, (exact(fresh), fresh.replayed_iterations + rerun))
        out["global_exact"] = all(f[0] for f in flags) and out.get("global_exact", True)
        out["global_recomputed_iterations"] = [f[1] for f in flags]
    out["pp_recovery_s_localized"] = sorted(local_s)[len(local_s) // 2]
    out["pp_recovery_s_global"] = sorted(global_s)[len(global_s) // 2]
    out["localized_s_all"], out["global_s_all"] = local_s, global_s
    return out


def _merge_losses(losses: dict, step: int) -> dict:
    """Every stage ends with the same loss sequence: healthy stages carry the history, replayed ones
    recomputed part of it, and where both have an iteration the values must be identical."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {int(k): v for k, v in losses.items()})
    merged: dict[int, torch.Tensor] = {}
    for d in everyone:
        for k, v in d.items():
            if k in merged and not torch.equal(merged[k], v):
                raise ReplayDivergence(f"loss of iteration {k} differs between stages after recovery")
            merged[k] = v
    return {k: v for k, v in sorted(merged.items()) if k <= step}


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    serve(run)


if __name__ == "__main__":
    main()
