"""TorchTitan 0.3.0's pipeline path on torch 2.13: two fixes, applied by :func:`install`.

1. **The schedule call.** TorchTitan 0.3.0 calls ``pp_schedule.step(arg_mbs=..., kwarg_mbs=...,
   target_mbs=..., losses=..., loss_kwargs=..., return_outputs=False)``: the micro-batch keyword API of a
   newer torch. torch 2.13's single-stage schedules (``ScheduleGPipe``, ``Schedule1F1B``) take whole-batch
   ``*args, **kwargs`` there, so ``arg_mbs`` reaches the model as a keyword argument and the first step fails
   with ``forward() got an unexpected keyword argument 'arg_mbs'``. :func:`install` lets ``step`` accept the
   micro-batch keywords and runs ``_step_microbatches`` with them, exactly as ``step`` does after splitting.

2. **Shape inference that runs the model on uninitialised memory.** On its first step a torch 2.13
   ``PipelineStage`` without static shapes infers them by running its module once, and a stage that is not
   the first runs it on ``torch.empty`` inputs. TorchTitan's MoE layers count routed tokens in forward
   (``tokens_per_expert_E``, the expert-bias signal), so that extra forward adds counts decided by whatever
   the memory held to the first bias update, and a restarted pipeline would add such counts again at its
   first step (where the fault-free run had none). :func:`set_static_shapes` gives each stage its
   shapes up front (from one no-grad forward on zeros whose counter side effects are undone), so the
   stages vote STATIC and no inference forward ever runs.
"""

from __future__ import annotations

import torch
from torch.distributed.pipelining import schedules
from torch.distributed.pipelining._utils import _TensorMeta

__all__ = ["install", "set_static_shapes"]

_MB_KEYS = ("arg_mbs", "kwarg_mbs", "target_mbs")


def install() -> None:
    """Idempotent. Only changes calls that pass the micro-batch keywords."""
    cls = schedules.PipelineScheduleSingle
    if getattr(cls.step, "_torchmoe_compat", False):
        return
    original = cls.step

    def step(self, *args, target=None, losses=None, return_outputs=True, loss_kwargs=None, **kwargs):
        if not any(k in kwargs for k in _MB_KEYS):
            return original(
                self,
                *args,
                target=target,
                losses=losses,
                return_outputs=return_outputs,
                loss_kwargs=loss_kwargs,
                **kwargs,
            )
        arg_mbs, kwarg_mbs, target_mbs = (kwargs.pop(k, None) for k in _MB_KEYS)
        if args or kwargs or target is not None:
            raise TypeError("pass either whole-batch inputs or arg_mbs/kwarg_mbs/target_mbs, not both")
        self._stage.has_backward = self._has_backward
        self._stage.clear_runtime_states()
        self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
        if self._stage.is_last and return_outputs:
            return self._merge_outputs(self._stage.output_chunks)
        return None

    step._torchmoe_compat = True
    cls.step = step


def _meta(t: torch.Tensor, requires_grad: bool) -> _TensorMeta:
    return _TensorMeta(
        shape=t.shape, stride=t.stride(), dtype=t.dtype, requires_grad=requires_grad and t.is_floating_point()
    )


@torch.no_grad()
def set_static_shapes(stage, tokens: torch.Tensor, kwargs: dict, dim: int) -> None:
    """Give a stock ``PipelineStage`` static input/output shapes (one rank per stage, plain tensors), from one
    micro-batch's token ids ``[microbatch, seq]`` and model keyword arguments (attention masks, positions).

    Stage 0 takes the token ids; every later stage takes the hidden state ``[microbatch, seq, dim]`` in its
    parameters' dtype, which is checked against what the stage before it outputs (every rank runs this, so a
    mismatch fails on the rank whose output differs)."""
    mod = stage.submod
    dtype = next(mod.parameters()).dtype
    mb, seq = tokens.shape[:2]
    x = torch.zeros_like(tokens) if stage.is_first else torch.zeros(mb, seq, dim, dtype=dtype, device=stage.device)
    saved = {n: b.detach().clone() for n, b in mod.named_buffers() if b is not None}
    try:
        out = mod(x, **kwargs)
    finally:  # undo the forward's side effects (routed-token counters)
        bufs = dict(mod.named_buffers())
        for n, b in saved.items():
            bufs[n].copy_(b)
    if not torch.is_tensor(out):
        raise NotImplementedError(
            f"pipeline stage {stage.stage_index} returns {type(out).__name__}; static shapes support one output tensor"
        )
    if not stage.is_last and (tuple(out.shape) != (mb, seq, dim) or out.dtype != dtype):
        raise RuntimeError(
            f"pipeline stage {stage.stage_index} outputs {tuple(out.shape)} {out.dtype}, the next "
            f"stage expects ({mb}, {seq}, {dim}) {dtype}"
        )
    stage._user_meta.inputs = (_meta(x, requires_grad=not stage.is_first),)  # plain tensors: gradient shapes
    stage._user_meta.outputs = (_meta(out, requires_grad=True),)  # follow from these
