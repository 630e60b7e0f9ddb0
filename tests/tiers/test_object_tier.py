"""Object-store tier against real stores: a local directory (file://) and S3 on a real moto server.
When every host copy is gone, recovery downloads the window, verifies every file and stays bit-exact; a
store that is down never blocks the caller and the upload catches up when it is back."""

import json
import os

import pytest

from torchmoe_ckpt.core.errors import StoreConfigError
from torchmoe_ckpt.core.rejection import RejectionKind
from torchmoe_ckpt.persist.uploader import Uploader
from torchmoe_ckpt.storage_format.checksums import FileEntry, crc32_bytes
from torchmoe_ckpt.storage_format.layout import manifest_name, writer_name
from torchmoe_ckpt.storage_format.manifest import WindowManifest
from torchmoe_ckpt.tiers.host_tier import HostTier
from torchmoe_ckpt.tiers.object_tier import ObjectTier
from torchmoe_harness.launch import compare, run_torchrun

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast


def test_azure_blob_round_trip_on_azurite(tmp_path, azurite):
    """az:// through adlfs against Azurite: upload (manifest last), list, verified download, retention."""
    tier = HostTier(tmp_path / "host", "run", 0, 1)
    store = ObjectTier("az://tmoe/ckpt", "run", 0, storage_options=azurite.storage_options, keep_windows=1)
    up = Uploader(store, tier)
    for wid in (1, 2):
        _window(tier, wid, bytes([wid]) * 4096)
        up.submit(wid)
        assert up.flush(timeout=30)
    assert up.uploaded == [1, 2] and store.window_ids() == [2]  # retention deleted window 1
    fresh = HostTier(tmp_path / "fresh", "run", 0, 1)
    assert store.download(2, fresh) == [] and fresh.verify(2) == []
    assert (fresh.window_dir(2) / "slot-00/rank-00000/__0_0.distcp").read_bytes() == bytes([2]) * 4096
    _cli_verifies_the_store("az://tmoe/ckpt", azurite.storage_options, 2)


def _cli_verifies_the_store(uri: str, opts: dict, window_id: int) -> None:
    """`torchmoe-ckpt verify URI` exits 0 while every byte in the store verifies, 1 after one byte flips."""
    from torchmoe_ckpt.ops.cli import main
    from torchmoe_ckpt.ops.inspection import inspect_location
    from torchmoe_ckpt.storage_format.store_open import open_store

    assert main(["verify", uri, "--storage-options", json.dumps(opts)]) == 0
    info = inspect_location(uri, opts)
    assert window_id in [w["window_id"] for w in info["windows"] if w["status"] == "verified"], info
    fs, root = open_store(uri, opts, probe=False)
    victim = next(f for f in fs.find(root) if f.endswith(".distcp") and f"window-{window_id:06d}" in f)
    data = bytearray(fs.cat_file(victim))
    data[0] ^= 0x01
    fs.pipe_file(victim, bytes(data))
    assert main(["verify", uri, "--storage-options", json.dumps(opts)]) == 1
    assert main(["inspect", uri, "--storage-options", json.dumps(opts)]) == 0


def spec(root, store):
    return {
        "run": {"steps": 12, "dtype": "fp32"},
        "checkpoint": {"window": 3},
        "failures": [{"step": 10, "phase": "update", "lose_all_hosts": True}],
        "host_tier": {"root": str(root), "run_id": "t", "object_store": store},
    }


@pytest.mark.parametrize("kind", ["file", "s3", "az"])
def test_all_host_copies_lost_recovers_from_the_object_store(tmp_path, reference, kind, request):
    if kind == "file":
        store = {"uri": f"file://{tmp_path / 'store'}"}
    elif kind == "az":
        store = {
            "uri": f"az://tmoe/{tmp_path.name}",
            "storage_options": request.getfixturevalue("azurite").storage_options,
        }
    else:
        store = {
            "uri": f"s3://tmoe-bucket/{tmp_path.name}",
            "storage_options": request.getfixturevalue("moto").storage_options,
        }
    ref = reference(2, {"steps": 12, "dtype": "fp32"})
    run = run_torchrun(2, spec(tmp_path / "shm", store), tmp_path / "run")
    rec = run.report["recoveries"][0]
    assert rec["lost"] == "every node's host memory lost" and rec["source"] == "object store", rec
    assert rec["replayed_iterations"] == 2
    up = run.report["checkpoint"]["object_store"]
    assert up["windows_uploaded"] >= 1 and up["bytes"] > 0, up
    cmp = compare(ref, run)
    assert cmp.bit_exact, cmp.mismatches[:10]
    if kind == "s3":
        _cli_verifies_the_store(store["uri"], store["storage_options"], up["last_window"])


def _window(tier: HostTier, wid: int, payload: bytes) -> None:
    """A committed one-file window on the host tier (what the writer thread produces)."""
    wdir = tier.window_dir(wid)
    (wdir / "slot-00" / f"rank-{tier.rank:05d}").mkdir(parents=True)
    (wdir / "slot-00" / f"rank-{tier.rank:05d}" / "__0_0.distcp").write_bytes(payload)
    man = WindowManifest(
        wid,
        1,
        1,
        1,
        {"slots": []},
        {f"slot-00/rank-{tier.rank:05d}/__0_0.distcp": FileEntry(len(payload), crc32_bytes(payload))},
    )
    (wdir / manifest_name(writer_name(tier.rank))).write_text(man.to_json())


def test_corrupt_or_half_uploaded_windows_are_never_used(tmp_path):
    tier = HostTier(tmp_path / "host", "run", 0, 1)
    store = ObjectTier(f"file://{tmp_path / 'store'}", "run", 0, keep_windows=5)
    for wid in (1, 2, 3):
        _window(tier, wid, bytes([wid]) * 1000)
        store.upload(tier, wid)
    assert store.window_ids() == [1, 2, 3]
    base = tmp_path / "store" / "run"
    (base / "window-000003" / "MANIFEST.rank-00000.json").unlink()  # half-uploaded: invisible
    data = base / "window-000002" / "slot-00" / "rank-00000" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-1] + b"\xff")  # corrupt
    assert store.window_ids() == [1, 2]
    fresh = HostTier(tmp_path / "fresh", "run", 0, 1)
    problems = store.download(2, fresh)
    assert problems and problems[0].kind is RejectionKind.CORRUPT and "torn or corrupt" in str(problems[0])
    assert fresh.window_ids() == []  # nothing half-downloaded looks committed
    assert store.download(1, fresh) == [] and fresh.verify(1) == []
    store.keep = 1
    assert store.collect() == [1] and store.window_ids() == [2]  # retention really deletes


def test_bad_store_settings_fail_at_start_with_one_clear_message(tmp_path, moto):
    with pytest.raises(StoreConfigError, match="unknown object-store URI scheme 'gs'"):
        ObjectTier("gs://bucket/x", "run", 0)
    opts = moto.storage_options
    with pytest.raises(StoreConfigError, match="bucket/container does not exist"):
        ObjectTier("s3://no-such-bucket-here/x", "run", 0, storage_options=opts)
    no_creds = {"client_kwargs": opts["client_kwargs"]}  # moto takes any key; a missing one is detectable
    with pytest.raises(StoreConfigError, match="credentials"):
        ObjectTier("s3://tmoe-bucket/x", "run", 0, storage_options=no_creds)
    from torchmoe_harness.servers import free_port

    dead = dict(opts, client_kwargs={"endpoint_url": f"http://127.0.0.1:{free_port()}"})
    with pytest.raises(StoreConfigError, match="reachable"):
        ObjectTier("s3://tmoe-bucket/x", "run", 0, storage_options=dead)


@pytest.mark.parametrize(
    "uri,meant",
    [
        ("s3:/bucket", "s3://bucket"),
        ("s3:bucket/ckpt", "s3://bucket/ckpt"),
        ("az:/c/p", "az://c/p"),
        ("file:/tmp/x", "file:///tmp/x"),
    ],
)
def test_a_scheme_without_slashes_is_refused_naming_the_uri_meant(tmp_path, monkeypatch, uri, meant):
    """fsspec reads "s3:/bucket" as the local directory ./s3:/bucket: uploads would "succeed" into it."""
    import torchmoe_ckpt as tmc
    from torchmoe_ckpt.tiers.object_tier import make_store

    monkeypatch.chdir(tmp_path)
    with pytest.raises(tmc.ConfigError, match=f"did you mean '{meant}'"):
        tmc.ObjectStoreConfig(uri=uri)
    with pytest.raises(StoreConfigError, match=f"did you mean '{meant}'"):
        make_store(uri, "run", 0)
    with pytest.raises(StoreConfigError, match=f"did you mean '{meant}'"):
        ObjectTier(uri, "run", 0)
    assert not list(tmp_path.iterdir())  # no local directory named after the typo


def test_error_explanations_do_not_read_port_numbers_as_http_status():
    from torchmoe_ckpt.storage_format.store_open import explain as _explain

    class EndpointConnectionError(Exception):  # botocore's name; only the text and name are read
        pass

    # a free port like 44033 once made an unreachable endpoint read as "403: authentication failed"
    down = _explain(
        "s3://b/x",
        EndpointConnectionError('Could not connect to the endpoint URL: "http://127.0.0.1:44033/b/x/.probe"'),
    )
    assert "not reachable" in down and "authentication" not in down
    assert "authentication failed" in _explain(
        "s3://b/x", OSError("An error occurred (403) when calling the PutObject operation: Forbidden")
    )
    assert "does not exist" in _explain("s3://b/x", FileNotFoundError("NoSuchBucket"))


def test_store_down_never_blocks_and_upload_catches_up(tmp_path, moto):
    from torchmoe_harness.servers import create_bucket

    create_bucket(moto.storage_options, "down-bucket")
    tier = HostTier(tmp_path / "host", "run", 0, 1)
    store = ObjectTier(
        "s3://down-bucket/run", "run", 0, storage_options=moto.storage_options, attempts=2, backoff_s=0.05
    )
    up = Uploader(store, tier)
    _window(tier, 1, b"x" * 5000)
    with moto.down():
        up.submit(1)  # returns at once although the store is unreachable
        assert not up.flush(timeout=1.5)  # still pending: the uploader keeps retrying
    # the store is back (same port; moto keeps its buckets in this process)
    assert up.flush(timeout=30) and up.uploaded == [1]
    assert store.window_ids() == [1]


def test_a_store_that_loses_files_mid_upload_gets_the_whole_window_again(tmp_path, moto):
    """The store restarts (empty) while a window is being uploaded: the files written before are gone. The
    manifest must not go up over them (inspect would list a torn window as good): the upload fails, the
    uploader uploads the whole window again, and `verify` passes."""
    from torchmoe_ckpt.ops.inspection import inspect_location

    tier = HostTier(tmp_path / "host", "run", 0, 1)
    wdir, files = tier.window_dir(1), {}
    for i in range(2):
        rel = f"slot-0{i}/rank-00000/__0_0.distcp"
        (wdir / rel).parent.mkdir(parents=True)
        (wdir / rel).write_bytes(bytes([i + 1]) * 3000)
        files[rel] = FileEntry(3000, crc32_bytes(bytes([i + 1]) * 3000))
    (wdir / manifest_name(writer_name(0))).write_text(WindowManifest(1, 1, 2, 1, {"slots": []}, files).to_json())
    uri = f"s3://tmoe-bucket/{tmp_path.name}"
    store = ObjectTier(uri, "run", 0, storage_options=moto.storage_options)
    real_put, lost = store._put, []

    def put_and_lose_the_first_file(path: str, data: bytes) -> None:  # a restart between the two files
        real_put(path, data)
        if path.endswith("slot-01/rank-00000/__0_0.distcp") and not lost:
            lost.append(path.replace("slot-01", "slot-00"))
            store.fs.rm(lost[0])

    store._put = put_and_lose_the_first_file
    up = Uploader(store, tier)
    up.submit(1)
    assert up.flush(timeout=30) and up.uploaded == [1] and lost
    assert any("torn in the store" in e for e in up.errors), up.errors  # the first attempt was refused
    info = inspect_location(uri, moto.storage_options)
    assert [(w["window_id"], w["status"]) for w in info["windows"]] == [(1, "verified")], info
    assert main_verify(uri, moto.storage_options) == 0


def main_verify(uri: str, opts: dict) -> int:
    from torchmoe_ckpt.ops.cli import main

    return main(["verify", uri, "--storage-options", json.dumps(opts)])


def test_status_lines_say_each_window_once_and_store_changes_once(caplog):
    """RunStatus (what rank 0 prints): a healthy window's line waits for its upload; while the store fails,
    lines say pending at once; one warning per change of state; the exit summary names the pending windows."""
    import logging

    from torchmoe_ckpt.ops.status import recovery_line
    from torchmoe_ckpt.persist.run_status import RunStatus

    st = RunStatus(0, peers=1, store="s3://b/x")
    with caplog.at_level(logging.INFO, logger="torchmoe_ckpt"):
        st.window_committed(0, 1, 2, 3 * 2**20, 1)
        assert not st.lines  # said when uploaded
        st.uploaded_window(0, 0.25)
        st.window_committed(1, 3, 4, 3 * 2**20, 1)
        for _ in range(3):  # retries: one warning, not three
            st.upload_failed(1, "upload of window 1: EndpointConnectionError: down", 5.0)
        st.window_committed(2, 5, 6, 3 * 2**20, 1)
        st.uploaded_window(1, 9.0)  # back: window 2 still pending
        summary = st.exit_summary(4.0, 4.0, "/dev/shm/x")
    assert st.lines[0] == "window 0 steps 1..2 bytes 3.0 MiB host ok peers 1/1 store uploaded (lag 0.25 s)"
    assert st.lines[1] == "window 1 steps 3..4 bytes 3.0 MiB host ok peers 1/1 store pending"
    assert st.lines[2].startswith("object store failing: upload of window 1: EndpointConnectionError: down;")
    assert st.lines[3].startswith("window 2 steps 5..6 bytes 3.0 MiB host ok peers 1/1 store pending (2 behind, lag")
    assert st.lines[4].startswith("object store back: window 1 uploaded after 3 failed attempt(s)")
    assert "1 pending (window 2) after waiting 4.0 s of exit_wait_s = 4" in st.lines[5], st.lines[5]
    assert summary["pending"] == [2] and summary["uploaded"] == 2 and len(st.lines) == 6
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3  # failing, back, exit with pending windows
    assert recovery_line(
        {
            "recovered_step": 6,
            "window_id": 1,
            "source": "peer 1",
            "source_peer": 1,
            "replayed_iterations": 2,
            "seconds": 0.5,
        }
    ) == (
        "recovered step 6 from window 1 (copy from the host memory of rank 1), "
        "replayed 2 iteration(s) in 0.50 s; every replayed loss matched the "
        "original run bit for bit"
    )


def test_exit_with_no_window_committed_is_a_warning_that_says_why(caplog):
    import logging

    from torchmoe_ckpt.persist.run_status import RunStatus

    with caplog.at_level(logging.INFO, logger="torchmoe_ckpt"):
        RunStatus(0).exit_summary(0.0, 30.0, "/dev/shm/x")
        RunStatus(1).exit_summary(0.0, 30.0, "/dev/shm/x")  # other ranks: the same line at DEBUG
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "exit: 0 window(s) committed" in warned[0], warned
    assert "nothing a restart could resume from" in warned[0] and "shorter than one window" in warned[0], warned


_HOLDER = """
import sys, time
from torchmoe_ckpt.config import TierConfig
from torchmoe_ckpt.persist.build_tiers import build_tiers
store = {"uri": sys.argv[2], "lease_s": 2.0}
if len(sys.argv) > 3:
    import json
    store["storage_options"] = json.loads(sys.argv[3])
build_tiers(TierConfig(root=sys.argv[1], run_id="t", object_store=store), 0, 1)
print("holding", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_a_second_job_on_the_same_store_prefix_is_refused(tmp_path, monkeypatch, kind, request, fault_summary):
    """Two jobs with the same run id on different host roots meet in one object store: the second is refused
    in one line while the first renews its lease; once the first is gone (SIGKILL), its lease expires and a
    third job takes the prefix over."""
    import subprocess
    import sys

    from torchmoe_ckpt.config import TierConfig
    from torchmoe_ckpt.ownership.store_lease import StoreLeasedError
    from torchmoe_ckpt.persist.build_tiers import build_tiers

    if kind == "file":
        store, opts = {"uri": f"file://{tmp_path / 'store'}"}, None
    else:
        opts = request.getfixturevalue("moto").storage_options
        store = {"uri": f"s3://tmoe-bucket/{tmp_path.name}", "storage_options": opts}
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path / "host-a"), store["uri"], *([json.dumps(opts)] if opts else [])],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, TORCHELASTIC_RUN_ID="job-a"),
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
        cfg = TierConfig(root=str(tmp_path / "host-b"), run_id="t", object_store=dict(store, lease_s=2.0))
        with pytest.raises(StoreLeasedError) as exc:
            build_tiers(cfg, 0, 1)
        msg = str(exc.value)
        fault_summary(f"second job on the same store prefix ({kind})", 1, "refused with one line")
        assert "\n" not in msg and "torchrun:job-a" in msg and "another run_id" in msg, msg
    finally:
        holder.kill()
        holder.wait()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-c")  # the holder is gone: its lease expires, c takes over
    tiers = build_tiers(TierConfig(root=str(tmp_path / "host-c"), run_id="t", object_store=cfg.object_store), 0, 1)
    assert tiers.lease is not None and tiers.lease.read()["job"] == "torchrun:job-c"
    tiers.lease.release()
    assert tiers.lease.read() is None  # a clean exit gives the prefix up at once
