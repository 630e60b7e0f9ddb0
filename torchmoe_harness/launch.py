"""Launch harness runs under real torchrun processes and compare their results tensor by tensor."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .servers import free_port


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
    standalone: bool = True,
) -> str:
    """`torchrun --standalone --nproc_per_node nproc ... program` (a script path or `-m module`, with its
    arguments); returns its output (also written to `log_path`), raises with the tail on failure or timeout.
    `standalone=False`: the plainest launch line instead, `torchrun --nproc_per_node nproc --master-port P` (static
    rendezvous, rendezvous id "none"), on a free port."""
    rdzv = ["--standalone"] if standalone else [f"--master-port={free_port()}"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *rdzv,
        f"--nproc_per_node={nproc}",
        f"--max-restarts={max_restarts}",
        *program,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(extra_env or {}))
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    try:
        log, _ = proc.communicate(timeout=timeout)
    except BaseException as exc:  # a timeout, or this process interrupted: torchrun and its workers go too
        stop_torchrun(proc)
        log, _ = proc.communicate()
        log_path.write_text(log)
        if not isinstance(exc, subprocess.TimeoutExpired):
            raise
        raise RuntimeError(
            f"torchrun did not finish within {timeout:.0f} s (killed; log: {log_path}); last output:\n{log[-3000:]}"
        ) from None
    log_path.write_text(log)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited {proc.returncode} (full log: {log_path}); last output:\n{log[-4000:]}")
    return log


def die_with_parent() -> None:
    """`preexec_fn` of a launched torchrun: SIGTERM it when the process that launched it dies, even by
    SIGKILL (Linux PR_SET_PDEATHSIG), so a killed `torchmoe-ckpt selftest` leaves no job behind; torchrun
    acts on SIGTERM by stopping its workers (SIGTERM, SIGKILL after its grace)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


def stop_torchrun(proc: subprocess.Popen, grace_s: float = 40.0) -> None:
    """End a torchrun and every worker it started. Its workers lead sessions of their own, so a SIGKILL to
    torchrun's group alone orphans them: SIGTERM first (torchrun stops its workers, SIGKILLing them after
    its 30 s grace), then SIGKILL to torchrun and to whatever of its workers is left."""
    workers = children_of(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    for pid in [proc.pid, *workers]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


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


def children_of(pid: int) -> list[int]:
    """The pids whose parent is `pid` (from /proc): a torchrun agent's workers."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


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
