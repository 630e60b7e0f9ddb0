"""The harness's pipeline stage trainer: TinyMoE cut into stages, trained with an explicit GPipe/1F1B
schedule over the library's stage I/O (`torchmoe_ckpt.pipeline.stage_io`), and replayable by localized recovery
(`torchmoe_ckpt.pipeline.recovery`, through its `StageReplayable` protocol).

Per iteration on every stage: the micro-batch forwards/backwards of the schedule, then one all-reduce
over the stages of [local grad-norm^2, loss] (global clipping norm and the loss, known to every stage and
logged by every stage), clipping, the expert-bias update of this stage's MoE layers, the optimizer step.
In replay the all-reduce is skipped: the norm comes from the log (frozen operators compute no
trustworthy weight gradient, so it could not be recomputed anyway).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchmoe_ckpt.model.coverage import position_lambda_lr
from torchmoe_ckpt.pipeline.boundary_log import BoundaryLog
from torchmoe_ckpt.pipeline.stage_io import SCHEDULES, Peer, StageIO, actions, boundary_tag
from torchmoe_ckpt.recovery.sparse_to_dense import ReplayDivergence, init_optimizer_state
from torchmoe_ckpt.runtime import faults
from torchmoe_harness.data import TokenStream
from torchmoe_harness.model import TinyMoE
from torchmoe_harness.trainer import DTYPES, RunConfig, training_state


@dataclass
class PipelineConfig:
    stages: int = 2
    microbatches: int = 2
    schedule: str = "1f1b"
    layers_per_stage: list[int] | None = None  # None: as even as possible, earlier stages get the extra
    log_max_bytes: int | None = None  # bound on each stage's boundary log (None: unbounded)

    def validate(self, run: RunConfig) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"pipeline schedule {self.schedule!r} is not one of {SCHEDULES} (Interleaved1F1B is "
                f"not supported: use 1f1b)"
            )
        if self.stages < 2:
            raise ValueError(f"pipeline stages must be >= 2, got {self.stages}; use the FSDP harness for one stage")
        if run.batch_size % self.microbatches:
            raise ValueError(f"batch_size {run.batch_size} must be divisible by microbatches {self.microbatches}")
        if run.dtype != "fp32":
            raise ValueError(f"pipeline runs support dtype fp32 only, got {run.dtype!r}: set run.dtype='fp32'")
        split = self.split(run.model.n_layers)
        if len(split) != self.stages or sum(split) != run.model.n_layers or min(split) < 1:
            raise ValueError(
                f"layers_per_stage {split} must give each of the {self.stages} stages >= 1 of the "
                f"{run.model.n_layers} layers: set model.n_layers >= stages or fix layers_per_stage"
            )

    def split(self, n_layers: int) -> list[int]:
        if self.layers_per_stage is not None:
            return list(self.layers_per_stage)
        q, r = divmod(n_layers, self.stages)
        return [q + (1 if s < r else 0) for s in range(self.stages)]


def build_stage(cfg: RunConfig, pp: PipelineConfig, stage: int, init_seed: int | None = None) -> TinyMoE:
    """The whole TinyMoE initialised exactly as the unsplit model, then cut to this stage's modules (fqns
    unchanged, so operator discovery and checkpoints name parameters as in the full model)."""
    torch.manual_seed(cfg.seed)
    model = TinyMoE(cfg.model)
    model.init_weights(cfg.seed if init_seed is None else init_seed)
    split = pp.split(cfg.model.n_layers)
    first = sum(split[:stage])
    mine = set(range(first, first + split[stage]))
    for i in range(cfg.model.n_layers):
        if i not in mine:
            del model.layers[str(i)]
    if stage != 0:
        model.tok_embeddings = None
    if stage != pp.stages - 1:
        model.norm = None
        model.output = None
    return model


def stage_forward(model: TinyMoE, x: torch.Tensor) -> torch.Tensor:
    h = model.tok_embeddings(x) if model.tok_embeddings is not None else x
    for layer in model.layers.values():
        h = layer(h)
    return model.output(model.norm(h)) if model.output is not None else h


@dataclass
class StageStep:
    """One iteration's result on one stage (the fields SparseCheckpointer.after_step reads, and more)."""

    step: int
    loss: torch.Tensor  # replay check value: the loss on the last stage, a float64 output sum elsewhere
    grad_norm: torch.Tensor  # global norm before clipping (fp32 scalar)
    lr: float
    tokens: torch.Tensor
    rng_state: torch.Tensor
    expert_counts: torch.Tensor
    expert_probs: torch.Tensor
    global_loss: torch.Tensor  # the training loss of the iteration (fp32 scalar)
    seconds: float = 0.0
    replayed: bool = False


class StageTrainer:
    """One pipeline stage (one rank, DP=1): the same optimizer, LR schedule and bias update as the
    harness Trainer; satisfies `torchmoe_ckpt.pipeline.stage_io.StageReplayable` (what localized recovery needs)."""

    def __init__(
        self,
        cfg: RunConfig,
        pp: PipelineConfig,
        stage: int,
        log: BoundaryLog | None,
        init_seed: int | None = None,
        stage_ranks: list[int] | None = None,
    ):
        pp.validate(cfg)
        self.cfg, self.pp, self.stage, self.n_stages = cfg, pp, stage, pp.stages
        self.ranks = stage_ranks or list(range(pp.stages))
        self.rank = self.ranks[stage]
        self.compute_dtype = DTYPES[cfg.dtype]
        self.model = build_stage(cfg, pp, stage, init_seed)
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay, foreach=False
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.stream = TokenStream(cfg.model.vocab_size, cfg.seq_len, cfg.batch_size, seed=cfg.seed)
        self.step = 0
        self.log = log
        self.before_update: list[Callable[[], None]] = []
        self.layer_ids = [int(k) for k in self.model.layers.keys()]
        self.first, self.last = stage == 0, stage == pp.stages - 1
        self.live_io = StageIO(
            None if self.first else Peer(self.ranks[stage - 1]), None if self.last else Peer(self.ranks[stage + 1])
        )
        self.replay_io: StageIO | None = None  # set by recovery for the replay of this stage
        self.replayed_iterations = 0  # the recomputation counter

    def _lr_factor(self, it: int) -> float:
        warm = max(1, self.cfg.warmup)
        if it < warm:
            return (it + 1) / warm
        return max(0.1, 1.0 - (it - warm) / max(1, 4 * self.cfg.steps))

    # ---- one iteration -------------------------------------------------------------------------------
    def train_step(self, replay=None) -> StageStep:
        """A live iteration with the neighbours, or (replay given) a replay with `self.replay_io`."""
        t_start = time.perf_counter()
        step = self.step + 1
        faults.set_iteration(step)
        io = self.live_io if replay is None else self.replay_io
        if io is None:
            raise RuntimeError("replay needs replay_io (the neighbours' logs); set it before replaying")
        tokens = self.batch(step) if replay is None else replay.tokens
        rng_state = torch.get_rng_state() if replay is None else replay.rng_state
        if replay is not None:
            torch.set_rng_state(rng_state)
        faults.point("forward")
        m = self.pp.microbatches
        mb_tokens = tokens.chunk(m, dim=0)
        b, s, d = tokens.shape[0] // m, tokens.shape[1] - 1, self.cfg.model.dim
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        loss = torch.zeros((), dtype=torch.float32)
        check = torch.zeros((), dtype=torch.float64)
        order = actions(self.pp.schedule if replay is None else "gpipe", self.stage, self.pp.stages, m)
        for kind, mb in order:
            if kind == "F":
                x = self._recv_fwd(io, step, mb, (b, s, d), mb_tokens[mb])
                inputs[mb] = x
                out = stage_forward(self.model, x)
                if self.last:
                    ce = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), mb_tokens[mb][:, 1:].reshape(-1))
                    outputs[mb] = ce / m
                    loss = loss + outputs[mb].detach()
                else:
                    outputs[mb] = out
                    check = check + out.detach().double().sum()
                    self._send(io.down, step, mb, out.detach(), "fwd")
            else:
                if mb == 0:
                    faults.point("backward")
                if self.last:
                    outputs.pop(mb).backward()
                else:
                    outputs.pop(mb).backward(self._recv_bwd(io, step, mb, (b, s, d)))
                x = inputs.pop(mb)
                if not self.first:
                    self._send(io.up, step, mb, x.grad, "bwd")
        for p in (io.up, io.down):
            if isinstance(p, Peer):
                p.finish()
        if self.last:
            check = loss.double()
        grads = [p.grad for p in self.params if p.grad is not None]
        local = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if replay is None:
            red = torch.stack([local.float() ** 2, loss if self.last else torch.zeros((), dtype=torch.float32)])
            dist.all_reduce(red)
            norm, global_loss = red[0].sqrt(), red[1].clone()
        else:
            norm = replay.grad_norm
            global_loss = loss if self.last else torch.zeros((), dtype=torch.float32)
            if io.reduce_loss:
                global_loss = global_loss.clone()
                dist.all_reduce(global_loss)
            if io.meta is not None:
                meta = io.meta.meta(step)
                global_loss = meta["loss"]
                if self.last and not torch.equal(loss, meta["loss"]):
                    raise ReplayDivergence(
                        f"stage {self.stage} replay of iteration {step} gave loss {loss.item()!r}, "
                        f"the neighbour logged {meta['loss'].item()!r}"
                    )
        torch.nn.utils.clip_grads_with_norm_(self.params, self.cfg.max_norm, norm)
        for hook in self.before_update:
            hook()
        counts, probs = self._update_expert_bias()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        faults.point("optimizer")
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step = step
        if self.log is not None:
            self.log.record_meta(step, norm, global_loss)
        if replay is not None:
            self.replayed_iterations += 1
        return StageStep(
            step,
            check,
            norm.detach().clone(),
            lr,
            tokens,
            rng_state,
            counts,
            probs,
            global_loss.detach().clone(),
            time.perf_counter() - t_start,
            replay is not None,
        )

    def _recv_fwd(self, io: StageIO, it: int, mb: int, shape, mb_tokens: torch.Tensor) -> torch.Tensor:
        if self.first:
            return mb_tokens[:, :-1]
        if isinstance(io.up, Peer):
            x = io.up.recv(shape, torch.float32, boundary_tag(it, mb, False))
        else:
            x = io.up.fetch(it, mb).clone()
        return x.requires_grad_(True)

    def _recv_bwd(self, io: StageIO, it: int, mb: int, shape) -> torch.Tensor:
        if isinstance(io.down, Peer):
            return io.down.recv(shape, torch.float32, boundary_tag(it, mb, True))
        return io.down.fetch(it, mb).clone()

    def _send(self, to, it: int, mb: int, t: torch.Tensor, direction: str) -> None:
        if isinstance(to, Peer):
            to.send(t, boundary_tag(it, mb, direction == "bwd"))
        if self.log is not None:
            self.log.record(it, mb, direction, t)  # on the sender, for every send (live or replayed)

    @torch.no_grad()
    def _update_expert_bias(self) -> tuple[torch.Tensor, torch.Tensor]:
        """TorchTitan's aux-loss-free balancing on this stage's layers (DP=1: the counts are global)."""
        e = self.cfg.model.num_experts
        rows = len(self.layer_ids)  # this stage's MoE layers in order (operators.expert_grid numbers them so)
        counts, probs = torch.zeros(rows, e, dtype=torch.float32), torch.zeros(rows, e, dtype=torch.float32)
        for i, m in enumerate(self.model.moe_layers()):
            counts[i], probs[i] = m.tokens_per_expert_E, m.router_prob_E
            if m.expert_bias_E is not None and m.load_balance_coeff:
                delta = m.load_balance_coeff * torch.sign(m.tokens_per_expert_E.mean() - m.tokens_per_expert_E)
                m.expert_bias_E.add_(delta - delta.mean())
            m.tokens_per_expert_E.zero_()
            m.router_prob_E.zero_()
        return counts, probs

    def reset_iteration(self) -> None:
        """Undo what an aborted iteration left behind (gradients, routed-token counters): the state is
        then exactly the state after iteration `self.step`."""
        self.optimizer.zero_grad(set_to_none=True)
        for m in self.model.moe_layers():
            m.tokens_per_expert_E.zero_()
            m.router_prob_E.zero_()
        for p in (self.live_io.up, self.live_io.down):
            if isinstance(p, Peer):
                p.pending.clear()  # sends of the aborted iteration: their peer is gone

    # ---- state access (same contract as torchmoe_harness.trainer.Trainer) ----------------------------
    def batch(self, step: int) -> torch.Tensor:
        """The token batch of iteration `step` (deterministic: the same on every attempt)."""
        return self.stream.batch(step, 0)

    def set_step(self, step: int) -> None:
        self.step = step
        position_lambda_lr(self.scheduler, step)

    def export_state(self) -> dict[str, torch.Tensor]:
        return training_state(self.model, self.optimizer, self.step)

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Inverse of export_state (a healthy stage resuming its live state after a worker restart)."""
        init_optimizer_state(self.optimizer)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(state[f"param/{name}"])
                st = self.optimizer.state[p]
                for key in ("step", "exp_avg", "exp_avg_sq"):
                    st[key].copy_(state[f"optim/{name}/{key}"])
            for name, b in self.model.named_buffers():
                if f"buffer/{name}" in state:
                    b.copy_(state[f"buffer/{name}"])
        self.set_step(int(state["step"]))
        if not torch.equal(torch.tensor(self.optimizer.param_groups[0]["lr"], dtype=torch.float64), state["lr"]):
            raise RuntimeError(f"stage {self.stage}: LR after set_step({self.step}) differs from the saved LR")
