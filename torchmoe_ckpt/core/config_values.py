"""The torch-free values the configuration is made of: byte sizes, the operator patterns, the replay policy.

`torchmoe_ckpt.config` imports only this, `errors`, `storage_format.store_open` and `watchdog` (no torch), so a
launcher can build and check every config before torch loads (TorchTitan's `[sparse_checkpoint]` section does).
The modules that use these values (host_memory, moe_structure/operators, replay_check) re-export them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

from .errors import ConfigError

__all__ = [
    "DEFAULT_HOST_ROOT",
    "is_kind",
    "parse_bytes",
    "OperatorSpec",
    "ReplayCheck",
    "REPLAY_CHECKS",
    "DEFAULT_TOLERANCE",
    "ReplayPolicy",
]

DEFAULT_HOST_ROOT = "/dev/shm/torchmoe-ckpt"  # TierConfig.root's default: shared memory survives a worker restart
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def is_kind(value, kinds) -> bool:
    """isinstance, with bool (an int subclass) refused as a number."""
    return isinstance(value, kinds) and not isinstance(value, bool)


def parse_bytes(value, field: str = "host_memory_limit") -> int | None:
    """A byte count: an int, or a string like "64 GiB", "512M", "1.5 TiB" (binary units; "GB" is read as GiB)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{field} must be a number of bytes or a string like '64 GiB', got {value!r}")
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", value)
        if not m:
            raise ConfigError(f"{field} {value!r} is not a size: write bytes or e.g. '64 GiB', '512 MiB'")
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise ConfigError(f"{field} must be > 0 bytes (or None: no limit), got {value!r}")
    return int(value)


@dataclass(frozen=True)
class OperatorSpec:
    """Where experts and routers are, as fnmatch patterns of module names, e.g.
    `OperatorSpec(experts=("model.layers.*.mlp.experts",), routers=("model.layers.*.mlp.gate",))`. An experts
    module is an expert list or holds grouped `[E, ...]` tensors. Given patterns replace detection for that role."""

    experts: tuple[str, ...] = ()
    """Patterns of the experts modules (an expert list, or a module holding grouped [E, ...] tensors). Empty:
    detected by structure."""

    routers: tuple[str, ...] = ()
    """Patterns of the router (gate) modules, one per MoE layer. Empty: detected by structure."""

    def __post_init__(self):
        for role in ("experts", "routers"):
            value = getattr(self, role)
            if not isinstance(value, (tuple, list)) or not all(isinstance(p, str) and p for p in value):
                raise ConfigError(f"OperatorSpec.{role} must be a tuple of module-name patterns, got {value!r}")
            object.__setattr__(self, role, tuple(value))


ReplayCheck = Literal["exact", "tolerant"]
REPLAY_CHECKS: tuple[str, ...] = get_args(ReplayCheck)
# Relative bound of the tolerant check: 12x above what non-deterministic GPU kernels moved replays by, 4x to 27x
# below what another data order's batches did (docs/gpu.md, "Choosing the bound").
DEFAULT_TOLERANCE = 1e-2


@dataclass(frozen=True)
class ReplayPolicy:
    """How recovery checks each replayed iteration against the original run (replay_check.py)."""

    mode: ReplayCheck = "exact"
    """"exact": every replayed loss equals the logged one bit for bit (CUDA: deterministic kernels);
    "tolerant": within `tolerance`, reported as approximate."""
    tolerance: float = DEFAULT_TOLERANCE
    """Tolerant only: the largest relative deviation accepted."""

    def __post_init__(self):
        if self.mode not in REPLAY_CHECKS:
            raise ConfigError(
                f"replay_check {self.mode!r} must be 'exact' (bit for bit; CUDA needs deterministic kernels) or "
                "'tolerant' (within replay_tolerance, reported as approximate)"
            )
        t = self.tolerance
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < 1:
            raise ConfigError(
                f"replay_tolerance must be a relative bound in (0, 1), e.g. {DEFAULT_TOLERANCE}, got {t!r}"
            )
