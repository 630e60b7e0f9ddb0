"""What the slot format can hold, checked up front: anything else is refused at construction, naming the
tensor or object, so that nothing is ever restored at a wrong value.

A slot holds, per operator, the parameters (fp32 master), AdamW/Adam `exp_avg`, `exp_avg_sq` and `step`,
and every persistent buffer. The LR scheduler is positioned by step count (see `SchedulerPosition`), the
batch, RNG state, gradient norm and LRs of each iteration are logged for replay.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, ReduceLROnPlateau

from .errors import UncapturedStateError
from .operators import Operator, local_tensor

__all__ = [
    "check_optimizer",
    "check_optimizer_state",
    "check_coverage",
    "infer_compute_dtype",
    "SchedulerPosition",
    "position_lambda_lr",
]

ADAM_STATE_KEYS = frozenset({"step", "exp_avg", "exp_avg_sq"})


def check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Adam/AdamW without amsgrad, holding every parameter of the model."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise UncapturedStateError(
            f"optimizer {type(optimizer).__name__} is not supported: slots hold Adam/AdamW state (exp_avg, exp_avg_sq, "
            "step) only; use torch.optim.AdamW or torch.optim.Adam"
        )
    if any(g.get("amsgrad") for g in optimizer.param_groups):
        raise UncapturedStateError(
            "AdamW(amsgrad=True) keeps max_exp_avg_sq, which slots do not hold: use amsgrad=False"
        )
    in_optim = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        if id(p) not in in_optim and p.requires_grad:
            raise UncapturedStateError(
                f"parameter {name} is not in the optimizer, so the slot format has no optimizer state for it: pass "
                "every trainable parameter to the optimizer, or set requires_grad=False (then it is held by value)"
            )


def check_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """After the first update: the state holds nothing but what slots capture (a subclass could add keys)."""
    for _p, st in optimizer.state.items():
        extra = sorted(set(st) - ADAM_STATE_KEYS)
        if extra:
            raise UncapturedStateError(
                f"optimizer state has keys {extra} that slots do not hold (only "
                f"{sorted(ADAM_STATE_KEYS)}): use stock Adam/AdamW"
            )


def check_coverage(model: nn.Module, ops: list[Operator]) -> None:
    """Every parameter and persistent buffer (what `state_dict` holds) belongs to an operator."""
    claimed = {pc.fqn for o in ops for pc in o.pieces}
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    for key in model.state_dict(keep_vars=True):
        t = tensors.get(key)
        if t is None or key in claimed:
            continue
        if local_tensor(t).numel() == 0:
            continue  # uneven sharding left this rank without a piece of it
        raise UncapturedStateError(
            f"{key} {tuple(t.shape)} belongs to no operator, so slots would not capture it: "
            "name its module in OperatorSpec, or make the buffer non-persistent if it is "
            "not training state"
        )


def infer_compute_dtype(model: nn.Module) -> torch.dtype:
    """FSDP2's mixed-precision param dtype when set, else the parameters' own dtype."""
    get_state = getattr(model, "_get_fsdp_state", None)
    if get_state is not None:
        policy = getattr(get_state(), "_mp_policy", None)
        if policy is not None and policy.param_dtype is not None:
            return policy.param_dtype
    p = next(model.parameters(), None)
    return p.dtype if p is not None else torch.float32


def position_lambda_lr(sched: LambdaLR, step: int) -> None:
    """Put a LambdaLR and its optimizer's LRs where `step` calls of `step()` leave them, from the closed form
    base_lr x lambda(step): O(1), and a changed lambda (an extended run) takes effect from here on."""
    sched.last_epoch = step
    sched._step_count = step + 1  # construction counts as one call of step()
    lrs = [base * fn(step) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
    for group, lr in zip(sched.optimizer.param_groups, lrs):
        group["lr"] = lr
    sched._last_lr = list(lrs)


class SchedulerPosition:
    """Put an LR scheduler (and the optimizer's LRs) where `step` completed iterations leave it.

    LambdaLR (TorchTitan's warmup/decay and most hand-written schedules) is positioned in O(1) from its
    lambdas, so a run resumed with a *changed* schedule continues on the new one. Every other step-count
    scheduler is replayed from the state it had at construction, `step` times: the same float operations as
    the original run, hence the same LRs bit for bit. ReduceLROnPlateau depends on metrics the library does
    not see and is refused."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: LRScheduler | None):
        if scheduler is not None and (
            isinstance(scheduler, ReduceLROnPlateau) or not isinstance(scheduler, LRScheduler)
        ):
            raise UncapturedStateError(
                f"LR scheduler {type(scheduler).__name__} cannot be positioned by step count "
                "(ReduceLROnPlateau follows a metric): use a step-based scheduler such as "
                "LambdaLR, or none"
            )
        self.optimizer, self.scheduler = optimizer, scheduler
        self._initial = None if scheduler is None else copy.deepcopy(scheduler.state_dict())
        self._initial_lrs = [g["lr"] for g in optimizer.param_groups]

    def seek(self, step: int) -> None:
        sched, groups = self.scheduler, self.optimizer.param_groups
        if sched is None:
            return
        if type(sched) is LambdaLR:
            position_lambda_lr(sched, step)
            return
        sched.load_state_dict(copy.deepcopy(self._initial))
        for group, lr in zip(groups, self._initial_lrs):
            group["lr"] = lr
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()": intended here
            for _ in range(step):
                sched.step()
