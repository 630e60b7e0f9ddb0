"""The torch-free values the configuration is made of, and their checks: byte sizes (parsed and printed), whole
numbers, timeouts, store URIs, the operator patterns, the replay policy.

`torchmoe_ckpt.config` imports only core/ (this, `errors`, `sparse_config`, `tier_config`: no torch), so a
launcher can build and check every config before torch loads (TorchTitan's `[sparse_checkpoint]` section does).
The modules that use these values (host_memory, moe_structure/operators, replay_check) re-export them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Literal, get_args

from .errors import ConfigError, StoreConfigError

__all__ = [
    "DEFAULT_HOST_ROOT",
    "is_kind",
    "check_whole",
    "check_timeout",
    "check_uri",
    "config_from_dict",
    "parse_bytes",
    "human_bytes",
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


def check_whole(name: str, value, none_ok: bool = False) -> None:
    """An integer field given as "2" or 2.0 fails here with its name, not as a TypeError in a comparison."""
    if (value is None and none_ok) or is_kind(value, int):
        return
    raise ConfigError(
        f"{name} must be an integer{' or None' if none_ok else ''}, got {value!r} ({type(value).__name__})"
    )


def check_timeout(name: str, value, error=ValueError) -> None:
    """A timeout in seconds: a finite number > 0, or None (off). inf, nan, True and "60" are refused."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise error(f"{name} must be a finite number of seconds > 0, or None (off), got {value!r}")


_SCHEME_WITHOUT_SLASHES = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):(?!//)(.*)$")


def check_uri(uri: str) -> None:
    """A scheme without '//' ("s3:/bucket") is a typo that fsspec reads as a local path (./s3:/bucket), so uploads
    would "succeed" into the working dir: refused, naming the URI meant (one letter before ':' is a drive)."""
    _check_bucket(uri)
    m = _SCHEME_WITHOUT_SLASHES.match(uri) if isinstance(uri, str) else None
    if m is None:
        return
    scheme, rest = m.group(1), m.group(2).lstrip("/")
    meant = f"{scheme}:///{rest}" if scheme.lower() == "file" else f"{scheme}://{rest}"
    raise StoreConfigError(
        f"object-store URI {uri!r} has a scheme ({scheme}:) but no '//' after it, so it would "
        f"be read as a local directory named {uri!r}: did you mean {meant!r}? (a local "
        "directory: give its path, or file:///absolute/path)"
    )


# The schemes whose URI starts with a bucket (S3) or container (Azure) the store must already have.
_BUCKET_SCHEMES = {"s3": "bucket", "s3a": "bucket", "az": "container", "abfs": "container", "abfss": "container"}


def _check_bucket(uri) -> None:
    """ "s3://" or "s3:///prefix" names no bucket: fsspec's error for it says nothing of a bucket, so say it here."""
    if not isinstance(uri, str) or "://" not in uri:
        return
    scheme, rest = uri.split("://", 1)
    what = _BUCKET_SCHEMES.get(scheme.lower())
    if what is not None and not rest.split("/", 1)[0].strip():
        raise StoreConfigError(
            f"object-store URI {uri!r} names no {what}: give {scheme}://<{what}>/<prefix>, e.g. "
            f"{scheme}://my-{what}/checkpoints (the {what} must exist; the prefix is created)"
        )


def config_from_dict(cls, d: dict, where: str):
    """A config dataclass from its dict (TOML table) form: an unknown key, or a value its constructor refuses,
    raises ConfigError naming `where`."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where} must be a table/dict, got {type(d).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where}: known keys are {sorted(known)}")
    try:
        return cls(**d)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


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


def human_bytes(n: float) -> str:
    """A byte count as people read it ("1.5 MiB"): the status lines, host-memory and staging messages."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


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
