"""CPU mode for TorchTitan 0.3.0: run the real ``Trainer`` on CPU + gloo without forking TorchTitan.

TorchTitan 0.3.0 is written for CUDA (and against a torch newer than 2.13). On a CPU-only
machine its real Trainer fails in eleven places (see ``docs/torchtitan-cpu-mode.md``). This
module fixes the runtime ones with small, explicit monkeypatches, all applied by one call::

    from titan_integration.cpu_mode import enable_cpu_mode
    enable_cpu_mode()          # BEFORE anything imports torchtitan
    import torchtitan.train

``enable_cpu_mode()`` is idempotent. The remaining failures are configuration choices, not
code bugs; :func:`apply_cpu_config` sets them on a ``Trainer.Config`` (our config registry
calls it, so no extra CLI flags are needed), and :func:`cpu_cli_flags` returns the same
settings as flags for running a stock TorchTitan config (``--module deepseek_v3 ...``).

Nothing here changes numerics on GPU: the launcher only calls it when CUDA is unavailable.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from typing import Any

__all__ = ["enable_cpu_mode", "cpu_mode_enabled", "apply_cpu_config", "cpu_cli_flags"]

_ENABLED = False

_TRITON_KERNELS_MODULE = "torchtitan.distributed.minimal_async_ep.kernels"
# Names torchtitan.distributed.minimal_async_ep.api imports from the triton kernels module.
_TRITON_KERNEL_NAMES = (
    "copy_full_counts_to_peers_kernel",
    "copy_rows_to_peers_kernel",
    "expand_topk_grad_kernel",
    "fill_combine_metadata_kernel",
    "fill_dispatch_metadata_kernel",
    "invert_flat_indices_kernel",
    "reduce_topk_slots_kernel",
    "topk_scores_grad_kernel",
)


def cpu_mode_enabled() -> bool:
    """True once :func:`enable_cpu_mode` has run in this process."""
    return _ENABLED


def _install_triton_shim() -> None:
    """Pre-seed the one torchtitan module that imports triton unconditionally (fix B).

    A fake top-level ``triton`` package does not work (torch then imports
    ``triton.backends.compiler``), so we stub only torchtitan's kernels module. The stub's
    functions raise if called: they are only used by ``moe_comm_backend="minimal_async_ep"``,
    which needs CUDA symmetric memory anyway.
    """
    if _TRITON_KERNELS_MODULE in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    stub = types.ModuleType(_TRITON_KERNELS_MODULE)
    stub.__doc__ = "CPU-mode stub (titan_integration.cpu_mode): triton is not installed."

    def _make(name: str):
        def _unavailable(*_args: Any, **_kwargs: Any):
            raise RuntimeError(f"{name} needs triton (minimal_async_ep MoE backend); it is not available in CPU mode")

        _unavailable.__name__ = name
        return _unavailable

    for name in _TRITON_KERNEL_NAMES:
        setattr(stub, name, _make(name))
    sys.modules[_TRITON_KERNELS_MODULE] = stub


def _cpu_stubs() -> None:
    """Give ``torch.cpu`` the CUDA memory/introspection API TorchTitan's metrics call."""
    import resource

    import torch

    class _CpuProps:
        name = "cpu"
        try:
            total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
            total_memory = 1 << 34

    def memory_stats(*_a: Any, **_k: Any) -> dict[str, int]:
        # Peak RSS of this process stands in for CUDA's peak allocator stats.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    stubs = {
        "get_device_name": lambda *_a, **_k: "cpu",
        "get_device_properties": lambda *_a, **_k: _CpuProps(),
        "memory_stats": memory_stats,
        "reset_peak_memory_stats": lambda *_a, **_k: None,
        "empty_cache": lambda *_a, **_k: None,
    }
    for name, fn in stubs.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)


def _dense_mask(block_mask: Any, L: int, S: int, device: Any) -> Any:
    """Evaluate ``block_mask.mask_mod`` on the full (B, H, L, S) grid once per BlockMask.

    TorchTitan builds one BlockMask per step and every layer reuses it, so the result is cached
    on the BlockMask object. Mask mods are evaluated with broadcast index tensors (one vectorised
    call); if a mask_mod does not broadcast, ``create_mask`` (vmap) is used instead.
    """
    import torch
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from torch.nn.attention.flex_attention import create_mask

    cached = getattr(block_mask, "_torchmoe_cpu_dense_mask", None)
    if cached is not None and cached.shape[-2:] == (L, S):
        return cached
    B, H = block_mask.shape[0], block_mask.shape[1]
    try:
        b = torch.arange(B, device=device).view(B, 1, 1, 1)
        h = torch.arange(H, device=device).view(1, H, 1, 1)
        q = torch.arange(L, device=device).view(1, 1, L, 1)
        kv = torch.arange(S, device=device).view(1, 1, 1, S)
        with TransformGetItemToIndex():
            mask = block_mask.mask_mod(b, h, q, kv)
        mask = torch.as_tensor(mask, device=device).to(torch.bool).expand(B, H, L, S)
    except Exception:  # any non-broadcastable mask_mod: use the reference path
        mask = create_mask(block_mask.mask_mod, B, H, L, S, device=device)
    try:
        block_mask._torchmoe_cpu_dense_mask = mask
    except AttributeError:  # pragma: no cover - BlockMask without __dict__
        pass
    return mask


def cpu_flex_attention(
    query: Any,
    key: Any,
    value: Any,
    score_mod: Any = None,
    block_mask: Any = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: Any = None,
    *,
    return_aux: Any = None,
):
    """Drop-in for ``flex_attention`` on CPU: dense mask from ``block_mask.mask_mod`` + SDPA / math.

    Same signature and return convention as ``torch.nn.attention.flex_attention.flex_attention``.
    Eager ``flex_attention`` does run forward+backward on CPU once ``_validate_device`` is
    patched, but it re-traces the mask_mod on every call (TorchTitan builds a new document-mask
    closure each step): 15-30 ms per call and ~6000 objects of cyclic garbage per call, which
    TorchTitan's periodic ``gc.collect`` then pays for in multi-second pauses. This evaluates
    the mask once with ``create_mask`` and runs ``scaled_dot_product_attention`` (or an explicit
    softmax when the log-sum-exp is requested, or a row is fully masked). ``score_mod`` and
    ``max_scores`` requests fall back to eager ``flex_attention``.
    """
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import AuxOutput, flex_attention

    L, S = query.size(-2), key.size(-2)
    want_max = return_aux is not None and return_aux.max_scores
    if score_mod is not None or want_max or (block_mask is not None and tuple(block_mask.seq_lengths) != (L, S)):
        return flex_attention(
            query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
            enable_gqa=enable_gqa, return_lse=return_lse, kernel_options=kernel_options,
            return_aux=return_aux,
        )  # fmt: skip
    scale = query.size(-1) ** -0.5 if scale is None else scale
    mask = None
    if block_mask is not None:
        mask = _dense_mask(block_mask, L, S, query.device)
    want_lse = return_lse or (return_aux is not None and return_aux.lse)
    has_empty_rows = mask is not None and not bool(mask.any(-1).all())

    if not want_lse and not has_empty_rows:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        lse = None
    else:
        k, v = key, value
        if enable_gqa and key.size(-3) != query.size(-3):
            rep = query.size(-3) // key.size(-3)
            k, v = key.repeat_interleave(rep, dim=-3), value.repeat_interleave(rep, dim=-3)
        acc = torch.promote_types(query.dtype, torch.float32)
        scores = (query @ k.transpose(-2, -1)).to(acc) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        probs = torch.exp(scores - safe_lse.unsqueeze(-1))  # fully masked rows -> all zeros
        out = (probs.to(v.dtype) @ v).to(query.dtype)

    if return_aux is not None:
        return out, AuxOutput(lse=lse if return_aux.lse else None)
    if return_lse:
        return out, lse
    return out


def _patch_already_imported_device_globals() -> None:
    """If torchtitan was imported before us, repoint its module-level ``device_type`` globals."""
    import torch

    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("torchtitan") or mod is None:
            continue
        if getattr(mod, "device_type", None) == "cuda":
            mod.device_type = "cpu"
        if getattr(mod, "device_module", None) is getattr(torch, "cuda", object()):
            mod.device_module = torch.cpu


def enable_cpu_mode() -> None:
    """Apply every runtime patch TorchTitan 0.3.0's Trainer needs on CPU/gloo. Idempotent.

    Call it before anything imports ``torchtitan`` (the triton shim and the device-type patch
    must be in place when ``torchtitan.tools.utils`` is first imported; if it already was,
    its ``device_type`` globals are repointed to ``"cpu"`` as a best effort).
    """
    global _ENABLED
    if _ENABLED:
        return

    import torch
    import torch._utils
    import torch.distributed as dist

    # Failure "No module named 'triton'" (import chain trainer -> ... -> minimal_async_ep/kernels.py).
    _install_triton_shim()

    # Qwen3.5's model.py imports flash-linear-attention's triton (CUDA) kernels at module level: plain-torch
    # reference implementations under fla's names (titan_integration.fla_cpu; docs/torchtitan.md).
    from titan_integration import fla_cpu

    fla_cpu.install()

    # Failure 1 "torch._C has no attribute '_cuda_setDevice'": tools/utils.py falls back to "cuda".
    torch._utils._get_available_device_type = lambda: "cpu"
    _patch_already_imported_device_globals()

    # Failure 2 "torch.cpu has no attribute 'get_device_name'" (metrics DeviceMemoryMonitor).
    _cpu_stubs()

    # Failure 7 "incompatible function arguments ... BarrierOptions ... ['cpu']": drop non-int device_ids.
    _orig_barrier = dist.barrier
    if not getattr(_orig_barrier, "_cpu_mode_patched", False):

        def barrier(*args: Any, device_ids: Any = None, **kwargs: Any):
            if device_ids is not None and not all(isinstance(d, int) for d in device_ids):
                device_ids = None
            return _orig_barrier(*args, device_ids=device_ids, **kwargs)

        barrier._cpu_mode_patched = True  # type: ignore[attr-defined]
        dist.barrier = barrier

    # Failure 8 "torch.distributed has no attribute 'set_timeout'" (API newer than torch 2.13).
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout  # type: ignore[attr-defined]

    # Failure 6 "Cannot use ReduceOp.PREMUL_SUM with Gloo": with divide factor 1.0 a plain SUM is exact.
    from torch.distributed.fsdp import FSDPModule

    _orig_set_gdf = FSDPModule.set_gradient_divide_factor
    if not getattr(_orig_set_gdf, "_cpu_mode_patched", False):

        def set_gradient_divide_factor(self, factor: float) -> None:
            _orig_set_gdf(self, factor)
            self.set_force_sum_reduction_for_comms(True)

        set_gradient_divide_factor._cpu_mode_patched = True  # type: ignore[attr-defined]
        FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor

    # Failure 4 "FlexAttention does not support backward on CPU": the eager math path does backward fine.
    import torch.nn.attention.flex_attention as _flex

    _flex._validate_device = lambda *_a, **_k: None

    # Imported only now: torchtitan must see the patches above at import time.
    import torchtitan.distributed.utils as tt_dist_utils
    import torchtitan.models.common.attention as tt_attention

    # Failure 5 "InductorError: IndexError: tuple index out of range": compiled flex attn fails on CPU
    # Inductor. Replaced by an exact dense-mask SDPA equivalent (eager flex re-traces every call).
    tt_attention.FlexAttention._compiled_flex_attn = staticmethod(cpu_flex_attention)
    # Not a failure, wall time: compiling create_block_mask costs seconds per process; eager is instant here.
    tt_attention._compiled_create_block_mask = _flex.create_block_mask

    # Failure 5 again under --debug.deterministic: set_determinism re-compiles flex attention; re-apply ours.
    _orig_set_determinism = tt_dist_utils.set_determinism
    if not getattr(_orig_set_determinism, "_cpu_mode_patched", False):

        def set_determinism(*args: Any, **kwargs: Any) -> None:
            _orig_set_determinism(*args, **kwargs)
            tt_attention.FlexAttention._compiled_flex_attn = staticmethod(cpu_flex_attention)

        set_determinism._cpu_mode_patched = True  # type: ignore[attr-defined]
        tt_dist_utils.set_determinism = set_determinism

    _quiet_expected_cpu_warnings()
    _ENABLED = True


def _quiet_expected_cpu_warnings() -> None:
    """Silence warnings that CPU mode triggers by design (they repeat every step and hide the log)."""
    import warnings

    for pattern in (
        # The MoE router asks for fp32 autocast; params are already fp32 in CPU mode.
        r"In CPU autocast, but the target dtype is not supported",
        # We chose eager flex attention on purpose (failure 5).
        r"flex_attention called without torch\.compile",
        # DTensor RNG on a CPU mesh: TorchTitan seeds via torch.manual_seed as well.
        r"DTensor random operators may not have complete support on cpu",
        r"DTensor manual_seed\(\) may not have complete support on cpu",
    ):
        warnings.filterwarnings("ignore", message=pattern)


def apply_cpu_config(config: Any) -> Any:
    """Set the config choices CPU mode needs on a TorchTitan ``Trainer.Config`` (returns it).

    * Failure 3 (``fully_shard``: "all parameters must be DTensors on the full SPMD mesh"):
      ``parallelism.spmd_backend = "partial_dtensor"``.
    * Failure 9 (bf16 GEMM on AVX2 CPUs is ~7x slower): ``training.mixed_precision_param = "float32"``.
    * Failure 10 (EP>1: "CUDA graphs support only expert parallel token dispatcher ..."):
      ``training.disable_cuda_graphs = True`` (there are no CUDA graphs on CPU anyway).
    """
    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.mixed_precision_param = "float32"
    config.training.disable_cuda_graphs = True
    return config


def cpu_cli_flags(expert_parallel_degree: int = 1) -> list[str]:
    """The same settings as :func:`apply_cpu_config`, as TorchTitan CLI flags (for stock configs)."""
    flags = [
        "--parallelism.spmd_backend",
        "partial_dtensor",
        "--training.mixed_precision_param",
        "float32",
    ]
    if expert_parallel_degree > 1:
        flags.append("--training.disable_cuda_graphs")
    return flags
