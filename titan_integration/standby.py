"""A pre-imported standby per rank, so that a restarted TorchTitan worker does not import torch again.

Opt-in: ``TORCHMOE_STANDBY=1`` in the environment of ``torchrun ... -m titan_integration.train``. Three quarters
of a restart's kill-to-training time is a new Python process importing torch, TorchTitan and their
dependencies (bench_restart); none of it is our code, and none of it differs between attempts. So:

* In torchrun's first attempt each worker, once every import is done and before it creates a process group,
  a thread or a CUDA context, forks a **standby**: a detached copy of itself (own session, so torchrun's
  ``killpg`` of the worker spares it; stdio on /dev/null) that listens on an abstract Unix socket named by the
  user, torchrun's run id and the local rank, and exits when the torchrun agent that started the job is gone.
* When torchrun restarts the workers, each new worker (``titan_integration.train``, which imports only the
  standard library and our launcher's argument code before this point) connects to its rank's standby and
  hands itself over: its argv, environment, working directory and stdio (file descriptors passed with
  SCM_RIGHTS). The standby forks a child that takes them on and runs the launcher's ``main`` again (every
  import already done: module lookups), while the new worker waits: it forwards torchrun's SIGTERM/SIGINT to
  the child, and exits as the child did (the same code, or killed by the same signal), so torchrun sees its
  worker exactly as if it had run the training itself. If the new worker is killed (SIGKILL), the child sees
  the connection close and kills itself. The standby keeps serving later restarts.
* No standby (first attempt, not enabled, CUDA already initialised, a failed hand-over): the worker starts the
  ordinary way. The child re-reads everything attempt-specific from its new environment (the attempt number,
  process-group keys, fault injection, restart-timing marks); modules that read the environment at import
  time read the same job's values (torchrun gives every attempt the same environment but the attempt).

Costs: one idle process per rank holding the imported modules (copy-on-write pages of the first worker,
~0.5 GB RSS on CPU), one socket; the time saved is the imports phase of every restart."""

from __future__ import annotations

import array
import json
import os
import select
import signal
import socket
import sys
import threading
from collections.abc import Callable

ENV = "TORCHMOE_STANDBY"
_MAX_HEADER = 1 << 20
_taken_over = False  # this process is a standby's child: it trains, it hands nothing over
_forked: int | None = None  # the standby this process forked (first attempt)
_entry: Callable[[list[str]], int] | None = None  # the launcher's main, run by a standby's child (start())


def state() -> dict:
    """For the restart timing record: whether this worker runs in a standby, and the standby it started."""
    return {"in_standby": _taken_over, "standby_pid": _forked}


def _note_state() -> None:
    """Into this process's restart timing record (called once everything is imported: restart_timing imports
    TorchTitan, which must not be imported before the launcher has set up CPU mode)."""
    from titan_integration import restart_timing

    restart_timing.note(standby=state())


def enabled() -> bool:
    return os.environ.get(ENV, "0") not in ("0", "", "false", "no")


def address(env: dict | os._Environ = os.environ) -> str | None:
    """The abstract socket of this rank's standby (None outside torchrun)."""
    run, local = env.get("TORCHELASTIC_RUN_ID"), env.get("LOCAL_RANK")
    if run is None or local is None:
        return None
    return f"\0torchmoe-standby-{os.getuid()}-{run}-{local}"


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


# ---- the restarted worker: hand over -----------------------------------------------------------------------


def hand_over(argv: list[str]) -> int | None:
    """In a restarted worker: let this rank's standby run the training; returns the exit status to leave with
    (after the child ended), or None when there is no standby to take over (start the ordinary way)."""
    if _taken_over or not enabled() or _attempt() == 0 or (addr := address()) is None:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(addr)
        request = {"argv": [sys.argv[0], *argv], "env": dict(os.environ), "cwd": os.getcwd(), "agent": os.getppid()}
        fds = array.array("i", [0, 1, 2])
        header = json.dumps(request).encode()
        conn.sendmsg([len(header).to_bytes(4, "big"), header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        child = int(json.loads(_read_line(conn))["pid"])
    except (OSError, ValueError, KeyError):
        conn.close()
        return None

    def forward(sig, _frame):
        try:
            os.kill(child, sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    try:
        result = json.loads(_read_line(conn))
    except (OSError, ValueError):  # the standby died under the child: the training is gone
        return 1
    if "signal" in result:  # die the way the child died: torchrun reads the signal
        signal.signal(result["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), result["signal"])
    return int(result.get("exit", 1))


def _read_line(conn: socket.socket) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        got = conn.recv(4096)
        if not got:
            raise OSError("connection closed")
        buf += got
    return buf


# ---- the first attempt: fork the standby -------------------------------------------------------------------


def start(entry: Callable[[list[str]], int]) -> int | None:
    """In torchrun's first attempt, once everything is imported and before any thread, process group or CUDA
    context exists: fork this rank's standby, whose children run `entry` (the launcher's main) with a restarted
    worker's arguments. Returns its pid (None when not started)."""
    global _entry
    _entry = entry
    pid = _fork()
    _note_state()
    return pid


def _fork() -> int | None:
    if not enabled() or _attempt() != 0 or address() is None or threading.active_count() > 1:
        return None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a forked CUDA context is unusable
        return None
    global _forked
    agent = os.getppid()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            _serve(agent)
        except BaseException:  # a standby never reports: the worker starts the ordinary way
            code = 1
        os._exit(code)
    _forked = pid
    return pid


def _serve(agent: int) -> None:
    os.setsid()  # out of the worker's process group: torchrun's killpg of the worker spares the standby
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(address())
    except OSError:  # a standby for this rank serves already
        return
    listener.listen(1)
    while True:
        ready, _, _ = select.select([listener], [], [], 1.0)
        if not _alive(agent):
            return  # the job is over
        if not ready:
            continue
        conn, _ = listener.accept()
        try:
            request, fds = _receive(conn)
        except (OSError, ValueError):
            conn.close()
            continue
        child = os.fork()
        if child == 0:
            listener.close()
            _become(request, fds, conn)  # never returns
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(json.dumps({"pid": child}).encode() + b"\n")
        except OSError:
            pass
        _, status = os.waitpid(child, 0)
        result = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exit": os.WEXITSTATUS(status)}
        try:
            conn.sendall(json.dumps(result).encode() + b"\n")
        except OSError:
            pass
        conn.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    msg, anc, _, _ = conn.recvmsg(4, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    size = int.from_bytes(msg, "big")
    if not 0 < size <= _MAX_HEADER or len(fds) != 3:
        raise ValueError("not a hand-over")
    body = b""
    while len(body) < size:
        got = conn.recv(size - len(body))
        if not got:
            raise OSError("connection closed")
        body += got
    return json.loads(body), list(fds)


def _become(request: dict, fds: list[int], conn: socket.socket) -> None:
    """The forked child: take on the restarted worker's stdio, environment, directory and argv, then run the
    launcher's main (every module imported already)."""
    global _taken_over
    _taken_over = True
    code = 1
    try:
        for fd, target in zip(fds, (0, 1, 2)):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = list(request["argv"])
        # The worker's parent is torchrun's agent, which names the job (the run lock keys on it): this child's
        # own parent is the standby, so it answers with the agent of the worker it stands in for.
        os.getppid = lambda agent=int(request["agent"]): agent
        _reset_for_attempt()

        def watch() -> None:  # the worker torchrun knows is gone (SIGKILL): so is this training
            try:
                while conn.recv(1):
                    pass
            except OSError:
                pass
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="tmoe-standby-watch", daemon=True).start()
        code = _entry(sys.argv[1:]) or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _reset_for_attempt() -> None:
    """What the first attempt left in module state that belongs to an attempt, not to the job."""
    from titan_integration import restart_timing
    from torchmoe_ckpt.runtime import faults

    restart_timing.reset()
    _note_state()
    faults.arm(os.environ.get("TORCHMOE_FAULT", ""))  # parsed at import: the first attempt's copy
    faults.set_iteration(0)
