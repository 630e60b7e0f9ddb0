"""TorchTitan's pipeline path (deepseek_v3 tiny, ``pipeline_parallel_degree`` 2 and 3, stock ``Schedule1F1B``
and ``ScheduleGPipe``) with sparse checkpoints, stage-boundary logs and localized recovery, under torchrun
with a real ``kill -9`` (titan_integration/titan_pipeline_recovery.py).

Every recovery test compares every stage's final model, optimizer state (exp_avg, exp_avg_sq, step), buffers
(expert bias), LR and loss sequence with ``torch.equal`` against the fault-free run of the same job, and
checks the recomputation counter: a healthy stage re-executed nothing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

from titan_integration import recovery_demo

pytestmark = pytest.mark.titan  # starts TorchTitan: not in make test-fast

STEPS = 8
LAYOUTS = {  # name: (stages, microbatch size, window, schedule)
    "pp2": (2, 2, 3, "1F1B"),
    "pp2_gpipe": (2, 2, 3, "GPipe"),
    "pp3": (3, 1, 2, "1F1B"),  # 1F1B needs micro-batches >= stages; stage 2 holds 2 operators: W <= 2
}
_REFERENCES: dict[str, Path] = {}


def _job(d: Path, layout: str, extra_sparse: str = "", extra: str = "") -> Path:
    stages, mbs, window, schedule = LAYOUTS[layout]
    par = (
        f'[parallelism]\npipeline_parallel_degree = {stages}\npipeline_parallel_schedule = "{schedule}"\n'
        f"pipeline_parallel_microbatch_size = {mbs}\n{extra}"
    )
    return recovery_demo.write_job(
        d, steps=STEPS, window=window, host_dir=d / "host", extra_sparse=extra_sparse, extra=par
    )


def _run(d: Path, env: dict[str, str], layout: str, fault: str | None = None, max_restarts: int = 1) -> str:
    rc, out = recovery_demo.torchrun(
        d, env, _job(d, layout), nproc=LAYOUTS[layout][0], fault=fault, timeout=55, max_restarts=max_restarts
    )
    assert rc == 0, out[-5000:]
    return out


def _reference(tmp_path_factory, env, layout: str) -> Path:
    if layout not in _REFERENCES:
        d = tmp_path_factory.mktemp(f"ref-{layout}")
        _run(d, env, layout)
        _REFERENCES[layout] = d
    return _REFERENCES[layout]


def _check_exact(reference: Path, d: Path, layout: str, attempts: int = 1) -> dict:
    stages = LAYOUTS[layout][0]
    ranks = recovery_demo.compare(reference, d, stages)
    for r in ranks:
        assert r.attempt == attempts, f"torchrun restarted the workers {attempts} time(s)"
        assert not r.differing, f"stage {r.rank}: {len(r.differing)} tensors differ, e.g. {r.differing[:4]}"
        assert r.losses_equal and r.losses_compared, r.losses_compared
        state, _ = recovery_demo.load_rank(d, r.rank)
        assert any(k.endswith("exp_avg_sq") for k in state) and int(state["step"]) == STEPS
    rec = ranks[0].recovery
    assert all(r.recovery == rec for r in ranks)
    return rec


def _roles(rec: dict) -> dict[int, tuple[str, int]]:
    return {s["stage"]: (s["role"], s["replayed_total"]) for s in rec["stages"]}


@pytest.mark.parametrize(
    "layout",
    ["pp2", pytest.param("pp2_gpipe", marks=pytest.mark.matrix), pytest.param("pp3", marks=pytest.mark.matrix)],
)
def test_fault_free_reference(tmp_path_factory, env, layout):
    """Its own item: the kill tests below reuse it (no item runs two torchrun jobs)."""
    d = _reference(tmp_path_factory, env, layout)
    stages = LAYOUTS[layout][0]
    for rank in range(stages):
        _state, run = recovery_demo.load_rank(d, rank)
        assert run["attempt"] == 0 and run["recovery"]["plan"] is None
        assert sorted(map(int, run["loss_bits"])) == list(range(1, STEPS + 1))
    # the pipeline's loss on every stage (computed by the last, summed with zeros): identical bits
    assert all(
        recovery_demo.load_rank(d, r)[1]["loss_bits"] == recovery_demo.load_rank(d, 0)[1]["loss_bits"]
        for r in range(stages)
    )


def test_pp2_logs_and_windows(tmp_path_factory, env):
    d = _reference(tmp_path_factory, env, "pp2")
    for rank in range(2):
        _state, run = recovery_demo.load_rank(d, rank)
        assert run["checkpoint"]["windows_committed"] >= STEPS // 3 - 1
    logs = sorted(p.name for p in (d / "host" / "demo" / "pp" / "log" / "stage-0").glob("t*.fwd.pt"))
    assert logs and all(n.endswith(".fwd.pt") for n in logs)  # stage 0 sends forward only
    assert not list((d / "host" / "demo" / "pp" / "log" / "stage-0").glob("*.bwd.pt"))
    assert list((d / "host" / "demo" / "pp" / "log" / "stage-1").glob("*.bwd.pt"))


@pytest.mark.parametrize("victim, point", [(1, "backward"), pytest.param(0, "optimizer", marks=pytest.mark.matrix)])
def test_pp2_kill_one_stage_recovers_alone(tmp_path, tmp_path_factory, env, victim, point):
    """kill -9 of one stage: it alone replays its window and then the iterations up to its neighbour's,
    from the neighbour's log, through TorchTitan's Schedule1F1B; the neighbour recomputes nothing."""
    reference = _reference(tmp_path_factory, env, "pp2")
    out = _run(tmp_path, env, "pp2", fault=f"kill:point={point}:rank={victim}:step=7")
    assert f"event=fault_injected action=kill point={point} rank={victim} iteration=7" in out
    assert "event=pp_peer_failure" in out  # the healthy stage kept its live state
    rec = _check_exact(reference, tmp_path, "pp2")
    assert rec["plan"]["mode"] == "local" and rec["plan"]["segments"][0]["first"] == victim
    other = 1 - victim
    roles = _roles(rec)
    assert roles[other] == ("healthy", 0), roles  # zero recomputation on the healthy stage
    assert roles[victim][0] == "recovered" and roles[victim][1] >= 1, roles
    assert f"event=pp_stage_recovered stage={victim}" in out
    ranks = recovery_demo.compare(reference, tmp_path, 2)
    report = recovery_demo.format_report(
        ranks, layout="pp2", fault="kill", window=3, kill_step=7, wall_reference=0.0, wall_failure=0.0
    )
    assert "BIT-EXACT" in report and "plan           local" in report
    assert f"stage {other}        healthy" in report and "recomputed 0 iterations" in report


@pytest.mark.matrix
def test_pp2_gpipe_kill_stage(tmp_path, tmp_path_factory, env):
    reference = _reference(tmp_path_factory, env, "pp2_gpipe")
    _run(tmp_path, env, "pp2_gpipe", fault="kill:point=backward:rank=1:step=6")
    rec = _check_exact(reference, tmp_path, "pp2_gpipe")
    assert rec["plan"]["mode"] == "local" and _roles(rec)[0] == ("healthy", 0)


@pytest.mark.matrix
def test_pp2_every_stage_killed_falls_back_to_global(tmp_path, tmp_path_factory, env):
    reference = _reference(tmp_path_factory, env, "pp2")
    out = _run(tmp_path, env, "pp2", fault="kill:point=forward:rank=0:step=7;kill:point=forward:rank=1:step=7")
    rec = _check_exact(reference, tmp_path, "pp2")
    assert rec["plan"]["mode"] == "global" and "no live neighbour" in rec["plan"]["reason"]
    assert "event=pp_recovery mode=global" in out
    assert {role for role, _ in _roles(rec).values()} == {"global"}


@pytest.mark.matrix
@pytest.mark.parametrize("victims, segments", [((1,), [(1, 1)]), ((1, 2), [(1, 2)]), ((0, 2), [(0, 0), (2, 2)])])
def test_pp3_middle_adjacent_and_disjoint_stages(tmp_path, tmp_path_factory, env, victims, segments):
    """PP=3: the middle stage alone (activations from stage 0's log, gradients from stage 2's); stages 1 and
    2 together (one segment, live exchange inside, stage 0's log at its border); stages 0 and 2 (two
    independent segments, in parallel, both fed by stage 1's logs)."""
    reference = _reference(tmp_path_factory, env, "pp3")
    _run(tmp_path, env, "pp3", fault=";".join(f"kill:point=forward:rank={v}:step=7" for v in victims))
    rec = _check_exact(reference, tmp_path, "pp3")
    assert rec["plan"]["mode"] == "local"
    assert [(s["first"], s["last"]) for s in rec["plan"]["segments"]] == segments
    roles = _roles(rec)
    healthy = [s for s in range(3) if s not in victims]
    assert all(roles[s] == ("healthy", 0) for s in healthy), roles
    assert all(roles[v][0] == "recovered" for v in victims), roles


@pytest.mark.matrix
def test_pp2_failure_during_recovery_restarts_it(tmp_path, tmp_path_factory, env):
    """Stage 1 is killed in iteration 7, then again half-way through its replay (attempt 1): the healthy stage
    keeps its live state a second time, and the next attempt plans and recovers again, exactly."""
    reference = _reference(tmp_path_factory, env, "pp2")
    out = _run(
        tmp_path,
        env,
        "pp2",
        fault="kill:point=backward:rank=1:step=7;kill:point=recovery:rank=1:attempt=1",
        max_restarts=2,
    )
    assert "point=recovery rank=1" in out and out.count("event=pp_peer_failure stage=0") == 2
    rec = _check_exact(reference, tmp_path, "pp2", attempts=2)
    roles = _roles(rec)
    assert roles[0] == ("healthy", 0) and roles[1][0] == "recovered", roles


_BAD = [  # (extra [sparse_checkpoint] lines, extra [parallelism] lines, ranks, what the one line says)
    (
        "",
        "",
        1,
        "pipeline_parallel_degree = 2 with 1 ranks: sparse checkpointing with pipeline parallelism runs "
        "one rank per stage; fix: run --nproc_per_node 2",
    ),
    (
        "replicas = 1",
        "",
        2,
        "replicas/object_store: with pipeline parallelism windows are kept on the host "
        "tier only so far; fix: replicas = 0",
    ),
    ("", "", 2, "window = 'auto': pipeline stages must share window bounds; fix: window = 3"),
    (
        "",
        "pipeline_parallel_schedule = 'Interleaved1F1B'",
        2,
        "sparse checkpointing supports one stage per rank; fix: use one of 1F1B, GPipe",
    ),
    ("", "", 2, None),  # supported: no error
]


def test_unsupported_pipeline_jobs_are_rejected_with_the_fix(tmp_path, env):
    jobs = []
    for i, (sparse, par, nproc, _needle) in enumerate(_BAD):
        job = _job(tmp_path / f"job{i}", "pp2", sparse)
        text = job.read_text()
        if i == 2:
            text = text.replace("window = 3", 'window = "auto"')
        if par:
            text = text.replace('pipeline_parallel_schedule = "1F1B"', par)
        job.write_text(text)
        jobs.append((str(job), nproc))
    code = (
        "import json, sys\n"
        "from titan_integration.cpu_mode import enable_cpu_mode\nenable_cpu_mode()\n"
        "from titan_integration.job_toml import load_job\n"
        "from titan_integration.titan_pipeline_recovery import check_pipeline_job\n"
        "out = []\n"
        "for path, n in json.loads(sys.argv[1]):\n"
        "    try:\n        c = load_job(path); check_pipeline_job(c, c.sparse_checkpoint, n); out.append(None)\n"
        "    except Exception as e:\n        out.append(type(e).__name__ + ': ' + str(e))\n"
        "print(json.dumps(out))\n"
    )
    import json

    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(jobs)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=55,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for (_s, _p, _n, needle), msg in zip(_BAD, got):
        if needle is None:
            assert msg is None
        else:
            assert msg.startswith("JobConfigError: ") and needle in msg and "\n" not in msg, msg


@pytest.mark.matrix  # the launcher's one-line path: test_titan_sparse.py; the checks: the test above
def test_unsupported_pipeline_job_is_one_error_line_at_launch(tmp_path, env):
    job = _job(tmp_path / "job", "pp2", "replicas = 1")
    proc = subprocess.run(
        [sys.executable, "-m", "titan_integration.train", "--config", str(job)],
        cwd=tmp_path,
        env=dict(env, WORLD_SIZE="2"),
        capture_output=True,
        text=True,
        timeout=55,
    )
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(err) == 1 and err[0].startswith("error: [sparse_checkpoint] replicas/object_store"), err
