"""The ``[sparse_checkpoint]`` section of a TorchTitan job file: fields, validation, and mapping onto the core.

Its keys are the core configuration's own field names (torchmoe_ckpt.config: SparseConfig, TierConfig,
ObjectStoreConfig, CheckpointConfig), so what one reads in docs/api.md is what one writes here:

    [sparse_checkpoint]
    enable = true
    window = "auto"            # SparseConfig.window: or an int >= 1 (forced window size W)
    popularity = "hard"        # SparseConfig.popularity: expert popularity, hard | soft | decayed | capacity
    sliding = false            # SparseConfig.sliding: any W consecutive slots recover (a failure loses only its
                               # own iteration; more bytes per slot)
    host_memory_limit = ""     # SparseConfig.host_memory_limit: bytes or e.g. "64 GiB" ("" = none; counted either
                               # way); refused at start with the figure when the plan needs more
    max_window = 0             # SparseConfig.max_window: auto W never above this (0 = no bound)
    root = "/dev/shm/torchmoe-ckpt"  # TierConfig.root: the node-local host directory
    run_id = ""                # TierConfig.run_id: "" = torchrun's run id (new for every launch); a name resumes
                               # across launches
    replicas = 0               # TierConfig.replicas: peers holding a copy of every window (0 = this node only)
    upload_backlog = 4         # TierConfig.upload_backlog: windows kept while the object store lags or is down
    spare_windows = 1          # TierConfig.spare_windows: collected windows' files kept to be written over
    object_store = {}          # TierConfig.object_store, ObjectStoreConfig's fields ({} = none):
                               #   uri = "s3://bucket/x"   file://, s3://, az://, abfs://, memory://
                               #   format = "dcp"          "dcp" (DCP files) | "tensorstore" (zarr3 + OCDBT)
                               #   exit_wait_s = 30        at exit, wait at most this long for pending uploads
                               #   keep = 2, lease_s = 30, storage_options = {} (default: the section's)
    storage_options = {}       # fsspec options (endpoint_url, key, secret, connection_string ...) for the dense
                               # export, and for the object store when its table has none
    hang_timeout_s = 0         # CheckpointConfig.hang_timeout_s: > 0: a collective that hangs this long ends the
                               # rank (torchrun restarts); 0 = off here (TorchTitan has its own timeouts)
    on_unusable_checkpoint = "fail" # CheckpointConfig: windows exist but every one is rejected (corrupt, torn,
                               # replay diverged): "fail" = refuse with the reasons (exit 2), "restart" = step 0
    replay_check = "exact"     # CheckpointConfig: "exact" = bit for bit (on GPUs needs deterministic kernels:
                               # torch.use_deterministic_algorithms + CUBLAS_WORKSPACE_CONFIG, checked at start);
                               # "tolerant" = within replay_tolerance, reported as approximate
    replay_tolerance = 1e-2    # CheckpointConfig: tolerant: largest relative deviation accepted
    persist_interval = 1       # persist every window to the storage tiers (only 1 is supported so far)
    dense_export_uri = ""      # "" = none; any fsspec URI: dense exports in TorchTitan's layout, {uri}/step-N
    dense_export_every = 0     # > 0: export every N iterations (dcp.async_save, off the training thread)
    dense_export_keep = 2      # newest exports kept; older ones deleted
    pipeline_log_max_bytes = 0 # with pipeline parallelism: bound on each stage's boundary log (0 = none)

Older names still work for one release, with a warning once the section is valid (``DEPRECATED``): ``host_dir``
(root), ``ordering`` (popularity), ``fault_timeout_s`` (hang_timeout_s), ``object_store_uri``,
``object_store_format`` and ``store_exit_wait_s`` (object_store.uri / .format / .exit_wait_s).

Everything is checked before training starts; a bad value raises :class:`JobConfigError` whose message is
one line ``... ; fix: ...`` naming the key as the file wrote it (the launcher prints it as ``error: <message>``
and exits with status 2). :meth:`SparseCheckpointSection.check_resources` is what the launcher runs first, before
TorchTitan is imported: the host directory (created and probe-written), the on-store format (tensorstore
importable, a driver for the URI) and the object store / dense-export location (opened and probe-written).
"""

from __future__ import annotations

import importlib.util
import math
import os
import uuid
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

__all__ = [
    "JobConfigError",
    "DeprecatedKeyWarning",
    "SparseCheckpointSection",
    "DEPRECATED",
    "ORDERINGS",
    "STORE_FORMATS",
    "STORE_KEYS",
]

ORDERINGS = ("hard", "soft", "decayed", "capacity")  # SparseConfig.popularity
STORE_FORMATS = ("dcp", "tensorstore")  # torchmoe_ckpt.config.ObjectStoreConfig.format
# The object_store table's keys: torchmoe_ckpt.config.ObjectStoreConfig's fields (tests keep them equal; this module
# imports neither torch nor TorchTitan, the launcher checks the section first)
STORE_KEYS = ("uri", "storage_options", "keep", "format", "exit_wait_s", "lease_s")
# Old key -> the core name it is now ("table.key": a key of that table)
DEPRECATED = {
    "host_dir": "root",
    "ordering": "popularity",
    "fault_timeout_s": "hang_timeout_s",
    "object_store_uri": "object_store.uri",
    "object_store_format": "object_store.format",
    "store_exit_wait_s": "object_store.exit_wait_s",
}


class JobConfigError(ValueError):
    """A job-file problem the user fixes by editing the file; the message is one line naming the fix."""


class DeprecatedKeyWarning(FutureWarning):
    """A [sparse_checkpoint] key under its old name (shown by default, unlike DeprecationWarning)."""


@dataclass
class SparseCheckpointSection:
    enable: bool = False
    window: int | str = "auto"  # SparseConfig.window ("auto": None)
    popularity: str = "hard"  # SparseConfig.popularity
    sliding: bool = False  # SparseConfig.sliding
    host_memory_limit: int | str = ""  # SparseConfig.host_memory_limit ("" or 0: none)
    max_window: int = 0  # SparseConfig.max_window (0: none)
    root: str = "/dev/shm/torchmoe-ckpt"  # TierConfig.root
    run_id: str = ""  # TierConfig.run_id; "": derived from torchrun's TORCHELASTIC_RUN_ID (never shared between jobs)
    replicas: int = 0  # TierConfig.replicas
    upload_backlog: int = 4  # TierConfig.upload_backlog
    spare_windows: int = 1  # TierConfig.spare_windows
    object_store: dict[str, Any] = field(default_factory=dict)  # TierConfig.object_store (STORE_KEYS; {}: none)
    storage_options: dict[str, Any] = field(default_factory=dict)  # the dense export's (and the store's by default)
    hang_timeout_s: float = 0.0  # CheckpointConfig.hang_timeout_s (0: off)
    on_unusable_checkpoint: str = "fail"  # CheckpointConfig.on_unusable_checkpoint: "fail" | "restart"
    replay_check: str = "exact"  # CheckpointConfig.replay_check: "exact" | "tolerant"
    replay_tolerance: float = 1e-2  # CheckpointConfig.replay_tolerance (replay_check.DEFAULT_TOLERANCE)
    persist_interval: int = 1
    dense_export_uri: str = ""
    dense_export_every: int = 0
    dense_export_keep: int = 2
    pipeline_log_max_bytes: int = 0  # bound on each pipeline stage's boundary log (0: unbounded)
    # How the file named each key that came under an old name (new name -> old name): messages say what it wrote.
    # Not a field: it describes the file, not a setting (set per instance by from_table).
    given_as: ClassVar[dict[str, str]] = {}

    # ---- construction from a TOML table ------------------------------------------------------------
    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_table(cls, table: dict[str, Any], *, section: str = "sparse_checkpoint") -> SparseCheckpointSection:
        """Build and validate from a parsed TOML table (old key names mapped onto the core's). Raises
        JobConfigError (one line); warns (DeprecatedKeyWarning) about old names once the section is valid."""
        if not isinstance(table, dict):
            raise JobConfigError(f"[{section}] must be a table; fix: write it as a [{section}] section")
        valid = cls.keys()
        unknown = [k for k in table if k not in valid and k not in DEPRECATED]
        if unknown:
            raise JobConfigError(f"[{section}] unknown key '{unknown[0]}'; fix: use one of {', '.join(valid)}")
        table, given_as = _core_names(table, section)
        sec = cls(**table)
        sec.given_as = given_as
        sec.validate(section)
        if given_as and os.environ.get("RANK", "0") == "0":  # every rank reads the file: one says it
            old = ", ".join(f"{o} -> {n}" for n, o in given_as.items())
            warnings.warn(
                f"[{section}] deprecated key name(s), still read this release: {old}; fix: use the new names "
                "(the core configuration's, docs/torchtitan.md)",
                DeprecatedKeyWarning,
                stacklevel=2,
            )
        return sec

    def _name(self, key: str) -> str:
        return self.given_as.get(key, key)

    def validate(self, section: str = "sparse_checkpoint") -> None:
        def bad(key: str, why: str, fix: str) -> JobConfigError:
            value = (
                self.object_store.get(key.split(".", 1)[1]) if key.startswith("object_store.") else getattr(self, key)
            )
            return JobConfigError(f"[{section}] {self._name(key)} = {value!r}: {why}; fix: {fix}")

        if not isinstance(self.enable, bool):
            raise bad("enable", "must be a boolean", "enable = true or enable = false")
        w = self.window
        if isinstance(w, bool) or not (w == "auto" or isinstance(w, int)):
            raise bad("window", 'must be "auto" or an integer >= 1', 'window = "auto" or e.g. window = 4')
        if isinstance(w, int) and w < 1:
            raise bad("window", "must be >= 1", 'window = "auto" (sized from measured bandwidth) or an integer >= 1')
        if not isinstance(self.sliding, bool):
            raise bad("sliding", "must be a boolean", "sliding = true or sliding = false")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 0:
            raise bad("replicas", "must be an integer >= 0", "replicas = 0 (host memory only) or 1, 2, ...")
        for key in ("root", "run_id", "dense_export_uri"):
            if not isinstance(getattr(self, key), str):
                raise bad(key, "must be a string", f'{self._name(key)} = "..."')
        if not self.root:
            raise bad("root", "must not be empty", f'{self._name("root")} = "/dev/shm/torchmoe-ckpt"')
        if "/" in self.run_id:
            raise bad("run_id", "must be a name without '/' (or empty: torchrun's run id)", 'run_id = "my-job"')
        if not isinstance(self.storage_options, dict):
            raise bad("storage_options", "must be a table", 'storage_options = { endpoint_url = "..." }')
        self._validate_store(bad, section)
        if (
            isinstance(self.persist_interval, bool)
            or not isinstance(self.persist_interval, int)
            or self.persist_interval < 1
        ):
            raise bad("persist_interval", "must be an integer >= 1", "persist_interval = 1")
        if self.persist_interval != 1:
            # The core's PersistThread persists every committed window; skipping windows needs a core change.
            raise bad("persist_interval", "only 1 (persist every window) is supported so far", "persist_interval = 1")
        if self.popularity not in ORDERINGS:
            raise bad("popularity", "unknown ordering", f"use one of {', '.join(ORDERINGS)}")
        t = self.hang_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < math.inf:
            raise bad(
                "hang_timeout_s", "must be a finite number >= 0", f"{self._name('hang_timeout_s')} = 0 (off) or e.g. 60"
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
        if self.storage_options and not (self.store_uri or self.dense_export_uri):
            raise JobConfigError(
                f"[{section}] storage_options is set but there is no object store (object_store.uri is empty) and "
                'no dense_export_uri; fix: set object_store = { uri = "..." } or remove storage_options'
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
            raise bad("replay_tolerance", "must be a relative bound in (0, 1)", "replay_tolerance = 1e-2")
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

    def _validate_store(self, bad, section: str) -> None:
        """The object_store table: ObjectStoreConfig's keys and value types (its URI is opened in check_store)."""
        o = self.object_store
        if not isinstance(o, dict):
            raise bad("object_store", "must be a table", 'object_store = { uri = "s3://bucket/prefix" }')
        unknown = [k for k in o if k not in STORE_KEYS]
        if unknown:
            raise JobConfigError(
                f"[{section}] object_store: unknown key '{unknown[0]}'; fix: use one of {', '.join(STORE_KEYS)}"
            )
        if not o:
            return
        uri, fmt = self._name("object_store.uri"), self._name("object_store.format")
        if not isinstance(o.get("uri", ""), str):
            raise bad("object_store.uri", "must be a string", f'{uri} = "s3://bucket/prefix"')
        if not isinstance(o.get("storage_options", {}), dict):
            raise bad("object_store.storage_options", "must be a table", 'storage_options = { endpoint_url = "..." }')
        if o.get("format", "dcp") not in STORE_FORMATS:
            raise bad("object_store.format", "unknown format", f"use one of {', '.join(STORE_FORMATS)}")
        for key, fix in (("exit_wait_s", "30 (0: do not wait for pending uploads at exit)"), ("lease_s", "30")):
            v = o.get(key, 30.0)
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not 0 <= v < math.inf
                or (key == "lease_s" and v == 0)
            ):
                name = self._name(f"object_store.{key}")
                raise bad(
                    f"object_store.{key}",
                    "must be a number of seconds >= 0" if key == "exit_wait_s" else "must be a number of seconds > 0",
                    f"{name} = {fix}",
                )
        k = o.get("keep", 2)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise bad("object_store.keep", "must be an integer >= 1 (windows kept in the store)", "keep = 2")
        if o.get("format", "dcp") != "dcp" and not o.get("uri"):
            raise bad("object_store.format", f"is set but {uri} is empty", f"set {uri} or remove {fmt}")

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
        root = Path(self.root)
        probe = root / f".probe-{os.getpid()}-{uuid.uuid4().hex}"  # unique: every rank probes at once
        try:
            root.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            why = exc.strerror or str(exc)
            raise JobConfigError(
                f"[sparse_checkpoint] {self._name('root')} = {self.root!r}: cannot create or write it "
                f"({type(exc).__name__}: {why}); fix: {self._name('root')} = a writable node-local "
                'directory, e.g. "/dev/shm/torchmoe-ckpt"'
            ) from None

    def check_format(self) -> None:
        """The tensorstore format needs the tensorstore package and a kvstore driver for the URI's scheme."""
        if self.store_format != "tensorstore" or not self.store_uri:
            return
        fmt = self._name("object_store.format")
        key = f"[sparse_checkpoint] {fmt} = {self.store_format!r}"
        if importlib.util.find_spec("tensorstore") is None:
            raise JobConfigError(
                f"{key}: the tensorstore package is not installed; fix: pip install "
                f"'torchmoe-ckpt[tensorstore]' or {fmt} = \"dcp\""
            )
        from torchmoe_ckpt.storage.tensorstore_spec import NoTensorstoreDriver, kvstore_spec

        try:
            kvstore_spec(self.store_uri)  # no storage options: nothing but the scheme is looked at
        except NoTensorstoreDriver as exc:
            raise JobConfigError(f'{key}: {exc}; fix: {fmt} = "dcp" for this store') from None

    def check_store(self, probe: bool = True) -> None:
        """Open (and by default probe-write) the object store and the dense-export location once; raises
        JobConfigError naming the fix (with the key as the file wrote it)."""
        from torchmoe_ckpt.storage.store_open import StoreConfigError, open_store

        for key, uri, options in (
            (self._name("object_store.uri"), self.store_uri, self.store_options),
            ("dense_export_uri", self.dense_export_uri if self.dense_export_every else "", self.storage_options),
        ):
            if not uri:
                continue
            try:
                open_store(uri, options or None, probe=probe)
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
        from torchmoe_ckpt.capture.host_memory import parse_bytes

        return parse_bytes(self.host_memory_limit)

    def core_config(self):
        """The library's SparseConfig for this section."""
        from torchmoe_ckpt.config import SparseConfig

        return SparseConfig(
            window=None if self.window == "auto" else int(self.window),
            popularity=self.popularity,
            sliding=self.sliding,
            host_memory_limit=self.memory_limit(),
            max_window=self.max_window or None,
        )

    def replay_policy(self):
        """How recovery checks each replayed iteration (torchmoe_ckpt.replay_check.ReplayPolicy)."""
        from torchmoe_ckpt.recovery.replay_check import ReplayPolicy

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
        cfg: dict[str, Any] = {"root": self.root, "run_id": self.resolved_run_id(), "replicas": self.replicas}
        if ranks_per_node:
            cfg["ranks_per_node"] = ranks_per_node
        for key, default in (("upload_backlog", 4), ("spare_windows", 1)):  # host memory: only when changed
            if getattr(self, key) != default:
                cfg[key] = getattr(self, key)
        if self.store_uri:
            cfg["object_store"] = dict(
                self.object_store,
                format=self.store_format,
                exit_wait_s=self.exit_wait_s,
                storage_options=dict(self.store_options),
            )
        return cfg

    # ---- the object store, as the core reads it (ObjectStoreConfig's defaults where the table is silent) ----------
    @property
    def store_uri(self) -> str:
        return self.object_store.get("uri", "")

    @property
    def store_format(self) -> str:
        return self.object_store.get("format", "dcp")

    @property
    def store_options(self) -> dict:
        """The object store's fsspec options: its table's, else the section's (one set for both, as before)."""
        return self.object_store.get("storage_options", self.storage_options)

    @property
    def exit_wait_s(self) -> float:
        """ObjectStoreConfig.exit_wait_s: the bounded wait for pending uploads at exit."""
        return float(self.object_store.get("exit_wait_s", 30.0))

    def to_dict(self) -> dict:
        return asdict(self)


def _core_names(table: dict[str, Any], section: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The table with every old key under its core name (DEPRECATED), and {core name: old name} for what moved.
    A key given under both names is an error (which one would win is not obvious)."""
    out = {k: v for k, v in table.items() if k not in DEPRECATED}
    store = dict(out["object_store"]) if isinstance(out.get("object_store"), dict) else None
    given_as: dict[str, str] = {}
    for old, new in DEPRECATED.items():
        if old not in table:
            continue
        head, _, sub = new.partition(".")
        if head in out and not sub or sub and store is not None and sub in store:
            raise JobConfigError(f"[{section}] {old} and {new} are both set; fix: keep {new} (the new name)")
        if sub:
            if store is None and "object_store" in out:  # not a table: validation says so
                continue
            store = {} if store is None else store
            store[sub] = table[old]
        else:
            out[new] = table[old]
        given_as[new] = old
    if store is not None:
        out["object_store"] = store
    return out, given_as
