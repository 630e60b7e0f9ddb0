"""The ``[sparse_checkpoint]`` section of a TorchTitan job file: fields, validation, and mapping onto the core.

    [sparse_checkpoint]
    enable = true
    window = "auto"            # or an int >= 1 (forced window size W)
    replicas = 0               # peers holding a copy of every window (0 = this node's host memory only)
    host_dir = "/dev/shm/torchmoe-ckpt"
    run_id = ""                # "" = torchrun's run id (new for every launch); set a name to resume across launches
    object_store_uri = ""      # "" = none; file://, s3://, az://, abfs://, memory://
    storage_options = {}       # passed to fsspec as-is (endpoint_url, key, secret, connection_string ...)
    object_store_format = "dcp" # on-store format: "dcp" (DCP files) | "tensorstore" (zarr3 + OCDBT; file, memory, s3)
    store_exit_wait_s = 30     # at exit, wait at most this long for pending uploads (a store that is down)
    persist_interval = 1       # persist every window to the storage tiers (only 1 is supported so far)
    ordering = "hard"          # expert popularity: hard | soft | decayed | capacity
    fault_timeout_s = 0        # > 0: a collective that hangs this long ends the rank (torchrun restarts)
    dense_export_uri = ""      # "" = none; any fsspec URI: dense exports in TorchTitan's layout, {uri}/step-N
    dense_export_every = 0     # > 0: export every N iterations (dcp.async_save, off the training thread)
    dense_export_keep = 2      # newest exports kept; older ones deleted
    pipeline_log_max_bytes = 0 # with pipeline parallelism: bound on each stage's boundary log (0 = none)
    on_unusable_checkpoint = "fail" # windows exist but every one is rejected (corrupt, torn, replay diverged):
                               # "fail" = refuse with the reasons (exit 2), "restart" = start over from step 0
    replay_check = "exact"     # recovery's replay: "exact" = bit for bit (on GPUs needs deterministic kernels:
                               # torch.use_deterministic_algorithms + CUBLAS_WORKSPACE_CONFIG, checked at start);
                               # "tolerant" = within replay_tolerance, reported as approximate
    replay_tolerance = 1e-3    # tolerant: largest relative deviation of a replayed loss / gradient norm accepted
    host_memory_limit = ""     # host memory per rank the checkpointer may hold: bytes or e.g. "64 GiB" ("" = none;
                               # counted either way); refused at start with the figure when the plan needs more
    max_window = 0             # auto W never above this (0 = no bound besides the memory limit)
    upload_backlog = 4         # windows kept in host memory while the object store lags or is down
    spare_windows = 1          # collected windows whose data files are kept to be written over (0 = delete them)

Everything is checked before training starts; a bad value raises :class:`JobConfigError` whose message is
one line ``... ; fix: ...`` (the launcher prints it as ``error: <message>`` and exits with status 2).
:meth:`SparseCheckpointSection.check_resources` is what the launcher runs first, before TorchTitan is imported:
the host directory (created and probe-written), the on-store format (tensorstore importable, a driver for
the URI) and the object store / dense-export location (opened and probe-written).
"""

from __future__ import annotations

import importlib.util
import math
import os
import uuid
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = ["JobConfigError", "SparseCheckpointSection", "ORDERINGS", "STORE_FORMATS"]

ORDERINGS = ("hard", "soft", "decayed", "capacity")
STORE_FORMATS = ("dcp", "tensorstore")  # torchmoe_ckpt.config.ObjectStoreConfig.format


class JobConfigError(ValueError):
    """A job-file problem the user fixes by editing the file; the message is one line naming the fix."""


@dataclass
class SparseCheckpointSection:
    enable: bool = False
    window: int | str = "auto"
    replicas: int = 0
    host_dir: str = "/dev/shm/torchmoe-ckpt"
    run_id: str = ""  # "": derived from torchrun's TORCHELASTIC_RUN_ID (never shared between jobs)
    object_store_uri: str = ""
    storage_options: dict[str, Any] = field(default_factory=dict)
    object_store_format: str = "dcp"
    store_exit_wait_s: float = 30.0  # bounded wait for pending uploads at exit (ObjectStoreConfig.exit_wait_s)
    persist_interval: int = 1
    ordering: str = "hard"
    fault_timeout_s: float = 0.0
    dense_export_uri: str = ""
    dense_export_every: int = 0
    dense_export_keep: int = 2
    pipeline_log_max_bytes: int = 0  # bound on each pipeline stage's boundary log (0: unbounded)
    on_unusable_checkpoint: str = "fail"  # torchmoe_ckpt.CheckpointConfig.on_unusable_checkpoint: "fail" | "restart"
    replay_check: str = "exact"  # torchmoe_ckpt.CheckpointConfig.replay_check: "exact" | "tolerant"
    replay_tolerance: float = 1e-3  # torchmoe_ckpt.CheckpointConfig.replay_tolerance (replay_check.DEFAULT_TOLERANCE)
    host_memory_limit: int | str = ""  # torchmoe_ckpt.SparseConfig.host_memory_limit ("" or 0: none)
    max_window: int = 0  # torchmoe_ckpt.SparseConfig.max_window (0: none)
    upload_backlog: int = 4  # torchmoe_ckpt.TierConfig.upload_backlog
    spare_windows: int = 1  # torchmoe_ckpt.TierConfig.spare_windows

    # ---- construction from a TOML table ------------------------------------------------------------
    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_table(cls, table: dict[str, Any], *, section: str = "sparse_checkpoint") -> SparseCheckpointSection:
        """Build and validate from a parsed TOML table. Raises JobConfigError (one line)."""
        if not isinstance(table, dict):
            raise JobConfigError(f"[{section}] must be a table; fix: write it as a [{section}] section")
        valid = cls.keys()
        unknown = [k for k in table if k not in valid]
        if unknown:
            raise JobConfigError(f"[{section}] unknown key '{unknown[0]}'; fix: use one of {', '.join(valid)}")
        sec = cls(**table)
        sec.validate(section)
        return sec

    def validate(self, section: str = "sparse_checkpoint") -> None:
        def bad(key: str, why: str, fix: str) -> JobConfigError:
            return JobConfigError(f"[{section}] {key} = {getattr(self, key)!r}: {why}; fix: {fix}")

        if not isinstance(self.enable, bool):
            raise bad("enable", "must be a boolean", "enable = true or enable = false")
        w = self.window
        if isinstance(w, bool) or not (w == "auto" or isinstance(w, int)):
            raise bad("window", 'must be "auto" or an integer >= 1', 'window = "auto" or e.g. window = 4')
        if isinstance(w, int) and w < 1:
            raise bad("window", "must be >= 1", 'window = "auto" (sized from measured bandwidth) or an integer >= 1')
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 0:
            raise bad("replicas", "must be an integer >= 0", "replicas = 0 (host memory only) or 1, 2, ...")
        for key in ("host_dir", "run_id", "object_store_uri", "dense_export_uri"):
            if not isinstance(getattr(self, key), str):
                raise bad(key, "must be a string", f'{key} = "..."')
        if not self.host_dir:
            raise bad("host_dir", "must not be empty", 'host_dir = "/dev/shm/torchmoe-ckpt"')
        if "/" in self.run_id:
            raise bad("run_id", "must be a name without '/' (or empty: torchrun's run id)", 'run_id = "my-job"')
        if not isinstance(self.storage_options, dict):
            raise bad("storage_options", "must be a table", 'storage_options = { endpoint_url = "..." }')
        if (
            isinstance(self.persist_interval, bool)
            or not isinstance(self.persist_interval, int)
            or self.persist_interval < 1
        ):
            raise bad("persist_interval", "must be an integer >= 1", "persist_interval = 1")
        if self.persist_interval != 1:
            # The core's PersistThread persists every committed window; skipping windows needs a core change.
            raise bad("persist_interval", "only 1 (persist every window) is supported so far", "persist_interval = 1")
        if self.ordering not in ORDERINGS:
            raise bad("ordering", "unknown ordering", f"use one of {', '.join(ORDERINGS)}")
        if (
            isinstance(self.fault_timeout_s, bool)
            or not isinstance(self.fault_timeout_s, (int, float))
            or not 0 <= self.fault_timeout_s < math.inf
        ):
            raise bad("fault_timeout_s", "must be a finite number >= 0", "fault_timeout_s = 0 (off) or e.g. 60")
        if (
            isinstance(self.store_exit_wait_s, bool)
            or not isinstance(self.store_exit_wait_s, (int, float))
            or not 0 <= self.store_exit_wait_s < math.inf
        ):
            raise bad(
                "store_exit_wait_s",
                "must be a number of seconds >= 0",
                "store_exit_wait_s = 30 (0: do not wait for pending uploads at exit)",
            )
        for key in (
            "dense_export_every",
            "dense_export_keep",
            "pipeline_log_max_bytes",
            "max_window",
            "upload_backlog",
        ):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(key, "must be an integer >= 0", f"{key} = 0 (off) or e.g. 100")
        if self.dense_export_every and not self.dense_export_uri:
            raise bad(
                "dense_export_every",
                "needs a place to write",
                'set dense_export_uri = "file:///..." (any fsspec URI) or dense_export_every = 0',
            )
        if self.storage_options and not (self.object_store_uri or self.dense_export_uri):
            raise JobConfigError(
                f"[{section}] storage_options is set but object_store_uri is empty; "
                "fix: set object_store_uri or remove storage_options"
            )
        if self.on_unusable_checkpoint not in ("fail", "restart"):
            raise bad(
                "on_unusable_checkpoint",
                'must be "fail" or "restart"',
                'on_unusable_checkpoint = "fail" (refuse when every window is rejected) or "restart" '
                "(start over from step 0, overwriting them)",
            )
        if self.replay_check not in ("exact", "tolerant"):
            raise bad(
                "replay_check",
                'must be "exact" or "tolerant"',
                'replay_check = "exact" (bit for bit; GPUs need deterministic kernels) or "tolerant" (within '
                "replay_tolerance, reported as approximate)",
            )
        t = self.replay_tolerance
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < 1:
            raise bad("replay_tolerance", "must be a relative bound in (0, 1)", "replay_tolerance = 1e-3")
        if self.object_store_format not in STORE_FORMATS:
            raise bad("object_store_format", "unknown format", f"use one of {', '.join(STORE_FORMATS)}")
        if isinstance(self.spare_windows, bool) or not isinstance(self.spare_windows, int) or self.spare_windows < 0:
            raise bad("spare_windows", "must be an integer >= 0", "spare_windows = 1 (or 0: delete collected files)")
        try:
            self.memory_limit()
        except ValueError:
            raise bad(
                "host_memory_limit",
                'must be bytes > 0 or a size like "64 GiB"',
                'host_memory_limit = "64 GiB" (or "": none)',
            ) from None
        if self.object_store_format != "dcp" and not self.object_store_uri:
            raise bad(
                "object_store_format",
                "is set but object_store_uri is empty",
                "set object_store_uri or remove object_store_format",
            )

    # ---- launch-time checks (touch the file system / the store) -------------------------------------------
    def check_resources(self, probe: bool = True) -> None:
        """Everything a run needs from outside, checked in the launcher's first seconds (one line each)."""
        if self.enable:
            self.check_host_dir()
        self.check_format()
        self.check_store(probe=probe)

    def check_host_dir(self) -> None:
        """The host directory exists (created if missing) and takes a file; else raw FileNotFoundError /
        NotADirectoryError / PermissionError would come from the host tier after the model is built."""
        root = Path(self.host_dir)
        probe = root / f".probe-{os.getpid()}-{uuid.uuid4().hex}"  # unique: every rank probes at once
        try:
            root.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            why = exc.strerror or str(exc)
            raise JobConfigError(
                f"[sparse_checkpoint] host_dir = {self.host_dir!r}: cannot create or write it "
                f"({type(exc).__name__}: {why}); fix: host_dir = a writable node-local "
                'directory, e.g. "/dev/shm/torchmoe-ckpt"'
            ) from None

    def check_format(self) -> None:
        """The tensorstore format needs the tensorstore package and a kvstore driver for the URI's scheme."""
        if self.object_store_format != "tensorstore" or not self.object_store_uri:
            return
        key = f"[sparse_checkpoint] object_store_format = {self.object_store_format!r}"
        if importlib.util.find_spec("tensorstore") is None:
            raise JobConfigError(
                f"{key}: the tensorstore package is not installed; fix: pip install "
                "'torchmoe-ckpt[tensorstore]' or object_store_format = \"dcp\""
            )
        from torchmoe_ckpt.storage.tensorstore_tier import NoTensorstoreDriver, kvstore_spec

        try:
            kvstore_spec(self.object_store_uri)  # no storage options: nothing but the scheme is looked at
        except NoTensorstoreDriver as exc:
            raise JobConfigError(f'{key}: {exc}; fix: object_store_format = "dcp" for this store') from None

    def check_store(self, probe: bool = True) -> None:
        """Open (and by default probe-write) the object store and the dense-export location once; raises
        JobConfigError naming the fix. Both use ``storage_options``."""
        from torchmoe_ckpt.storage.store_open import StoreConfigError, open_store

        for key in ("object_store_uri", "dense_export_uri"):
            uri = getattr(self, key)
            if not uri or (key == "dense_export_uri" and not self.dense_export_every):
                continue
            try:
                open_store(uri, self.storage_options or None, probe=probe)
            except StoreConfigError as exc:
                msg = str(exc)
                if "fix:" not in msg:
                    msg = (
                        msg.replace(": use one of", "; fix: use one of", 1)
                        if ": use one of" in msg
                        else (f"{msg}; fix: correct [sparse_checkpoint] {key} / storage_options")
                    )
                raise JobConfigError(f"[sparse_checkpoint] {key}: {msg}") from None

    # ---- mapping onto the core ---------------------------------------------------------------------
    def memory_limit(self) -> int | None:
        """host_memory_limit in bytes (None: no limit). Raises ValueError (a ConfigError) for a bad value."""
        if self.host_memory_limit in ("", 0):
            return None
        from torchmoe_ckpt.host_memory import parse_bytes

        return parse_bytes(self.host_memory_limit)

    def core_config(self):
        """The library's SparseConfig for this section."""
        from torchmoe_ckpt.config import SparseConfig

        return SparseConfig(
            window=None if self.window == "auto" else int(self.window),
            popularity=self.ordering,
            host_memory_limit=self.memory_limit(),
            max_window=self.max_window or None,
        )

    def replay_policy(self):
        """How recovery checks each replayed iteration (torchmoe_ckpt.replay_check.ReplayPolicy)."""
        from torchmoe_ckpt.replay_check import ReplayPolicy

        return ReplayPolicy(self.replay_check, float(self.replay_tolerance))

    def resolved_run_id(self) -> str:
        """The run id windows are kept under: the job file's, else torchrun's (the same in every restart of
        one launch, new for every launch), so two jobs never share a default."""
        from torchmoe_ckpt.config import default_run_id

        rid = self.run_id or default_run_id()
        if not rid:
            raise JobConfigError(
                "[sparse_checkpoint] run_id is empty and there is no torchrun run id "
                '(TORCHELASTIC_RUN_ID) to derive one from; fix: run_id = "my-job" (unique per run)'
            )
        return rid

    def tiers_config(self, ranks_per_node: int | None = None) -> dict:
        """The dict torchmoe_ckpt.storage.tiers.build_tiers takes."""
        cfg: dict[str, Any] = {"root": self.host_dir, "run_id": self.resolved_run_id(), "replicas": self.replicas}
        if ranks_per_node:
            cfg["ranks_per_node"] = ranks_per_node
        for key, default in (("upload_backlog", 4), ("spare_windows", 1)):  # host memory: only when changed
            if getattr(self, key) != default:
                cfg[key] = getattr(self, key)
        if self.object_store_uri:
            cfg["object_store"] = {
                "uri": self.object_store_uri,
                "storage_options": dict(self.storage_options),
                "format": self.object_store_format,
                "exit_wait_s": float(self.store_exit_wait_s),
            }
        return cfg

    def to_dict(self) -> dict:
        return asdict(self)
