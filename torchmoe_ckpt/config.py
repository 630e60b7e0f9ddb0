"""Typed configuration of the checkpointer and its storage tiers, validated at construction: a mistake that can
be seen without touching storage raises `ConfigError` with one line naming the field and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

# Torch-free, every one of them (tests/api/test_config_torch_free.py): a launcher checks a config before torch loads.
from .core.config_values import (
    DEFAULT_HOST_ROOT,
    DEFAULT_TOLERANCE,
    OperatorSpec,
    ReplayCheck,
    ReplayPolicy,
    check_timeout,
    check_whole,
    config_from_dict,
    is_kind,
    parse_bytes,
)
from .core.errors import ConfigError
from .core.sparse_config import (  # noqa: F401 (re-exported: SparseConfig lives in core/, below its readers)
    COPY_PHASES,
    CUDA_OVERLAP,
    HOST_BUFFERS,
    POLICIES,
    POPULARITIES,
    CopyPhase,
    HostBuffers,
    Policy,
    Popularity,
    SparseConfig,
)
from .core.tier_config import (  # noqa: F401 (re-exported: TierConfig lives in core/, below its readers)
    STALL_POLICIES,
    STORE_FORMATS,
    ObjectStoreConfig,
    OnStall,
    StoreFormat,
    TierConfig,
    default_run_id,
)

__all__ = ["ConfigError", "SparseConfig", "ObjectStoreConfig", "TierConfig", "CheckpointConfig", "DEFAULT_HOST_ROOT"]

# The choice fields' values, each written once: the Literal is the field's type, the tuple is what is checked.
OnUnusable = Literal["fail", "restart"]
UNUSABLE_POLICIES: tuple[str, ...] = get_args(OnUnusable)  # (recovery.resume's on_unusable)


@dataclass
class CheckpointConfig:
    """Everything `Checkpointer` needs besides the model, optimizer and step function. `tiers=None` keeps windows
    in this process only; `max_grad_norm` turns on clipping (the library clips: replay reuses the logged norm)."""

    tiers: TierConfig | None = None
    """Where windows are kept beyond this process (host memory, peers, object store). None: this process only."""

    window: SparseConfig = field(default_factory=SparseConfig)
    """How windows are sized and filled: a whole SparseConfig (a dict is read as one), not the window size; W itself
    is `window.window`, e.g. `CheckpointConfig(window=SparseConfig(window=3))` or `{"window": {"window": 3}}`.
    Default: SparseConfig() (W chosen by Algorithm 1)."""

    max_grad_norm: float | None = None
    """Gradient clipping by the library (> 0): replay reuses the logged norm. None: no clipping."""

    operators: OperatorSpec | None = None
    """Where experts and routers are, when structural detection does not find them. None: detected."""

    router_top_k: int | None = None
    """Experts per token, when neither the router output nor the model says it (>= 1). None: detected."""

    compute_dtype: Any = None
    """The dtype forward runs in: a floating torch.dtype or a name ("bf16", "fp32", ...). None: FSDP2's param
    dtype, else the model's."""

    on_unusable_checkpoint: OnUnusable = "fail"
    """Windows exist but every one is rejected (corrupt, torn, replay diverged): "fail" raises
    UnusableCheckpointError on every rank and touches nothing; "restart" starts from step 0 and overwrites them."""

    hang_timeout_s: float | None = 100.0
    """With more than one rank, a step that blocks longer than this ends the process (exit 124, `event=hang`) so
    torchrun restarts the job (watchdog.py). Keep it below the process group's timeout and above the slowest
    step. None: off."""

    hang_start_timeout_s: float | None = 300.0
    """The bound for resume() and the first step after it, and (plus the upload wait) close(). None:
    hang_timeout_s."""

    replay_check: ReplayCheck = "exact"
    """"exact": every replayed loss equals the original bit for bit (CUDA: deterministic kernels); "tolerant":
    within replay_tolerance, reported as approximate."""

    replay_tolerance: float = DEFAULT_TOLERANCE
    """"tolerant": the largest relative deviation accepted, in (0, 1) (docs/gpu.md, "Choosing the bound")."""

    host_memory_limit: int | str | None = None
    """The same as window.host_memory_limit, which it sets (setting both to different values is an error)."""

    def __post_init__(self):
        if self.on_unusable_checkpoint not in UNUSABLE_POLICIES:
            raise ConfigError(
                f"on_unusable_checkpoint {self.on_unusable_checkpoint!r} must be 'fail' (refuse to "
                "resume when every window is rejected) or 'restart' (start over from step 0)"
            )
        if isinstance(self.tiers, dict):
            self.tiers = TierConfig.from_dict(self.tiers)
        if isinstance(self.window, dict):
            self.window = config_from_dict(SparseConfig, self.window, "window")
        if not isinstance(self.window, SparseConfig):
            raise ConfigError(
                f"window must be a SparseConfig (e.g. SparseConfig(window=3)) or a dict, got {self.window!r}"
            )
        self._merge_host_memory_limit()
        if self.tiers is not None and not isinstance(self.tiers, TierConfig):
            raise ConfigError(f"tiers must be a TierConfig, a dict or None, got {type(self.tiers).__name__}")
        check_whole("router_top_k", self.router_top_k, none_ok=True)
        if self.max_grad_norm is not None and not is_kind(self.max_grad_norm, (int, float)):
            raise ConfigError(f"max_grad_norm must be a number > 0 or None (no clipping), got {self.max_grad_norm!r}")
        if self.router_top_k is not None and self.router_top_k < 1:
            raise ConfigError(f"router_top_k must be >= 1 or None, got {self.router_top_k}")
        if self.max_grad_norm is not None and not 0 < self.max_grad_norm < math.inf:
            raise ConfigError(
                f"max_grad_norm must be a finite number > 0 or None (no clipping), got {self.max_grad_norm}"
            )
        self.compute_dtype = compute_dtype_of(self.compute_dtype)
        check_timeout("hang_timeout_s", self.hang_timeout_s, ConfigError)
        check_timeout("hang_start_timeout_s", self.hang_start_timeout_s, ConfigError)
        self.replay_policy()  # validates replay_check and replay_tolerance

    def _merge_host_memory_limit(self) -> None:
        """`host_memory_limit` given here is set on `window` (SparseConfig), where the checkpointer reads it."""
        if self.host_memory_limit is None:
            return
        limit = parse_bytes(self.host_memory_limit, "host_memory_limit")
        if self.window.host_memory_limit not in (None, limit):
            raise ConfigError(
                f"host_memory_limit is set twice ({limit} and window.host_memory_limit "
                f"{self.window.host_memory_limit}): set one"
            )
        self.host_memory_limit = self.window.host_memory_limit = limit

    def replay_policy(self) -> ReplayPolicy:
        """How recovery checks each replayed iteration (replay_check.py)."""
        return ReplayPolicy(self.replay_check, self.replay_tolerance)


# What compute_dtype may be given as besides a torch.dtype: name -> torch attribute.
DTYPE_NAMES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
    "fp64": "float64",
    "float64": "float64",
}


def compute_dtype_of(value):
    """CheckpointConfig.compute_dtype as a torch dtype (or None: inferred from the model)."""
    if value is None:
        return None  # before importing torch: a launcher builds configs before torch loads
    import torch

    if isinstance(value, str):
        name = DTYPE_NAMES.get(value.lower().removeprefix("torch."))
        if name is None:
            raise ConfigError(
                f"compute_dtype {value!r} is not a dtype name: use one of {sorted(DTYPE_NAMES)} or a torch.dtype"
            )
        value = getattr(torch, name)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ConfigError(
            f"compute_dtype must be a floating-point dtype (torch.bfloat16, torch.float16, torch.float32 or a name "
            f"such as 'bf16'), or None (inferred from the model), got {value!r}"
        )
    return value
