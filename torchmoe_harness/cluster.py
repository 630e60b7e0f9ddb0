"""A small cluster on one machine: real nodes to rehearse fault tolerance on before a large run.

Each node is a network, mount, PID and UTS namespace of its own: its own address on a private bridge (a veth
pair), its own tmpfs on /dev/shm (its "RAM": the host tier lives there), its own /proc and host name. One
torchrun agent per node joins a c10d rendezvous whose TCPStore runs in a namespace of its own; optionally an
S3 object store (moto) runs in another. Links are rate-limited with `tc tbf` (`netem` is not needed).

    from torchmoe_harness.cluster import Cluster

    with Cluster(nodes=2, link_rate="40mbit", object_store=True) as c:
        for node in c.nodes:
            c.start(node, ["train.py", "--steps", "100"], max_restarts=1)
        c.lose(c.nodes[1])                  # the node dies whole: its processes, its /dev/shm
        new = c.add_node()                  # a replacement with a new address and an empty /dev/shm
        c.start(new, ["train.py", "--steps", "100"])
        c.blackhole(c.nodes[0], 5)          # its bridge port down for 5 s: packets dropped, no reset
        c.throttle(c.nodes[0], "4mbit")     # its link, both directions
        c.cut_store(c.nodes[0])             # no route to the object store, its connections aborted (restore_store)
        c.wait(120)

CLI (the same, from a shell; `up` holds the cluster, the fault commands talk to it over a unix socket):

    python -m torchmoe_harness.cluster up --nodes 2 --link-rate 40mbit -- train.py --steps 100
    python -m torchmoe_harness.cluster lose 1
    python -m torchmoe_harness.cluster add
    python -m torchmoe_harness.cluster blackhole 0 --seconds 30
    python -m torchmoe_harness.cluster throttle 0 4mbit
    python -m torchmoe_harness.cluster cut-store 0 [--seconds 20]
    python -m torchmoe_harness.cluster down            # or Ctrl-C on `up`; `sweep` removes a dead run's leftovers

Traffic stays on the run's own bridge (a private 10.x.y.0/24 with no route out; the bridge has no address on
the host) and loopback. Every name carries the run's prefix `tmoe-<pid>-<n>` (links `tm<pid>-<n>...`), and
everything is torn down on exit, on error, on Ctrl-C and SIGTERM; a later run sweeps what a dead run left.
Needs root, `ip`, `tc`, `unshare` and `nsenter`; `why_unavailable()` says in one line what is missing.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from torchmoe_harness.launch import die_with_parent

__all__ = ["Cluster", "ClusterNode", "sweep", "why_unavailable"]

PREFIX = "tmoe"
STORE_PORT = 29400
S3_PORT = 5000
BUCKET = "tmoe"
_counter = itertools.count()
_REPO = str(Path(__file__).resolve().parents[1])
_NETNS_RE = re.compile(rf"^{PREFIX}-(\d+)-\d+-")
_LINK_RE = re.compile(r"^tm(\d+)-\d+[bvp]")
# The node's init (its PID 1): reaps every orphan, so a dead agent's pid is gone from the node's /proc at once.
_INIT = (
    "import os,signal,sys,time\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
    "while True:\n"
    "    try:\n"
    "        os.waitpid(-1, 0)\n"
    "    except ChildProcessError:\n"
    "        time.sleep(0.2)\n"
)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def why_unavailable() -> str | None:
    """None when namespaces can be made here; otherwise one line saying why not."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return f"network namespaces, veths and bridges need root (running as uid {os.geteuid()})"
    missing = [t for t in ("ip", "tc", "ss", "unshare", "nsenter", "mount") if shutil.which(t) is None]
    if missing:
        return f"missing tool(s) {', '.join(missing)} (iproute2, util-linux)"
    name = f"{PREFIX}-{os.getpid()}-probe-x"
    res = _ip("netns", "add", name, check=False)
    if res.returncode != 0:
        return f"cannot create a network namespace: {res.stderr.strip() or 'ip netns add failed'}"
    _ip("netns", "del", name, check=False)
    return None


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def sweep() -> list[str]:
    """Remove namespaces and links that a dead run (its pid gone) of this tool left behind; returns their names."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NETNS_RE.match(name)
        if m and not _alive(int(m.group(1))):
            for pid in _ip("netns", "pids", name, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for kind in ("bridge", "veth"):
        for line in _ip("-o", "link", "show", "type", kind, check=False).stdout.splitlines():
            name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
            m = _LINK_RE.match(name)
            if m and not _alive(int(m.group(1))):
                _ip("link", "del", name, check=False)
                removed.append(name)
    return removed


def netns_of_run(tag: str) -> list[str]:
    """The network namespaces of run `tag` that exist now (what must be empty after teardown)."""
    out = _ip("netns", "list", check=False).stdout.splitlines()
    return [ln.split()[0] for ln in out if ln.split() and ln.split()[0].startswith(tag + "-")]


@dataclass
class ClusterNode:
    """One node: its namespaces (held by its init process), its address, its bridge port, its agents."""

    index: int
    netns: str
    ip: str
    port: str  # the host-side veth: the node's bridge port
    hostname: str
    unshare: subprocess.Popen | None = None
    init_pid: int | None = None  # its PID 1, as this (the host's) PID namespace numbers it
    agents: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    lost: bool = False

    @property
    def agent(self) -> subprocess.Popen | None:
        return self.agents[-1] if self.agents else None

    def pids(self) -> list[int]:
        """Host pids of every process in this node's PID namespace (its init included)."""
        if self.init_pid is None or self.lost:
            return []
        try:
            ns = os.readlink(f"/proc/{self.init_pid}/ns/pid")
        except OSError:
            return []
        out = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                with contextlib.suppress(OSError):
                    if os.readlink(d / "ns/pid") == ns:
                        out.append(int(d.name))
        return out

    def path(self, inside: str) -> Path:
        """A path as this node sees it (e.g. /dev/shm/...), readable from the host while the node lives."""
        return Path(f"/proc/{self.init_pid}/root") / inside.lstrip("/")

    def log(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.logs if p.exists())


class Cluster:
    """N nodes on one machine (see the module's doc). `close()` (or leaving the `with`) tears everything down."""

    def __init__(
        self,
        nodes: int = 2,
        nproc_per_node: int = 1,
        link_rate: str | None = None,
        object_store: bool = False,
        out: str | os.PathLike | None = None,
        run_id: str | None = None,
        shm_size: str = "512m",
        env: dict | None = None,
        join_timeout_s: int = 60,
        read_timeout_s: int = 20,
        keep_alive_s: int = 1,
    ):
        reason = why_unavailable()
        if reason:
            raise RuntimeError(f"cluster unavailable: {reason}")
        sweep()
        n = next(_counter) % 100
        self.tag = f"{PREFIX}-{os.getpid()}-{n}"
        self._link = f"tm{os.getpid()}-{n}"
        self.subnet = f"10.{200 + os.getpid() % 50}.{n}"
        self.out = Path(out) if out else Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
        self.out.mkdir(parents=True, exist_ok=True)
        self.nnodes, self.nproc_per_node = nodes, nproc_per_node
        self.link_rate, self.shm_size = link_rate, shm_size
        self.run_id = run_id or self.tag
        self.env = dict(env or {})
        self.join_timeout_s, self.read_timeout_s = join_timeout_s, read_timeout_s
        self.keep_alive_s = keep_alive_s  # a lost node leaves the rendezvous after 3 missed heartbeats
        self.bridge = f"{self._link}b"
        self.nodes: list[ClusterNode] = []  # every node ever started, lost ones included
        self._servers: list[tuple[str, subprocess.Popen]] = []
        self._netns: list[str] = []
        self._timers: list[threading.Timer] = []
        self._closed = False
        self._lock = threading.RLock()
        atexit.register(self.close)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            self.store_ip = self._netns_with_port("store", 1)[1]
            waits = [self._start_store()]  # the servers start (import torch, moto) while the nodes are made
            self.s3_ip = None
            if object_store:
                self.s3_ip = self._netns_with_port("s3", 2)[1]
                waits.append(self._start_s3())
            for _ in range(nodes):
                self.add_node()
            for ready, proc, what in waits:
                self._wait_file(ready, proc, what)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------ topology
    def _netns_with_port(self, role: str, host: int) -> tuple[str, str, str]:
        """A network namespace `<tag>-<role>` on the bridge at <subnet>.<host>; returns (netns, ip, port)."""
        ns, ip = f"{self.tag}-{role}", f"{self.subnet}.{host}"
        port, peer = f"{self._link}v{host}", f"{self._link}p{host}"
        _ip("netns", "add", ns)
        self._netns.append(ns)
        _ip("link", "add", port, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", ns)
        _ip("-n", ns, "link", "set", peer, "name", "eth0")
        _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "set", port, "master", self.bridge)
        _ip("link", "set", port, "up")
        return ns, ip, port

    def _spawn(self, ns: str, cmd: list[str], log: Path) -> subprocess.Popen:
        with open(log, "wb") as f:
            return subprocess.Popen(
                ["ip", "netns", "exec", ns, *cmd],
                cwd=_REPO,  # `-m torchmoe_harness.cluster` is this file, whatever checkout the caller's cwd holds
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._env(),
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def _env(self, extra: dict | None = None) -> dict:
        env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="eth0")
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # a replacement node must be able to join (torch 2.13)
        env.update(self.env)
        env.update(extra or {})
        return env

    def _wait_file(self, path: Path, proc: subprocess.Popen, what: str, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while not path.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited ({proc.returncode}) before it was ready")
            if time.monotonic() > end:
                raise RuntimeError(f"{what} not ready within {timeout:.0f} s")
            time.sleep(0.05)

    def _start_store(self) -> tuple[Path, subprocess.Popen, str]:
        ready = self.out / "store.ready"
        cmd = [sys.executable, "-m", "torchmoe_harness.cluster", "_store", self.store_ip, str(STORE_PORT), str(ready)]
        proc = self._spawn(f"{self.tag}-store", cmd, self.out / "store.log")
        self._servers.append(("store", proc))
        return ready, proc, "the rendezvous store"

    def _start_s3(self) -> tuple[Path, subprocess.Popen, str]:
        ready = self.out / "s3.ready"
        cmd = [sys.executable, "-m", "torchmoe_harness.cluster", "_s3", str(S3_PORT), BUCKET, str(ready)]
        proc = self._spawn(f"{self.tag}-s3", cmd, self.out / "s3.log")
        self._servers.append(("s3", proc))
        return ready, proc, "the object store (moto)"

    @property
    def store_endpoint(self) -> str:
        return f"{self.store_ip}:{STORE_PORT}"

    @property
    def object_store(self) -> dict | None:
        """The object store for TierConfig/ObjectStoreConfig as the nodes reach it: {"uri", "storage_options"}."""
        if self.s3_ip is None:
            return None
        from torchmoe_harness.servers import S3_KEY, S3_SECRET

        opts = {"key": S3_KEY, "secret": S3_SECRET, "client_kwargs": {"endpoint_url": f"http://{self.s3_ip}:{S3_PORT}"}}
        return {"uri": f"s3://{BUCKET}/{self.run_id}", "storage_options": opts}

    def add_node(self) -> ClusterNode:
        """A new node (a first one, or a replacement): a new address, an empty /dev/shm, a fresh PID namespace."""
        with self._lock:
            host = 10 + len(self.nodes)  # node i is <subnet>.(10 + i): a replacement gets a new address
            index = host - 10
            ns, ip, port = self._netns_with_port(f"node{index}", host)
            name = f"{self.tag}-node{index}"
            node = ClusterNode(index, ns, ip, port, name)
            hosts = self._hosts_file()
            ready = self.out / f"node{index}.ready"
            boot = (
                f"hostname {name} && mount -t tmpfs -o size={self.shm_size} tmpfs /dev/shm && "
                f"mount --bind {hosts} /etc/hosts && touch {ready} && exec {sys.executable} -c '{_INIT}'"
            )
            cmd = ["unshare", "--pid", "--fork", "--mount-proc", "--uts", "--kill-child", "--", "sh", "-c", boot]
            node.unshare = self._spawn(ns, cmd, self.out / f"node{index}-init.log")
            self.nodes.append(node)
            self._wait_file(ready, node.unshare, f"node {index}")
            from torchmoe_harness.launch import children_of

            end = time.monotonic() + 10
            while not (kids := children_of(node.unshare.pid)) and time.monotonic() < end:
                time.sleep(0.02)
            if not kids:
                raise RuntimeError(f"node {index}: its init did not start")
            node.init_pid = kids[0]
            if self.link_rate:
                self.throttle(node, self.link_rate)
            return node

    def _hosts_file(self) -> Path:
        """/etc/hosts of every node: its own name and every other address of the run (no lookup leaves the run)."""
        path = self.out / "hosts"
        if not path.exists():
            rows = ["127.0.0.1 localhost", f"{self.subnet}.1 {self.tag}-store", f"{self.subnet}.2 {self.tag}-s3"]
            rows += [f"{self.subnet}.{10 + i} {self.tag}-node{i}" for i in range(200)]
            path.write_text("\n".join(rows) + "\n")
        return path

    @property
    def live_nodes(self) -> list[ClusterNode]:
        return [n for n in self.nodes if not n.lost]

    def node(self, ref: int | ClusterNode) -> ClusterNode:
        return ref if isinstance(ref, ClusterNode) else self.nodes[ref]

    # ------------------------------------------------------------------------------------------ jobs
    def start(
        self,
        node: int | ClusterNode,
        program: list[str],
        max_restarts: int = 0,
        env: dict | None = None,
        rdzv_id: str | None = None,
    ) -> subprocess.Popen:
        """Start one torchrun agent on `node` running `program` (a script and its arguments, or `-m module ...`);
        every agent joins the run's c10d rendezvous (`rdzv_id`, default the cluster's run id: a relaunch after
        a job ended gives a new one, torchrun closes a finished rendezvous). Returns the agent's process (its
        exit code is torchrun's)."""
        node = self.node(node)
        with self._lock:
            log = self.out / f"node{node.index}-agent{len(node.agents)}.log"
            cmd = [
                "nsenter",
                f"--target={node.init_pid}",
                "--net",
                "--mount",
                "--pid",
                "--uts",
                f"--wd={os.getcwd()}",
                "--",
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={self.nnodes}",
                f"--nproc-per-node={self.nproc_per_node}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.store_endpoint}",
                f"--rdzv-id={rdzv_id or self.run_id}",
                f"--rdzv-conf=is_host=false,join_timeout={self.join_timeout_s},read_timeout={self.read_timeout_s},"
                f"keep_alive_interval={self.keep_alive_s},keep_alive_max_attempt=3",
                f"--local-addr={node.ip}",
                f"--max-restarts={max_restarts}",
                "--monitor-interval=0.5",
                *program,
            ]
            with open(log, "wb") as f:
                proc = subprocess.Popen(
                    cmd,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=self._env(env),
                    start_new_session=True,
                    preexec_fn=die_with_parent,
                )
            node.agents.append(proc)
            node.logs.append(log)
            return proc

    def wait(self, timeout: float, agents: list[subprocess.Popen] | None = None) -> list[int]:
        """Exit codes of `agents` (default: the newest agent of every live node); on timeout RuntimeError."""
        agents = agents if agents is not None else [n.agent for n in self.live_nodes if n.agent is not None]
        end = time.monotonic() + timeout
        codes = []
        for a in agents:
            try:
                codes.append(a.wait(max(0.1, end - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"the job did not end within {timeout:.0f} s; logs in {self.out}") from None
        return codes

    # ------------------------------------------------------------------------------------------ faults
    def lose(self, node: int | ClusterNode) -> None:
        """The node dies whole: its PID namespace is killed (every process at once, SIGKILL), its /dev/shm goes
        with its mount namespace, its address with its network namespace."""
        node = self.node(node)
        with self._lock:
            if node.lost:
                return
            if node.init_pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(node.init_pid, signal.SIGKILL)  # PID 1 gone: the kernel kills the namespace
            for p in [node.unshare, *node.agents]:
                if p is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(20)
            node.lost = True
            _ip("netns", "del", node.netns, check=False)
            _ip("link", "del", node.port, check=False)  # gone with the namespace, unless a socket keeps it a while
            with contextlib.suppress(ValueError):
                self._netns.remove(node.netns)

    def blackhole(self, node: int | ClusterNode, seconds: float | None = None) -> None:
        """Take the node's bridge port down: its packets are dropped (no reset, no error). With `seconds`, it
        comes back by itself after that long (without blocking); `heal(node)` brings it back now."""
        node = self.node(node)
        _ip("link", "set", node.port, "down")
        if seconds is not None:
            t = threading.Timer(seconds, self.heal, (node,))
            t.daemon = True
            self._timers.append(t)
            t.start()

    def heal(self, node: int | ClusterNode) -> None:
        node = self.node(node)
        if not node.lost and not self._closed:
            _ip("link", "set", node.port, "up", check=False)

    def throttle(self, node: int | ClusterNode, rate: str | None) -> None:
        """Limit the node's link to `rate` (tc units: "40mbit", "4mbit") in both directions with tbf; None lifts it."""
        node = self.node(node)
        for prefix, dev in ((["tc"], node.port), (["ip", "netns", "exec", node.netns, "tc"], "eth0")):
            if rate is None:
                subprocess.run([*prefix, "qdisc", "del", "dev", dev, "root"], capture_output=True)
                continue
            bps = _rate_bps(rate)
            burst = max(16000, bps // 8 // 100)  # 10 ms of the rate, at least a few full frames
            subprocess.run(
                [*prefix, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate]
                + ["burst", str(burst), "latency", "100ms"],
                check=True,
                capture_output=True,
            )

    def cut_store(self, node: int | ClusterNode, seconds: float | None = None) -> None:
        """The node loses its route to the object store (a blackhole route in its namespace: new connections fail,
        packets dropped) and its open connections to the store are aborted (`ss -K`); training traffic is
        untouched. `restore_store(node)` (or `seconds`) brings the route back.

        Why abort: a request already under way when the route goes only stalls (TCP retransmits, then success
        once the route is back: no error under botocore's 60 s read timeout; a 64 MB upload frozen mid-request
        and cut for 4 s: 14 s, no error). Whether an upload was under way was chance, so a short cut sometimes
        failed uploads and sometimes only delayed them; aborted, it fails at once (0.4-1.3 s), and so does every
        new connection until the route is back."""
        node = self.node(node)
        if self.s3_ip is None:
            raise RuntimeError("this cluster has no object store (Cluster(object_store=True))")
        _ip("-n", node.netns, "route", "replace", "blackhole", f"{self.s3_ip}/32")
        _ip("netns", "exec", node.netns, "ss", "-K", "dst", self.s3_ip)
        if seconds is not None:
            t = threading.Timer(seconds, self.restore_store, (node,))
            t.daemon = True
            self._timers.append(t)
            t.start()

    def restore_store(self, node: int | ClusterNode) -> None:
        node = self.node(node)
        if not node.lost and not self._closed and self.s3_ip:
            _ip("-n", node.netns, "route", "del", "blackhole", f"{self.s3_ip}/32", check=False)

    # ------------------------------------------------------------------------------------------ teardown
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for t in self._timers:
            t.cancel()
        for node in self.nodes:
            if node.init_pid is not None and not node.lost:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(node.init_pid, signal.SIGKILL)
        for proc in [p for n in self.nodes for p in [n.unshare, *n.agents] if p] + [p for _, p in self._servers]:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(20)
        for ns in self._netns:
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", ns, check=False)
        self._netns.clear()
        # A namespace lives on (nameless) while the kernel still holds one of its sockets (e.g. an orphaned
        # connection retransmitting into a dead route): delete the veths here, not only through the namespace.
        for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
            name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
            if name.startswith(self._link + "v"):
                _ip("link", "del", name, check=False)
        _ip("link", "del", self.bridge, check=False)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)

    def __enter__(self) -> Cluster:
        # SIGTERM (as Ctrl-C already does) unwinds through __exit__, when nobody else handles it; a SIGKILL leaves
        # the namespaces to the next run's sweep (the nodes themselves die with this process: PDEATHSIG).
        self._old_term = None
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
                self._old_term = signal.signal(signal.SIGTERM, _exit_on_signal)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.close()
        finally:
            if self._old_term is not None:
                signal.signal(signal.SIGTERM, self._old_term)


def _exit_on_signal(signum, _frame):
    raise SystemExit(128 + signum)


def _rate_bps(rate: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)(bit|bps)?", rate.strip().lower())
    if not m:
        raise ValueError(f"link rate {rate!r}: use tc units such as 40mbit, 4mbit, 500kbit")
    bits = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] * (8 if m.group(3) == "bps" else 1)
    return int(bits)


# ---------------------------------------------------------------------------------------------- servers
def _serve_store(host: str, port: int, ready: str) -> None:
    """The rendezvous store (in its own namespace): a TCPStore server until killed."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
    Path(ready).touch()
    while store is not None:
        time.sleep(3600)


def _serve_s3(port: int, bucket: str, ready: str) -> None:
    """moto (S3) on every address of its namespace, with `bucket` created, until killed."""
    import logging

    from moto.server import ThreadedMotoServer

    from torchmoe_harness.servers import S3_KEY, S3_SECRET, _wait_port, create_bucket

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    ThreadedMotoServer(ip_address="0.0.0.0", port=port, verbose=False).start()
    _wait_port(port, 20)
    opts = {"key": S3_KEY, "secret": S3_SECRET, "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
    create_bucket(opts, bucket)
    Path(ready).touch()
    while True:
        time.sleep(3600)


# ---------------------------------------------------------------------------------------------- CLI
STATE_DIR = Path(tempfile.gettempdir())


def _control_path(directory: str | None) -> Path:
    """The control socket of a running `up`: in --dir, else the newest live one in the temp directory."""
    if directory:
        return Path(directory) / "control.sock"
    found = sorted(STATE_DIR.glob(f"{PREFIX}-*/control.sock"), key=lambda p: p.stat().st_mtime, reverse=True)
    for p in found:
        m = re.match(rf"{PREFIX}-(\d+)-", p.parent.name)
        if m and _alive(int(m.group(1))):
            return p
    raise SystemExit("no running cluster found: start one with `python -m torchmoe_harness.cluster up ...`")


def _request(directory: str | None, msg: dict) -> int:
    path = _control_path(directory)
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(path))
        s.sendall(json.dumps(msg).encode() + b"\n")
        reply = json.loads(s.makefile().readline())
    print(reply["message"])
    return 0 if reply["ok"] else 1


class _Control:
    """The fault commands of `up`, served over a unix socket in the cluster's directory."""

    def __init__(self, cluster: Cluster, program: list[str], max_restarts: int, stop: threading.Event):
        self.c, self.program, self.max_restarts, self.stop = cluster, program, max_restarts, stop
        self.path = cluster.out / "control.sock"
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(str(self.path))
        self.sock.listen(4)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    reply = {"ok": True, "message": self.handle(json.loads(conn.makefile().readline()))}
                except Exception as exc:  # the reply says what failed; `up` goes on
                    reply = {"ok": False, "message": f"{type(exc).__name__}: {exc}"}
                conn.sendall(json.dumps(reply).encode() + b"\n")

    def handle(self, msg: dict) -> str:
        c, op = self.c, msg["op"]
        node = c.node(int(msg["node"])) if "node" in msg else None
        if op == "lose":
            c.lose(node)
            return f"node {node.index} ({node.ip}) lost: its processes, /dev/shm and address are gone"
        if op == "add":
            new = c.add_node()
            if self.program:
                c.start(new, self.program, self.max_restarts)
            return f"node {new.index} added at {new.ip}" + (" (agent started)" if self.program else "")
        if op == "blackhole":
            c.blackhole(node, msg.get("seconds"))
            return f"node {node.index} blackholed" + (f" for {msg['seconds']} s" if msg.get("seconds") else "")
        if op == "heal":
            c.heal(node)
            return f"node {node.index} back on the bridge"
        if op == "throttle":
            c.throttle(node, msg.get("rate"))
            return f"node {node.index} link: {msg.get('rate') or 'unlimited'}"
        if op == "cut-store":
            c.cut_store(node, msg.get("seconds"))
            return f"node {node.index} cut off the object store" + (
                f" for {msg['seconds']} s" if msg.get("seconds") else ""
            )
        if op == "restore-store":
            c.restore_store(node)
            return f"node {node.index} reaches the object store again"
        if op == "status":
            rows = [f"cluster {c.tag} in {c.out}, rendezvous {c.store_endpoint}, run id {c.run_id}"]
            if c.s3_ip:
                rows.append(f"object store http://{c.s3_ip}:{S3_PORT} bucket {BUCKET}")
            for n in c.nodes:
                agent = "no agent" if n.agent is None else f"agent {'running' if n.agent.poll() is None else 'ended'}"
                state = "lost" if n.lost else agent
                rows.append(f"node {n.index} {n.ip} {n.netns}: {state}")
            return "\n".join(rows)
        if op == "down":
            self.stop.set()
            return f"cluster {c.tag} going down"
        raise ValueError(f"unknown command {op!r}")

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(OSError):
            self.path.unlink()


def _up(a) -> int:
    program = a.program[1:] if a.program[:1] == ["--"] else a.program
    stop = threading.Event()

    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGHUP, _exit_on_signal)
    with Cluster(a.nodes, a.nproc_per_node, a.link_rate, a.object_store, run_id=a.run_id, shm_size=a.shm) as c:
        ctl = _Control(c, program, a.max_restarts, stop)
        try:
            print(f"cluster {c.tag}: {a.nodes} node(s) on {c.subnet}.0/24, rendezvous {c.store_endpoint}, dir {c.out}")
            if c.object_store:
                print(f"object store: {json.dumps(c.object_store)}", flush=True)
            for n in c.nodes:
                print(f"node {n.index}: {n.ip} ({n.netns})", flush=True)
                if program:
                    c.start(n, program, a.max_restarts)
            while not stop.wait(0.5):
                agents = [n.agent for n in c.live_nodes if n.agent is not None]
                if program and not a.keep and agents and all(p.poll() is not None for p in agents):
                    codes = [p.returncode for p in agents]
                    print(f"job ended: agent exit codes {codes}; logs in {c.out}", flush=True)
                    return 0 if all(x == 0 for x in codes) else 1
            return 0
        finally:
            ctl.close()
            print(f"cluster {c.tag} torn down", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m torchmoe_harness.cluster", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    register_subcommands(sub)
    a = ap.parse_args(argv)
    return a.fn(a)


def register_subcommands(sub) -> None:
    up = sub.add_parser("up", help="start the cluster (and the program on every node); holds it until the job ends")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--nproc-per-node", type=int, default=1)
    up.add_argument("--link-rate", default=None, help="tc tbf rate of every node's link, e.g. 40mbit")
    up.add_argument("--object-store", action="store_true", help="an S3 store (moto) in its own namespace")
    up.add_argument("--run-id", default=None, help="torchrun's --rdzv-id (default: the cluster's name)")
    up.add_argument("--max-restarts", type=int, default=1)
    up.add_argument("--shm", default="512m", help="each node's /dev/shm tmpfs size")
    up.add_argument("--keep", action="store_true", help="stay up after the job ends (until `down` or Ctrl-C)")
    up.add_argument("program", nargs=argparse.REMAINDER, help="-- script.py args (run under torchrun on every node)")
    up.set_defaults(fn=_up)

    def fault(name: str, help_: str, node: bool = True, seconds: bool = False, rate: bool = False) -> None:
        p = sub.add_parser(name, help=help_)
        p.add_argument("--dir", default=None, help="the cluster's directory (default: the newest running one)")
        if node:
            p.add_argument("node", type=int)
        if rate:
            p.add_argument("rate", nargs="?", default=None, help="e.g. 4mbit; omitted: unlimited")
        if seconds:
            p.add_argument("--seconds", type=float, default=None)

        def fn(a) -> int:
            msg = {"op": name, **{k: getattr(a, k) for k in ("node", "seconds", "rate") if hasattr(a, k)}}
            return _request(a.dir, msg)

        p.set_defaults(fn=fn)

    fault("lose", "kill a node whole (its PID namespace, /dev/shm and address)")
    fault("add", "add a replacement node at a new address (and start the program on it)", node=False)
    fault("blackhole", "take a node's bridge port down (for --seconds, or until `heal`)", seconds=True)
    fault("heal", "bring a blackholed node back")
    fault("throttle", "limit a node's link (tc tbf), both directions", rate=True)
    fault("cut-store", "cut a node off the object store (for --seconds, or until `restore-store`)", seconds=True)
    fault("restore-store", "give a node its route to the object store back")
    fault("status", "list the nodes", node=False)
    fault("down", "tear the cluster down", node=False)
    sw = sub.add_parser("sweep", help="remove namespaces and links that dead runs of this tool left behind")
    sw.set_defaults(fn=lambda a: print("\n".join(sweep()) or "nothing to sweep") or 0)
    for hidden, fn in (
        ("_store", lambda a: _serve_store(*a.args[:1], int(a.args[1]), a.args[2])),
        ("_s3", lambda a: _serve_s3(int(a.args[0]), a.args[1], a.args[2])),
    ):
        h = sub.add_parser(hidden)
        h.add_argument("args", nargs="*")
        h.set_defaults(fn=fn)


if __name__ == "__main__":
    sys.exit(main())
