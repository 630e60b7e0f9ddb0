"""TierConfig and ObjectStoreConfig: where windows are kept beyond the process (host memory, peers, an object
store), checked at construction. Torch-free and below every layer that reads them: build_tiers builds the tiers
from a TierConfig, the JIT checkpoint writes where it points. `torchmoe_ckpt.config` re-exports every name (users
import it from there, or from the package root)."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from .config_values import DEFAULT_HOST_ROOT, check_timeout, check_uri, check_whole, config_from_dict, is_kind
from .errors import ConfigError, StoreConfigError

__all__ = [
    "ObjectStoreConfig",
    "TierConfig",
    "StoreFormat",
    "OnStall",
    "STORE_FORMATS",
    "STALL_POLICIES",
    "MAX_REPLICAS",
    "default_run_id",
]

# The choice fields' values, each written once: the Literal is the field's type, the tuple is what is checked.
StoreFormat = Literal["dcp", "tensorstore"]
OnStall = Literal["warn", "fail"]
STORE_FORMATS: tuple[str, ...] = get_args(StoreFormat)
STALL_POLICIES: tuple[str, ...] = get_args(OnStall)
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# The most peer copies of each window (TierConfig.replicas): 1 survives a node loss, 2 two at once; a value above
# this is a typo (10**12 would plan copies no job has the nodes or host memory for).
MAX_REPLICAS = 16


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
        check_whole("object_store.keep", self.keep)
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
    """r: peers that hold a copy of each window (HSDP replicas first); 0: this node only. At most MAX_REPLICAS
    (each copy is a window of host memory on another node; fewer nodes than r: a warning, the copies missing)."""

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

    peer_timeout_s: float | None = 300.0
    """The longest one peer message may wait for its partner rank (a header, or one chunk of at most 64 MiB:
    13 s at 40 Mbit/s), in seconds; None: the library group's own timeout. A peer that does not answer within it
    stops the peer tier for the rest of the process, with one warning: its copies count as not durable and the
    training goes on (the host tier and the object store still commit)."""

    def __post_init__(self):
        if isinstance(self.object_store, dict):
            self.object_store = config_from_dict(ObjectStoreConfig, self.object_store, "object_store")
        if self.run_id is not None and (not isinstance(self.run_id, str) or not _RUN_ID.match(self.run_id)):
            raise ConfigError(
                f"run_id {self.run_id!r} must be 1-128 characters of letters, digits, '.', '_' "
                "or '-' (it names a directory)"
            )
        if not isinstance(self.root, (str, os.PathLike)) or not str(self.root):
            raise ConfigError(f"root is empty: give a node-local directory, e.g. {DEFAULT_HOST_ROOT}")
        check_whole("replicas", self.replicas)
        for name in ("upload_backlog", "spare_windows"):
            check_whole(name, getattr(self, name))
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (windows kept in host memory), got {getattr(self, name)}")
        _check_lag_bound(self.peer_max_lag_windows)
        _check_interval(self.peer_interval, self.peer_link_share)
        check_timeout("peer_timeout_s", self.peer_timeout_s, ConfigError)
        check_whole("ranks_per_node", self.ranks_per_node, none_ok=True)
        if not 0 <= self.replicas <= MAX_REPLICAS:
            raise ConfigError(
                f"replicas must be 0..{MAX_REPLICAS} (peers holding a copy of each window, each a window of host "
                f"memory on another node; 1 survives one node loss), got {self.replicas}"
            )
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
        return config_from_dict(cls, d, "host_tier")


def default_run_id() -> str | None:
    """torchrun's run id: the same in every attempt of one launch, different between launches."""
    rid = os.environ.get("TORCHELASTIC_RUN_ID")
    return re.sub(r"[^A-Za-z0-9._-]", "-", rid)[:128] if rid and rid != "none" else None


def _check_lag_bound(value) -> None:
    check_whole("peer_max_lag_windows", value)
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
