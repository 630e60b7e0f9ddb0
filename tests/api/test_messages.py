"""One golden test per user-facing message: the exact text a user reads, for a given input, is pinned once here, in
tests/golden/messages/<case>.txt. Other tests check the error type or the `event=` fields (tests/support/events.py),
not the message's phrases.

Each case below is one input and the message it gets: a config validation error (core configs and the TorchTitan
`[sparse_checkpoint]` section), the refusal of another run's windows, the refusal of a run whose every window was
rejected, and the CLI's one-line errors. Run-specific parts (temporary paths) are normalised before comparing.

A message changed on purpose: regenerate the golden files, then read the diff (`git diff tests/golden`) as a user would:

    UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/api/test_messages.py
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import torchmoe_ckpt.config as tmc
from titan_integration.sparse_config import JobConfigError, SparseCheckpointSection
from torchmoe_ckpt.core.config_values import check_uri, parse_bytes
from torchmoe_ckpt.core.errors import StoreConfigError
from torchmoe_ckpt.core.rejection import Rejection, RejectionKind
from torchmoe_ckpt.model.identity import build_identity, identity_mismatch, refusal
from torchmoe_ckpt.model.operators import discover_operators
from torchmoe_ckpt.ops.cli import main
from torchmoe_ckpt.recovery.resume import unusable_message
from torchmoe_ckpt.tiers.object_tier import ObjectTier
from torchmoe_harness.model import TinyMoE, TinyMoEConfig

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "messages"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"


def _why(kind: RejectionKind, message: str) -> Rejection:
    return Rejection(kind, message)


def _raised(exc_type: type[BaseException], fn: Callable[[], object]) -> str:
    with pytest.raises(exc_type) as info:
        fn()
    return str(info.value)


def _config(exc_type: type[BaseException], fn: Callable[[], object]) -> Callable[[], str]:
    return lambda: _raised(exc_type, fn)


def _section(table: dict) -> Callable[[], str]:
    return _config(JobConfigError, lambda: SparseCheckpointSection.from_table(table))


def _cli(*args: str) -> Callable[[], str]:
    """The CLI's stderr for these arguments (exit 2, one line: checked here for every case)."""

    def run(capsys) -> str:
        try:
            rc = main(list(args))
        except SystemExit as exc:  # argparse's own errors
            rc = exc.code
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1, (rc, err)
        return err

    run.wants_capsys = True  # type: ignore[attr-defined]
    return run


def _identity(dtype=torch.float32, seed=0, **cfg):
    model = TinyMoE(TinyMoEConfig(**cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return build_identity(model, opt, dtype, discover_operators(model), "r", data="d", seed=seed)


def _another_model() -> str:
    why = identity_mismatch(_identity(num_experts=4).to_dict(), _identity(dtype=torch.bfloat16, num_experts=8, dim=48))
    assert why is not None
    return refusal("run-a", why)


def _another_seed() -> str:
    why = identity_mismatch(_identity(num_experts=4).to_dict(), _identity(num_experts=4, seed=1))
    assert why is not None
    return refusal("run-a", why)


RUN_DIR = "/dev/shm/torchmoe/run-a"

CASES: dict[str, Callable] = {
    # core configs (torchmoe_ckpt/core/config_values.py, sparse_config.py, tier_config.py)
    "sparse_window_not_an_integer": _config(tmc.ConfigError, lambda: tmc.SparseConfig(window="3")),
    "sparse_overlap_not_a_number": _config(tmc.ConfigError, lambda: tmc.CheckpointConfig(window={"overlap": "1"})),
    "sparse_decay_out_of_range": _config(tmc.ConfigError, lambda: tmc.SparseConfig(decay=2.0)),
    "checkpoint_window_not_a_sparse_config": _config(tmc.ConfigError, lambda: tmc.CheckpointConfig(window=3)),
    "checkpoint_on_unusable_unknown": _config(
        tmc.ConfigError, lambda: tmc.CheckpointConfig(on_unusable_checkpoint="never")
    ),
    "checkpoint_max_grad_norm_zero": _config(tmc.ConfigError, lambda: tmc.CheckpointConfig(max_grad_norm=0)),
    "tiers_unknown_key": _config(tmc.ConfigError, lambda: tmc.CheckpointConfig(tiers={"root": "/tmp/x", "replica": 1})),
    "tiers_replicas_not_an_integer": _config(tmc.ConfigError, lambda: tmc.TierConfig(replicas="1")),
    "tiers_peer_timeout_zero": _config(ValueError, lambda: tmc.TierConfig(peer_timeout_s=0)),
    "store_exit_wait_negative": _config(
        tmc.ConfigError, lambda: tmc.ObjectStoreConfig(uri="file:///tmp/x", exit_wait_s=-1.0)
    ),
    "store_format_unknown": _config(tmc.ConfigError, lambda: tmc.ObjectStoreConfig(uri="s3://b/p", format="zarr")),
    "store_keep_not_an_integer": _config(tmc.ConfigError, lambda: tmc.ObjectStoreConfig(uri="s3://b/p", keep="2")),
    "uri_unknown_scheme": _config(StoreConfigError, lambda: ObjectTier("gs://bucket/x", "run", 0)),
    "uri_missing_slash": _config(ValueError, lambda: check_uri("s3:/bucket/x")),
    "bytes_not_a_size": _config(tmc.ConfigError, lambda: parse_bytes("lots")),
    # another run's windows (torchmoe_ckpt/model/identity.py)
    "identity_another_model": _another_model,
    "identity_another_seed": _another_seed,
    # every window rejected (torchmoe_ckpt/recovery/resume.py)
    "unusable_replay_diverged": lambda: unusable_message(
        "run-a",
        RUN_DIR,
        {
            3: {_why(RejectionKind.REPLAY_DIVERGENCE, "replay: ReplayDivergence: loss 1.25 != 1.5 at step 10"): [0, 1]},
            2: {_why(RejectionKind.CORRUPT, "slot-01/items-0.bin: checksum 1a != 2b (corrupt)"): [1]},
        },
    ),
    "unusable_damaged": lambda: unusable_message(
        "run-a", RUN_DIR, {2: {_why(RejectionKind.TORN, "slot-00/manifest.json: torn (no manifest)"): [0]}}
    ),
    "unusable_parts_lost": lambda: unusable_message(
        "run-a",
        RUN_DIR,
        {2: {_why(RejectionKind.NO_COPY, "no copy: rank 1 holds no copy of window 2 on any tier"): [1]}},
    ),
    # the TorchTitan [sparse_checkpoint] section (titan_integration/sparse_config.py)
    "titan_old_and_new_name": _section({"root": "/a", "host_dir": "/b"}),
    "titan_not_one_of": _section({"popularity": "x"}),
    "titan_old_name_not_one_of": _section({"ordering": "x"}),
    "titan_exit_wait_negative": _section({"object_store": {"uri": "memory://a", "exit_wait_s": -1}}),
    "titan_unknown_store_key": _section({"object_store": {"url": "memory://a"}}),
    "titan_not_a_bool": _section({"sliding": "yes"}),
    "titan_window_zero": _section({"window": 0}),
    "titan_unknown_scheme": _config(
        JobConfigError,
        lambda: SparseCheckpointSection.from_table({"object_store": {"uri": "ftp://host/x"}}).check_store(),
    ),
    "titan_on_unusable_unknown": _section({"on_unusable_checkpoint": "never"}),
    # the CLI's one-line errors (torchmoe_ckpt/ops/cli.py)
    "cli_empty_location": _cli("inspect", ""),
    "cli_a_file": _cli("inspect", "/etc/passwd"),
    "cli_no_such_location": _cli("verify", "/no/such/dir"),
    "cli_unknown_scheme": _cli("inspect", "gs://bucket/x"),
    "cli_missing_slash": _cli("verify", "s3:/bucket/x"),
    "cli_bad_storage_options": _cli("verify", "/tmp", "--storage-options", "{not json"),
    "cli_out_of_range": _cli("simulate", "--seeds", "0"),
    "cli_not_an_int": _cli("selftest", "--window", "three"),
    "cli_fail_at_past_steps": _cli("selftest", "--fail-at", "20", "--steps", "12"),
    "cli_hsdp_not_a_divisor": _cli("selftest", "--nproc", "3", "--hsdp", "2"),
}


def normalise(text: str) -> str:
    """The message with its run-specific parts replaced: temporary directories, object addresses."""
    text = text.replace(tempfile.gettempdir().rstrip("/") + "/", "<tmp>/")
    text = re.sub(r"<tmp>/pytest-of-[^/]+/pytest-\d+/[^/\s]+", "<tmp_path>", text)
    return re.sub(r"0x[0-9a-f]{6,}", "0x<addr>", text)


@pytest.mark.parametrize("case", sorted(CASES))
def test_message(case, capsys):
    make = CASES[case]
    text = normalise(make(capsys) if getattr(make, "wants_capsys", False) else make())
    path = GOLDEN / f"{case}.txt"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text if text.endswith("\n") else text + "\n")
        return
    assert path.exists(), f"no golden file {path}: run UPDATE_GOLDEN=1 pytest {__file__} and review it"
    want = path.read_text()
    assert (text if text.endswith("\n") else text + "\n") == want


def test_every_golden_file_has_its_case():
    """A golden file whose case was removed or renamed is left over: delete it (UPDATE_GOLDEN does not)."""
    assert sorted(p.stem for p in GOLDEN.glob("*.txt")) == sorted(CASES)
