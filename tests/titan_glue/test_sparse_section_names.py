"""The TorchTitan ``[sparse_checkpoint]`` section uses the core configuration's field names; the old names still
work for one release, with one warning, and map onto exactly what the new names give."""

from __future__ import annotations

import tomllib
import warnings
from dataclasses import fields
from pathlib import Path

import pytest

from titan_integration.sparse_cli import merged, split_args
from titan_integration.sparse_config import (
    DEPRECATED,
    STORE_KEYS,
    DeprecatedKeyWarning,
    JobConfigError,
    SparseCheckpointSection,
)
from torchmoe_ckpt.config import ObjectStoreConfig, SparseConfig, TierConfig

NEW = {
    "root": "/dev/shm/x",
    "popularity": "decayed",
    "hang_timeout_s": 7,
    "object_store": {"uri": "memory://names/x", "format": "dcp", "exit_wait_s": 5},
    "run_id": "r",
}
OLD = {
    "host_dir": "/dev/shm/x",
    "ordering": "decayed",
    "fault_timeout_s": 7,
    "object_store_uri": "memory://names/x",
    "object_store_format": "dcp",
    "store_exit_wait_s": 5,
    "run_id": "r",
}


def _section(table):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        sec = SparseCheckpointSection.from_table(table)
    return sec, [w for w in seen if issubclass(w.category, DeprecatedKeyWarning)]


def test_section_keys_are_the_core_configs_field_names():
    core = {f.name for c in (SparseConfig, TierConfig) for f in fields(c)}
    own = {"enable", "storage_options", "persist_interval", "on_unusable_checkpoint", "replay_check"}
    own |= {"replay_tolerance", "hang_timeout_s", "dense_export_uri", "dense_export_every", "dense_export_keep"}
    own |= {"pipeline_log_max_bytes"}
    assert set(SparseCheckpointSection.keys()) - core <= own, set(SparseCheckpointSection.keys()) - core - own
    assert set(STORE_KEYS) == {f.name for f in fields(ObjectStoreConfig)}
    for old, new in DEPRECATED.items():  # every old key maps onto a key that exists
        head, _, sub = new.partition(".")
        assert head in SparseCheckpointSection.keys() and (not sub or sub in STORE_KEYS), old


def test_old_names_warn_once_and_give_the_same_configuration_as_the_new_ones():
    new, new_warnings = _section(NEW)
    old, old_warnings = _section(OLD)
    assert not new_warnings
    assert len(old_warnings) == 1
    msg = str(old_warnings[0].message)
    for o, n in DEPRECATED.items():
        assert f"{o} -> {n}" in msg, msg
    assert "fix: use the new names" in msg
    assert old.core_config() == new.core_config()
    assert old.tiers_config() == new.tiers_config()
    assert TierConfig.from_dict(new.tiers_config()).object_store.exit_wait_s == 5.0
    assert (old.hang_timeout_s, old.exit_wait_s, old.store_uri) == (7, 5.0, "memory://names/x")


def test_a_key_under_both_names_is_refused_in_one_line():
    with pytest.raises(JobConfigError, match=r"host_dir and root are both set; fix: keep root"):
        SparseCheckpointSection.from_table({"root": "/a", "host_dir": "/b"})
    with pytest.raises(JobConfigError, match=r"object_store_uri and object_store\.uri are both set"):
        SparseCheckpointSection.from_table({"object_store": {"uri": "memory://a"}, "object_store_uri": "memory://b"})


def test_messages_name_the_key_as_the_file_wrote_it():
    with pytest.raises(JobConfigError, match=r"^\[sparse_checkpoint\] ordering = 'x': 'x' is not one of hard, soft"):
        SparseCheckpointSection.from_table({"ordering": "x"})
    with pytest.raises(JobConfigError, match=r"^\[sparse_checkpoint\] popularity = 'x': 'x' is not one of hard, soft"):
        SparseCheckpointSection.from_table({"popularity": "x"})
    with pytest.raises(JobConfigError, match=r"object_store\.exit_wait_s = -1: must be a number of seconds >= 0"):
        SparseCheckpointSection.from_table({"object_store": {"uri": "memory://a", "exit_wait_s": -1}})
    with pytest.raises(JobConfigError, match=r"object_store: unknown key 'url'; fix: use one of uri, "):
        SparseCheckpointSection.from_table({"object_store": {"url": "memory://a"}})
    with pytest.raises(JobConfigError, match=r"sliding = 'yes': must be true or false.*; fix: "):
        SparseCheckpointSection.from_table({"sliding": "yes"})


def test_sliding_reaches_the_core_config():
    assert SparseCheckpointSection.from_table({"sliding": True}).core_config().sliding is True
    assert SparseCheckpointSection.from_table({}).core_config().sliding is False


def test_command_line_sets_one_key_of_the_object_store_and_keeps_the_files_others():
    rest, flags = split_args(
        ["--steps", "3", "--sparse_checkpoint.object_store.exit_wait_s", "2", "--sparse_checkpoint.popularity", "soft"]
    )
    assert rest == ["--steps", "3"]
    assert flags == {"object_store": {"exit_wait_s": 2.0}, "popularity": "soft"}
    table = merged({"object_store": {"uri": "memory://f", "keep": 3}}, flags)
    assert table["object_store"] == {"uri": "memory://f", "keep": 3, "exit_wait_s": 2.0}
    sec, warned = _section(table)
    assert not warned and sec.exit_wait_s == 2.0 and sec.store_uri == "memory://f" and sec.popularity == "soft"


def test_the_shipped_job_file_uses_the_new_names():
    job = Path(__file__).resolve().parents[2] / "titan_integration" / "jobs" / "tiny_sparse.toml"
    table = tomllib.loads(job.read_text())["sparse_checkpoint"]
    assert not set(table) & set(DEPRECATED)
    _, warned = _section(table)
    assert not warned


@pytest.mark.parametrize(
    "file, flag, want",
    [
        ({"root": "/f"}, {"host_dir": "/c"}, {"root": "/c"}),  # an old-name flag over the file's new name
        ({"host_dir": "/f"}, {"root": "/c"}, {"root": "/c"}),  # a new-name flag over the file's old name
        ({"object_store": {"uri": "memory://f", "keep": 3}}, {"object_store_uri": "memory://c"}, None),
        ({"object_store_uri": "memory://f"}, {"object_store": {"uri": "memory://c"}}, None),
    ],
)
def test_a_command_line_flag_replaces_the_files_value_under_either_name(file, flag, want):
    sec, _ = _section(merged(file, flag))
    if want is not None:
        assert sec.root == want["root"]
    else:
        assert sec.store_uri == "memory://c"
        assert sec.object_store.get("keep", 2) == file.get("object_store", {}).get("keep", 2)  # the file's others kept


def test_tiers_config_carries_the_store_defaults():
    sec, _ = _section({"object_store": {"uri": "memory://d"}, "run_id": "r"})
    store = sec.tiers_config()["object_store"]
    assert (store["format"], store["exit_wait_s"]) == ("dcp", 30.0)
    assert TierConfig.from_dict(sec.tiers_config()).object_store == ObjectStoreConfig("memory://d")
