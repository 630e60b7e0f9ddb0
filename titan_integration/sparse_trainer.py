"""Sparse per-iteration checkpointing inside TorchTitan 0.3.0's real Trainer (a subclass, no fork).

``SparseTrainer`` is a ``torchtitan.trainer.Trainer`` whose ``Config`` adds one field,
``sparse_checkpoint`` (:class:`titan_integration.sparse_config.SparseCheckpointSection`), and builds its
checkpointer as a :class:`titan_integration.checkpoint_manager.SparseCheckpointManager`. A stock Trainer
becomes one through ``--override.imports`` (:func:`titan_integration.overrides.adopt`).
With ``enable = false`` it trains exactly like the stock Trainer. With ``enable = true``:

* every iteration runs :meth:`SparseTrainer.sparse_step` -- TorchTitan's own ``train_step`` body (same
  batch fetch, global token count, ``forward_backward_step``, ``dist_utils.clip_grad_norm_``, optimizer and
  LR-scheduler step, metric logging) with four additions:
  - the batch (``input`` + ``labels``), the RNG state (CPU and GPU generators: torchmoe_ckpt.recovery.rng), this rank's
    loss, the global grad norm and the LR are kept for exact replay (loss and norm stay on the device; the
    checkpointer copies them to host memory without waiting);
  - the MoE layers' ``tokens_per_expert_E`` are cloned on the device after backward, *before* TorchTitan's
    bias-update optimizer pre-hook zeroes them: that is the expert-popularity signal (the checkpointer sums it
    over the ranks on its own gloo group at window starts, not per iteration and not on the NCCL group);
  - ``before_update`` hooks (the SparseCheckpointer's wait for the in-flight slot copy) run after clipping
    and before ``optimizers.step()``, i.e. before the expert-bias update and the weight update;
  - ``SparseCheckpointer.after_step`` runs right after the optimizer and LR-scheduler step.
* at ``train()`` start it looks for the newest committed window on the storage tiers (host directory,
  peers, object store); if there is one it rebuilds the dense state with ``sparse_to_dense`` (replaying the
  window's iterations with frozen operators, grad norm taken from the log), skips the data loader past the
  recovered step and continues. TorchTitan's own checkpoint load is skipped then (it would be older).

:class:`TitanReplayable` is the ``torchmoe_ckpt.recovery.sparse_to_dense.Replayable`` adapter over a SparseTrainer.

Under pipeline parallelism (one rank per stage) :class:`titan_integration.titan_pipeline_recovery.TitanPipeline`
adds stage-boundary logs, the live state of healthy stages and localized recovery of failed stages; the
step above is the same, with the pipeline's loss recorded on every stage.

Test/diagnostic environment variables (off by default: ``TORCHMOE_FAULT``, ``TORCHMOE_TITAN_EXPORT``,
``TORCHMOE_TITAN_SCRAMBLE``) are described in docs/torchtitan-internals.md.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated

import torch
import tyro
from torchtitan.components.dataloader import DataloaderExhaustedError
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from titan_integration import pipeline_compat, restart_timing
from titan_integration.checkpoint_manager import SparseCheckpointManager
from titan_integration.sparse_config import JobConfigError, SparseCheckpointSection
from titan_integration.tensor_parallel import check_tensor_parallel_job
from titan_integration.titan_optimizers import init_titan_optimizer_state, register_titan_optimizers
from titan_integration.titan_pipeline_recovery import TitanPipeline
from titan_integration.titan_replay import OptimizerView, TitanReplayable, TitanStepResult, pack_batches, unpack_batches
from titan_integration.titan_state_export import state_tensors, write_export
from titan_integration.upstream_pin import UPSTREAM_TRAIN_STEP
from torchmoe_ckpt.model.coverage import position_lambda_lr
from torchmoe_ckpt.recovery import rng
from torchmoe_ckpt.recovery.replay_check import check_replay_check
from torchmoe_ckpt.recovery.replay_log import group_hyper
from torchmoe_ckpt.recovery.resume import RecoveryOptions, ResumeResult
from torchmoe_ckpt.recovery.sparse_to_dense import ReplayDivergence
from torchmoe_ckpt.runtime import faults
from torchmoe_ckpt.runtime.distributed import key_rendezvous_by_attempt
from torchmoe_ckpt.runtime.watchdog import CollectiveWatchdog
from torchmoe_ckpt.sparse_checkpointer import PlanningGroups
from torchmoe_ckpt.startup import IdentityParts, StartupHooks, start

__all__ = ["SparseTrainer", "TitanReplayable", "TitanStepResult", "UPSTREAM_TRAIN_STEP"]

log = logging.getLogger("torchmoe_ckpt.titan")
pipeline_compat.install()  # also on the --override.imports path, which does not go through our launcher
register_titan_optimizers()  # DistMuon's update rule (per matrix), for the core's replay checks
IGNORE_INDEX = -100


class SparseTrainer(Trainer):
    """TorchTitan's Trainer with sparse per-iteration checkpointing and exact sparse-to-dense recovery."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        sparse_checkpoint: Annotated[SparseCheckpointSection, tyro.conf.Suppress] = field(
            default_factory=SparseCheckpointSection
        )
        checkpoint: SparseCheckpointManager.Config = field(default_factory=SparseCheckpointManager.Config)

    def __init__(self, config: Config):
        super().__init__(config)  # builds self.checkpointer (a SparseCheckpointManager)
        self.init_sparse(config.sparse_checkpoint)

    def init_sparse(self, section: SparseCheckpointSection, check: bool = True) -> None:
        """Our part of the trainer: called once Trainer.__init__ has built model, optimizer, data loader and
        checkpointer (from ``__init__``, or from ``overrides.adopt`` for a stock Trainer)."""
        restart_timing.mark("model_built")  # called once Trainer.__init__ has built model, optimizer, data loader
        if check and section.enable and not isinstance(self.checkpointer, SparseCheckpointManager):
            raise TypeError(
                f"config.checkpoint is a {type(self.checkpointer).__name__}; sparse checkpointing needs "
                "SparseCheckpointManager.Config there (fix: build the config with "
                "titan_integration.job_toml.load_job, or derive(cfg, SparseCheckpointManager.Config))"
            )
        if section.enable:  # resolved once, inside the worker: the pipeline's paths use it too
            section.run_id = section.resolved_run_id()
        self._sparse_section = section
        self.before_update: list[Callable[[], None]] = []
        self.sparse = None  # SparseCheckpointer once train() starts with enable = true
        self.recovery_report: dict | None = None
        self._skip_batches = 0
        self._losses: dict[int, torch.Tensor] = {}
        self._lrs: dict[int, float] = {}  # the LR each iteration used (replayed ones: the logged LR)
        self._step_seconds: list[float] = []
        self._attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self._watchdog = None
        self._pp = None  # TitanPipeline under pipeline parallelism
        self._resume_iter = None

    def init_distributed(self):
        """TorchTitan's own init_distributed with a store of this rendezvous round for every process group (the
        shared agent store otherwise hands a restart the previous round's keys: torchmoe_ckpt.runtime.distributed)."""
        key_rendezvous_by_attempt()
        dims = super().init_distributed()
        restart_timing.mark("pg_ready")
        return dims

    # ---- helpers ------------------------------------------------------------------------------------
    @property
    def sc(self) -> SparseCheckpointSection:
        return self._sparse_section

    @property
    def model(self) -> torch.nn.Module:
        if len(self.model_parts) != 1:
            raise NotImplementedError(
                "sparse checkpointing with several model parts per rank (looped pipeline "
                'schedules) is not supported; fix: pipeline_parallel_schedule = "1F1B"'
            )
        return self.model_parts[0]

    @property
    def compute_dtype(self) -> torch.dtype:
        return TORCH_DTYPE_MAP[self.config.training.mixed_precision_param]

    def _moe_modules(self) -> list[torch.nn.Module]:
        out = []
        for part in self.model_parts:
            for block in part.get_submodule("layers").values():
                if getattr(block, "moe_enabled", False):
                    out.append(block.moe)
        return out

    def _expert_counts(self) -> torch.Tensor:
        """This rank's routed-token counts [layers, experts] of this iteration, where the model keeps them (no copy
        to the host, no collective: the SparseCheckpointer sums them at the next window start). Read before
        TorchTitan's bias-update pre-hook zeroes them."""
        rows = []
        for moe in self._moe_modules():
            t = moe.tokens_per_expert_E
            t = t.to_local() if hasattr(t, "to_local") else t
            rows.append(t.detach().to(torch.float64, copy=True))  # the pre-hook zeroes the buffer in place
        if not rows:
            return torch.zeros(1, 1, dtype=torch.float64)
        return torch.stack(rows)

    def set_lr_step(self, step: int) -> None:
        """Position every LambdaLR at `step` completed iterations (what `step` scheduler.step() calls give)."""
        for sched in self.lr_schedulers:
            position_lambda_lr(sched, step)

    # ---- one iteration --------------------------------------------------------------------------------
    def train_step(self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]):
        if not self.sc.enable:
            return super().train_step(data_iterator)
        t0 = time.perf_counter()
        if self._pp is not None:
            try:
                self._pp.before_step()
                res = self._step_and_checkpoint(data_iterator)
            except ReplayDivergence:
                raise
            except RuntimeError as exc:  # gloo's errors (DistBackendError), torchrun's SIGTERM: a peer failed
                self._pp.on_peer_failure(exc)
            self._pp.after_step()
        else:
            res = self._step_and_checkpoint(data_iterator)
        self._losses[res.step], self._lrs[res.step] = res.loss, res.lr
        self._step_seconds.append(time.perf_counter() - t0)
        restart_timing.after_step(self.recovery_report, torch.distributed.get_rank(), self._attempt)

    def _step_and_checkpoint(self, data_iterator) -> TitanStepResult:
        if self._watchdog is not None:
            with self._watchdog.watch(f"train_step {self.step}"):
                res = self.sparse_step(data_iterator)
                self.sparse.after_step(res)  # may all-reduce (window commit): watched too
        else:
            res = self.sparse_step(data_iterator)
            self.sparse.after_step(res)
        return res

    def sparse_step(self, data_iterator=None, replay=None) -> TitanStepResult:
        """TorchTitan's ``train_step`` for iteration ``self.step`` (already incremented), optionally replaying
        a logged iteration (batch, RNG state and grad norm from the log). Returns the step's record.

        A copy of ``Trainer.train_step`` as of ``UPSTREAM_TRAIN_STEP`` (torchtitan 0.3.0, with its source digest):
        tests/titan_glue/test_upstream_pin.py fails when the installed TorchTitan's differs
        (titan_integration/upstream_pin.py says what to re-check here)."""
        t_start = time.perf_counter()
        faults.set_iteration(self.step)
        faults.point("forward")
        self.optimizers.zero_grad(set_to_none=self.config.training.disable_cuda_graphs)
        lr_metrics = self.lr_schedulers.get_metrics()
        should_log = replay is None and self.metrics_processor.should_log(self.step)
        parallel_dims = self.parallel_dims

        if replay is None:
            rng_state, device_rng = rng.capture()
            groups: list[tuple[dict[str, torch.Tensor], torch.Tensor]] = []
            for _ in range(self.gradient_accumulation_steps):
                for _ in range(self.num_pipeline_parallel_microbatches):
                    groups.append(next(data_iterator))
            tokens = pack_batches(groups)
        else:
            rng_state, device_rng = replay.rng_state, replay.device_rng
            replay.restore_rng()
            tokens = replay.tokens
            groups = unpack_batches(tokens)

        local_valid_tokens = torch.tensor(0, dtype=torch.int64)
        for _d, labels in groups:
            local_valid_tokens += (labels != IGNORE_INDEX).sum()
        if parallel_dims.dp_enabled:
            global_valid_tokens = dist_utils.dist_sum_tensor(
                local_valid_tokens.to(self.device), parallel_dims.get_mesh("batch")
            )
        else:
            global_valid_tokens = local_valid_tokens.to(self.device)

        accumulated_loss: torch.Tensor | None = None
        faults.point("backward")  # fires before the forward here: TorchTitan runs forward+backward in one call
        per_call = self.num_pipeline_parallel_microbatches if parallel_dims.pp_enabled else 1
        for i in range(0, len(groups), per_call):
            dicts = [
                {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in d.items()}
                for d, _ in groups[i : i + per_call]
            ]
            labels = [lab.to(self.device) for _, lab in groups[i : i + per_call]]
            if self._pp is not None:
                self._pp.before_forward(self.step, dicts[0], labels[0])
            if not parallel_dims.pp_enabled:
                dicts, labels = dicts[0], labels[0]
            loss = self.forward_backward_step(
                input_dict=dicts, labels=labels, global_valid_tokens=global_valid_tokens
            ).detach()
            accumulated_loss = loss.clone() if accumulated_loss is None else accumulated_loss.add_(loss)
        assert accumulated_loss is not None
        if self._pp is not None:  # every stage records the pipeline's loss (only the last stage computes it)
            accumulated_loss = self._pp.pipeline_loss(accumulated_loss, self.step)

        params = [p for m in self.model_parts for p in m.parameters()]
        replayed_norm = None
        if replay is None:
            grad_norm = dist_utils.clip_grad_norm_(
                params,
                self.config.training.max_norm,
                foreach=True,
                pp_mesh=parallel_dims.get_optional_mesh("pp"),
                ep_enabled=parallel_dims.ep_enabled,
            )
        else:
            if not parallel_dims.pp_enabled:  # (a pipeline replays failed stages alone: no norm collective there)
                # The replayed gradients' norm, for the replay check: TorchTitan's own computation, with an infinite
                # bound (the clip coefficient is then exactly 1: the gradients are left bit for bit as they are).
                replayed_norm = dist_utils.clip_grad_norm_(
                    params, float("inf"), foreach=True, ep_enabled=parallel_dims.ep_enabled
                )
            # Frozen operators compute no trustworthy weight gradients: clip with the logged global norm,
            # split exactly like dist_utils.clip_grad_norm_ does.
            grad_norm = replay.grad_norm.to(self.device)
            self._clip_with_norm(params, grad_norm)

        counts = self._expert_counts()
        for hook in self.before_update:
            hook()
        if replay is not None:  # the original iteration's LRs, even if the schedule changed since (extended run)
            replay.apply_lrs(self.optimizers)  # every group of every optimizer, in order
        groups = [g for opt in self.optimizers.optimizers for g in opt.param_groups]
        lr, lrs, hyper = float(groups[0]["lr"]), tuple(float(g["lr"]) for g in groups), group_hyper(groups)
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()  # TorchTitan's expert-bias update runs here, as a step pre-hook
        faults.point("optimizer")  # the update is applied, this iteration's snapshot not yet taken
        self.lr_schedulers.step()
        if self._pp is not None:
            self._pp.after_update(self.step, grad_norm, accumulated_loss)

        if should_log:
            self._log_metrics(accumulated_loss, local_valid_tokens, global_valid_tokens, grad_norm, lr_metrics)
        return TitanStepResult(
            step=self.step,
            loss=accumulated_loss.detach().float().clone(),  # on the device: no host sync here
            grad_norm=grad_norm.detach().float().clone(),
            lr=lr,
            tokens=tokens,
            rng_state=rng_state,
            expert_counts=counts,
            # TorchTitan's router keeps no probability sums (only tokens_per_expert): the soft popularity policy
            # scores by the counts instead, deliberately.
            expert_probs=counts,
            seconds=time.perf_counter() - t_start,
            device_rng=device_rng,
            replayed_grad_norm=None if replayed_norm is None else replayed_norm.detach().float(),
            lrs=lrs,
            hyper=hyper,
        )

    def _clip_with_norm(self, params: list[torch.Tensor], total_norm: torch.Tensor) -> None:
        max_norm = self.config.training.max_norm
        params = [p for p in params if p.grad is not None]
        if self.parallel_dims.ep_enabled:
            ep = [p for p in params if "ep" in (p.device_mesh.mesh_dim_names or ())]
            non_ep = [p for p in params if "ep" not in (p.device_mesh.mesh_dim_names or ())]
            torch.nn.utils.clip_grads_with_norm_(ep, max_norm, total_norm, True)
            torch.nn.utils.clip_grads_with_norm_(non_ep, max_norm, total_norm, True)
        else:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm, True)

    def _log_metrics(self, accumulated_loss, local_valid_tokens, global_valid_tokens, grad_norm, lr_metrics):
        """The metric block of TorchTitan's train_step, unchanged."""
        parallel_dims = self.parallel_dims
        if parallel_dims.dp_cp_enabled:
            loss_mesh = parallel_dims.get_optional_mesh("loss")
            local_avg_loss = accumulated_loss * global_valid_tokens / local_valid_tokens
            global_avg_loss, global_max_loss, global_ntokens_seen = (
                dist_utils.dist_sum(accumulated_loss, loss_mesh),
                dist_utils.dist_max(local_avg_loss, loss_mesh),
                dist_utils.dist_sum(torch.tensor(self.ntokens_seen, dtype=torch.int64, device=self.device), loss_mesh),
            )
        else:
            global_avg_loss = global_max_loss = float(accumulated_loss.item())
            global_ntokens_seen = self.ntokens_seen
        if not math.isfinite(global_avg_loss):
            raise RuntimeError(
                f"Loss is not finite (global_avg_loss={global_avg_loss}) at step {self.step}. Stopping training."
            )
        self.metrics_processor.log(
            self.step,
            global_avg_loss,
            global_max_loss,
            float(grad_norm.item()),
            extra_metrics={"n_tokens_seen": global_ntokens_seen, **lr_metrics},
        )

    # ---- data ---------------------------------------------------------------------------------------
    def batch_generator(self, data_iterable):
        # A recovery that already read batches from the data loader hands over its iterator: TorchTitan's
        # datasets keep their position, so a second iterator would not start from the beginning.
        it = self._resume_iter if self._resume_iter is not None else iter(data_iterable)
        self._resume_iter = None
        skip, self._skip_batches = self._skip_batches, 0
        for _ in range(skip):  # resume after recovery: the replayed iterations' batches came from the log
            try:
                next(it)
            except StopIteration as ex:
                raise DataloaderExhaustedError() from ex
        yield from super().batch_generator(it)

    # ---- run ----------------------------------------------------------------------------------------
    def train(self):
        if not self.sc.enable:
            return super().train()

        sc = self.sc
        if sc.hang_timeout_s:
            self._watchdog = CollectiveWatchdog(timeout_s=float(sc.hang_timeout_s))
        check_replay_check(sc.replay_check, self.device)  # "exact" on CUDA needs deterministic kernels
        # The optimizer state slots are laid out on and loaded into, as the first step would make it (bf16 moments
        # under "fused_opt_states_bf16"), before the identity records its layout and before any recovery.
        init_titan_optimizer_state(self.optimizers, self.config.optimizer.implementation)
        # Recovery issues collectives too (the run lock, the window agreement, peer pulls, the replay): a peer
        # frozen there ends the attempt like one frozen in a training step.
        watched = self._watchdog.watch("recovery") if self._watchdog is not None else contextlib.nullcontext()
        with watched:
            self._start()
        restart_timing.mark("recovered")
        try:
            super().train()
            self.sparse.close(upload_timeout_s=sc.exit_wait_s)  # a bounded wait for the store, the exit summary
            self._export()
        finally:
            self.sparse.stop()  # after an error: the threads end, nothing collective (a no-op once closed)

    def _start(self) -> None:
        """The library's start-up sequence (torchmoe_ckpt.startup): identity, tiers, recovery, the checkpointer.
        Under pipeline parallelism the recovery is the pipeline's (titan_pipeline_recovery): windows are planned
        per stage, retention and bandwidth agreed over the whole pipeline."""
        sc, c = self.sc, self.config
        try:  # the override path (a stock Trainer) skips the launcher's check
            check_tensor_parallel_job(c, sc, torch.distributed.get_world_size())
        except JobConfigError as exc:
            raise ValueError(str(exc)) from None
        if self.parallel_dims.pp_enabled:
            self._pp = TitanPipeline(self)
            if self._watchdog is not None:  # a peer's death is the pipeline's business (live state, then exit);
                self._watchdog.exit_on_dist_error = False  # the watchdog still ends a rank stuck in a hang
        replayable = TitanReplayable(self)
        pp = self._pp

        def recover_pipeline(tiers, _identity):
            first_window = pp.recover(tiers.host, self._attempt)
            return ResumeResult(None, pp.completed or None, pp.report, next_window_id=first_window), replayable

        # Tests scramble the live weights once a window is found: what recovery forgets shows up as a mismatch.
        scramble = (lambda _w: self._scramble()) if os.environ.get("TORCHMOE_TITAN_SCRAMBLE") == "1" else None
        started = start(
            replayable,
            self.compute_dtype,
            sc.core_config(),
            sc.tiers_config(),
            identity=IdentityParts(
                # the data identity: the dataset and seed of the job file
                data=f"dataset={getattr(c.training, 'dataset', None)} seed={getattr(c.debug, 'seed', None)}",
                steps=c.training.steps,
                hsdp_replicate=c.parallelism.data_parallel_replicate_degree,
            ),
            recovery=RecoveryOptions(
                on_unusable=self.sc.on_unusable_checkpoint, replay_check=sc.replay_policy(), before_replay=scramble
            ),
            hooks=StartupHooks(recover_with=recover_pipeline if pp is not None else None),
            groups=PlanningGroups(
                group=pp.stage_group if pp is not None else None,
                agree_group=None,  # every rank (under pipeline parallelism: every stage)
                sum_counts=pp is None,  # _expert_counts are this rank's (a stage plans alone)
            ),
        )
        self.sparse = started.checkpointer.attach(self)
        if pp is not None:
            self.recovery_report = pp.report
            if pp.completed:
                self.checkpointer.restored_step = pp.completed
            return
        res = started.resumed
        if res.window is None:
            if self._attempt > 0:
                logger.warning("torchmoe: no committed window on any tier; starting from scratch")
                self.recovery_report = dict(res.report, cold_start=True, recovered_step=0, attempt=self._attempt)
            return
        outcome, step = res.outcome, res.recovered_step  # read typed; the report is their JSON view
        assert outcome is not None and step is not None  # a window recovered from the tiers (`recover`)
        rep = dict(res.report, attempt=self._attempt, restart_seconds=outcome.total_seconds)
        self._skip_batches = step * self.gradient_accumulation_steps * self.num_pipeline_parallel_microbatches
        self.recovery_report = rep
        # newer than any TorchTitan checkpoint: its load is skipped
        self.checkpointer.restored_step = step

    @torch.no_grad()
    def _scramble(self) -> None:
        g = torch.Generator().manual_seed(12345 + torch.distributed.get_rank())
        for p in self.model.parameters():
            loc = p.to_local() if hasattr(p, "to_local") else p
            loc.copy_(torch.randn(loc.shape, generator=g, dtype=loc.dtype))

    # ---- export (tests, diagnostics) -------------------------------------------------------------------
    def export_state(self) -> dict[str, torch.Tensor]:
        return state_tensors(self.model, OptimizerView(self.optimizers), self.step)

    def _export(self) -> None:
        write_export(self)  # only with $TORCHMOE_TITAN_EXPORT (titan_state_export.py)
