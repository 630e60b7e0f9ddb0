"""The harness trainer: one deterministic training iteration, usable for normal steps and for replay.

Replay runs the very same code path with the logged batch, RNG state and global gradient norm, so a
replayed iteration is bit-identical to the original one on CPU (and on a GPU with deterministic kernels).
The model, its batches and its collectives live on `RunConfig.device`: CPU + gloo, or CUDA + NCCL."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torchmoe_ckpt.model.coverage import position_lambda_lr
from torchmoe_ckpt.model.optim_state import Optimizers
from torchmoe_ckpt.recovery import rng
from torchmoe_ckpt.recovery.replay_log import Replay, group_hyper
from torchmoe_ckpt.runtime import faults
from torchmoe_harness.data import TokenStream
from torchmoe_harness.model import TinyMoE, TinyMoEConfig
from torchmoe_harness.optimizers import KINDS, build_optimizers
from torchmoe_harness.parallel import apply_expert_parallel, apply_fsdp, build_mesh

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class RunConfig:
    model: TinyMoEConfig = field(default_factory=TinyMoEConfig)
    steps: int = 12
    batch_size: int = 2
    seq_len: int = 16
    seed: int = 0
    lr: float = 3e-3
    warmup: int = 3
    weight_decay: float = 0.1
    max_norm: float = 0.5  # small enough that clipping is active on most steps
    dtype: str = "fp32"
    hsdp: int = 1  # replicate degree; 1 = plain FSDP2
    # Experts owned whole by one rank each, tokens sent to them (parallel.apply_expert_parallel); the rest FSDP2.
    expert_parallel: bool = False
    # AdamW implementation: "single" (per-tensor loop, the default everywhere), "foreach" or "fused" (one pass
    # over param, grad and moments, TorchTitan's default; the MoE-regime bench uses it).
    optimizer: str = "single"
    # Where the model trains: "cpu", "cuda" (this rank's GPU: LOCAL_RANK), or None: CUDA when available, else CPU.
    device: str | None = None
    # Which optimizers (torchmoe_harness.optimizers.KINDS): "adamw" (the default, with `optimizer` above as its
    # implementation), "amsgrad", "sgd", "muon-adamw" (Muon on the 2-D matrices, AdamW on the rest),
    # "adafactor-adamw". "adamw-bf16" is priced by the bench but not trained here (CPU AdamW: one dtype).
    optimizer_kind: str = "adamw"
    # Replay: experts still FROZEN (Replay.frozen) compute no weight gradient (cheaper replay: forward and input
    # gradients only). The replay check then compares the losses only: the replayed gradient norm lacks the
    # skipped slices, so it is not reported for those iterations.
    replay_skips_frozen: bool = False
    # Accumulated micro-batches per step, each of `batch_size` rows (the step's batch is micro_batches x batch_size
    # rows): a longer step on the same model, the GPU check's representative regime (docs/gpu.md).
    micro_batches: int = 1

    def __post_init__(self):
        if isinstance(self.model, dict):
            self.model = TinyMoEConfig(**self.model)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.seq_len > self.model.max_seq_len:
            raise ValueError(f"seq_len {self.seq_len} exceeds model max_seq_len {self.model.max_seq_len}")
        if self.optimizer not in ("single", "foreach", "fused"):
            raise ValueError(
                f"optimizer {self.optimizer!r}: use 'single', 'foreach' or 'fused' (AdamW implementations)"
            )
        if self.optimizer_kind not in KINDS or self.optimizer_kind == "adamw-bf16":
            trainable = ", ".join(k for k in KINDS if k != "adamw-bf16")
            raise ValueError(
                f"optimizer_kind {self.optimizer_kind!r}: use one of {trainable} "
                "(adamw-bf16 needs torch's CUDA AdamW: on CPU it steps one dtype, fp32 parameters with bf16 states "
                "fail in its kernels)"
            )
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ValueError(f"micro_batches must be a whole number >= 1, got {self.micro_batches!r}")
        if self.expert_parallel and self.hsdp != 1:
            raise ValueError(f"expert_parallel supports plain FSDP2 only (hsdp = 1), not hsdp = {self.hsdp}")
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"device {self.device!r}: use 'cpu', 'cuda' or None (CUDA when available)")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' but this machine has no CUDA device: use device 'cpu' or None")

    def torch_device(self) -> torch.device:
        """This rank's device: the current CUDA device (init_process_group set it from LOCAL_RANK), or the CPU."""
        kind = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class StepResult:
    step: int
    loss: torch.Tensor  # this rank's loss (fp32 scalar)
    grad_norm: torch.Tensor  # global norm before clipping (fp32 scalar)
    lr: float
    tokens: torch.Tensor  # the batch this rank trained on
    rng_state: torch.Tensor
    expert_counts: torch.Tensor  # [layers, experts] routed tokens, summed over all ranks
    expert_probs: torch.Tensor  # [layers, experts] summed gating probabilities, over all ranks
    seconds: float = 0.0
    device_rng: dict | None = None  # device generators' states (torchmoe_ckpt.recovery.rng)
    replayed_grad_norm: torch.Tensor | None = None  # replay only: the norm of the replayed gradients
    lrs: tuple[float, ...] = ()  # every param group's LR (all optimizers)
    hyper: tuple[dict, ...] = ()  # every param group's other hyper-parameters (replay_log.group_hyper)


class Trainer:
    def __init__(self, cfg: RunConfig, init_seed: int | None = None):
        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.compute_dtype = DTYPES[cfg.dtype]
        self.device = cfg.torch_device()
        self.mesh = build_mesh(self.world, cfg.hsdp, self.device.type)
        torch.manual_seed(cfg.seed)
        model = TinyMoE(cfg.model)
        model.init_weights(cfg.seed if init_seed is None else init_seed)  # on the CPU: the same on any device
        model.to(self.device)
        ignored = apply_expert_parallel(model, self.mesh, self.compute_dtype) if cfg.expert_parallel else None
        apply_fsdp(model, self.mesh, self.compute_dtype, ignored)
        self.model = model
        self.params = [p for p in model.parameters()]
        if cfg.optimizer_kind == "adamw":
            impl = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[cfg.optimizer]
            self.optimizer = torch.optim.AdamW(
                self.params, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay, **impl
            )
            self.schedulers = [torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)]
        else:
            opts, self.schedulers = build_optimizers(
                cfg.optimizer_kind, model, cfg.lr, cfg.weight_decay, lr_factor=self._lr_factor
            )
            self.optimizer = opts[0] if len(opts) == 1 else Optimizers(opts)  # several: stepped as one
        self.scheduler = self.schedulers[0]
        self.stream = self._stream()
        self.step = 0  # iterations completed
        # Called after clipping and before anything mutates the training state (bias update, optimizer step):
        # the snapshot copy of the previous iteration must be finished by then.
        self.before_update: list[Callable[[], None]] = []
        self.update_lock = threading.Lock()  # held while the state mutates (see train_step)
        self._expert_of: dict | None = None  # replay: operator name -> (GroupedExperts, expert index)

    def _stream(self) -> TokenStream:
        cfg = self.cfg
        return TokenStream(cfg.model.vocab_size, cfg.seq_len, cfg.batch_size * cfg.micro_batches, seed=cfg.seed)

    def set_micro_batches(self, n: int) -> None:
        """From the next step on, `n` accumulated micro-batches per step (the GPU check's regimes share one model)."""
        self.cfg = replace(self.cfg, micro_batches=n)
        self.stream = self._stream()

    def _forward_backward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The step's loss, its gradients accumulated: one pass, or the mean over `micro_batches` passes."""
        n = self.cfg.micro_batches
        if n == 1:
            logits = self.model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            faults.point("backward")  # as backward starts: the peers are about to block in its reduce-scatter
            loss.backward()
            return loss
        total = None
        for part in tokens.chunk(n):
            logits = self.model(part[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), part[:, 1:].reshape(-1)) / n
            faults.point("backward")
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        assert total is not None
        return total

    def _lr_factor(self, it: int) -> float:
        warm = max(1, self.cfg.warmup)
        if it < warm:
            return (it + 1) / warm
        return max(0.1, 1.0 - (it - warm) / max(1, 4 * self.cfg.steps))

    # ---- one iteration -------------------------------------------------------------------------------
    def train_step(self, replay: Replay | None = None) -> StepResult:
        t_start = time.perf_counter()
        step = self.step + 1
        faults.set_iteration(step)
        faults.point("forward")
        if replay is None:
            tokens = self.stream.batch(step, self.rank).to(self.device, non_blocking=True)
            rng_state, device_rng = rng.capture()
        else:
            tokens, rng_state, device_rng = replay.tokens.to(self.device), replay.rng_state, replay.device_rng
            replay.restore_rng()
        skip = replay.frozen if replay is not None and self.cfg.replay_skips_frozen else frozenset()
        frozen = self._freeze_experts(skip)
        try:
            loss = self._forward_backward(tokens)
        finally:
            for experts in frozen:
                experts.frozen = frozenset()
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        replayed_norm = None
        if replay is not None:  # clip with the logged norm; the replayed one is what the replay check compares
            # (not when frozen experts skipped their weight gradients: the norm of the rest is no logged figure)
            replayed_norm, norm = None if frozen else norm, replay.grad_norm.to(self.device)
        torch.nn.utils.clip_grads_with_norm_(self.params, self.cfg.max_norm, norm)
        for hook in list(self.before_update):  # a hook may remove itself (scenario._once)
            hook()
        stats = self._reduce_expert_stats()  # the iteration's last collective
        # Everything that mutates the training state runs under update_lock, with no collective inside: a
        # just-in-time checkpoint (jit.py) taken from another thread sees iteration `step`'s start or end.
        with self.update_lock:
            counts, probs = self._apply_expert_bias(stats)
            if replay is not None:
                replay.apply_lrs(self.optimizer)  # the original iteration's LR, whatever the schedule says now
            lr = self.optimizer.param_groups[0]["lr"]
            lrs = tuple(float(g["lr"]) for g in self.optimizer.param_groups)
            hyper = group_hyper(self.optimizer.param_groups)
            self.optimizer.step()
            faults.point("optimizer")  # the update is applied, the snapshot of this iteration not yet taken
            for sched in self.schedulers:
                sched.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step = step
        return StepResult(
            step=step,
            loss=loss.detach(),
            grad_norm=norm.detach().clone(),
            lr=lr,
            tokens=tokens,
            rng_state=rng_state,
            expert_counts=counts,
            expert_probs=probs,
            seconds=time.perf_counter() - t_start,
            device_rng=device_rng,
            replayed_grad_norm=replayed_norm,
            lrs=lrs,
            hyper=hyper,
        )

    def _freeze_experts(self, frozen_ops: frozenset[str]) -> list:
        """Mark the experts of `frozen_ops` (operator names, Replay.frozen) on their GroupedExperts for this
        iteration (model.expert_mlp skips their weight gradients); returns the modules marked."""
        if not frozen_ops:
            return []
        if self._expert_of is None:  # operator name -> (GroupedExperts, its expert indices), found once
            from torchmoe_ckpt.model.operators import discover_operators

            self._expert_of = {
                o.name: (self.model.get_submodule(o.moe).routed_experts.inner_experts, o.experts)
                for o in discover_operators(self.model, optimizer=self.optimizer)  # the checkpointer's operators
                if o.kind == "expert"
            }
        by_module: dict = {}
        for name in frozen_ops:
            if name in self._expert_of:
                mod, experts = self._expert_of[name]
                by_module.setdefault(mod, set()).update(experts)
        for mod, experts in by_module.items():
            mod.frozen = frozenset(experts)
        return list(by_module)

    @torch.no_grad()
    def _reduce_expert_stats(self) -> torch.Tensor:
        moes = self.model.moe_layers()
        stats = torch.stack([torch.stack([m.tokens_per_expert_E, m.router_prob_E]) for m in moes])  # [L,2,E]
        dist.all_reduce(stats)
        return stats

    @torch.no_grad()
    def _apply_expert_bias(self, stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """TorchTitan's aux-loss-free balancing: global token counts move each expert's routing bias.
        The counts are also what popularity ordering reads, before they are zeroed."""
        moes = self.model.moe_layers()
        for m, s in zip(moes, stats):
            if m.expert_bias_E is not None and m.load_balance_coeff:
                delta = m.load_balance_coeff * torch.sign(s[0].mean() - s[0])
                m.expert_bias_E.add_(delta - delta.mean())
            m.tokens_per_expert_E.zero_()
            m.router_prob_E.zero_()
        return stats[:, 0].clone(), stats[:, 1].clone()

    # ---- state access --------------------------------------------------------------------------------
    def set_step(self, step: int) -> None:
        """Position the iteration counter and LR schedule at `step` completed iterations."""
        self.step = step
        for sched in self.schedulers:
            position_lambda_lr(sched, step)

    def export_state(self) -> dict[str, torch.Tensor]:
        """Every tensor that defines the training state on this rank, for torch.equal comparisons."""
        return training_state(self.model, self.optimizer, self.step)


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, torch.Tensor]:
    """Every tensor that defines a rank's training state (local shards): parameters, optimizer state,
    buffers (router_prob_E is per-iteration scratch), LR and step."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[f"param/{name}"] = _host(local(p))
        for key, val in optimizer.state.get(p, {}).items():
            out[f"optim/{name}/{key}"] = _host(local(val)) if torch.is_tensor(val) else torch.tensor(val)
    for name, b in model.named_buffers():
        if b is not None and not name.endswith("router_prob_E"):
            out[f"buffer/{name}"] = _host(b)
    out["lr"] = torch.tensor(optimizer.param_groups[0]["lr"], dtype=torch.float64)
    out["step"] = torch.tensor(step)
    return out


def _host(t: torch.Tensor) -> torch.Tensor:
    """A host copy (a clone on CPU): states compare on any machine, whatever device trained them."""
    return t.detach().to("cpu", copy=True)


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor that backs `t` (aliases its storage)."""
    return t._local_tensor if isinstance(t, DTensor) else t
