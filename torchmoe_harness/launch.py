"""Launch harness runs under real torchrun processes and compare their results tensor by tensor."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class RunResult:
    out_dir: Path
    states: list[dict[str, torch.Tensor]]  # per rank
    losses: list[dict[int, torch.Tensor]]  # per rank: step -> loss of the final execution of that step
    report: dict  # rank 0's JSON report
    log: str = ""


def run_torchrun(
    nproc: int,
    spec: dict,
    out_dir: str | os.PathLike | None = None,
    timeout: float = 120.0,
    extra_env: dict | None = None,
    max_restarts: int = 0,
) -> RunResult:
    """Run `torchmoe_harness.worker` on `nproc` local ranks (on the spec's device: CPU + gloo, or one GPU per rank +
    NCCL) and load what each rank wrote."""
    out = Path(out_dir or tempfile.mkdtemp(prefix="tmoe-run-"))
    log = launch(nproc, spec, out, timeout, extra_env, max_restarts)
    return load_result(out, nproc, log)


def launch(
    nproc: int,
    spec: dict,
    out: Path,
    timeout: float = 120.0,
    extra_env: dict | None = None,
    max_restarts: int = 0,
    module: str = "torchmoe_harness.worker",
) -> str:
    """torchrun `module --spec out/spec.json --out out`; returns its output, raises with the tail on failure."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    return torchrun(
        nproc,
        ["-m", module, "--spec", str(out / "spec.json"), "--out", str(out)],
        out / "torchrun.log",
        timeout,
        extra_env,
        max_restarts,
    )


def torchrun(
    nproc: int,
    program: list[str],
    log_path: Path,
    timeout: float = 120.0,
    extra_env: dict | None = None,
    max_restarts: int = 0,
) -> str:
    """`torchrun --standalone --nproc_per_node nproc ... program` (a script path or `-m module`, with its
    arguments); returns its output (also written to `log_path`), raises with the tail on failure or timeout."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        f"--max-restarts={max_restarts}",
        *program,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(extra_env or {}))
    # Own process group, so a timeout kills torchrun *and* its workers instead of orphaning them.
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        log_path.write_text(log)
        raise RuntimeError(
            f"torchrun did not finish within {timeout:.0f} s (killed; log: {log_path}); last output:\n{log[-3000:]}"
        ) from None
    log_path.write_text(log)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited {proc.returncode} (full log: {log_path}); last output:\n{log[-4000:]}")
    return log


def load_result(out: Path, nproc: int, log: str = "") -> RunResult:
    states, losses = [], []
    for r in range(nproc):
        blob = torch.load(out / f"rank{r}.pt", weights_only=True, map_location="cpu")
        states.append(blob["state"])
        losses.append(blob["losses"])
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    return RunResult(out, states, losses, report, log)


@dataclass
class Comparison:
    bit_exact: bool
    compared_tensors: int
    compared_losses: int
    mismatches: list[str] = field(default_factory=list)


def compare(a: RunResult, b: RunResult, loss_steps_from: int = 1) -> Comparison:
    """torch.equal on every tensor of every rank, and on every loss from `loss_steps_from` on."""
    mism: list[str] = []
    n_t = n_l = 0
    for r, (sa, sb) in enumerate(zip(a.states, b.states)):
        if sa.keys() != sb.keys():
            mism.append(f"rank{r}: different keys {sorted(set(sa) ^ set(sb))[:5]}")
        for k in sorted(set(sa) & set(sb)):
            n_t += 1
            if sa[k].dtype != sb[k].dtype or sa[k].shape != sb[k].shape or not torch.equal(sa[k], sb[k]):
                mism.append(f"rank{r}: {k}")
        la, lb = a.losses[r], b.losses[r]
        for step in sorted(s for s in la if s >= loss_steps_from):
            n_l += 1
            if step not in lb or not torch.equal(la[step], lb[step]):
                mism.append(f"rank{r}: loss at step {step}")
    return Comparison(not mism and n_t > 0, n_t, n_l, mism)


def processes_mentioning(marker: str) -> list[int]:
    """PIDs of processes (other than this one) whose command line contains `marker`: what a test checks
    is gone after a job, e.g. a SIGSTOPped worker that must not outlive it."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if marker in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids
