"""flash-linear-attention's Gated DeltaNet ops in plain torch, for Qwen3.5 in CPU mode.

TorchTitan 0.3.0's ``torchtitan/models/qwen3_5/model.py`` imports flash-linear-attention (``fla``) at module level:
the gated delta rule (chunked and fused-recurrent) and the varlen causal depthwise convolution, all triton kernels
that run on CUDA tensors only. On a CPU the family could not even be imported. :func:`install` puts modules under
exactly the names that file imports into ``sys.modules``, implemented with plain torch ops and torch's autograd:

* the gated delta rule follows fla 0.5.2's own reference, ``fla/ops/gated_delta_rule/naive.py``
  (``naive_recurrent_gated_delta_rule``): per step ``h = h * exp(g_t)``, ``v'_t = beta_t * (v_t - k_t h)``,
  ``h = h + k_t^T v'_t``, ``o_t = (scale * q_t) h``, in float32, with ``scale`` defaulting to ``K ** -0.5``
  (computed in its closed form per document, :func:`_recurrence`, which a token loop would cost seconds for); plus
  what the kernel entry point (``fla/ops/gated_delta_rule/chunk.py``) adds around it: ``use_qk_l2norm_in_kernel``
  (``x / sqrt(sum(x^2) + 1e-6)`` in float32, as ``fla/modules/l2norm.py``), grouped value heads (HV a multiple of
  H), ``initial_state``/``output_final_state`` of shape ``[N, HV, K, V]`` (float32), varlen ``cu_seqlens`` (the
  state restarts at every document), and the output cast back to ``q``'s dtype;
* ``causal_conv1d`` is a depthwise ``F.conv1d`` over each document, left-padded by ``W - 1`` zeros (``x`` is
  ``[B, T, D]``, ``weight`` ``[D, W]``), then the activation TorchTitan passes (``"silu"``/``"swish"`` or None).

Numerics: the reference recurrence is mathematically the chunked kernel's, not bit-identical to it (different
summation order, no exp2). So on a CPU Qwen3.5 trains with these reference ops, and our CPU tests check the
checkpointing (recovered vs never-failed runs, both with these ops), not fla's kernels. Deterministic: torch's
CPU ops, no atomics. On a GPU machine with ``fla`` installed nothing here is installed and the real kernels run.

The ``...Function`` classes TorchTitan registers with ``spmd_types`` (it never calls their ``apply``) are
``torch.autograd.Function`` subclasses taking the same positional arguments as fla's, whose backward recomputes
the reference forward under autograd.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["install", "installed", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d"]

_L2NORM_EPS = 1e-6  # fla/modules/l2norm.py's default, inside the square root


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + _L2NORM_EPS)).to(x.dtype)


def _recurrence(q, k, v, beta, g, scale: float, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """naive_recurrent_gated_delta_rule on one sequence, solved in closed form rather than token by token (a
    Python loop over tokens costs seconds per step on a CPU): q, k [T, H, K]; v [T, H, V]; beta, g [T, H];
    h [H, K, V]. With G = cumsum(g), the recurrence unrolls to h_t = e^{G_t} h_0 + sum_{s<=t} e^{G_t - G_s} k_s u_s^T
    where u_t = beta_t (v_t - k_t^T e^{g_t} h_{t-1}); so (I + A) U = beta (V - e^G K h_0) with A strictly lower,
    A_ts = beta_t e^{G_t - G_s} k_t.k_s (a unit-triangular solve), and o_t = scale q_t^T h_t. The same WY form
    fla's chunked kernels use, over a whole document instead of chunks of 64;
    tests/titan_glue/test_fla_cpu.py checks it against the token-by-token recurrence."""
    q, k, v = (x.float().transpose(0, 1) for x in (q, k, v))  # [H, T, *]
    beta, G = beta.float().t(), g.float().t().cumsum(-1)  # [H, T]
    T = q.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    decay = (G[:, :, None] - G[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, t, s]: e^{G_t - G_s}
    eG = G.exp()[:, :, None]
    A = (beta[:, :, None] * decay * (k @ k.transpose(-1, -2))).tril(-1)
    rhs = beta[:, :, None] * (v - eG * (k @ h))
    eye = torch.eye(T, dtype=A.dtype, device=A.device)
    U = torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True)  # [H, T, V]
    q = q * scale
    o = eG * (q @ h) + (decay * (q @ k.transpose(-1, -2))) @ U
    h_final = eG[:, -1:] * h + (k * decay[:, -1, :, None]).transpose(-1, -2) @ U
    return o.transpose(0, 1), h_final


def _gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if k.shape[2] != H or HV % H:
        raise ValueError(f"gated delta rule: q/k heads {H}/{k.shape[2]} and v heads {HV} (HV must be a multiple of H)")
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    if HV != H:  # grouped value heads: value head i reads key/query head i // (HV // H), as fla's kernels do
        q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    scale = K**-0.5 if scale is None else scale
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"gated delta rule: varlen (cu_seqlens) needs batch size 1, got {B}")
        bounds = [int(b) for b in cu_seqlens.tolist()]
        spans = [(0, s, e) for s, e in zip(bounds[:-1], bounds[1:])]
    else:
        spans = [(b, 0, T) for b in range(B)]
    outs, finals = [], []
    for n, (b, s, e) in enumerate(spans):
        h0 = q.new_zeros(HV, K, V, dtype=torch.float32) if initial_state is None else initial_state[n].float()
        o, h = _recurrence(q[b, s:e], k[b, s:e], v[b, s:e], beta[b, s:e], g[b, s:e], scale, h0)
        outs.append(o)
        finals.append(h)
    o = torch.cat(outs).unsqueeze(0) if cu_seqlens is not None else torch.stack(outs)
    return o.to(q.dtype), (torch.stack(finals) if output_final_state else None)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    cp_context: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla.ops.gated_delta_rule.chunk_gated_delta_rule's signature; (o [B, T, HV, V], final_state or None)."""
    if state_v_first or cp_context is not None or kwargs.get("use_gate_in_kernel"):
        raise NotImplementedError(
            "the CPU gated delta rule (titan_integration.fla_cpu) implements what TorchTitan's Qwen3.5 uses; "
            "state_v_first, cp_context and use_gate_in_kernel need flash-linear-attention on a GPU"
        )
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta.float()) * (2.0 if allow_neg_eigval else 1.0)
    return _gated_delta_rule(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens
    )


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    **_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's fused-recurrent entry point (g defaults to no decay, beta to ones, as there)."""
    g = torch.zeros(v.shape[:3], dtype=torch.float32, device=v.device) if g is None else g
    beta = torch.ones(v.shape[:3], dtype=v.dtype, device=v.device) if beta is None else beta
    return _gated_delta_rule(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens
    )


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool | None = False,
    activation: str | None = None,
    backend: str | None = "triton",
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    **_kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Depthwise causal conv over each document of ``x`` [B, T, D] with ``weight`` [D, W]; (y, None)."""
    if weight is None or initial_state is not None or output_final_state:
        raise NotImplementedError(
            "the CPU causal_conv1d (titan_integration.fla_cpu) takes a weight, no initial state and no final state"
        )
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d: activation {activation!r} (fla supports silu/swish or None)")
    D, W = weight.shape
    w = weight.unsqueeze(1)  # [D, 1, W]: F.conv1d's depthwise layout

    def conv(seg: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        y = F.conv1d(F.pad(seg.t().unsqueeze(0), (W - 1, 0)), w, bias, groups=D)[0].t()
        return F.silu(y) if activation is not None else y

    if cu_seqlens is not None:
        bounds = [int(b) for b in cu_seqlens.tolist()]
        y = torch.cat([conv(x[0, s:e]) for s, e in zip(bounds[:-1], bounds[1:])]).unsqueeze(0)
    else:
        y = torch.stack([conv(xb) for xb in x])
    if residual is not None:
        y = y + residual
    return y, None


def _recomputing_function(name: str, fn: Any) -> type:
    """An autograd.Function taking fla's positional ``apply`` arguments whose backward recomputes ``fn`` under
    autograd: every floating-point tensor argument gets its gradient, everything else None."""

    def forward(ctx: Any, *args: Any) -> Any:
        ctx.positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.args = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.positions))
        with torch.no_grad():
            return fn(*args)

    def backward(ctx: Any, *grads: Any) -> Any:
        args = list(ctx.args)
        for i, t in zip(ctx.positions, ctx.saved_tensors):
            args[i] = t.detach().requires_grad_(t.dtype.is_floating_point)
        with torch.enable_grad():
            outs = fn(*args)
        pairs = [(o, g) for o, g in zip(outs, grads) if o is not None and g is not None and o.requires_grad]
        wrt = [i for i in ctx.positions if args[i].requires_grad]
        got = torch.autograd.grad(
            [o for o, _ in pairs], [args[i] for i in wrt], [g for _, g in pairs], allow_unused=True
        )
        result: list[Any] = [None] * len(args)
        for i, g in zip(wrt, got):
            result[i] = g
        return tuple(result)

    return type(
        name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)}
    )


def _chunk_apply(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    state_v_first=False,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    use_qk_l2norm_in_kernel=False,
    *_rest,
):
    # ChunkGatedDeltaRuleFunction.forward's positional order (fla/ops/gated_delta_rule/chunk.py)
    return chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        use_qk_l2norm_in_kernel,
        state_v_first=state_v_first,
        cu_seqlens=cu_seqlens,
    )


def _recurrent_apply(
    q,
    k,
    v,
    g=None,
    gk=None,
    gv=None,
    beta=None,
    A_log=None,
    dt_bias=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False,
    state_v_first=False,
    cu_seqlens=None,
    *_rest,
):
    # FusedRecurrentFunction.forward's positional order (fla/ops/gated_delta_rule/fused_recurrent.py)
    if gk is not None or gv is not None or A_log is not None or use_beta_sigmoid_in_kernel or state_v_first:
        raise NotImplementedError("the CPU fused-recurrent gated delta rule takes g and beta only (fla_cpu)")
    return fused_recurrent_gated_delta_rule(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens
    )


def _conv_apply(
    x,
    weight=None,
    bias=None,
    residual=None,
    initial_state=None,
    output_final_state=False,
    activation=None,
    cu_seqlens=None,
    *_rest,
):
    # CausalConv1dFunction.forward's positional order (fla/modules/conv/triton/ops.py)
    return causal_conv1d(
        x, weight, bias, residual, initial_state, output_final_state, activation, cu_seqlens=cu_seqlens
    )


ChunkGatedDeltaRuleFunction = _recomputing_function("ChunkGatedDeltaRuleFunction", _chunk_apply)
FusedRecurrentFunction = _recomputing_function("FusedRecurrentFunction", _recurrent_apply)
CausalConv1dFunction = _recomputing_function("CausalConv1dFunction", _conv_apply)

# The modules TorchTitan 0.3.0's qwen3_5/model.py imports, and the names it takes from each.
_MODULES: dict[str, dict[str, Any]] = {
    "fla": {},
    "fla.modules": {},
    "fla.modules.conv": {},
    "fla.modules.conv.triton": {},
    "fla.modules.conv.triton.ops": {"CausalConv1dFunction": CausalConv1dFunction},
    "fla.modules.conv.causal_conv1d": {"causal_conv1d": causal_conv1d},
    "fla.ops": {},
    "fla.ops.gated_delta_rule": {
        "chunk_gated_delta_rule": chunk_gated_delta_rule,
        "fused_recurrent_gated_delta_rule": fused_recurrent_gated_delta_rule,
    },
    "fla.ops.gated_delta_rule.chunk": {
        "ChunkGatedDeltaRuleFunction": ChunkGatedDeltaRuleFunction,
        "chunk_gated_delta_rule": chunk_gated_delta_rule,
    },
    "fla.ops.gated_delta_rule.fused_recurrent": {
        "FusedRecurrentFunction": FusedRecurrentFunction,
        "fused_recurrent_gated_delta_rule": fused_recurrent_gated_delta_rule,
    },
}
_SHIM_MARK = "__torchmoe_fla_cpu__"


def installed() -> bool:
    """True when ``fla`` in this process is this module's CPU stand-in."""
    return getattr(sys.modules.get("fla"), _SHIM_MARK, False)


def install() -> bool:
    """Install the CPU stand-ins unless a real ``fla`` can run here; True when they are (now) installed.

    Called by CPU mode (titan_integration.cpu_mode.enable_cpu_mode) before TorchTitan is imported. fla's triton
    kernels need CUDA tensors, so with CUDA unavailable the stand-ins replace an installed fla too; a machine with
    CUDA and fla keeps fla."""
    if installed():
        return True
    if "fla" in sys.modules or (importlib.util.find_spec("fla") is not None and torch.cuda.is_available()):
        return False
    for name, attrs in _MODULES.items():
        mod = types.ModuleType(name, f"CPU stand-in for flash-linear-attention's {name} (titan_integration.fla_cpu)")
        mod.__path__ = []  # a package, so that the submodule imports resolve through sys.modules
        # a spec, so that importlib.util.find_spec("fla") answers (families.missing) instead of raising
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        setattr(mod, _SHIM_MARK, True)
        for attr, value in attrs.items():
            setattr(mod, attr, value)
        sys.modules[name] = mod
    return True
