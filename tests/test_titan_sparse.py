"""Sparse checkpointing inside TorchTitan 0.3.0's real Trainer (CPU mode, gloo, torchrun).

* the ``[sparse_checkpoint]`` section and the ``--config job.toml`` loader: validation, one-line errors;
* a real ``kill -9`` of rank 1 in iteration 6 (``TORCHMOE_FAULT=kill:point=backward:rank=1:step=6``) under ``torchrun --max-restarts 1``: the restarted workers
  recover from the host tier by sparse-to-dense replay, and the final model + optimizer state of every rank
  and every loss after the recovery are ``torch.equal`` to a fault-free run.

Run: ``pytest tests/test_titan_sparse.py --durations=0`` (the fault-free reference run is a module fixture).
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

from titan_integration import demo  # noqa: E402  (cheap: does not import torchtitan)
from titan_integration.sparse_config import JobConfigError, SparseCheckpointSection  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).parent / "torchrun"
STEPS, WINDOW, KILL_STEP = 8, 3, 6


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    e = demo.child_env()
    e["TORCHMOE_TITAN_ASSETS"] = str(tmp_path_factory.mktemp("titan-assets"))
    e.pop("TORCHMOE_FAULT", None)
    return e


def _job(d: Path, extra_sparse: str = "", extra: str = "") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    text = f"""
dump_folder = "{d / 'dump'}"
[training]
steps = {STEPS}
[debug]
seed = 7
deterministic = true
[sparse_checkpoint]
enable = true
window = {WINDOW}
host_dir = "{d / 'host'}"
run_id = "test"
fault_timeout_s = 60
{extra_sparse}
{extra}
"""
    path = d / "job.toml"
    path.write_text(text)
    return path


def _train_direct(tmp_path: Path, env: dict[str, str], job: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "titan_integration.train", "--config", str(job)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def _torchrun(d: Path, env: dict[str, str], job: Path, fault: str | None = None,
              nproc: int = 2) -> subprocess.CompletedProcess:
    e = dict(env, TORCHMOE_TITAN_EXPORT=str(d / "export"), TORCHMOE_TITAN_SCRAMBLE="1")
    if fault:
        e["TORCHMOE_FAULT"] = fault
    launcher = [str(TORCHRUN)] if TORCHRUN.exists() else [sys.executable, "-m", "torch.distributed.run"]
    cmd = launcher + ["--standalone", "--nproc_per_node", str(nproc), "--max-restarts", "1", "--tee", "3",
                      "-m", "titan_integration.train", "--config", str(job)]
    proc = subprocess.run(cmd, cwd=d, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return proc


def _load(d: Path, rank: int):
    import torch

    state = torch.load(d / "export" / f"state-rank-{rank}.pt", weights_only=True)
    runs = sorted(glob.glob(str(d / "export" / f"run-rank-{rank}-attempt-*.json")))
    return state, json.loads(Path(runs[-1]).read_text())


# ---- [sparse_checkpoint] section ----------------------------------------------------------------------
def test_section_defaults_and_mapping():
    sec = SparseCheckpointSection.from_table({"enable": True, "window": 4, "ordering": "decayed", "replicas": 1,
                                              "host_dir": "/dev/shm/x", "run_id": "r"})
    core = sec.core_config()
    assert core.window == 4 and core.popularity == "decayed"
    assert SparseCheckpointSection.from_table({"window": "auto"}).core_config().window is None
    tiers = sec.tiers_config()
    assert tiers == {"root": "/dev/shm/x", "run_id": "r", "replicas": 1}


@pytest.mark.parametrize("table, needle", [
    ({"windwo": 3}, "unknown key 'windwo'; fix: use one of enable, window, replicas"),
    ({"window": 0}, "window = 0: must be >= 1"),
    ({"window": -2}, "window = -2: must be >= 1"),
    ({"window": "big"}, 'must be "auto" or an integer'),
    ({"ordering": "random"}, "ordering = 'random': unknown ordering; fix: use one of hard, soft, decayed, capacity"),
    ({"replicas": -1}, "replicas = -1"),
    ({"enable": "yes"}, "enable = 'yes': must be a boolean"),
    ({"fault_timeout_s": -1}, "fault_timeout_s = -1"),
    ({"storage_options": {"key": "k"}}, "object_store_uri is empty"),
])
def test_section_rejects_bad_values(table, needle):
    with pytest.raises(JobConfigError) as exc:
        SparseCheckpointSection.from_table(table)
    msg = str(exc.value)
    assert needle in msg and "fix:" in msg and "\n" not in msg


def test_store_uri_is_probed(tmp_path):
    SparseCheckpointSection.from_table({"object_store_uri": f"file://{tmp_path}/store"}).check_store()
    with pytest.raises(JobConfigError, match=r"unknown object-store URI scheme 'ftp'.*fix: use one of"):
        SparseCheckpointSection.from_table({"object_store_uri": "ftp://host/x"}).check_store()
    with pytest.raises(JobConfigError, match=r"^\[sparse_checkpoint\] object_store_uri: .*'file:///proc/torchmoe-nope'.*fix:"):
        SparseCheckpointSection.from_table({"object_store_uri": "file:///proc/torchmoe-nope"}).check_store()


# ---- --config job.toml: one clear line, exit status 2 -----------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra_sparse, extra, needle", [
    ("ordering = 'fifo'", "", "error: [sparse_checkpoint] ordering = 'fifo': unknown ordering; fix: use one of"),
    ("bogus = 1", "", "error: [sparse_checkpoint] unknown key 'bogus'; fix: use one of enable, window"),
    ("object_store_uri = 'gopher://x/y'", "", "error: [sparse_checkpoint] object_store_uri: unknown object-store "
                                              "URI scheme 'gopher'"),
    ("", "[trainingg]\nsteps = 3", "error: unknown section [trainingg]; fix: use one of [training]"),
])
def test_bad_job_file_is_one_error_line_before_torchtitan(tmp_path, env, extra_sparse, extra, needle):
    job = _job(tmp_path / "job", extra_sparse, extra)
    proc = _train_direct(tmp_path, env, job)
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(err) == 1 and err[0].startswith(needle), proc.stderr[-3000:]
    assert "fix:" in err[0] and "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.timeout(120)
def test_unknown_key_in_torchtitan_section_names_valid_keys(tmp_path, env):
    job = _job(tmp_path / "job", "", "[parallelism]\nexpert_parallel_degre = 2")
    proc = _train_direct(tmp_path, env, job)
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(err) == 1, proc.stderr[-3000:]
    assert err[0].startswith("error: [parallelism] unknown key 'expert_parallel_degre'; fix: use one of")
    assert "expert_parallel_degree" in err[0]


@pytest.mark.timeout(120)
def test_job_file_maps_onto_torchtitan_config(tmp_path, env):
    job = _job(tmp_path / "job", "ordering = 'soft'", "[optimizer]\nlr = 1e-3\nbeta2 = 0.99\n"
               "[lr_scheduler]\nwarmup_steps = 2\n[parallelism]\ndata_parallel_replicate_degree = 2\n"
               "[activation_checkpoint]\nmode = 'none'\n[model]\nflavor = 'tiny'")
    code = (
        "import sys\n"
        "from titan_integration.cpu_mode import enable_cpu_mode; enable_cpu_mode()\n"
        "from titan_integration.job_toml import load_job\n"
        "from titan_integration.sparse_trainer import SparseTrainer\n"
        f"c = load_job({str(job)!r})\n"
        "assert type(c) is SparseTrainer.Config, type(c)\n"
        "assert c.training.steps == 8 and c.debug.seed == 7 and c.debug.deterministic\n"
        "assert c.parallelism.data_parallel_replicate_degree == 2\n"
        "assert c.lr_scheduler.warmup_steps == 2 and c.activation_checkpoint is None\n"
        "kw = c.optimizer.param_groups[0].optimizer_kwargs\n"
        "assert kw['lr'] == 1e-3 and kw['betas'] == (0.9, 0.99), kw\n"
        "sc = c.sparse_checkpoint\n"
        "assert sc.enable and sc.window == 3 and sc.ordering == 'soft' and sc.run_id == 'test'\n"
        "assert c.training.mixed_precision_param == 'float32'  # CPU mode settings kept\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "ok"


# ---- kill -9 under torchrun: bit-exact recovery ---------------------------------------------------------
LAYOUTS = {  # name: (ranks, job-file lines)
    "fsdp2": (2, ""),                                                # FSDP2 (dp_shard 2)
    "ep2": (2, "[parallelism]\nexpert_parallel_degree = 2"),         # experts split over EP 2
    # HSDP 2x2 needs 4 ranks: ~90 s on 2 shared cores, so opt-in (TORCHMOE_TITAN_SLOW=1).
    "hsdp2x2": (4, "[parallelism]\ndata_parallel_replicate_degree = 2\ndata_parallel_shard_degree = 2"),
}
SLOW = os.environ.get("TORCHMOE_TITAN_SLOW") == "1"


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def titan_reference(request, tmp_path_factory, env) -> tuple[str, Path]:
    """Fault-free run of the same job (module fixture: its time shows as the setup of the first user)."""
    layout = request.param
    nproc, extra = LAYOUTS[layout]
    if nproc > 2 and not SLOW:
        pytest.skip(f"{layout} runs {nproc} ranks (~90 s on 2 cores); set TORCHMOE_TITAN_SLOW=1")
    d = tmp_path_factory.mktemp(f"ref-{layout}")
    _torchrun(d, env, _job(d, extra=extra), nproc=nproc)
    return layout, d


@pytest.mark.timeout(300)
def test_kill9_rank1_recovers_bit_exact(tmp_path, env, titan_reference):
    import torch

    layout, reference = titan_reference
    nproc, extra = LAYOUTS[layout]
    d = tmp_path / "kill"
    proc = _torchrun(d, env, _job(d, extra=extra), fault=f"kill:point=backward:rank=1:step={KILL_STEP}", nproc=nproc)
    if layout == "ep2":
        assert "ep=2" in proc.stdout
    if layout == "hsdp2x2":
        assert "dp_replicate=2, dp_shard=2" in proc.stdout
    assert f"event=fault_injected action=kill point=backward rank=1 iteration={KILL_STEP} attempt=0" in proc.stdout
    for rank in range(nproc):
        want, ref_run = _load(reference, rank)
        got, run = _load(d, rank)
        assert ref_run["attempt"] == 0 and run["attempt"] == 1, "torchrun restarted the workers once"
        rec = run["recovery"]
        assert rec is not None and rec["source"] == "host", rec
        assert 1 <= rec["recovered_step"] < KILL_STEP and rec["replayed_iterations"] == WINDOW - 1, rec
        # Final state: every parameter, optimizer moment/step, buffer (expert_bias_E ...), LR and step.
        assert want.keys() == got.keys()
        assert any(k.startswith("optim/") and k.endswith("exp_avg_sq") for k in got)
        assert any("expert_bias" in k for k in got)
        bad = [k for k in want if not torch.equal(want[k], got[k])]
        assert not bad, f"rank {rank}: {len(bad)} tensors differ, e.g. {bad[:4]}"
        assert int(got["step"]) == STEPS
        # Every loss after the recovery, bit for bit.
        after = [str(s) for s in range(rec["recovered_step"] + 1, STEPS + 1)]
        assert [run["loss_bits"][s] for s in after] == [ref_run["loss_bits"][s] for s in after]
        assert run["checkpoint"]["slots_captured"] == STEPS - rec["recovered_step"]
