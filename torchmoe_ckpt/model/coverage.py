"""What the slot format can hold, checked up front: anything else is refused at construction, naming the
tensor or object, so that nothing is ever restored at a wrong value (optimizers: `optim_state`).
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, ReduceLROnPlateau

from ..core.errors import UncapturedStateError
from ..core.operator import Operator
from .operators import local_tensor

__all__ = ["check_coverage", "infer_compute_dtype", "SchedulerPosition", "position_lambda_lr"]


def check_coverage(model: nn.Module, ops: list[Operator]) -> None:
    """Every parameter and persistent buffer (what `state_dict` holds) belongs to an operator."""
    claimed = {pc.fqn for o in ops for pc in o.pieces}
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    for key in model.state_dict(keep_vars=True):
        t = tensors.get(key)
        if t is None or key in claimed or local_tensor(t).numel() == 0:  # 0: uneven sharding left this rank none
            continue
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
    """Put LR schedulers (one, a list, or None) and their optimizers' LRs where `step` iterations leave them.
    LambdaLR is positioned in O(1) from its lambdas (a changed schedule takes effect); any other step-count
    scheduler is replayed `step` times from its initial state (the same LRs bit for bit). ReduceLROnPlateau
    follows a metric and is refused.

    Args:
        optimizer: the optimizer (or optimizers) whose LRs the schedulers set.
        scheduler: an LRScheduler, a list of them, or None (no schedule: nothing to position).

    Raises:
        UncapturedStateError: a scheduler that cannot be positioned by step count (ReduceLROnPlateau, or not an
            LRScheduler).
    """

    def __init__(self, optimizer, scheduler: LRScheduler | list | None):
        if scheduler is None:
            scheds = []
        elif isinstance(scheduler, (list, tuple)):
            scheds = list(scheduler)
        else:
            scheds = [scheduler]
        for sched in scheds:
            if isinstance(sched, ReduceLROnPlateau) or not isinstance(sched, LRScheduler):
                raise UncapturedStateError(
                    f"LR scheduler {type(sched).__name__} cannot be positioned by step count "
                    "(ReduceLROnPlateau follows a metric): use a step-based scheduler such as "
                    "LambdaLR, or none"
                )
        self.optimizer, self.scheduler, self.schedulers = optimizer, scheduler, scheds
        # Per scheduler: its state and its optimizer's LRs at construction (what a replay from the start needs).
        self._initial = [(copy.deepcopy(s.state_dict()), [g["lr"] for g in s.optimizer.param_groups]) for s in scheds]

    def seek(self, step: int) -> None:
        for sched, (state, lrs) in zip(self.schedulers, self._initial):
            if type(sched) is LambdaLR:
                position_lambda_lr(sched, step)
                continue
            sched.load_state_dict(copy.deepcopy(state))
            for group, lr in zip(sched.optimizer.param_groups, lrs):
                group["lr"] = lr
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()": intended here
                for _ in range(step):
                    sched.step()
