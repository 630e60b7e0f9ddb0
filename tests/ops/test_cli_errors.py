"""Every error of `torchmoe-ckpt` is one line on stderr with exit 2 (bad locations, unreachable or
unauthenticated stores, numbers out of range); `inspect` never merges runs; `verify` fails, listing each
problem, on a window that not every rank committed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchmoe_ckpt.ops.cli import main

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast

CLI = [sys.executable, "-c", "import sys; from torchmoe_ckpt.ops.cli import main; sys.exit(main())"]


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    try:
        rc = main(list(args))
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, (rc, err)
    assert err.strip() and "\n" not in err.strip(), err  # one line: no traceback, no usage block
    assert "error:" in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["inspect", ""], "location is empty"),
        (["inspect", "/etc/passwd"], "is a file, not a checkpoint location"),
        (["verify", "/no/such/dir"], "no such checkpoint location"),
        (["inspect", "gs://bucket/x"], "unknown object-store URI scheme"),
        (["verify", "s3:/bucket/x"], "did you mean 's3://bucket/x'?"),
        (["verify", "/tmp", "--storage-options", "{not json"], "--storage-options"),
        (["simulate", "--seeds", "0"], "--seeds: 0 is out of range: must be >= 1"),
        (["simulate", "--hours", "-5"], "--hours: -5 is out of range: must be > 0"),
        (["simulate", "--hours", "nan"], "--hours: nan is out of range"),
        (["selftest", "--nproc", "0"], "--nproc: 0 is out of range"),
        (["selftest", "--nproc", "99999999999999999999"], "this machine runs at most"),
        (["bench", "--nproc", "100000"], "--nproc: 100000 is out of range: this machine runs at most"),
        (["selftest", "--steps", "0"], "--steps: 0 is out of range"),
        (["selftest", "--experts", "-1"], "--experts: -1 is out of range"),
        (["selftest", "--layers", "0"], "--layers: 0 is out of range"),
        (["selftest", "--window", "0"], "--window: 0 is out of range"),
        (["selftest", "--window", "three"], "--window: 'three' is not a valid int"),
        (["selftest", "--fail-at", "20", "--steps", "12"], "--fail-at 20 must be in [1, --steps 12]"),
        (["selftest", "--nproc", "3", "--hsdp", "2"], "--hsdp 2 must divide --nproc 3"),
        (["bench", "--nproc", "0"], "--nproc: 0 is out of range"),
        (["bench", "--overlap", "0"], "--overlap: 0 is out of range: must be in (0.0, 1.0]"),
        (["bench", "--overlap", "1.5"], "--overlap: 1.5 is out of range"),
        (["no-such-command"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, args, needle):
    rc, _, err = run_cli(capsys, *args)
    one_line_error(rc, err, needle)


def test_a_directory_that_is_not_a_run_is_refused(capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    rc, _, err = run_cli(capsys, "inspect", str(tmp_path))
    one_line_error(rc, err, "not a checkpoint run")


def test_s3_with_a_dead_endpoint_is_one_line(capsys, moto):
    from torchmoe_harness.servers import free_port

    dead = dict(moto.storage_options, client_kwargs={"endpoint_url": f"http://127.0.0.1:{free_port()}"})
    t0 = time.monotonic()
    rc, _, err = run_cli(capsys, "verify", "s3://tmoe-bucket/ckpt", "--storage-options", json.dumps(dead))
    one_line_error(rc, err, "not reachable", "endpoint_url")
    assert time.monotonic() - t0 < 45
    with moto.down():  # the real server, stopped
        rc, _, err = run_cli(
            capsys, "inspect", "s3://tmoe-bucket/ckpt", "--storage-options", json.dumps(moto.storage_options)
        )
    one_line_error(rc, err, "not reachable")


def test_s3_without_credentials_is_one_line(moto):
    """No key/secret in the options and none in the environment (a real process, a clean environment)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_EC2_METADATA_DISABLED="true",
        AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
        AWS_CONFIG_FILE="/nonexistent",
        HOME=str(Path("/nonexistent")),
    )
    opts = {"client_kwargs": {"endpoint_url": moto.endpoint_url}}
    p = subprocess.run(
        CLI + ["verify", "s3://tmoe-bucket/ckpt", "--storage-options", json.dumps(opts)],
        capture_output=True,
        text=True,
        env=env,
        timeout=55,
    )
    one_line_error(p.returncode, p.stderr, "authentication failed", "credentials")


def _two_rank_run(root: Path, run_id: str = "run", node_ranks=None, **run):
    """A run of 2 ranks (each a 1-process checkpointer writing as rank r of 2) with windows 0 and 1.
    `node_ranks`: the ranks the host tier says write into this node directory (build_tiers sets them). The identity
    says world size 2, as a 2-rank job's would (verify checks the manifests against it, as recovery does)."""
    from torchmoe_ckpt.config import SparseConfig
    from torchmoe_ckpt.model.identity import build_identity
    from torchmoe_ckpt.model.operators import discover_operators
    from torchmoe_ckpt.persist.build_tiers import Tiers
    from torchmoe_ckpt.sparse_checkpointer import RunContext, SparseCheckpointer
    from torchmoe_ckpt.tiers.host_tier import HostTier
    from torchmoe_harness.trainer import RunConfig, Trainer

    for rank in (0, 1):
        t = Trainer(RunConfig(steps=6, **run))
        tier = HostTier(root, run_id, rank, 2)
        tier.node_ranks = node_ranks
        ops = discover_operators(t.model, optimizer=t.optimizer)
        ident = build_identity(t.model, t.optimizer, t.compute_dtype, ops, run_id, 2)
        ctx = RunContext(tiers=Tiers(tier, None, None), identity=ident, ops=ops)
        ck = SparseCheckpointer(t.model, t.optimizer, t.compute_dtype, SparseConfig(window=3), ctx)
        ck.attach(t)
        for _ in range(7):
            ck.after_step(t.train_step())
        ck.flush(commit=False)
        ck.stop()
    return root / run_id


def test_verify_fails_on_a_window_not_committed_by_every_rank(capsys, tmp_path, one_rank_group):
    run = _two_rank_run(tmp_path)
    rc, out, err = run_cli(capsys, "verify", str(run))
    assert rc == 0, err
    (run / "window-000001" / "MANIFEST.rank-00001.json").unlink()  # rank 1 never committed window 1
    rc, out, err = run_cli(capsys, "verify", str(run))
    assert rc == 1, (out, err)
    assert "verify: problem: window 1 rank all: not committed by rank(s) [1]" in err, err
    assert "FAILED (1 problem(s)" in err
    # every problem is listed: a flipped byte in window 0 as well
    data = next(run.glob("window-000000/slot-00/rank-00000/*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[0] ^= 1
    data.write_bytes(bytes(raw))
    rc, out, err = run_cli(capsys, "verify", str(run))
    assert rc == 1 and "FAILED (2 problem(s)" in err and "window 0 rank 0:" in err, err


def test_verify_fails_when_every_file_of_one_rank_is_wiped(capsys, tmp_path, one_rank_group):
    """Both ranks write one node directory; every file of rank 1 is wiped (its manifests, slots, records):
    the host tier's manifests name the ranks of the node, so verify misses rank 1 (it said OK before)."""
    import shutil

    run = _two_rank_run(tmp_path, node_ranks=[0, 1])
    assert run_cli(capsys, "verify", str(run))[0] == 0
    for p in sorted(run.rglob("*rank-00001*"), reverse=True):
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    assert not list(run.rglob("*rank-00001*"))
    rc, out, err = run_cli(capsys, "verify", str(run))
    assert rc == 1 and "not committed by rank(s) [1]" in err, (out, err)


def test_verify_names_a_window_copied_in_from_another_run(capsys, tmp_path, one_rank_group):
    """A window of another model's run copied into this run's directory verifies file by file, but recovery
    would refuse it (IdentityMismatch): verify says so, naming the run each belongs to."""
    import shutil

    run = _two_rank_run(tmp_path / "a")
    other = _two_rank_run(tmp_path / "b", model={"n_layers": 3})
    shutil.rmtree(run / "window-000001")
    shutil.copytree(other / "window-000001", run / "window-000001")
    rc, out, err = run_cli(capsys, "verify", str(run))
    assert rc == 1, (out, err)
    # Same run id, one window each: nothing tells which is the run's own, so both are named, neither blamed.
    assert "written by different runs" in err and "window(s) [0] by run 'run'" in err, err
    assert "window(s) [1] by run 'run'" in err, err


def test_verify_blames_the_window_of_another_run_id_not_the_runs_own(capsys, tmp_path, one_rank_group):
    """The copied-in window is the newest one here; the directory's run id says which windows are the run's."""
    import shutil

    run = _two_rank_run(tmp_path / "a")
    other = _two_rank_run(tmp_path / "b", run_id="other")
    shutil.rmtree(run / "window-000001")
    shutil.copytree(other / "window-000001", run / "window-000001")
    rc, out, err = run_cli(capsys, "verify", str(run))
    assert rc == 1, (out, err)
    assert "window 1: written by run 'other'" in err and "recovery refuses it" in err, err
    assert "window 0: written by" not in err, err


def test_inspect_of_a_root_lists_each_run_separately(capsys, tmp_path, one_rank_group):
    _two_rank_run(tmp_path / "node-0")
    import shutil

    shutil.copytree(tmp_path / "node-0" / "run", tmp_path / "node-0" / "other")
    shutil.rmtree(tmp_path / "node-0" / "other" / "window-000000")
    rc, out, err = run_cli(capsys, "inspect", str(tmp_path))
    assert rc == 0, err
    assert "2 runs (listed separately" in out and "run node-0/other:" in out and "run node-0/run:" in out, out
    from torchmoe_ckpt.ops.inspection import inspect_location

    info = inspect_location(str(tmp_path))
    runs = {r["run"]: [w["window_id"] for w in r["windows"]] for r in info["runs"]}
    assert runs == {"node-0/other": [1, 2], "node-0/run": [0, 1, 2]}, runs  # 2: in flight, uncommitted
    rc, out, err = run_cli(capsys, "verify", str(tmp_path))
    assert rc == 0, err


_LAUNCHER = """
import sys
from pathlib import Path
from torchmoe_harness.launch import torchrun
torchrun(1, [sys.argv[1], sys.argv[2]], Path(sys.argv[2]) / "torchrun.log", timeout=300)
"""
_QUIET_WORKER = "import time; time.sleep(300)  # writes nothing: a dead launcher's pipe cannot end it\n"


def test_a_killed_launcher_leaves_no_job_behind(tmp_path):
    """The CLI's `selftest` runs torchrun through `torchmoe_harness.launch.torchrun`; torchrun's workers lead
    sessions of their own. When the launching process dies, even by SIGKILL, torchrun gets SIGTERM and stops
    its workers: nothing of the job keeps running (a job that writes nothing is not ended by the broken pipe
    either)."""
    from torchmoe_harness.launch import processes_mentioning

    worker = tmp_path / "quiet_worker.py"
    worker.write_text(_QUIET_WORKER)
    marker = str(tmp_path)
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(worker), marker], start_new_session=True)
    try:
        end = time.monotonic() + 50
        while len(processes_mentioning(marker)) < 3 and time.monotonic() < end:  # launcher, torchrun, worker
            time.sleep(0.2)
        assert len(processes_mentioning(marker)) >= 3, "torchrun never started its worker"
    finally:
        launcher.kill()
        launcher.wait()
    end = time.monotonic() + 50  # torchrun's grace for its workers is 30 s
    while processes_mentioning(marker) and time.monotonic() < end:
        time.sleep(0.2)
    left = processes_mentioning(marker)
    for pid in left:  # do not leave them to the next test either
        os.kill(pid, 9)
    assert not left, "processes of the killed launcher's job are still running"
