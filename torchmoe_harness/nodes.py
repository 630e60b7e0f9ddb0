"""Several real torchrun agents on this machine, each an emulated host: what a cluster does when a host dies
and a new one joins, with stock torchrun (c10d rendezvous, elastic restarts).

    with Cluster(out_dir, nnodes=2) as c:
        a = c.start(0, ["-m", "torchmoe_harness.worker", "--spec", ...], max_restarts=1)
        b = c.start(1, [...], max_restarts=1)
        ...                         # wait until node 1's worker is where the test wants it
        b.kill()                    # the host dies: its agent and every worker, SIGKILL, at once
        c.start(1, [...])           # a new host joins the job (restart count 0, as on a real cluster)
        a.wait(120)

The rendezvous endpoint is a TCPStore hosted by this (the launching) process, as a cluster's rendezvous
service (etcd, a head node) outlives any training host; every agent joins it with `is_host=false`. Without
that, the first agent to bind the endpoint hosts the rendezvous, and killing that agent would end the job
for a reason that has nothing to do with checkpointing. Each agent leads its own session, and so does each
of its workers (torchrun starts them with `start_new_session`): `kill()` finds the workers by parent pid
before it kills the agent, so nothing of a dead host survives it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from torchmoe_harness.launch import children_of, die_with_parent

__all__ = ["Cluster", "Node", "process_state"]


def process_state(pid: int) -> str | None:
    """The one-letter state of `pid` ("R", "S", "T" = stopped, "Z"), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


class Node:
    """One torchrun agent and its workers: one emulated host."""

    def __init__(self, index: int, proc: subprocess.Popen, log_path: Path):
        self.index, self.proc, self.log_path = index, proc, log_path
        self._log = open(log_path, "rb")  # read incrementally while the agent writes it

    def workers(self) -> list[int]:
        """Pids of the worker processes this agent runs now (its direct children)."""
        return children_of(self.proc.pid) if self.proc.poll() is None else []

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, predicate, timeout: float, what: str, poll_s: float = 0.1) -> None:
        """Poll `predicate()` until true; raise with the log tail when `timeout` passes or the agent ends."""
        end = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"node {self.index} ended (exit {self.proc.returncode}) before {what}:\n{self.log()[-3000:]}"
                )
            if time.monotonic() > end:
                raise RuntimeError(f"node {self.index}: no {what} within {timeout:.0f} s:\n{self.log()[-3000:]}")
            time.sleep(poll_s)

    def wait_stopped_worker(self, timeout: float) -> int:
        """Wait until one of this node's workers is stopped (SIGSTOP: a frozen rank); returns its pid."""
        found: list[int] = []

        def stopped() -> bool:
            found[:] = [p for p in self.workers() if process_state(p) in ("T", "t")]
            return bool(found)

        self.wait_for(stopped, timeout, "stopped worker")
        return found[0]

    def kill(self) -> None:
        """The host dies: SIGKILL to the agent and to every worker's process group (a worker and the processes
        it started, e.g. its watchdog's stop guard), all before any of them can react."""
        workers = self.workers()
        for pid in [self.proc.pid, *workers]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        for pid in workers:  # reaped by init once the agent is gone; wait until they are
            end = time.monotonic() + 10
            while process_state(pid) not in (None, "Z") and time.monotonic() < end:
                time.sleep(0.05)

    def wait(self, timeout: float) -> int:
        """The agent's exit code; on timeout the node is killed and RuntimeError raised with the log tail."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(
                f"node {self.index} did not finish within {timeout:.0f} s (killed); log {self.log_path}:\n"
                f"{self.log()[-4000:]}"
            ) from None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        self._log.close()


class Cluster:
    """A rendezvous endpoint and the agents (emulated hosts) that join it; `close()` kills what is left."""

    def __init__(
        self,
        out: str | os.PathLike,
        nnodes: int = 2,
        nproc_per_node: int = 1,
        job_id: str = "tmoe-job",
        env: dict | None = None,
        join_timeout_s: int = 120,
    ):
        import torch.distributed as dist

        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.nnodes, self.nproc_per_node, self.job_id = nnodes, nproc_per_node, job_id
        self.env = dict(env or {})
        self.join_timeout_s = join_timeout_s
        self._store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60), multi_tenant=True
        )
        self.port = self._store.port
        self.nodes: list[Node] = []
        self._started = 0

    def start(self, index: int, program: list[str], max_restarts: int = 0, env: dict | None = None) -> Node:
        """Start a torchrun agent as host `index` (a new one each call: a replacement host has a fresh agent).
        `program`: a script path or `-m module` with its arguments. `env`: this host's extra environment."""
        self._started += 1
        log_path = self.out / f"node{index}-{self._started}.log"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={self.nnodes}",
            f"--nproc-per-node={self.nproc_per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.port}",
            f"--rdzv-id={self.job_id}",
            f"--rdzv-conf=is_host=false,join_timeout={self.join_timeout_s}",
            f"--max-restarts={max_restarts}",
            "--monitor-interval=0.5",
            *program,
        ]
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **self.env, **(env or {})}
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=full_env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        node = Node(index, proc, log_path)
        self.nodes.append(node)
        return node

    def close(self) -> None:
        for node in self.nodes:
            node.close()
        self._store = None

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
