"""Typed configuration of the checkpointer and its storage tiers, validated at construction: a mistake that can
be seen without touching storage raises `ConfigError` with one line naming the field and the fix.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

# Torch-free, every one of them (tests/unit/test_config_torch_free.py): a launcher checks a config before torch loads.
from .core.config_values import (
    DEFAULT_HOST_ROOT,
    DEFAULT_TOLERANCE,
    OperatorSpec,
    ReplayCheck,
    ReplayPolicy,
    is_kind,
    parse_bytes,
)
from .core.errors import ConfigError
from .core.sparse_config import (  # noqa: F401 (re-exported: SparseConfig lives in core/, below its readers)
    COPY_PHASES,
    CUDA_OVERLAP,
    HOST_BUFFERS,
    POPULARITIES,
    CopyPhase,
    HostBuffers,
    Popularity,
    SparseConfig,
)
from .runtime.watchdog import check_timeout
from .storage_format.store_open import StoreConfigError, check_uri

__all__ = ["ConfigError", "SparseConfig", "ObjectStoreConfig", "TierConfig", "CheckpointConfig", "DEFAULT_HOST_ROOT"]

# The choice fields' values, each written once: the Literal is the field's type, the tuple is what is checked.
StoreFormat = Literal["dcp", "tensorstore"]
OnStall = Literal["warn", "fail"]
OnUnusable = Literal["fail", "restart"]
STORE_FORMATS: tuple[str, ...] = get_args(StoreFormat)
STALL_POLICIES: tuple[str, ...] = get_args(OnStall)
UNUSABLE_POLICIES: tuple[str, ...] = get_args(OnUnusable)  # (recovery.resume's on_unusable)
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass
class ObjectStoreConfig:
    """Where committed windows are uploaded in the background (file://, s3://, az://, abfs://, memory://)."""

    uri: str
    """The store's root: file://, s3://, az://, abfs://, memory:// (a scheme without '//' is refused)."""

    storage_options: dict[str, Any] = field(default_factory=dict)
    """Passed to fsspec: credentials, endpoint_url, connection_string, ..."""

    keep: int = 2
    """Committed windows kept in the store (>= 1); older ones are deleted once a newer one is complete."""

    format: StoreFormat = "dcp"
    """"dcp": standard DCP files (readable by torch.distributed.checkpoint); "tensorstore": zarr3 + OCDBT, one
    expert per chunk (needs the tensorstore extra and a kvstore driver for the scheme)."""

    exit_wait_s: float = 30.0
    """At exit, the longest wait for pending uploads; what is left is uploaded by the next run (>= 0)."""

    lease_s: float = 30.0
    """The writing job's lease on <uri>/<run_id> (ownership/store_lease.py), renewed every lease_s/3: a second job
    writing the same run is refused while the lease is fresh, and takes over once it has expired."""

    def __post_init__(self):
        if not isinstance(self.uri, str) or not self.uri:
            raise ConfigError("object_store.uri is empty: give a URI such as s3://bucket/prefix or file:///path")
        try:
            check_uri(self.uri)  # "s3:/bucket" would be a local directory: said now, not after a run of "uploads"
        except StoreConfigError as exc:
            raise ConfigError(f"object_store.uri: {exc}") from None
        _whole("object_store.keep", self.keep)
        if self.keep < 1:
            raise ConfigError(f"object_store.keep must be >= 1 (windows kept in the store), got {self.keep}")
        if self.format not in STORE_FORMATS:
            raise ConfigError(f"object_store.format {self.format!r} is not one of {', '.join(STORE_FORMATS)}")
        if not is_kind(self.exit_wait_s, (int, float)) or not 0 <= self.exit_wait_s < math.inf:
            raise ConfigError(
                f"object_store.exit_wait_s must be a number of seconds >= 0 (finite: the bounded wait for "
                f"pending uploads at exit), got {self.exit_wait_s!r}"
            )
        check_timeout("object_store.lease_s", self.lease_s, ConfigError)
        if self.lease_s is None:
            raise ConfigError("object_store.lease_s must be a finite number of seconds > 0, got None")
        if not isinstance(self.storage_options, dict):
            raise ConfigError(
                "object_store.storage_options must be a dict of fsspec options, got "
                f"{type(self.storage_options).__name__}"
            )


@dataclass
class TierConfig:
    """Host memory of this node, r peers, and optionally an object store."""

    root: str = DEFAULT_HOST_ROOT
    """The node-local directory windows are written to; shared memory (/dev/shm) survives a worker restart."""

    run_id: str | None = None
    """Names this training run: windows live under <root>/node-N/<run_id> (and <uri>/<run_id> in the store), and
    resume() reads only this run's. 1-128 letters, digits, '.', '_', '-'. None: torchrun's run id
    (TORCHELASTIC_RUN_ID), the same in every restart of one launch and new for every launch; to resume across
    launches, give a name. Two unrelated jobs must never share one: their windows would mix."""

    ranks_per_node: int | None = None
    """Ranks per failure domain (peers are placed on other nodes). None: LOCAL_WORLD_SIZE (one node per
    torchrun agent)."""

    replicas: int = 0
    """r: peers that hold a copy of each window (HSDP replicas first); 0: this node only."""

    object_store: ObjectStoreConfig | None = None
    """Where committed windows are also uploaded, in the background (a dict is read as ObjectStoreConfig)."""

    stall_iterations: int | None = 50
    """Iterations without a new durable window before the checkpoint counts as stalled (>= 1, keep it above
    2 x W). None: no check."""

    on_stall: OnStall = "warn"
    """A stall: "warn" logs it once per stall; "fail" raises CheckpointStallError in the training thread."""

    upload_backlog: int = 4
    """Windows kept in host memory beyond retention while the object store lags or is down (>= 0)."""

    spare_windows: int = 1
    """Collected windows whose data files are kept to be written over (no new allocation); 0: deleted at once."""

    peer_max_lag_windows: int = 4
    """How many windows the peer copy may be behind the newest window committed in memory (>= 1) before it counts
    as not durable: a warning once per crossing, `stats()['peers']['peer_durable']` False and `peers behind` in
    the status lines until it catches up. A window superseded while the link was busy is skipped, not queued.
    With `peer_interval` k it counts pushes missed (due windows not on the peers), not windows: the peer copy may
    be up to k * (peer_max_lag_windows + 1) - 1 windows old before it counts as not durable."""

    peer_interval: int | Literal["auto"] = 1
    """Push every k-th committed window to the peers (>= 1); the others are not pushed at all (the peer copy is
    the newest pushed window, so a node loss replays or loses up to k - 1 windows more). 1: every window.
    "auto": k from the measured seconds one push takes on the peer links against training's seconds per window,
    so that pushing occupies at most `peer_link_share` of the link's time; re-chosen after every push and agreed
    across ranks (the slowest link decides), at most 8. The host tier keeps the windows from the newest pushed one
    on (up to k more windows in host memory), so a node loss can still combine it with the peers' copies."""

    peer_link_share: float = 0.05
    """peer_interval="auto": the largest share of the peer links' time the pushes may take (0 < share <= 1)."""

    def __post_init__(self):
        if isinstance(self.object_store, dict):
            self.object_store = _from_dict(ObjectStoreConfig, self.object_store, "object_store")
        if self.run_id is not None and (not isinstance(self.run_id, str) or not _RUN_ID.match(self.run_id)):
            raise ConfigError(
                f"run_id {self.run_id!r} must be 1-128 characters of letters, digits, '.', '_' "
                "or '-' (it names a directory)"
            )
        if not isinstance(self.root, (str, os.PathLike)) or not str(self.root):
            raise ConfigError(f"root is empty: give a node-local directory, e.g. {DEFAULT_HOST_ROOT}")
        _whole("replicas", self.replicas)
        for name in ("upload_backlog", "spare_windows"):
            _whole(name, getattr(self, name))
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (windows kept in host memory), got {getattr(self, name)}")
        _check_lag_bound(self.peer_max_lag_windows)
        _check_interval(self.peer_interval, self.peer_link_share)
        _whole("ranks_per_node", self.ranks_per_node, none_ok=True)
        if self.replicas < 0:
            raise ConfigError(f"replicas must be >= 0 (peers holding a copy of each window), got {self.replicas}")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ConfigError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        if self.stall_iterations is not None and (not is_kind(self.stall_iterations, int) or self.stall_iterations < 1):
            raise ConfigError(
                f"stall_iterations must be an integer >= 1 (iterations without a durable window "
                f"before on_stall applies) or None (no check), got {self.stall_iterations!r}"
            )
        if self.on_stall not in STALL_POLICIES:
            raise ConfigError(f"on_stall {self.on_stall!r} must be 'warn' (log it) or 'fail' (end the job)")

    def resolved_run_id(self) -> str:
        """The explicit run id, else torchrun's; a run id shared by unrelated jobs would mix their windows."""
        rid = self.run_id or default_run_id()
        if rid is None:
            raise ConfigError(
                "run_id is not set and there is no torchrun run id (TORCHELASTIC_RUN_ID) to derive "
                "one from: set TierConfig(run_id=...) to a name unique to this training run"
            )
        return rid

    @classmethod
    def from_dict(cls, d: dict) -> TierConfig:
        """The dict form used by job specs: {"root":..., "run_id":..., "object_store": {"uri": ...}}."""
        return _from_dict(cls, d, "host_tier")


def default_run_id() -> str | None:
    """torchrun's run id: the same in every attempt of one launch, different between launches."""
    rid = os.environ.get("TORCHELASTIC_RUN_ID")
    return re.sub(r"[^A-Za-z0-9._-]", "-", rid)[:128] if rid and rid != "none" else None


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
            self.window = _from_dict(SparseConfig, self.window, "window")
        if not isinstance(self.window, SparseConfig):
            raise ConfigError(
                f"window must be a SparseConfig (e.g. SparseConfig(window=3)) or a dict, got {self.window!r}"
            )
        self._merge_host_memory_limit()
        if self.tiers is not None and not isinstance(self.tiers, TierConfig):
            raise ConfigError(f"tiers must be a TierConfig, a dict or None, got {type(self.tiers).__name__}")
        _whole("router_top_k", self.router_top_k, none_ok=True)
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


def _check_lag_bound(value) -> None:
    _whole("peer_max_lag_windows", value)
    if value < 1:
        raise ConfigError(f"peer_max_lag_windows must be >= 1 (windows the peer copy may be behind), got {value}")


def _check_interval(value, share) -> None:
    if value != "auto" and (not is_kind(value, int) or value < 1):
        raise ConfigError(
            f"peer_interval must be an integer >= 1 (push every k-th window) or 'auto' (chosen from the measured "
            f"link time), got {value!r}"
        )
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ConfigError(f"peer_link_share must be a number in (0, 1] (a share of the link's time), got {share!r}")


def _whole(name: str, value, none_ok: bool = False) -> None:
    """An integer field given as "2" or 2.0 fails here with its name, not as a TypeError in a comparison."""
    if (value is None and none_ok) or is_kind(value, int):
        return
    raise ConfigError(
        f"{name} must be an integer{' or None' if none_ok else ''}, got {value!r} ({type(value).__name__})"
    )


def _from_dict(cls, d: dict, where: str):
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
