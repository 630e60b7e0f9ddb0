"""The TorchTitan user path (issue 17): what a user types and sees, end to end.

* ``object_store_format`` in ``[sparse_checkpoint]``, mapped onto the library's ``ObjectStoreConfig.format``;
* ``--sparse_checkpoint.KEY VALUE`` on the command line, on the job-file and the ``--override.imports`` paths;
* every ``[sparse_checkpoint]`` value checked in the launcher's first seconds (one line, exit 2);
* the object-store clients' loggers quiet by default (a real Azurite server);
* extending a finished run with more steps and a changed LR schedule resumes exactly (real torchrun runs).
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

from titan_integration import recovery_demo  # cheap: does not import torchtitan
from titan_integration.job_toml import sparse_section
from titan_integration.sparse_cli import OVERRIDE_TARGET, SPARSE_ENV, merge_into_override, override_section, split_args
from titan_integration.sparse_config import STORE_FORMATS, JobConfigError, SparseCheckpointSection

pytestmark = pytest.mark.titan  # starts TorchTitan: not in make test-fast

OVERRIDE_FLAG = "--override.imports"


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    e = recovery_demo.child_env()
    e["TORCHMOE_TITAN_ASSETS"] = str(tmp_path_factory.mktemp("titan-assets"))
    return e


# The launcher's main, then whether TorchTitan had been imported by the time it returned (the checks must
# come first: that is what makes a config error cost well under a second instead of 15-40 s).
_MAIN = (
    "import sys; from titan_integration.train import main; rc = main(sys.argv[1:]); "
    "print('torchtitan imported:', 'torchtitan' in sys.modules); sys.exit(rc)"
)


def _launch(tmp_path: Path, env: dict[str, str], args: list[str]) -> tuple[subprocess.CompletedProcess, bool]:
    proc = subprocess.run(
        [sys.executable, "-c", _MAIN, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=55
    )
    return proc, "torchtitan imported: True" in proc.stdout


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(err) == 1 and err[0].startswith("error: ") and "fix:" in err[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    return err[0]


# ---- 1. object_store_format ------------------------------------------------------------------------------
def test_object_store_format_maps_onto_the_library_config(tmp_path):
    from torchmoe_ckpt.config import STORE_FORMATS as LIB_FORMATS
    from torchmoe_ckpt.config import TierConfig
    from torchmoe_ckpt.persist.build_tiers import build_tiers

    assert STORE_FORMATS == LIB_FORMATS
    sec = SparseCheckpointSection.from_table(
        {
            "enable": True,
            "host_dir": str(tmp_path / "host"),
            "run_id": "r",
            "object_store_uri": f"file://{tmp_path}/store",
            "object_store_format": "tensorstore",
        }
    )
    sec.check_resources()
    cfg = sec.tiers_config()
    assert cfg["object_store"]["format"] == "tensorstore"
    assert TierConfig.from_dict(cfg).object_store.format == "tensorstore"
    tiers = build_tiers(cfg, 0, 1)  # the tier the trainer builds from this dict
    assert type(tiers.store).__name__ == "TensorstoreTier"
    default = SparseCheckpointSection.from_table({"object_store_uri": "memory://x", "run_id": "r"})
    assert default.tiers_config()["object_store"]["format"] == "dcp"


@pytest.mark.parametrize(
    "table, needle",
    [
        (
            {"object_store_uri": "memory://x", "object_store_format": "zarr"},
            "[sparse_checkpoint] object_store_format = 'zarr': 'zarr' is not one of dcp, tensorstore; "
            "fix: use one of dcp, tensorstore",
        ),
        (
            {"object_store_format": "tensorstore"},
            "[sparse_checkpoint] object_store_format = 'tensorstore': is set but object_store.uri is empty; fix: set "
            "object_store.uri",
        ),
    ],
)
def test_object_store_format_rejects_bad_values(table, needle):
    with pytest.raises(JobConfigError) as exc:
        SparseCheckpointSection.from_table(table)
    assert str(exc.value).startswith(needle) and "\n" not in str(exc.value)


def test_tensorstore_format_needs_a_driver_for_the_store():
    sec = SparseCheckpointSection.from_table({"object_store_uri": "az://tmoe/x", "object_store_format": "tensorstore"})
    with pytest.raises(
        JobConfigError,
        match=r"^\[sparse_checkpoint\] object_store_format = 'tensorstore': "
        r"tensorstore has no kvstore driver for az://.*fix: object_store_format",
    ):
        sec.check_format()


# ---- 2. --sparse_checkpoint.KEY VALUE ----------------------------------------------------------------------
def test_sparse_flags_are_parsed_like_torchtitan_flags():
    rest, vals = split_args(
        [
            "--training.steps",
            "3",
            "--sparse_checkpoint.run_id",
            "X",
            "--sparse_checkpoint.window=4",
            "--sparse_checkpoint.no-enable",
            "--sparse_checkpoint.fault-timeout-s",
            "5",
            "--sparse_checkpoint.storage_options",
            '{"anon": true}',
            "--sparse_checkpoint.object_store_format",
            "tensorstore",
        ]
    )
    assert rest == ["--training.steps", "3"]
    assert vals == {
        "run_id": "X",
        "window": 4,
        "enable": False,
        "fault_timeout_s": 5.0,
        "storage_options": {"anon": True},
        "object_store_format": "tensorstore",
    }
    assert split_args(["--sparse_checkpoint.enable", "--x"])[1] == {"enable": True}
    assert split_args(["--sparse_checkpoint.window", "auto"])[1] == {"window": "auto"}
    assert split_args(["--sparse_checkpoint.replicas", "two"])[1] == {"replicas": "two"}  # validation names it
    for bad, needle in (
        (["--sparse_checkpoint.windwo", "3"], "--sparse_checkpoint.windwo: unknown"),
        (["--sparse_checkpoint.window"], "--sparse_checkpoint.window needs a value; fix:"),
        (
            ["--sparse_checkpoint.storage_options", "x"],
            "--sparse_checkpoint.storage_options 'x': not a JSON object; fix:",
        ),
    ):
        with pytest.raises(JobConfigError, match="^" + needle.replace(".", r"\.")):
            split_args(bad)


def test_sparse_flags_override_the_job_file_section(monkeypatch):
    job = {"sparse_checkpoint": {"enable": True, "window": 3, "run_id": "file"}}
    monkeypatch.setenv(SPARSE_ENV, '{"run_id": "cli", "ordering": "decayed"}')
    sec = sparse_section(job)
    assert (sec.window, sec.run_id, sec.popularity) == (3, "cli", "decayed")  # an old key name from the CLI
    monkeypatch.setenv(SPARSE_ENV, '{"window": 0}')
    with pytest.raises(JobConfigError, match=r"^\[sparse_checkpoint\] window = 0: must be >= 1 .*; fix:"):
        sparse_section(job)


def test_sparse_flags_go_into_the_override_entry():
    # the factory's own name (overrides.py imports TorchTitan, which must not be imported here before CPU mode)
    source = (Path(__file__).resolve().parents[2] / "titan_integration" / "overrides.py").read_text()
    assert OVERRIDE_TARGET == "titan_integration.overrides.sparse_checkpoint" and "\ndef sparse_checkpoint(" in source
    TARGET = OVERRIDE_TARGET
    args = ["--module", "m", OVERRIDE_FLAG, "other.mod.fn", f'{TARGET}={{"window": 3}}', "--training.steps", "4"]
    merged = merge_into_override(args, {"run_id": "X", "window": 5})
    assert merged == [
        "--module",
        "m",
        OVERRIDE_FLAG,
        "other.mod.fn",
        f'{TARGET}={{"window": 5, "run_id": "X"}}',
        "--training.steps",
        "4",
    ]
    sec = override_section(merged)
    assert sec.enable and sec.window == 5 and sec.run_id == "X"
    added = merge_into_override(["--training.steps", "4"], {"window": 2})
    assert added == ["--training.steps", "4", OVERRIDE_FLAG, f'{TARGET}={{"window": 2}}']
    assert override_section(["--training.steps", "4"]) is None
    with pytest.raises(JobConfigError, match=r"^\[override sparse_checkpoint\] window = 0: must be >= 1 .*; fix:"):
        override_section(merge_into_override(args, {"window": 0}))


@pytest.mark.parametrize("how", ["job", "override"])
def test_bad_sparse_flag_is_one_error_line_before_torchtitan(tmp_path, env, how):
    job = recovery_demo.write_job(tmp_path / "job", steps=4, window=3, host_dir=tmp_path / "host")
    base = ["--config", str(job)] if how == "job" else []
    proc, titan_imported = _launch(tmp_path, env, base + ["--sparse_checkpoint.window", "0"])
    line = _one_error_line(proc)
    label = "[sparse_checkpoint]" if how == "job" else "[override sparse_checkpoint]"
    assert line.startswith(f"error: {label} window = 0: must be >= 1 ") and "; fix: " in line, line
    proc, _ = _launch(tmp_path, env, base + ["--sparse_checkpoint.windwo", "3"])
    assert _one_error_line(proc).startswith(
        "error: --sparse_checkpoint.windwo: unknown [sparse_checkpoint] key; fix: use one of enable, window"
    )
    assert "torchtitan imported: False" in proc.stdout and not titan_imported, proc.stdout  # checked before it


# ---- 3. checked in the first seconds -----------------------------------------------------------------------
def test_host_dir_is_checked(tmp_path):
    SparseCheckpointSection.from_table({"enable": True, "host_dir": str(tmp_path / "a" / "b")}).check_resources()
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())  # probe removed
    (tmp_path / "file").write_text("x")
    for bad in (str(tmp_path / "file" / "sub"), "/proc/torchmoe-nope"):
        with pytest.raises(
            JobConfigError,
            match=r"^\[sparse_checkpoint\] host_dir = .*: cannot create or write it "
            r"\(\w+Error: .*\); fix: host_dir = a writable",
        ):
            SparseCheckpointSection.from_table({"enable": True, "host_dir": bad}).check_resources()
    # a disabled section is not used: its host directory is not touched
    SparseCheckpointSection.from_table({"host_dir": str(tmp_path / "file" / "sub")}).check_resources()


@pytest.mark.parametrize("how", ["job", "override", "flag"])
def test_bad_host_dir_fails_at_launch_before_torchtitan(tmp_path, env, how):
    (tmp_path / "file").write_text("x")
    bad = str(tmp_path / "file" / "host")
    if how == "job":
        args = ["--config", str(recovery_demo.write_job(tmp_path / "job", steps=4, window=3, host_dir=Path(bad)))]
    elif how == "override":
        args = [OVERRIDE_FLAG, f'{OVERRIDE_TARGET}={{"root": "{bad}"}}']
    else:
        args = ["--sparse_checkpoint.root", bad]
    proc, titan_imported = _launch(tmp_path, env, args)
    line = _one_error_line(proc)
    assert line.startswith(
        f"error: [sparse_checkpoint] root = '{bad}': cannot create or write it "
        "(NotADirectoryError: Not a directory); fix:"
    ), line
    assert "torchtitan imported: False" in proc.stdout and not titan_imported, proc.stdout  # checked before it


# ---- 4. quiet store clients --------------------------------------------------------------------------------
def test_store_client_loggers_are_quiet_unless_configured(azurite):
    from torchmoe_ckpt.storage_format.store_open import QUIET_LOGGERS
    from torchmoe_ckpt.tiers.object_tier import make_store

    saved = {n: logging.getLogger(n).level for n in [*QUIET_LOGGERS, ""]}
    try:
        logging.getLogger().setLevel(logging.INFO)  # as TorchTitan's init_logger does: INFO unless quieted
        for n in QUIET_LOGGERS:
            logging.getLogger(n).setLevel(logging.NOTSET)
        logging.getLogger("botocore").setLevel(logging.DEBUG)  # the user's choice stays
        make_store("az://tmoe/quiet", "run", 0, azurite.storage_options)
        for n in QUIET_LOGGERS:
            want = logging.DEBUG if n == "botocore" else logging.WARNING
            assert logging.getLogger(n).getEffectiveLevel() == want, n
        assert not logging.getLogger("azure.core.pipeline.policies.http_logging_policy").isEnabledFor(logging.INFO)
    finally:
        for n, level in saved.items():
            logging.getLogger(n).setLevel(level)


# ---- 5. extending a finished run with more steps and a changed LR schedule ---------------------------------
# TorchTitan's LR schedule is one function of (warmup, decay_ratio, steps): it cannot say "the old schedule up
# to the last window, the new one after". These three runs are chosen so that one stock schedule can:
#   first run   8 steps, warmup 6, decay_ratio 0.25: factor (s+1)/6 for s < 6, 1 at s = 6, decay at s = 7;
#   extension  12 steps, warmup 2, decay_ratio 0.25: 0.5, then 1 up to s = 9, decay at s = 10, 11 -- different
#              from the first run's at every s < 5, so a replay with the new schedule's LRs would diverge;
#   reference  12 steps, warmup 6, decay_ratio 0.25: the first run's factors for s < 6 and the extension's from
#              s = 6 on (the decay starts at steps + 1 - decay steps, whatever the warmup).
# The first run's newest committed window ends at iteration 6 (W = 3; 7..9 is incomplete), so the extension
# replays iterations 5, 6 with the logged (old) LRs and trains 7..12 with the new schedule.
EXT_WINDOW, EXT_STEPS, EXT_MORE = 3, 8, 12
OLD = ["--lr_scheduler.warmup_steps", "6", "--lr_scheduler.decay_ratio", "0.25"]
NEW = ["--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "0.25"]
_EXT_REFERENCE: dict[str, Path] = {}


def _ext_run(d: Path, env: dict[str, str], host: Path, run_id: str, steps: int, schedule: list[str]) -> str:
    job = recovery_demo.write_job(d, steps=EXT_STEPS, window=EXT_WINDOW, host_dir=d / "unused")
    args = [
        "--training.steps",
        str(steps),
        *schedule,
        "--sparse_checkpoint.root",
        str(host),
        "--sparse_checkpoint.run_id",
        run_id,
    ]  # flags over the file
    rc, out = recovery_demo.torchrun(d, env, job, nproc=2, train_args=args, timeout=55)
    assert rc == 0, out[-5000:]
    return out


def _ext_reference(tmp_path_factory, env) -> Path:
    if "ref" not in _EXT_REFERENCE:
        d = tmp_path_factory.mktemp("extend-ref")
        _ext_run(d, env, d / "host", "extend-ref", EXT_MORE, OLD[:2] + NEW[2:])  # warmup 6, decay as NEW
        _EXT_REFERENCE["ref"] = d
    return _EXT_REFERENCE["ref"]


def test_extension_reference_run(tmp_path_factory, env):
    """The reference of the test below, its own item (each item runs at most two torchrun jobs)."""
    d = _ext_reference(tmp_path_factory, env)
    for rank in range(2):
        _, run = recovery_demo.load_rank(d, rank)
        assert run["recovery"] is None and sorted(map(int, run["loss_bits"])) == list(range(1, EXT_MORE + 1))


def test_extended_run_with_changed_schedule_resumes_exactly(tmp_path, tmp_path_factory, env):
    reference = _ext_reference(tmp_path_factory, env)
    host = tmp_path / "host"
    _ext_run(tmp_path / "first", env, host, "extend", EXT_STEPS, OLD)
    out = _ext_run(tmp_path / "more", env, host, "extend", EXT_MORE, NEW)
    assert "Unrecognized options" not in out
    ranks = recovery_demo.compare(reference, tmp_path / "more", 2)
    for r in ranks:
        rec = r.recovery
        assert r.attempt == 0 and rec is not None and rec["source"] == "host", rec  # a new launch resumed
        assert rec["recovered_step"] == 6 and rec["replayed_iterations"] == EXT_WINDOW - 1, rec
        assert not r.differing, f"rank {r.rank}: {len(r.differing)} tensors differ, e.g. {r.differing[:4]}"
        assert r.losses_compared == list(range(7, EXT_MORE + 1)) and r.losses_equal and r.exact
        _, first = recovery_demo.load_rank(tmp_path / "first", r.rank)
        _, more = recovery_demo.load_rank(tmp_path / "more", r.rank)
        _, ref = recovery_demo.load_rank(reference, r.rank)
        peak = more["lrs"]["7"]
        assert first["lrs"]["5"] < peak  # warmup 6: the old schedule's LR in iteration 5 ...
        assert more["lrs"]["5"] == first["lrs"]["5"] and more["lrs"]["6"] == first["lrs"]["6"]  # ... replayed
        assert [ref["lrs"][str(s)] for s in range(1, 7)] == [first["lrs"][str(s)] for s in range(1, 7)]
        assert [ref["lrs"][str(s)] for s in range(7, EXT_MORE + 1)] == [
            more["lrs"][str(s)] for s in range(7, EXT_MORE + 1)
        ]  # the new schedule from iteration 7 on
        assert more["lrs"]["12"] < peak  # it decays at the end
