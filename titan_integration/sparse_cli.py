"""``--sparse_checkpoint.KEY VALUE`` on the command line, like TorchTitan's own ``--section.option`` flags.

The ``[sparse_checkpoint]`` section is not part of TorchTitan's config dataclasses (tyro would reject the
flags: ``Unrecognized options``), so the launcher takes these flags out of the argument list first:

* with a job file (``--config job.toml``) they override the file's ``[sparse_checkpoint]`` keys: the launcher
  puts them in ``$TORCHMOE_TITAN_SPARSE_ARGS`` (JSON), which :func:`titan_integration.job_toml.sparse_section`
  merges over the file's table, in the launcher's checks and in TorchTitan's ``ConfigManager`` alike;
* otherwise they go into the ``--override.imports titan_integration.overrides.sparse_checkpoint={...}`` JSON
  (added when absent; the override switches sparse checkpointing on unless ``--sparse_checkpoint.no-enable``).

Forms: ``--sparse_checkpoint.window 4``, ``--sparse_checkpoint.window=4``, ``--sparse_checkpoint.run-id X``
(``-`` or ``_``), booleans as flags (``--sparse_checkpoint.enable``, ``--sparse_checkpoint.no-enable``) or
with ``true``/``false``, tables (``storage_options``, ``object_store``) as a JSON object, one key of the
object store as ``--sparse_checkpoint.object_store.uri s3://...``. The old key names work as in a job file.
Values are typed by the field; the section's own validation then applies, so a bad value is the same one line
as in a job file.

Nothing here imports TorchTitan (CPU mode must be set up before it is imported) or torch.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, fields
from typing import Any

from titan_integration.sparse_config import DEPRECATED, STORE_KEYS, JobConfigError, SparseCheckpointSection

__all__ = [
    "PREFIX",
    "SPARSE_ENV",
    "OVERRIDE_TARGET",
    "split_args",
    "override_entries",
    "override_section",
    "merge_into_override",
    "env_overrides",
    "merged",
]

PREFIX = "--sparse_checkpoint."
SPARSE_ENV = "TORCHMOE_TITAN_SPARSE_ARGS"
OVERRIDE_TARGET = "titan_integration.overrides.sparse_checkpoint"  # == titan_integration.overrides.TARGET
OVERRIDE_FLAG = "--override.imports"
_DEFAULTS = {f.name: f for f in fields(SparseCheckpointSection)}
_TRUE, _FALSE = ("true", "True", "1", "yes"), ("false", "False", "0", "no")
# the object store's keys (ObjectStoreConfig's types)
_STORE_KINDS = {"uri": "str", "storage_options": "json", "keep": "int", "format": "str", "exit_wait_s": "float"}
_STORE_KINDS["lease_s"] = "float"
assert set(_STORE_KINDS) == set(STORE_KEYS)


def _known(key: str) -> bool:
    head, dot, sub = key.partition(".")
    return head == "object_store" and sub in _STORE_KINDS if dot else key in _DEFAULTS or key in DEPRECATED


def _kind(key: str) -> str:
    key = DEPRECATED.get(key, key)
    if key.startswith("object_store."):
        return _STORE_KINDS[key.split(".", 1)[1]]
    if key in ("window", "dense_interval"):  # "auto" or an int
        return "window"
    f = _DEFAULTS[key]
    default = f.default_factory() if f.default_factory is not MISSING else f.default
    return {bool: "bool", int: "int", float: "float", dict: "json", str: "str"}[type(default)]


def _typed(key: str, raw: str) -> Any:
    """The value a TOML file would give; a value of the wrong type is kept as text, so the section's own
    validation names the field and the fix."""
    kind = _kind(key)
    try:
        if kind == "window":
            return raw if raw == "auto" else int(raw)
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
    except ValueError:
        return raw
    if kind == "bool":
        return True if raw in _TRUE else False if raw in _FALSE else raw
    if kind == "json":
        try:
            val = json.loads(raw)
        except json.JSONDecodeError:
            val = None
        if not isinstance(val, dict):
            raise JobConfigError(
                f'{PREFIX}{key} {raw!r}: not a JSON object; fix: {PREFIX}{key} \'{{"endpoint_url": "http://..."}}\''
            )
        return val
    return raw


def split_args(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """(argv without the ``--sparse_checkpoint.*`` flags, {key: typed value}); later flags win."""
    rest: list[str] = []
    out: dict[str, Any] = {}
    valid = list(_DEFAULTS)
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith(PREFIX):
            rest.append(arg)
            continue
        name, eq, raw = arg[len(PREFIX) :].partition("=")
        name = name.replace("-", "_")
        negated = name.startswith("no_") and name[3:] in _DEFAULTS and _kind(name[3:]) == "bool"
        key = name[3:] if negated else name
        if not _known(key):
            raise JobConfigError(f"{PREFIX}{name}: unknown [sparse_checkpoint] key; fix: use one of {', '.join(valid)}")
        if _kind(key) == "bool" and not eq:
            if negated:
                out[key] = False
            elif i < len(argv) and argv[i] in _TRUE + _FALSE:
                out[key] = argv[i] in _TRUE
                i += 1
            else:
                out[key] = True
            continue
        if negated:
            raise JobConfigError(f"{arg}: a negated flag takes no value; fix: {PREFIX}{key}={raw}")
        if not eq:
            if i >= len(argv) or argv[i].startswith("--"):
                raise JobConfigError(f"{PREFIX}{key} needs a value; fix: {PREFIX}{key} VALUE")
            raw = argv[i]
            i += 1
        head, dot, sub = key.partition(".")
        if dot:  # one key of a table: merged into it (the table itself may come as JSON too)
            out.setdefault(head, {})[sub] = _typed(key, raw)
        else:
            out[key] = _typed(key, raw)
    return rest, out


def merged(table: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    """`flags` over `table`; the object store's keys one by one (a flag for its exit wait keeps the file's URI). A
    flag replaces the file's value under either name: `--sparse_checkpoint.host_dir X` over a file that says
    `root = ...` sets root (with the old name's warning), it is not a key given twice."""
    out = dict(table)
    if isinstance(out.get("object_store"), dict):
        out["object_store"] = dict(out["object_store"])
    for key, value in flags.items():
        target = DEPRECATED.get(key, key)
        targets = (
            [f"object_store.{k}" for k in value] if target == "object_store" and isinstance(value, dict) else [target]
        )
        for t in targets:
            out = {k: v for k, v in out.items() if k == key or DEPRECATED.get(k) != t}  # the file's old name
            _, _, sub = t.partition(".")
            if sub and key != "object_store" and isinstance(out.get("object_store"), dict):
                out["object_store"].pop(sub, None)  # an old-name flag over the file's table key
            elif not sub and key != t:
                out.pop(t, None)  # an old-name flag over the file's new name
    for key, value in flags.items():
        if key == "object_store" and isinstance(value, dict) and isinstance(out.get("object_store"), dict):
            out["object_store"] = {**out["object_store"], **value}
        else:
            out[key] = value
    return out


def env_overrides(environ) -> dict[str, Any]:
    """The command-line values the launcher handed on to the job-file loader."""
    raw = environ.get(SPARSE_ENV)
    return json.loads(raw) if raw else {}


# ---- --override.imports: the same parsing as torchtitan.config.override.parse_cli_imports ------------------
def _override_span(args: list[str]) -> tuple[int, int] | None:
    """[start, end) of the ``--override.imports`` flag and its tokens (the last occurrence wins in tyro)."""
    span = None
    for i, a in enumerate(args):
        if a == OVERRIDE_FLAG or a.startswith(OVERRIDE_FLAG + "="):
            end = i + 1
            if a == OVERRIDE_FLAG:
                while end < len(args) and not args[end].startswith("--"):
                    end += 1
            span = (i, end)
    return span


def _tokens(args: list[str], span: tuple[int, int]) -> list[str]:
    first = args[span[0]]
    return ([first.split("=", 1)[1]] if "=" in first else []) + args[span[0] + 1 : span[1]]


def override_entries(args: list[str]) -> list[tuple[str, dict]]:
    """Every ``--override.imports`` entry as (target, kwargs); bad JSON is one JobConfigError line."""
    span = _override_span(args)
    entries: list[tuple[str, dict]] = []
    for token in _tokens(args, span) if span else []:
        target, sep, raw = token.partition("=")
        if not sep:
            entries.extend((t, {}) for t in token.split(",") if t)
            continue
        try:
            kwargs = json.loads(raw)
        except json.JSONDecodeError as exc:
            kwargs, why = None, str(exc)
        else:
            why = "not a JSON object"
        if not isinstance(kwargs, dict):
            raise JobConfigError(
                f"--override.imports {target}: {why}; fix: quote it as one token: '{OVERRIDE_TARGET}={{\"window\": 3}}'"
            )
        entries.append((target, kwargs))
    return entries


def override_section(args: list[str]) -> SparseCheckpointSection | None:
    """The validated section our override entry describes (``enable`` defaults to true), or None."""
    section = None
    for target, kwargs in override_entries(args):
        if target.startswith("titan_integration.overrides.") and target != OVERRIDE_TARGET:
            raise JobConfigError(f"--override.imports {target}: no such override; fix: use {OVERRIDE_TARGET}")
        if target == OVERRIDE_TARGET:
            section = SparseCheckpointSection.from_table(
                {"enable": True, **kwargs}, section="override sparse_checkpoint"
            )
    return section


def merge_into_override(args: list[str], values: dict[str, Any]) -> list[str]:
    """``args`` with ``values`` merged into our override's JSON (the entry is added when absent)."""
    if not values:
        return list(args)
    span = _override_span(args)
    entries = override_entries(args)
    kwargs = {}
    for target, kw in entries:
        if target == OVERRIDE_TARGET:
            kwargs.update(kw)
    kwargs = merged(kwargs, values)
    others = [t if not kw else f"{t}={json.dumps(kw)}" for t, kw in entries if t != OVERRIDE_TARGET]
    tokens = others + [f"{OVERRIDE_TARGET}={json.dumps(kwargs)}"]
    if span is None:
        return list(args) + [OVERRIDE_FLAG, *tokens]
    return list(args[: span[0]]) + [OVERRIDE_FLAG, *tokens] + list(args[span[1] :])
