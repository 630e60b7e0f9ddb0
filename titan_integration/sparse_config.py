"""The ``[sparse_checkpoint]`` section of a TorchTitan job file, built on the core configuration.

Its keys are the core configuration's own field names (torchmoe_ckpt.config: `SparseConfig`, `TierConfig`,
`ObjectStoreConfig`, `CheckpointConfig`), with their defaults, their choices (the same `Literal` types) and their
checks: the core's, never restated here (tests/titan_glue/test_sparse_section_core.py). A core field is
declared here with `core(...)`, which reads its default from the core dataclass. What TOML changes:

* TOML has no null, so the core's ``None`` is written as ``TOML_NONE`` spells it: ``window = "auto"``,
  ``host_memory_limit = ""``, ``max_window = 0``, ``run_id = ""``, ``hang_timeout_s = 0``, ``object_store = {}``;
* ``TITAN_DEFAULTS``: the one default chosen differently here, ``hang_timeout_s`` off (TorchTitan has its own
  collective timeouts);
* the section's own keys: ``enable``, ``storage_options`` (the dense export's, and the store's by default),
  ``persist_interval``, ``dense_export_uri``/``_every``/``_keep``, ``pipeline_log_max_bytes``.

The keys, their meaning and an example: docs/torchtitan.md; each core field's docstring says what it does.

Older names still work for one release, with a warning once the section is valid (``DEPRECATED``): ``host_dir``
(root), ``ordering`` (popularity), ``fault_timeout_s`` (hang_timeout_s), ``object_store_uri``,
``object_store_format`` and ``store_exit_wait_s`` (object_store.uri / .format / .exit_wait_s).

Everything is checked before training starts; a bad value raises :class:`JobConfigError` whose message is
one line ``... ; fix: ...`` naming the key as the file wrote it (the launcher prints it as ``error: <message>``
and exits with status 2). :meth:`SparseCheckpointSection.check_resources` is what the launcher runs first, before
TorchTitan is imported: the host directory (created and probe-written), the on-store format (tensorstore
importable, a driver for the URI) and the object store / dense-export location (opened and probe-written). This
module imports neither torch nor TorchTitan (torchmoe_ckpt.config is torch-free).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import typing
import uuid
import warnings
from dataclasses import MISSING, Field, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from torchmoe_ckpt.config import (
    POPULARITIES,
    STORE_FORMATS,
    CheckpointConfig,
    ConfigError,
    CopyPhase,
    ObjectStoreConfig,
    OnUnusable,
    Policy,
    Popularity,
    SparseConfig,
    TierConfig,
    default_run_id,
)
from torchmoe_ckpt.core.config_values import ReplayCheck, ReplayPolicy

__all__ = [
    "JobConfigError",
    "DeprecatedKeyWarning",
    "SparseCheckpointSection",
    "CORE_KEYS",
    "TOML_NONE",
    "TITAN_DEFAULTS",
    "DEPRECATED",
    "ORDERINGS",
    "STORE_FORMATS",
    "STORE_KEYS",
]

ORDERINGS = POPULARITIES  # SparseConfig.popularity's choices
STORE_KEYS = tuple(f.name for f in fields(ObjectStoreConfig))  # the object_store table's keys
# The section's keys that are core fields, and the core dataclass each belongs to.
CORE_KEYS: dict[str, type] = {
    **dict.fromkeys(("window", "popularity", "sliding", "host_memory_limit", "max_window"), SparseConfig),
    # the GPU copy path (docs/gpu.md): the auto-W target and the switches the GPU check measures
    **dict.fromkeys(("max_step_overhead", "copy_phase", "copy_chunk_bytes"), SparseConfig),
    **dict.fromkeys(("reads_on_copy_stream", "device_staging"), SparseConfig),
    # the checkpoint policy (planning/policy.py): sparse windows or a dense snapshot every k iterations
    **dict.fromkeys(("policy", "dense_interval", "mtbf"), SparseConfig),
    **dict.fromkeys(("root", "run_id", "replicas", "upload_backlog", "spare_windows"), TierConfig),
    **dict.fromkeys(("peer_max_lag_windows", "peer_interval", "peer_link_share", "object_store"), TierConfig),
    **dict.fromkeys(("peer_timeout_s",), TierConfig),
    **dict.fromkeys(("hang_timeout_s", "on_unusable_checkpoint", "replay_check", "replay_tolerance"), CheckpointConfig),
}
# TOML has no null: how a key spells the core's None (the first spelling is the one the section's default uses).
TOML_NONE: dict[str, tuple[Any, ...]] = {
    "window": ("auto",),
    "dense_interval": ("auto",),  # the interval with the best predicted ETTR
    "mtbf": ("",),  # ~3 h at 16,384 GPUs, scaled to the job (SparseConfig.mtbf)
    "host_memory_limit": ("", 0),
    "max_window": (0,),
    "copy_chunk_bytes": (0,),  # one copy per item
    "run_id": ("",),  # torchrun's run id (TierConfig.run_id)
    "hang_timeout_s": (0.0,),  # off
    "object_store": ({},),  # no object store
}
# Defaults chosen differently from the core's (core value), with the reason.
TITAN_DEFAULTS: dict[str, Any] = {
    "hang_timeout_s": None,  # off: TorchTitan has its own timeouts (comm.init_timeout_seconds, train_timeout_seconds)
}
_STORE_PROBE_URI = "memory://sparse-checkpoint-check"  # checks an object_store key while the table has no uri yet
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


def _core_field(cls: type, name: str) -> Field:
    return next(f for f in fields(cls) if f.name == name)


def core_default(key: str) -> Any:
    """The core's default of a section key (or TITAN_DEFAULTS'), as the core holds it (None included)."""
    if key in TITAN_DEFAULTS:
        return TITAN_DEFAULTS[key]
    f = _core_field(CORE_KEYS[key], key)
    return f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default


def to_toml(key: str, value: Any) -> Any:
    """A core value as the section writes it (None: TOML_NONE's spelling)."""
    return TOML_NONE[key][0] if value is None and key in TOML_NONE else value


def to_core(key: str, value: Any) -> Any:
    """A section value as the core takes it (TOML_NONE's spellings: None; anything else as is, for its checks)."""
    if any(value == none and type(value) is not bool for none in TOML_NONE.get(key, ())):
        return None
    return value


def core(key: str) -> Any:
    """The dataclass field of a core key: the core's default, in TOML's spelling."""
    default = to_toml(key, core_default(key))
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default))
    return field(default=default)


@functools.cache
def choices(cls: type, name: str) -> tuple[Any, ...]:
    """The values a core field's Literal type allows (empty: not a choice field)."""
    hint = typing.get_type_hints(cls)[name]
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else ()


@dataclass
class SparseCheckpointSection:
    """TorchTitan's ``[sparse_checkpoint]``: the core fields below mean what their core docstrings say."""

    enable: bool = False
    """Sparse per-iteration checkpointing on; false: the stock Trainer, untouched."""
    window: int | Literal["auto"] = core("window")  # SparseConfig.window
    popularity: Popularity = core("popularity")  # SparseConfig.popularity
    sliding: bool = core("sliding")  # SparseConfig.sliding
    host_memory_limit: int | str = core("host_memory_limit")  # SparseConfig.host_memory_limit
    max_window: int = core("max_window")  # SparseConfig.max_window
    max_step_overhead: float = core("max_step_overhead")  # SparseConfig.max_step_overhead (CUDA, auto W)
    copy_phase: CopyPhase = core("copy_phase")  # SparseConfig.copy_phase
    copy_chunk_bytes: int = core("copy_chunk_bytes")  # SparseConfig.copy_chunk_bytes
    reads_on_copy_stream: bool = core("reads_on_copy_stream")  # SparseConfig.reads_on_copy_stream
    device_staging: bool = core("device_staging")  # SparseConfig.device_staging
    policy: Policy = core("policy")  # SparseConfig.policy: "auto", "sparse" or "dense"
    dense_interval: int | Literal["auto"] = core("dense_interval")  # SparseConfig.dense_interval
    mtbf: float | str = core("mtbf")  # SparseConfig.mtbf: seconds or "3h"; "": the default
    root: str = core("root")  # TierConfig.root
    run_id: str = core("run_id")  # TierConfig.run_id (resolved once per worker: resolved_run_id)
    replicas: int = core("replicas")  # TierConfig.replicas
    upload_backlog: int = core("upload_backlog")  # TierConfig.upload_backlog
    spare_windows: int = core("spare_windows")  # TierConfig.spare_windows
    peer_max_lag_windows: int = core("peer_max_lag_windows")  # TierConfig.peer_max_lag_windows
    peer_interval: int | Literal["auto"] = core(
        "peer_interval"
    )  # TierConfig.peer_interval: every k-th window, or "auto"
    peer_link_share: float = core("peer_link_share")  # TierConfig.peer_link_share
    peer_timeout_s: float = core("peer_timeout_s")  # TierConfig.peer_timeout_s: one peer message's longest wait
    object_store: dict[str, Any] = core("object_store")  # TierConfig.object_store: ObjectStoreConfig's keys
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options of the dense export, and of the object store when its table has none."""
    hang_timeout_s: float = core("hang_timeout_s")  # CheckpointConfig.hang_timeout_s (TITAN_DEFAULTS)
    on_unusable_checkpoint: OnUnusable = core("on_unusable_checkpoint")  # CheckpointConfig.on_unusable_checkpoint
    replay_check: ReplayCheck = core("replay_check")  # CheckpointConfig.replay_check
    replay_tolerance: float = core("replay_tolerance")  # CheckpointConfig.replay_tolerance
    persist_interval: int = 1
    """Persist every N-th window to the storage tiers; only 1 (every window) is supported so far."""
    dense_export_uri: str = ""
    """Where dense exports go, in TorchTitan's layout ({uri}/step-N; any fsspec URI). "": none."""
    dense_export_every: int = 0
    """> 0: a dense export every N iterations (dcp.async_save, off the training thread)."""
    dense_export_keep: int = 2
    """The newest dense exports kept; older ones are deleted."""
    pipeline_log_max_bytes: int = 0
    """Pipeline parallelism: the bound on each stage's boundary log. 0: none."""

    def __post_init__(self):
        # How the file named each key that came under an old name (new name -> old name), set by from_table:
        # messages say what the file wrote. Not a field: it describes the file, not a setting.
        self.given_as: dict[str, str] = {}

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

    def _value(self, key: str) -> Any:
        head, _, sub = key.partition(".")
        return self.object_store.get(sub) if sub else getattr(self, head)

    def _bad(self, section: str, key: str, why: str, fix: str) -> JobConfigError:
        return JobConfigError(f"[{section}] {self._name(key)} = {self._value(key)!r}: {why}; fix: {fix}")

    def _core_error(self, section: str, key: str, exc: ConfigError) -> JobConfigError:
        """The core's own message for a bad value, under the key as the file wrote it, with a fix."""
        cls, name = (ObjectStoreConfig, key.split(".", 1)[1]) if "." in key else (CORE_KEYS[key], key)
        why = re.sub(rf"^(?:\w+\.)?{re.escape(name)}:?\s+", "", str(exc))
        for none in TOML_NONE.get(key, ())[:1]:
            why = why.replace("None", _toml_text(none))
        allowed = choices(cls, name)
        if allowed:
            fix = f"use one of {', '.join(allowed)}"
        elif _core_field(cls, name).default is MISSING:  # ObjectStoreConfig.uri
            fix = f"correct {self._name(key)} (torchmoe_ckpt.config.{cls.__name__}.{name})"
        else:
            default = core_default(key) if cls is not ObjectStoreConfig else _core_field(cls, name).default
            fix = f"e.g. {self._name(key)} = {_toml_text(to_toml(key, default))} (the default)"
        return self._bad(section, key, why, fix)

    def validate(self, section: str = "sparse_checkpoint") -> None:
        """The section's own keys here; every core key by the core dataclass's own checks, one key at a time
        (so the message names it), then the whole core configuration once."""
        if not isinstance(self.enable, bool):
            raise self._bad(section, "enable", "must be a boolean", "enable = true or enable = false")
        if not isinstance(self.storage_options, dict):
            raise self._bad(section, "storage_options", "must be a table", 'storage_options = { endpoint_url = "..." }')
        self._validate_store(section)
        for key, cls in CORE_KEYS.items():
            if key == "object_store":
                continue  # key by key above
            try:
                cls(**{key: to_core(key, getattr(self, key))})
            except ConfigError as exc:
                raise self._core_error(section, key, exc) from None
        if not _whole(self.persist_interval, 1):
            raise self._bad(section, "persist_interval", "must be an integer >= 1", "persist_interval = 1")
        if self.persist_interval != 1:
            # The core's PersistThread persists every committed window; skipping windows needs a core change.
            raise self._bad(
                section, "persist_interval", "only 1 (persist every window) is supported so far", "persist_interval = 1"
            )
        if not isinstance(self.dense_export_uri, str):
            raise self._bad(section, "dense_export_uri", "must be a string", 'dense_export_uri = "..."')
        for key in ("dense_export_every", "dense_export_keep", "pipeline_log_max_bytes"):
            if not _whole(getattr(self, key), 0):
                raise self._bad(section, key, "must be an integer >= 0", f"{key} = 0 (off) or e.g. 100")
        if self.dense_export_every and not self.dense_export_uri:
            raise self._bad(
                section,
                "dense_export_every",
                "needs a place to write",
                'set dense_export_uri = "file:///..." (any fsspec URI) or dense_export_every = 0',
            )
        if self.storage_options and not (self.store_uri or self.dense_export_uri):
            raise JobConfigError(
                f"[{section}] storage_options is set but there is no object store (object_store.uri is empty) and "
                'no dense_export_uri; fix: set object_store = { uri = "..." } or remove storage_options'
            )
        try:
            self.checkpoint_config()  # what the keys give together (each one alone passed above)
        except ConfigError as exc:
            raise JobConfigError(f"[{section}] {exc}; fix: see docs/torchtitan.md") from None

    def _validate_store(self, section: str) -> None:
        """The object_store table: ObjectStoreConfig's keys, each checked by ObjectStoreConfig itself (its URI is
        opened in check_store)."""
        o = self.object_store
        if not isinstance(o, dict):
            raise self._bad(section, "object_store", "must be a table", 'object_store = { uri = "s3://bucket/prefix" }')
        unknown = [k for k in o if k not in STORE_KEYS]
        if unknown:
            raise JobConfigError(
                f"[{section}] object_store: unknown key '{unknown[0]}'; fix: use one of {', '.join(STORE_KEYS)}"
            )
        for key, value in o.items():
            if key == "uri" and value == "":
                continue  # no object store
            try:
                ObjectStoreConfig(**{"uri": _STORE_PROBE_URI, key: value})
            except ConfigError as exc:
                raise self._core_error(section, f"object_store.{key}", exc) from None
        if o.get("format", self.store_format) != _core_field(ObjectStoreConfig, "format").default and not o.get("uri"):
            uri, fmt = self._name("object_store.uri"), self._name("object_store.format")
            raise self._bad(section, "object_store.format", f"is set but {uri} is empty", f"set {uri} or remove {fmt}")

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
                f"directory, e.g. {_toml_text(core_default('root'))}"
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
        from torchmoe_ckpt.storage_format.tensorstore_spec import NoTensorstoreDriver, kvstore_spec

        try:
            kvstore_spec(self.store_uri)  # no storage options: nothing but the scheme is looked at
        except NoTensorstoreDriver as exc:
            raise JobConfigError(f'{key}: {exc}; fix: {fmt} = "dcp" for this store') from None

    def check_store(self, probe: bool = True) -> None:
        """Open (and by default probe-write) the object store and the dense-export location once; raises
        JobConfigError naming the fix (with the key as the file wrote it)."""
        from torchmoe_ckpt.core.errors import StoreConfigError
        from torchmoe_ckpt.storage_format.store_open import open_store

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
    def _core_kwargs(self, cls: type) -> dict[str, Any]:
        """This section's values of `cls`'s fields, as the core takes them (object_store: separately)."""
        return {k: to_core(k, getattr(self, k)) for k, c in CORE_KEYS.items() if c is cls and k != "object_store"}

    def core_config(self) -> SparseConfig:
        """The library's SparseConfig for this section (the core's defaults for what the section does not set)."""
        return SparseConfig(**self._core_kwargs(SparseConfig))

    def store_config(self) -> ObjectStoreConfig | None:
        """The library's ObjectStoreConfig (None: no object store); storage_options default to the section's."""
        if not self.store_uri:
            return None
        return ObjectStoreConfig(**{**self.object_store, "storage_options": dict(self.store_options)})

    def tier_config(self, run_id: str | None = None) -> TierConfig:
        """The library's TierConfig (run_id: this section's, unresolved, unless given)."""
        kwargs = self._core_kwargs(TierConfig)
        return TierConfig(**{**kwargs, "run_id": run_id or kwargs["run_id"], "object_store": self.store_config()})

    def checkpoint_config(self) -> CheckpointConfig:
        """The whole core configuration the section describes (the tiers with the run id unresolved)."""
        return CheckpointConfig(
            tiers=self.tier_config(), window=self.core_config(), **self._core_kwargs(CheckpointConfig)
        )

    def replay_policy(self) -> ReplayPolicy:
        """How recovery checks each replayed iteration (torchmoe_ckpt.replay_check.ReplayPolicy)."""
        return ReplayPolicy(self.replay_check, float(self.replay_tolerance))

    def resolved_run_id(self) -> str:
        """The run id windows are kept under: the job file's, else torchrun's (the same in every restart of
        one launch, new for every launch), so two jobs never share a default."""
        rid = self.run_id or default_run_id()
        if not rid:
            raise JobConfigError(
                "[sparse_checkpoint] run_id is empty and there is no torchrun run id "
                '(TORCHELASTIC_RUN_ID) to derive one from; fix: run_id = "my-job" (unique per run)'
            )
        return rid

    def tiers_config(self, ranks_per_node: int | None = None) -> dict:
        """The dict torchmoe_ckpt.persist.build_tiers.build_tiers takes: the keys set away from the core's defaults
        (root, run_id and replicas always), the object store in full."""
        cfg: dict[str, Any] = {"root": self.root, "run_id": self.resolved_run_id(), "replicas": self.replicas}
        if ranks_per_node:
            cfg["ranks_per_node"] = ranks_per_node
        changeable = (
            "upload_backlog",
            "spare_windows",
            "peer_max_lag_windows",
            "peer_interval",
            "peer_link_share",
            "peer_timeout_s",
        )
        for key in changeable:  # only when changed
            if getattr(self, key) != core_default(key):
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
        return self.object_store.get("format", _core_field(ObjectStoreConfig, "format").default)

    @property
    def store_options(self) -> dict:
        """The object store's fsspec options: its table's, else the section's (one set for both, as before)."""
        return self.object_store.get("storage_options", self.storage_options)

    @property
    def exit_wait_s(self) -> float:
        """ObjectStoreConfig.exit_wait_s: the bounded wait for pending uploads at exit."""
        return float(self.object_store.get("exit_wait_s", _core_field(ObjectStoreConfig, "exit_wait_s").default))

    def to_dict(self) -> dict:
        return asdict(self)


def _whole(value: Any, least: int) -> bool:
    """An integer (not a bool) >= least."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _toml_text(value: Any) -> str:
    """A value as a job file writes it."""
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value) if isinstance(value, (str, dict)) else repr(value)


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
        if (not sub and head in out) or (sub and store is not None and sub in store):
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
