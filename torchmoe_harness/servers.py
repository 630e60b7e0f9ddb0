"""Real local object-store servers for tests and benchmarks: moto (S3) and Azurite (Azure Blob).

Both bind to 127.0.0.1 on a free port, wait until they answer, and are always cleaned up (the Azurite
node process is killed by its pid). Each context manager yields a handle that unpacks like a tuple::

    with moto_server() as (endpoint_url, storage_options): ...
    with azurite_server() as (connection_string, storage_options): ...

and also offers `stop()` / `start()` / `restart()` and a `down()` context manager, so a test can take the
store away and bring it back on the same port (Azurite keeps its data directory; moto keeps its state,
which lives in-process).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]  # torchmoe_harness/servers.py -> repo
AZURITE_EXE = REPO_ROOT / ".azurite/node_modules/.bin/azurite-blob"
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
S3_KEY = S3_SECRET = "testing"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout: float, alive=lambda: True) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if not alive():
                raise RuntimeError(f"server on 127.0.0.1:{port} exited before it was ready") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"server on 127.0.0.1:{port} not ready after {timeout:.0f} s") from None
            time.sleep(0.05)


def _wait_port_closed(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        except OSError:
            return
        time.sleep(0.05)


class _Server:
    """start()/stop() are the subclass's; restart() and down() are the same for every server."""

    def start(self):
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def restart(self) -> None:
        self.stop()
        self.start()

    @contextlib.contextmanager
    def down(self) -> Iterator[None]:
        """The store is unreachable inside the block, back (same port, same data) after it."""
        self.stop()
        try:
            yield
        finally:
            self.start()


# --------------------------------------------------------------------------------------------- moto (S3)


class MotoServer(_Server):
    """A moto S3 server in this process (ThreadedMotoServer). Its state is in-process, so it survives a
    stop/start on the same port."""

    def __init__(self, port: int = 0):
        self.port = port
        self._server = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict:
        """Options for s3fs (and `open_store`): explicit key/secret and the endpoint, no region (moto
        rejects a us-east-1 LocationConstraint when a bucket is created)."""
        return {"key": S3_KEY, "secret": S3_SECRET, "client_kwargs": {"endpoint_url": self.endpoint_url}}

    def __iter__(self):
        return iter((self.endpoint_url, self.storage_options))

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> MotoServer:
        if self._server is not None:
            return self
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        server.start()
        self.port = server.get_host_and_port()[1]
        self._server = server
        _wait_port(self.port, 20)
        return self

    def stop(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            server.stop()
            _wait_port_closed(self.port)


@contextlib.contextmanager
def moto_server(port: int = 0) -> Iterator[MotoServer]:
    server = MotoServer(port).start()
    try:
        yield server
    finally:
        server.stop()


def create_bucket(storage_options: dict, name: str) -> None:
    """Create an S3 bucket (no-op if it exists). `storage_options` as given to s3fs / `open_store`."""
    import s3fs

    fs = s3fs.S3FileSystem(**storage_options, skip_instance_cache=True)
    if not fs.exists(name):
        fs.mkdir(name)
    fs.invalidate_cache()


# -------------------------------------------------------------------------------------- Azurite (Azure Blob)


class AzuriteServer(_Server):
    """An Azurite blob server (node process) from `.azurite/` at the repository root (`make setup`)."""

    def __init__(self, port: int = 0, location: str | Path | None = None, exe: str | Path | None = None):
        self.exe = Path(exe) if exe else AZURITE_EXE
        if not self.exe.exists():
            raise RuntimeError(
                f"Azurite is not installed ({self.exe} is missing): run `make setup` in {REPO_ROOT} "
                f"(it runs `npm install --prefix .azurite azurite@3.35.0`)"
            )
        if shutil.which("node") is None:
            raise RuntimeError("Azurite needs node (>= 20) on PATH")
        self.port = port or free_port()
        self._own_location = location is None
        self.location = Path(location) if location else Path(tempfile.mkdtemp(prefix="azurite-"))
        self._proc: subprocess.Popen | None = None
        atexit.register(self._kill)

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
            f"BlobEndpoint=http://127.0.0.1:{self.port}/{AZURITE_ACCOUNT};"
        )

    @property
    def storage_options(self) -> dict:
        """Options for adlfs (and `open_store`)."""
        return {"connection_string": self.connection_string}

    def __iter__(self):
        return iter((self.connection_string, self.storage_options))

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> AzuriteServer:
        if self.running:
            return self
        cmd = [
            str(self.exe),
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(self.port),
            "--location",
            str(self.location),
            "--skipApiVersionCheck",
            "--disableTelemetry",
            "--loose",
            "--silent",
        ]
        log_path = self.location / "azurite-stdout.log"
        with open(log_path, "ab") as out:
            self._proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            _wait_port(self.port, 30, alive=lambda: self._proc is not None and self._proc.poll() is None)
        except RuntimeError as exc:
            self._kill()
            tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
            raise RuntimeError(f"Azurite did not start: {exc}\n{tail}") from None
        return self

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def stop(self) -> None:
        self._kill()
        _wait_port_closed(self.port)

    def close(self) -> None:
        self.stop()
        if self._own_location:
            shutil.rmtree(self.location, ignore_errors=True)


@contextlib.contextmanager
def azurite_server(port: int = 0, location: str | Path | None = None) -> Iterator[AzuriteServer]:
    server = AzuriteServer(port, location)
    try:
        server.start()
        yield server
    finally:
        server.close()


def create_container(connection_string: str, name: str) -> None:
    """Create a blob container (no-op if it exists)."""
    from azure.core.exceptions import ResourceExistsError
    from azure.storage.blob import BlobServiceClient

    with BlobServiceClient.from_connection_string(connection_string) as client:
        try:
            client.create_container(name)
        except ResourceExistsError:
            pass
