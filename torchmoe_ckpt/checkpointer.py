"""`Checkpointer`: per-iteration sparse checkpointing and exact recovery for your own training loop (the
package docstring shows the loop).

The library owns what replay needs (RNG state, batch, gradient norm and clipping, the optimizer and scheduler
steps, the step counter); the step function only computes the loss and calls backward. On a GPU an iteration
adds no host synchronisation (docs/gpu.md). `optimizer` may be a list (with a list of schedulers).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from .config import CheckpointConfig
from .core.errors import ConfigError
from .model.coverage import SchedulerPosition, check_coverage, infer_compute_dtype
from .model.identity import RunIdentity, TorchSeed, torch_seed
from .model.operators import discover_operators, local_tensor
from .model.optim_state import as_optimizers, attach_optimizer_state, check_optimizer_state, check_optimizers
from .model.routing import RouterCounter
from .persist.build_tiers import Tiers
from .recovery import rng
from .recovery.replay_check import check_replay_check
from .recovery.replay_log import Replay, group_hyper
from .recovery.resume import RecoveryOptions, ResumeResult
from .recovery.sparse_to_dense import ReplayDivergence
from .runtime import faults
from .runtime.device_copy import host_copy
from .runtime.distributed import refusal_notes_restarts
from .runtime.watchdog import CollectiveWatchdog
from .sparse_checkpointer import PlanningGroups, SparseCheckpointer
from .startup import IdentityParts, start

log = logging.getLogger("torchmoe_ckpt.checkpointer")

__all__ = ["Checkpointer", "StepResult"]


@dataclass
class StepResult:
    """One iteration as the checkpointer logs it (also what `SparseCheckpointer.after_step` reads)."""

    step: int
    loss: torch.Tensor  # this rank's loss, detached
    grad_norm: torch.Tensor  # global gradient norm before clipping (zero when clipping is off)
    lr: float
    lrs: tuple[float, ...]
    tokens: Any  # the batch (host copies)
    rng_state: torch.Tensor
    expert_counts: torch.Tensor  # [MoE layers, experts], this rank's routed tokens (summed by SparseCheckpointer)
    expert_probs: torch.Tensor
    seconds: float
    device_rng: dict | None = None  # device generators' states (rng.py)
    replayed_grad_norm: torch.Tensor | None = None  # replay only: the norm the replayed gradients have
    hyper: tuple[dict, ...] = ()  # every param group's other hyper-parameters (replay_log.group_hyper)


class Checkpointer:
    """Owns the sparse checkpointer, its storage tiers and the training step. Use `with Checkpointer(...)` or
    call `close()` at the end (flushes the host tier and uploads, stops the threads)."""

    @refusal_notes_restarts  # under torchrun a refusal repeats --max-restarts times: it says so
    def __init__(  # noqa: PLR0913 (the public signature of tmc.Checkpointer, as README and docs/api.md show it)
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
        forward_backward: Callable[[Any], torch.Tensor],
        scheduler=None,
        config: CheckpointConfig | None = None,
        group: dist.ProcessGroup | None = None,
        data_identity: str | None = None,
        seed: int | None | str = "auto",
    ):
        """Check the model, optimizer and config up front; nothing is written and no thread starts until `resume()`.

        Args:
            model: the model to checkpoint (plain, FSDP2 or HSDP).
            optimizer: one, or a list holding every trainable parameter once.
            forward_backward: `forward_backward(batch)` runs forward and `loss.backward()` and returns the loss;
                nothing else (no optimizer or scheduler step, clipping or zeroing).
            scheduler: one, a list, or None.
            config: `CheckpointConfig` (None: defaults).
            group: the ranks that plan windows together (None: every rank).
            data_identity: the data order; part of the run identity.
            seed: "auto": the seed the user gave `torch.manual_seed`, before or after importing this package,
                recognised at `resume()`; an int; None: left out. Part of the run identity.

        Raises:
            ConfigError: a bad argument or config (the message names the field and the fix).
        """
        self.config = config or CheckpointConfig()
        if not callable(forward_backward):
            raise ConfigError("forward_backward must be a function batch -> loss that also calls loss.backward()")
        # Several optimizers are stepped, captured and replayed as one (`Optimizers`: torch.optim.Optimizer-like,
        # param_groups, state, step, zero_grad).
        optim = cast(torch.optim.Optimizer, as_optimizers(optimizer))
        check_optimizers(model, optim)  # before discovery: a refused optimizer is named as such
        self.schedule = SchedulerPosition(optim, scheduler)
        self.model, self.optimizer, self.scheduler = model, optim, scheduler
        self.forward_backward, self.group = forward_backward, group
        self.data_identity = data_identity
        if seed != "auto" and seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ConfigError(f'seed must be "auto", an integer or None, got {seed!r}')
        # Read now: recovery restores RNG states, which changes torch.initial_seed().
        self.seed: int | None | TorchSeed = torch_seed() if seed == "auto" else seed
        self.compute_dtype = self.config.compute_dtype or infer_compute_dtype(model)
        self.ops = discover_operators(model, self.config.operators, optim)  # as fine as the optimizer allows
        self.op_by_name = {o.name: o for o in self.ops}
        check_coverage(model, self.ops)
        # What slots hold of each operator's optimizer state; it creates the state every parameter needs from the
        # start (even before its first gradient). Once: recover() and SparseCheckpointer find it done.
        attach_optimizer_state(model, self.ops, optim, checked=True)
        self.params = list(model.parameters())
        self.device = local_tensor(self.params[0]).device if self.params else torch.device("cpu")
        check_replay_check(self.config.replay_check, self.device)  # "exact" on CUDA needs deterministic kernels
        self.routers = RouterCounter(model, self.ops, top_k=self.config.router_top_k)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.step_count = 0
        self.identity: RunIdentity | None = None
        self.tiers: Tiers | None = None
        self.sparse: SparseCheckpointer | None = None
        self.resumed: ResumeResult | None = None
        self._checked_state = False
        self._closed = False
        # Hangs end the process (exit 124) instead of waiting out the process group's timeout; only with peers.
        on = self.world > 1 and self.config.hang_timeout_s is not None
        self.watchdog = CollectiveWatchdog(self.config.hang_timeout_s if on else None, rank=self.rank)
        self._start_timeout_s = self.config.hang_start_timeout_s or self.config.hang_timeout_s

    def resume(self) -> int:
        """Recover the newest window any tier holds. Collective; call once, before the first `step`.

        Returns:
            The number of completed iterations to continue after (0: a new run).

        Raises:
            RuntimeError: called twice.
            IdentityMismatch: every window there belongs to another run.
            UnusableCheckpointError: windows exist but every one was rejected (`on_unusable_checkpoint="fail"`).
        """
        if self.sparse is not None:
            raise RuntimeError("resume() was already called: call it once, before the first step()")
        with self.watchdog.watch("resume", self._start_timeout_s):  # a peer frozen in recovery ends it too
            cfg = self.config
            started = start(
                _Replay(self),
                self.compute_dtype,
                cfg.window,
                cfg.tiers,
                ops=self.ops,
                identity=IdentityParts(data=self.data_identity, seed=self.seed),
                recovery=RecoveryOptions(on_unusable=cfg.on_unusable_checkpoint, replay_check=cfg.replay_policy()),
                # the routed-token counts of _iteration are this rank's
                groups=PlanningGroups(group=self.group, sum_counts=True),
            )
            self.identity, self.tiers, self.resumed = started.identity, started.tiers, started.resumed
            self.sparse = started.checkpointer
            if self.resumed is not None:  # handed over: the SparseCheckpointer lets it go at its next commit
                self.resumed.window = None  # (the report stays; a whole window held all run is host memory)
            return self.step_count

    def step(self, batch: Any) -> torch.Tensor:
        """One training iteration on `batch`, checkpointed.

        Args:
            batch: what `forward_backward` takes (logged for the replay).

        Returns:
            This rank's loss (detached).
        """
        if self.sparse is None:
            raise RuntimeError(
                "call ckpt.resume() once before the first step(): it recovers a previous attempt "
                "and returns the step to continue from"
            )
        if self._closed:
            raise RuntimeError("step() after close(): the checkpointer's threads are stopped")
        first = not self._checked_state
        with self.watchdog.watch(f"step {self.step_count + 1}", self._start_timeout_s if first else None):
            res = self._iteration(batch, None)
            if first:
                check_optimizer_state(self.model, self.optimizer, self.ops)
                self._checked_state = True
            self.sparse.after_step(res)
        return res.loss

    def stats(self) -> dict:
        out = self.sparse.stats() if self.sparse is not None else {}
        out["recovery"] = self.resumed.report if self.resumed is not None else None
        return out

    def close(self, upload_timeout_s: float | None = None) -> None:
        """Flush to the host tier, wait for the object store, log the exit summary and stop the threads. Idempotent.

        Args:
            upload_timeout_s: how long pending uploads may take (default: the object store's `exit_wait_s`).
        """
        sp = self.sparse
        if sp is None or self._closed:
            self.routers.close()
            self.watchdog.close()
            return
        self._closed = True
        store_cfg = self.config.tiers.object_store if self.config.tiers is not None else None
        if upload_timeout_s is None:
            upload_timeout_s = store_cfg.exit_wait_s if store_cfg is not None else 30.0
        try:
            with self.watchdog.watch("close", (self._start_timeout_s or 0) + upload_timeout_s):
                sp.close(upload_timeout_s)
        finally:
            sp.stop()  # after an error in close: the threads end all the same
            self.routers.close()
            self.watchdog.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _iteration(self, batch: Any, replay: Replay | None) -> StepResult:
        t_start = time.perf_counter()
        step = self.step_count + 1
        faults.set_iteration(step)
        faults.point("forward")
        if replay is None:
            rng_state, device_rng = rng.capture()
            # the caller may reuse its batch buffers: keep our own copy (on the copy stream: reads_on_copy_stream)
            logged = (
                host_copy(batch, clone_cpu=True)
                if self.sparse is None
                else self.sparse.engine.reads.copy(batch, clone_cpu=True)
            )
        else:
            logged, rng_state, device_rng = replay.tokens, replay.rng_state, replay.device_rng
            batch = tree_map(lambda x: x.to(self.device) if torch.is_tensor(x) else x, logged)  # where training had it
            replay.restore_rng()
        loss = self.forward_backward(batch)
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise TypeError(f"forward_backward must return the loss as a one-element tensor, got {type(loss).__name__}")
        faults.point("backward")  # here after backward (it runs inside forward_backward), before the norm's collective
        if replay is None and not self._checked_state:
            _check_gradients(self.params)  # the first step: a step function without backward would train nothing
        replayed_norm = self._grad_norm(None) if replay is not None and self.config.max_grad_norm else None
        norm = self._grad_norm(replay)
        if self.config.max_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(self.params, self.config.max_grad_norm, norm)
        if self.sparse is not None:
            self.sparse.before_update()  # the next update overwrites what the in-flight copy reads
        counts, probs = self.routers.take()  # this rank's, where the routers ran (summed at the next window start)
        if counts.numel() == 0:
            counts, probs = torch.zeros(1, 1, dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64)
        if replay is not None:
            replay.apply_lrs(self.optimizer)
        lrs = tuple(float(g["lr"]) for g in self.optimizer.param_groups)
        hyper = group_hyper(self.optimizer.param_groups)
        self.optimizer.step()
        faults.point("optimizer")
        for sched in self.schedule.schedulers:
            sched.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count = step
        loss, norm, seconds = loss.detach().clone(), norm.detach().clone(), time.perf_counter() - t_start
        return StepResult(
            step=step,
            loss=loss,
            grad_norm=norm,
            lr=lrs[0],
            lrs=lrs,
            tokens=logged,
            rng_state=rng_state,
            expert_counts=counts,
            expert_probs=probs,
            seconds=seconds,
            device_rng=device_rng,
            replayed_grad_norm=replayed_norm,
            hyper=hyper,
        )

    def _grad_norm(self, replay: Replay | None) -> torch.Tensor:
        if replay is not None:
            return replay.grad_norm  # frozen operators compute no trustworthy weight gradients: use the log
        if self.config.max_grad_norm is None:
            return torch.zeros((), dtype=torch.float32)
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _check_gradients(params: list[nn.Parameter]) -> None:
    """Refuse a step function that never called `loss.backward()`: the optimizer would step on no gradient, every
    iteration, and the run would train nothing without a word. Read on the first step only (attributes, no sync)."""
    trained = [p for p in params if p.requires_grad]
    if trained and all(p.grad is None for p in trained):
        raise ConfigError(
            "forward_backward(batch) returned its loss but no gradient reached any parameter: call loss.backward() "
            "inside it before returning the loss (the checkpointer steps the optimizer; it does not call backward)"
        )


class _Replay:
    """The `Replayable` view recovery drives: the same iteration, fed from the window's log."""

    def __init__(self, ck: Checkpointer):
        self.ck, self.model, self.optimizer = ck, ck.model, ck.optimizer

    def set_step(self, step: int) -> None:
        self.ck.step_count = step
        self.ck.schedule.seek(step)

    def train_step(self, replay: Replay | None = None) -> StepResult:
        if replay is None:
            raise ReplayDivergence("recovery replays logged iterations only")
        return self.ck._iteration(None, replay)
