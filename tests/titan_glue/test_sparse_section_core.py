"""TorchTitan's ``[sparse_checkpoint]`` section is built on the core configuration: every key that is a core field
takes its default, its choices and its checks from the core dataclass, and the section's module writes none of
them again (titan_integration/sparse_config.py)."""

from __future__ import annotations

import ast
import typing
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from titan_integration import sparse_config
from titan_integration.sparse_config import (
    CORE_KEYS,
    STORE_KEYS,
    TITAN_DEFAULTS,
    TOML_NONE,
    JobConfigError,
    SparseCheckpointSection,
    to_toml,
)
from torchmoe_ckpt.config import CheckpointConfig, ObjectStoreConfig, SparseConfig, TierConfig

CORE = (SparseConfig, TierConfig, ObjectStoreConfig, CheckpointConfig)
OWN = {  # the section's own keys, no core field behind them
    "enable",
    "storage_options",
    "persist_interval",
    "dense_export_uri",
    "dense_export_every",
    "dense_export_keep",
    "pipeline_log_max_bytes",
}
SECTION = {f.name: f for f in fields(SparseCheckpointSection)}


def _default(f):
    return f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default


def _core(key):
    return next(f for f in fields(CORE_KEYS[key]) if f.name == key)


def _literal(cls, name):
    hint = typing.get_type_hints(cls)[name]
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    return tuple(a for arm in typing.get_args(hint) if typing.get_origin(arm) is typing.Literal for a in arm.__args__)


def test_every_key_is_a_core_field_or_the_sections_own():
    assert set(SECTION) == set(CORE_KEYS) | OWN and not set(CORE_KEYS) & OWN
    for key, cls in CORE_KEYS.items():
        assert key in {f.name for f in fields(cls)}, f"{key} is not a field of {cls.__name__}"
    assert STORE_KEYS == tuple(f.name for f in fields(ObjectStoreConfig))
    assert set(TITAN_DEFAULTS) <= set(CORE_KEYS) and set(TOML_NONE) <= set(CORE_KEYS)


@pytest.mark.parametrize("key", sorted(CORE_KEYS))
def test_a_core_keys_default_is_the_cores(key):
    core_default = TITAN_DEFAULTS[key] if key in TITAN_DEFAULTS else _default(_core(key))
    assert _default(SECTION[key]) == to_toml(key, core_default)
    assert type(_default(SECTION[key])) is type(to_toml(key, core_default))
    if key in TITAN_DEFAULTS:  # a deliberate difference, not a copy
        assert TITAN_DEFAULTS[key] != _default(_core(key))


@pytest.mark.parametrize("key", sorted(CORE_KEYS))
def test_a_core_keys_choices_are_the_cores(key):
    core_choices = _literal(CORE_KEYS[key], key)
    section_choices = tuple(
        c for c in _literal(SparseCheckpointSection, key) if key not in TOML_NONE or c not in TOML_NONE[key]
    )
    assert section_choices == core_choices, key
    for choice in core_choices:  # each one accepted, and a value outside them refused with the core's list
        assert getattr(SparseCheckpointSection.from_table({key: choice}), key) == choice
    hint = typing.get_type_hints(CORE_KEYS[key])[key]
    if core_choices and typing.get_origin(hint) is typing.Literal:
        with pytest.raises(JobConfigError, match=f"; fix: use one of {', '.join(core_choices)}$"):
            SparseCheckpointSection.from_table({key: "not-a-choice"})
    elif core_choices:  # an integer or a choice (peer_interval): the core's message, which names both
        with pytest.raises(JobConfigError, match=f"or '{core_choices[0]}'.*got 'not-a-choice'; fix: e.g. {key} = "):
            SparseCheckpointSection.from_table({key: "not-a-choice"})


def test_object_store_choices_and_defaults_are_the_cores():
    sec = SparseCheckpointSection.from_table({"object_store": {"uri": "memory://x"}, "run_id": "r"})
    assert sec.store_config() == ObjectStoreConfig("memory://x")
    assert (sec.store_format, sec.exit_wait_s) == (
        ObjectStoreConfig("m://").format,
        ObjectStoreConfig("m://").exit_wait_s,
    )
    with pytest.raises(JobConfigError, match=f"use one of {', '.join(_literal(ObjectStoreConfig, 'format'))}$"):
        SparseCheckpointSection.from_table({"object_store": {"uri": "memory://x", "format": "zip"}})


def test_an_empty_section_is_the_core_configuration():
    sec = SparseCheckpointSection()
    assert sec.core_config() == SparseConfig()
    assert sec.tier_config() == TierConfig()
    want = CheckpointConfig(tiers=TierConfig(), **TITAN_DEFAULTS)
    assert sec.checkpoint_config() == want


def test_checks_are_the_cores():
    """A bad core value is refused with the core's own message (under the key as the file wrote it)."""
    for table, core_call in (
        ({"replicas": -1}, lambda: TierConfig(replicas=-1)),
        ({"window": 0}, lambda: SparseConfig(window=0)),
        ({"max_window": "3"}, lambda: SparseConfig(max_window="3")),
        ({"run_id": "a/b"}, lambda: TierConfig(run_id="a/b")),
        ({"replay_tolerance": 2}, lambda: CheckpointConfig(replay_tolerance=2)),
        ({"object_store": {"uri": "memory://x", "keep": 0}}, lambda: ObjectStoreConfig("memory://x", keep=0)),
    ):
        with pytest.raises(ValueError) as core_error:
            core_call()
        with pytest.raises(JobConfigError) as section_error:
            SparseCheckpointSection.from_table(table)
        core_text = str(core_error.value).split(" ", 1)[1]  # less the field's name, which the section writes first
        key = next(iter(table))
        if key in TOML_NONE:  # the core's None, as TOML spells it
            core_text = core_text.replace("None", sparse_config._toml_text(TOML_NONE[key][0]))
        assert core_text in str(section_error.value), (core_text, str(section_error.value))


def _core_defaults() -> set:
    """Every default the core configuration declares that a copy would have to write again (0, 1, 2, None,
    True/False, "" and {} are too common to tell a copy from an unrelated value)."""
    values = set()
    for cls in CORE:
        for f in fields(cls):
            d = _default(f)
            if isinstance(d, (str, int, float)) and not isinstance(d, bool) and d not in ("", 0, 1, 2):
                values.add(d)
    return values


def _core_choice_sets() -> list[set]:
    return [set(_literal(cls, f.name)) for cls in CORE for f in fields(cls) if _literal(cls, f.name)]


def test_the_section_module_writes_no_core_default_or_choice_list():
    source = Path(sparse_config.__file__).read_text()
    tree = ast.parse(source)
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }
    spellings = {s for spelled in TOML_NONE.values() for s in spelled if not isinstance(s, dict)}  # the section's own
    defaults, choice_sets = _core_defaults() - spellings, _core_choice_sets()
    copies = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and id(node) not in docstrings and not isinstance(node.value, bool):
            v = node.value  # a default, or a long one (a path) inside a message
            long_ones = [d for d in defaults if isinstance(d, str) and len(d) > 8]
            if v in defaults or isinstance(v, str) and any(d in v for d in long_ones):
                copies.append((node.lineno, v))
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):  # a list of choices, e.g. ("fail", "restart")
            written = {e.value for e in node.elts if isinstance(e, ast.Constant)}
            if any(len(written & choices) >= 2 for choices in choice_sets):
                copies.append((node.lineno, sorted(map(str, written))))
    assert not copies, f"core defaults or choice lists written again in sparse_config.py (line, value): {copies}"
    assert defaults >= {"hard", "dcp", "exact", "fail", 30.0, 0.01, 4, "/dev/shm/torchmoe-ckpt"}
    assert {"fail", "restart"} in choice_sets and {"dcp", "tensorstore"} in choice_sets
