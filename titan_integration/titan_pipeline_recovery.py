"""Sparse checkpointing and localized recovery on TorchTitan's pipeline path (one rank per stage).

TorchTitan builds the stages (``pipeline_llm``: its module split, its ``PipelineStage``s, its
``Schedule1F1B``/``ScheduleGPipe``) and trains with ``pp_schedule.step``. :class:`TitanPipeline` adds, on
each stage rank of a :class:`~titan_integration.sparse_trainer.SparseTrainer`:

* boundary logs: the stage becomes a :class:`torchmoe_ckpt.pipeline.stock.LoggingPipelineStage` (in
  place), which logs every activation and gradient it sends, plus a per-iteration record (global grad norm,
  loss), in ``<root>/<run_id>/pp/log/stage-S`` (host memory), collected as windows commit;
* static stage shapes (:func:`titan_integration.pipeline_compat.set_static_shapes`), so no shape-inference
  forward runs on restart and a stage can be re-initialised alone;
* a sparse window per stage (each stage plans over its own operators; all stages share W and window
  bounds, and agree on retention over the whole pipeline);
* on a peer failure (gloo error, torchrun's SIGTERM), a healthy stage discards the aborted iteration and
  keeps its live state in host memory (``pp/live/stage-S.pt``, emulating a stage that keeps running
  across torchrun's restart-all); at the next start it loads it back: no rollback, no recomputation;
* at start, :meth:`TitanPipeline.recover` plans with ``torchmoe_ckpt.pipeline.recovery.plan_recovery``
  (segments of failed stages, global fallback with a reason) and a failed stage replays its window
  (sparse-to-dense, frozen operators) and then the iterations up to the healthy stages' step *through
  TorchTitan's own schedule*, with the receives from outside its segment served from the neighbours' logs.
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

from titan_integration.pipeline_compat import set_static_shapes
from titan_integration.sparse_config import JobConfigError
from titan_integration.titan_replay import TitanReplayable, pack_batches
from torchmoe_ckpt.model.operators import discover_operators
from torchmoe_ckpt.pipeline.boundary_log import BoundaryLog, LogReader
from torchmoe_ckpt.pipeline.recovery import StageStatus, plan_recovery
from torchmoe_ckpt.pipeline.stock import LoggingPipelineStage, ReplayIO
from torchmoe_ckpt.recovery.replay_log import Replay
from torchmoe_ckpt.recovery.sparse_to_dense import ReplayDivergence, sparse_to_dense
from torchmoe_ckpt.runtime import faults

log = logging.getLogger("torchmoe_ckpt.titan_pipeline")
SCHEDULES = ("1F1B", "GPipe")
_TERM = {"flag": False}


class PeerFailure(RuntimeError):
    pass


def check_pipeline_job(config, sc, world_size: int) -> None:
    """What this integration supports under pipeline parallelism (``sc``: the [sparse_checkpoint] section);
    anything else is one line with the fix."""
    par = config.parallelism
    pp = par.pipeline_parallel_degree
    if pp <= 1 or not sc.enable:
        return
    if world_size != pp:
        raise JobConfigError(
            f"[parallelism] pipeline_parallel_degree = {pp} with {world_size} ranks: sparse "
            "checkpointing with pipeline parallelism runs one rank per stage; fix: run "
            f"--nproc_per_node {pp} (data-parallel groups per stage are not built yet)"
        )
    if par.pipeline_parallel_schedule.lower() not in {x.lower() for x in SCHEDULES}:
        raise JobConfigError(
            f"[parallelism] pipeline_parallel_schedule = {par.pipeline_parallel_schedule!r}: "
            f"sparse checkpointing supports one stage per rank; fix: use one of {', '.join(SCHEDULES)}"
        )
    if sc.window == "auto":
        raise JobConfigError(
            "[sparse_checkpoint] window = 'auto': pipeline stages must share window bounds; "
            "fix: window = 3 (an integer)"
        )
    if sc.replicas or sc.store_uri:
        raise JobConfigError(
            "[sparse_checkpoint] replicas/object_store: with pipeline parallelism windows are "
            "kept on the host tier only so far; fix: replicas = 0 and no object_store"
        )
    gbs, lbs = config.training.global_batch_size, config.training.local_batch_size
    if gbs not in (-1, lbs):
        raise JobConfigError(
            f"[training] global_batch_size = {gbs}: sparse checkpointing with pipeline parallelism "
            f"needs no gradient accumulation; fix: global_batch_size = {lbs} (= local_batch_size)"
        )


class TitanPipeline:
    def __init__(self, trainer):
        try:
            check_pipeline_job(trainer.config, trainer.sc, dist.get_world_size())
        except JobConfigError as exc:  # the override path skips the launcher's check
            raise ValueError(str(exc)) from None
        sc = trainer.sc
        self.trainer = trainer
        self.stage = trainer.pp_schedule._stage
        self.index, self.n = self.stage.stage_index, self.stage.num_stages
        self.microbatches = trainer.num_pipeline_parallel_microbatches
        root = Path(sc.root) / sc.run_id / "pp"
        self.log_dirs = [root / "log" / f"stage-{s}" for s in range(self.n)]
        self.live = [root / "live" / f"stage-{s}.pt" for s in range(self.n)]
        self.recoveries = root / "recoveries.jsonl"
        self.log = BoundaryLog(self.log_dirs[self.index], sc.pipeline_log_max_bytes or None)
        LoggingPipelineStage.adopt(self.stage, self.log, local_vote=True)
        self._shapes_set = False
        self.completed = 0  # newest iteration whose update is applied on this stage
        self.replayed = 0  # iterations this stage re-executed, over all restarts (the counter)
        self.report: dict = {}
        self._gc_floor = None
        self.stage_group = None
        for r in range(self.n):  # one single-rank group per stage: the checkpointer's per-stage planning
            g = dist.new_group([r], backend="gloo")
            if r == dist.get_rank():
                self.stage_group = g
        signal.signal(signal.SIGTERM, _on_term)

    # ---- training hooks ---------------------------------------------------------------------------------
    def before_step(self) -> None:
        if _TERM["flag"]:
            raise PeerFailure("SIGTERM from torchrun: a peer failed")

    def after_update(self, step: int, grad_norm: torch.Tensor, loss: torch.Tensor) -> None:
        self.completed = step
        self.log.record_meta(step, grad_norm, loss)

    def before_forward(self, step: int, input_dict: dict, labels: torch.Tensor) -> None:
        """Static shapes from the first micro-batch this process sees (no shape-inference forward, no vote)."""
        self.stage.iteration = step
        if not self._shapes_set:
            tr = self.trainer
            inputs, _labels, kwargs = tr.post_dataloading_process(dict(input_dict), labels)
            set_static_shapes(self.stage, inputs, kwargs, int(tr.config.model_spec.model.dim))
            self._shapes_set = True

    def pipeline_loss(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """The pipeline's loss on every stage. Live: the last stage's, summed with zeros over the stages (exact).
        A stage replaying alone takes it from the neighbour's per-iteration record; a last stage replaying
        computes its own, which :meth:`_recover_segment` checks against that record."""
        own = loss.detach().float().reshape(()) if self.stage.is_last else torch.zeros((), dtype=torch.float32)
        io = self.stage.replay_io
        if io is None:
            dist.all_reduce(own)
            return own
        if self.stage.is_last:
            return own
        return (io.up or io.down).meta(step)["loss"].clone()

    def after_step(self) -> None:
        tier, starts = self.tier, []
        for w in tier.window_ids():
            try:
                starts.append(tier.manifest(w).start_step)
            except (FileNotFoundError, ValueError):
                pass  # being collected right now
        floor = min(starts) if starts else None
        if floor is not None and floor != self._gc_floor:  # a newer window committed: collect older entries
            self.log.collect(floor)
            self._gc_floor = floor

    # ---- a peer failed: keep the live state, leave -------------------------------------------------------
    def on_peer_failure(self, exc: BaseException) -> None:
        tr = self.trainer
        tr.optimizers.zero_grad(set_to_none=True)  # the aborted iteration's partial gradients and counts
        for moe in tr._moe_modules():
            t = moe.tokens_per_expert_E
            (t.to_local() if hasattr(t, "to_local") else t).zero_()
        if tr.sparse is not None:
            tr.sparse.flush(commit=False)  # the copy in flight and what the host tier has queued; no collective
        self.log.flush()
        step = self.completed
        tr.set_lr_step(step)
        path = self.live[self.index]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(
            {
                "model": {k: v.detach().clone() for k, v in tr.model.state_dict().items()},
                "optim": tr.optimizers.state_dict(),
                "step": step,
                "replayed": self.replayed,
                "losses": {k: v for k, v in tr._losses.items() if k <= step},
            },
            tmp,
        )
        tmp.rename(path)  # written last: a half-written live state is never taken for a healthy one
        log.warning(
            "event=pp_peer_failure stage=%d step=%d error=%s: live state kept in host memory",
            self.index,
            step,
            str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__,
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    def _load_live(self, live: dict) -> None:
        tr = self.trainer
        tr.optimizers.load_state_dict(live["optim"])  # first: initialising empty optimizer state steps once
        tr.model.load_state_dict(live["model"])
        self._position(live["step"])
        self.completed = live["step"]
        self.replayed = live["replayed"]
        tr._losses.update(live["losses"])

    def _position(self, step: int) -> None:
        tr = self.trainer
        tr.step = step
        tr.set_lr_step(step)
        tr.ntokens_seen = step * tr.config.training.local_batch_size * tr.config.training.seq_len
        tr._skip_batches = step * self.microbatches

    # ---- start: who survived, plan, recover ---------------------------------------------------------------
    def recover(self, tier, attempt: int) -> int:
        """Runs on every stage at train() start. Returns the first window id for the new checkpointer."""
        t0 = time.perf_counter()
        self.tier = tier
        live = None
        if self.live[self.index].exists():
            live = torch.load(self.live[self.index], weights_only=False)
            self.live[self.index].unlink()  # consumed: if this process dies now, it is a failed stage next time
            self._load_live(live)
        windows = {}
        for w in tier.window_ids():
            if not tier.verify(w):
                windows[w] = tier.manifest(w).start_step
        status = StageStatus(self.index, live is not None, live["step"] if live else None, windows)
        statuses = [None] * self.n
        dist.all_gather_object(statuses, status)
        first_start = attempt == 0 and not any(s.healthy or s.windows for s in statuses)
        plan = None if first_start else plan_recovery(statuses, self.log_dirs, self.microbatches)
        rec: dict = {"stage": self.index, "attempt": attempt}
        if plan is not None:
            if self.index == 0:
                log.warning(
                    "event=pp_recovery mode=%s attempt=%d reason=%r plan=%s",
                    plan.mode,
                    attempt,
                    plan.reason,
                    json.dumps(plan.to_dict()),
                )
            if plan.mode in ("none", "local") and status.healthy:
                rec.update(role="healthy", step=self.completed)
            elif plan.mode == "local":
                rec.update(role="recovered", **self._recover_segment(tier, plan))
            elif plan.mode == "global":
                rec.update(role="global", **self._recover_global(tier, plan))
            else:  # cold: no window common to all stages
                self.log.clear()
                rec.update(role="cold")
        rec["wait_or_recovery_s"] = time.perf_counter() - t0
        rec["replayed_total"] = self.replayed
        recs = [None] * self.n
        try:
            if plan is not None and status.healthy and plan.mode in ("none", "local"):
                faults.set_iteration(self.completed)
                faults.point("recovery")  # a healthy stage waiting for its neighbours' recovery
            dist.barrier()  # recovery complete everywhere: only now does a recovered stage count as healthy
            dist.all_gather_object(recs, rec)
            self._merge_losses()
        except RuntimeError as exc:  # a failure during recovery: the next attempt plans again (widened)
            if rec.get("role") in ("healthy", None):
                self.on_peer_failure(exc)
            log.warning(
                "event=pp_failure_during_recovery stage=%d attempt=%d error=%s",
                self.index,
                attempt,
                str(exc).splitlines()[0][:200],
            )
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        # The loss history every stage holds afterwards starts after this iteration (tests compare from there).
        first_known = min((r["window_start"] for r in recs if r.get("role") == "global"), default=0)
        self.report = {
            "plan": plan.to_dict() if plan else None,
            "stages": recs,
            "recovered_step": first_known,
            "mode": plan.mode if plan else None,
        }
        if plan is not None and self.index == 0:
            self.recoveries.parent.mkdir(parents=True, exist_ok=True)
            with self.recoveries.open("a") as f:
                f.write(json.dumps({"attempt": attempt, **self.report}, default=str) + "\n")
        # Window ids stay aligned across stages: everyone starts after the newest one on any tier.
        nxt = torch.tensor([max(tier.window_ids(require_manifest=False), default=-1) + 1], dtype=torch.float64)
        dist.all_reduce(nxt, op=dist.ReduceOp.MAX)
        return int(nxt.item())

    def _merge_losses(self) -> None:
        """Every stage ends with the pipeline's whole loss history: healthy stages carry it, replayed ones
        recomputed part of it; where both have an iteration the values must be identical."""
        tr = self.trainer
        everyone = [None] * self.n
        dist.all_gather_object(everyone, {int(k): v for k, v in tr._losses.items()})
        for d in everyone:
            for k, v in d.items():
                if k in tr._losses and not torch.equal(tr._losses[k], v):
                    raise ReplayDivergence(f"loss of iteration {k} differs between stages after recovery")
                if k <= self.completed:
                    tr._losses[k] = v

    def _ops(self):
        # as the checkpointer discovered them (start()): as fine as the optimizers allow
        return {o.name: o for o in discover_operators(self.trainer.model, optimizer=list(self.trainer.optimizers))}

    def _recover_segment(self, tier, plan) -> dict:

        tr, seg, target = self.trainer, plan.segment_of(self.index), plan.target_step
        t0 = time.perf_counter()
        if os.environ.get("TORCHMOE_TITAN_SCRAMBLE") == "1":
            tr._scramble()
        window = tier.load_window(seg.window_id, self._ops(), tr.compute_dtype)
        self.log.clear()  # this stage's own log went down with it; what it replays is logged again
        up = LogReader(self.log_dirs[seg.up]) if seg.up is not None and self.index == seg.first else None
        down = LogReader(self.log_dirs[seg.down]) if seg.down is not None and self.index == seg.last else None
        self.stage.replay_io = ReplayIO(up, down)
        rep = sparse_to_dense(TitanReplayable(tr), window).to_dict()
        self.replayed += rep["replayed_iterations"]
        meta = LogReader(self.log_dirs[seg.up if seg.up is not None else seg.down])
        data = iter(tr.dataloader)  # phase 2 reads the data loader; training continues from this iterator
        for _ in range(tr.step * self.microbatches):
            next(data)
        replay = TitanReplayable(tr)
        for t in range(tr.step + 1, target + 1):  # phase 2: the iterations after the window
            tokens = pack_batches([next(data) for _ in range(self.microbatches)])
            rec = meta.meta(t)
            res = replay.train_step(Replay(tokens, rec["grad_norm"], torch.get_rng_state()))
            tr._losses[t] = res.loss
            self.replayed += 1
            if not torch.equal(res.loss, rec["loss"]):
                raise ReplayDivergence(
                    f"stage {self.index}: replayed loss of iteration {t} ({res.loss.item()!r}) "
                    f"differs from the logged {rec['loss'].item()!r}"
                )
        self.stage.replay_io = None
        self.log.flush()
        self._position(target)
        tr._skip_batches, tr._resume_iter = 0, data
        self.completed = target
        out = dict(
            mode="local",
            segment=[seg.first, seg.last],
            window_id=window.id,
            window_start=window.start_step,
            target_step=target,
            seconds=time.perf_counter() - t0,
            phase1=rep,
        )
        log.info(
            "event=pp_stage_recovered stage=%d segment=%d..%d window=%d target=%d replayed=%d seconds=%.3f",
            self.index,
            seg.first,
            seg.last,
            window.id,
            target,
            self.replayed,
            out["seconds"],
        )
        return out

    def _recover_global(self, tier, plan) -> dict:

        tr = self.trainer
        t0 = time.perf_counter()
        if os.environ.get("TORCHMOE_TITAN_SCRAMBLE") == "1":
            tr._scramble()
        window = tier.load_window(plan.window_id, self._ops(), tr.compute_dtype)
        self.log.drop_from(window.start_step + 1)
        rep = sparse_to_dense(TitanReplayable(tr), window).to_dict()  # jointly, live, like training
        self.replayed += rep["replayed_iterations"]
        self._position(tr.step)
        self.completed = tr.step
        for k in [k for k in tr._losses if k > tr.step]:
            del tr._losses[k]
        return dict(
            mode="global",
            window_id=window.id,
            window_start=window.start_step,
            reason=plan.reason,
            target_step=tr.step,
            seconds=time.perf_counter() - t0,
            phase1=rep,
        )


def _on_term(signum, frame) -> None:
    # torchrun's SIGTERM after a peer died: act on it at the next iteration boundary (or when gloo fails).
    _TERM["flag"] = True
