"""An object store that fails in the middle of a TorchTitan job (issue 17), on a real moto S3 server.

While training: a warning with the reason; training goes on. At exit: a summary that lists the windows that
never reached the store, and the process ends within `store_exit_wait_s` (+ slack). When the store is back
(here: empty, on the same port) the uploads catch up with complete windows only and `torchmoe-ckpt verify`
passes. Healthy windows print a status line each ("... store uploaded (lag ...)").
"""

from __future__ import annotations

import json
import re
import time
from datetime import datetime

import pytest

pytest.importorskip("torchtitan")

from titan_integration import recovery_demo
from torchmoe_harness.servers import create_bucket, moto_server

pytestmark = pytest.mark.titan  # starts TorchTitan: not in make test-fast

WAIT_S = 3
STEPS = 12  # W = 2: windows 0..5
STAMP = re.compile(r"\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


def _stamp(line: str) -> datetime:
    return datetime.strptime(STAMP.search(line).group(1), "%Y-%m-%d %H:%M:%S,%f")


def _rank0(lines: list[str], needle: str) -> list[int]:
    return [i for i, ln in enumerate(lines) if ln.startswith("[default0]") and needle in ln]


def test_store_outage_mid_run_warns_summarises_exits_in_time_and_catches_up(tmp_path):
    from torchmoe_ckpt.ops.cli import main as cli
    from torchmoe_ckpt.persist.uploader import Uploader
    from torchmoe_ckpt.storage_format.store_open import open_store
    from torchmoe_ckpt.tiers.host_tier import HostTier
    from torchmoe_ckpt.tiers.object_tier import ObjectTier

    with moto_server() as moto:
        create_bucket(moto.storage_options, "outage")
        opts = moto.storage_options
        sparse = (
            f'object_store = {{ uri = "s3://outage/ckpt", exit_wait_s = {WAIT_S} }}\nstorage_options = '
            f'{{ key = "{opts["key"]}", secret = "{opts["secret"]}", client_kwargs = {{ endpoint_url = '
            f'"{moto.endpoint_url}" }} }}'
        )
        host = tmp_path / "host"
        job = recovery_demo.write_job(tmp_path, steps=STEPS, window=2, host_dir=host, extra_sparse=sparse)
        seen: dict[str, float] = {}

        def echo(line: str) -> None:  # the store goes away once the first window is in it
            if "store uploaded" in line and "stopped" not in seen:
                moto.stop()
                seen["stopped"] = time.monotonic()
            if "torchmoe: exit:" in line and line.startswith("[default0]"):
                seen["summary"] = time.monotonic()

        rc, out = recovery_demo.torchrun(tmp_path, recovery_demo.child_env(), job, nproc=2, echo=echo, timeout=55)
        ended = time.monotonic()
        lines = out.splitlines()
        assert rc == 0, out[-5000:]
        assert "stopped" in seen, out[-5000:]
        # Healthy windows: one status line each on rank 0 (none on rank 1).
        first = lines[_rank0(lines, "torchmoe: window 0 steps 1..2 bytes ")[0]]
        assert re.search(
            r"torchmoe: window 0 steps 1\.\.2 bytes [\d.]+ MiB host ok store uploaded \(lag [\d.]+ s\)", first
        ), first
        assert not [ln for ln in lines if ln.startswith("[default1]") and "torchmoe: window" in ln]
        # The warning, with the reason, while rank 0 was still training.
        warn = _rank0(lines, "WARNING - torchmoe: object store failing: upload of window")
        done = _rank0(lines, "Training completed")
        assert warn and done and warn[0] < done[0], "\n".join(lines[-80:])
        assert "Cannot connect" in lines[warn[0]] or "Could not connect" in lines[warn[0]], lines[warn[0]]
        assert len(warn) == 1  # once per change of state, not once per retry
        assert _rank0(lines, "store pending")  # windows committed meanwhile say so
        # The exit summary lists the pending windows; the wait is bounded by object_store.exit_wait_s.
        summary = lines[_rank0(lines, "torchmoe: exit:")[0]]
        last = STEPS // 2 - 1
        m = re.search(
            rf"exit: (\d+) window\(s\) committed \(newest {last}, steps {STEPS - 1}\.\.{STEPS}\).* "
            rf"1 uploaded, (\d+) pending \(windows? ([\d, ]+)\) after waiting ([\d.]+) s of "
            rf"exit_wait_s = {WAIT_S}",
            summary,
        )
        assert m and "WARNING" in summary, summary
        assert int(m.group(1)) == last + 1 and str(last) in m.group(3).split(", "), summary
        assert float(m.group(4)) <= WAIT_S + 0.5
        waited = (_stamp(summary) - _stamp(lines[done[0]])).total_seconds()
        assert waited <= WAIT_S + 2.0, waited  # from the end of training to the summary
        assert ended - seen["summary"] <= 10, ended - seen["summary"]  # and the job ended right after it

        # The store is back on the same port, and empty (as after a restart without its data).
        moto.start()
        fs, _ = open_store("s3://outage/ckpt", opts)
        fs.rm("outage/ckpt", recursive=True)
        uri, cli_opts = "s3://outage/ckpt", ["--storage-options", json.dumps(opts)]
        for rank in range(2):  # what a run with this run_id does first (PersistThread: Uploader.catch_up)
            tier = HostTier(host / "node-0", "demo", rank, 2)
            up = Uploader(ObjectTier(uri, "demo", rank, opts), tier)
            up.catch_up()
            assert up.flush(30) and up.uploaded and max(up.uploaded) == last, (up.uploaded, up.errors)
        assert cli(["verify", uri, *cli_opts]) == 0


def test_store_exit_wait_s_is_a_checked_key_that_reaches_the_library_config():
    from titan_integration.sparse_cli import split_args
    from titan_integration.sparse_config import JobConfigError, SparseCheckpointSection
    from torchmoe_ckpt.config import ConfigError, ObjectStoreConfig, TierConfig

    assert split_args(["--sparse_checkpoint.store_exit_wait_s", "5"])[1] == {"store_exit_wait_s": 5.0}
    sec = SparseCheckpointSection.from_table({"store_exit_wait_s": 5, "object_store_uri": "memory://x", "run_id": "r"})
    assert TierConfig.from_dict(sec.tiers_config()).object_store.exit_wait_s == 5.0
    assert ObjectStoreConfig("memory://x").exit_wait_s == 30.0  # the default, documented
    with pytest.raises(JobConfigError, match=r"store_exit_wait_s = -1: must be a number of seconds >= 0 .*; fix:"):
        SparseCheckpointSection.from_table({"store_exit_wait_s": -1})
    with pytest.raises(ConfigError, match="exit_wait_s must be a number of seconds >= 0"):
        ObjectStoreConfig("memory://x", exit_wait_s=-2)
