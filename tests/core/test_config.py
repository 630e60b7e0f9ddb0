"""Every configuration value is checked at construction, by value: one ConfigError line naming the field
(issue 28: "bf16" raised AttributeError later, torch.int8, stall_iterations=True and inf/nan waits were
accepted)."""

from __future__ import annotations

import math

import pytest
import torch

import torchmoe_ckpt as tmc

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize("name", ["bf16", "bfloat16", "torch.bfloat16", "BF16"])
def test_compute_dtype_by_name(name):
    assert tmc.CheckpointConfig(compute_dtype=name).compute_dtype is torch.bfloat16
    assert tmc.CheckpointConfig(compute_dtype=torch.float16).compute_dtype is torch.float16
    assert tmc.CheckpointConfig().compute_dtype is None  # inferred from the model


BAD = [
    (tmc.CheckpointConfig, {"compute_dtype": "bf17"}, "compute_dtype 'bf17' is not a dtype name"),
    (tmc.CheckpointConfig, {"compute_dtype": torch.int8}, "compute_dtype must be a floating-point dtype"),
    (tmc.CheckpointConfig, {"compute_dtype": 16}, "compute_dtype must be a floating-point dtype"),
    (tmc.CheckpointConfig, {"hang_timeout_s": INF}, "hang_timeout_s must be a finite number"),
    (tmc.CheckpointConfig, {"hang_timeout_s": NAN}, "hang_timeout_s must be a finite number"),
    (tmc.CheckpointConfig, {"hang_timeout_s": 0}, "hang_timeout_s must be a finite number"),
    (tmc.CheckpointConfig, {"hang_timeout_s": True}, "hang_timeout_s must be a finite number"),
    (tmc.CheckpointConfig, {"hang_start_timeout_s": "60"}, "hang_start_timeout_s must be a finite number"),
    (tmc.CheckpointConfig, {"max_grad_norm": INF}, "max_grad_norm must be a finite number > 0"),
    (tmc.CheckpointConfig, {"max_grad_norm": NAN}, "max_grad_norm must be a finite number > 0"),
    (tmc.TierConfig, {"stall_iterations": True}, "stall_iterations must be an integer"),
    (tmc.SparseConfig, {"overlap": NAN}, "overlap must be a finite number > 0"),
    (tmc.SparseConfig, {"overlap": INF}, "overlap must be a finite number > 0"),
    (tmc.SparseConfig, {"bandwidth_bytes_per_s": 0.0}, "bandwidth_bytes_per_s must be a finite number > 0"),
    (tmc.SparseConfig, {"bandwidth_bytes_per_s": INF}, "bandwidth_bytes_per_s must be a finite number > 0"),
    (tmc.SparseConfig, {"decay": 2.0}, "decay must be in [0, 1]"),
    (tmc.SparseConfig, {"reorder_fraction": NAN}, "reorder_fraction must be in [0, 1]"),
]


@pytest.mark.parametrize(
    "cls,kw,words", BAD, ids=[f"{c.__name__}-{next(iter(k))}={k[next(iter(k))]!r}" for c, k, _ in BAD]
)
def test_bad_value_is_one_line_naming_the_field(cls, kw, words):
    with pytest.raises(tmc.ConfigError) as exc:
        cls(**kw)
    assert words in str(exc.value) and "\n" not in str(exc.value), exc.value


@pytest.mark.parametrize("wait", [INF, NAN, -1.0, True])
def test_store_exit_wait_is_finite(wait):
    with pytest.raises(tmc.ConfigError, match="exit_wait_s must be a number of seconds >= 0"):
        tmc.ObjectStoreConfig(uri="file:///tmp/x", exit_wait_s=wait)


def test_replicas_above_the_documented_bound_is_refused():
    from torchmoe_ckpt.core.tier_config import MAX_REPLICAS

    assert tmc.TierConfig(replicas=MAX_REPLICAS).replicas == MAX_REPLICAS
    for bad in (MAX_REPLICAS + 1, 10**12, -1):
        with pytest.raises(tmc.ConfigError) as exc:
            tmc.TierConfig(replicas=bad)
        assert "\n" not in str(exc.value) and str(MAX_REPLICAS) in str(exc.value), exc.value


@pytest.mark.parametrize(
    "uri,what,good",
    [
        ("s3://", "bucket", "s3://b"),
        ("s3:///ckpt", "bucket", "s3://b/ckpt"),
        ("s3a://", "bucket", "s3a://b"),
        ("az:///x", "container", "az://c/x"),
    ],
)
def test_a_store_uri_without_a_bucket_is_refused_naming_it(uri, what, good):
    assert tmc.ObjectStoreConfig(uri=good).uri == good  # with one: accepted (the store is probed at start)
    with pytest.raises(tmc.ConfigError) as exc:
        tmc.ObjectStoreConfig(uri=uri)
    assert "\n" not in str(exc.value) and f"names no {what}" in str(exc.value), exc.value
