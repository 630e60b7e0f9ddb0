"""Object-store tier: committed windows uploaded to any fsspec URI (file://, s3:// via s3fs, az:// and
abfs:// via adlfs, memory://), off the training path, with the manifest written last as the commit.

Layout: `<uri>/<run>/rank-RRRRR/window-NNNNNN/<the rank's window files>` and `.../MANIFEST.json` last, so
every rank uploads and fetches only its own pieces. Storage options are passed explicitly to fsspec
(DCP's `reset(checkpoint_id)` path would drop them). Uploads retry with exponential backoff; a store that
is down or slow only delays the upload queue, never training (the queue keeps the newest windows).
"""
from __future__ import annotations

import logging
import queue
import re
import threading
import time
import uuid

from .. import faults
from .host_tier import HostTier, rank_manifest_name
from .manifest import MANIFEST_NAME, WindowManifest, crc32_bytes, parse_window_dirname, window_dirname

log = logging.getLogger("torchmoe_ckpt.object_tier")
KNOWN = {"file": None, "memory": None, "s3": "s3fs (pip install 'torchmoe-ckpt[s3]')",
         "s3a": "s3fs (pip install 'torchmoe-ckpt[s3]')", "az": "adlfs (pip install 'torchmoe-ckpt[azure]')",
         "abfs": "adlfs (pip install 'torchmoe-ckpt[azure]')", "abfss": "adlfs (pip install 'torchmoe-ckpt[azure]')"}


class StoreConfigError(ValueError):
    """The object-store URI or its options cannot work; the message names the fix."""


def open_store(uri: str, storage_options: dict | None = None, probe: bool = True):
    """(fsspec filesystem, root path) for `uri`, checked once at start."""
    import fsspec
    scheme = uri.split("://", 1)[0] if "://" in uri else "file"
    if scheme not in KNOWN:
        raise StoreConfigError(f"unknown object-store URI scheme {scheme!r} in {uri!r}: use one of "
                               f"{', '.join(s + '://' for s in KNOWN)}")
    try:
        fs, root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    except ImportError as exc:
        raise StoreConfigError(f"{uri!r} needs {KNOWN[scheme]}: {exc}") from None
    except (TypeError, ValueError) as exc:  # an option the filesystem does not take
        raise StoreConfigError(f"{uri!r}: invalid storage_options {sorted(storage_options or {})} ({exc}); "
                               f"remove or fix the option it names") from None
    if scheme in ("az", "abfs", "abfss"):
        _shorten_azure_retry(fs)
    if probe:
        try:
            if _is_local(fs):  # on object stores makedirs would silently *create* a missing bucket
                fs.makedirs(root, exist_ok=True)
            probe_path = f"{root}/.probe-{uuid.uuid4().hex}"  # unique: every rank probes at once
            fs.pipe_file(probe_path, b"ok")
            fs.rm_file(probe_path)
        except Exception as exc:  # credentials, endpoint, missing bucket/container
            raise StoreConfigError(_explain(uri, exc)) from None
    return fs, root


def _explain(uri: str, exc: BaseException) -> str:
    """One message naming the likely fix for a store that cannot be written at start."""
    text = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    low = text.lower()
    if isinstance(exc, ConnectionError) or any(w in low for w in (
            "could not connect", "connection refused", "endpointconnectionerror", "name or service not known")):
        return (f"object store {uri!r}: the endpoint is not reachable ({text}); check endpoint_url / "
                f"connection_string in storage_options and that the service is running and reachable")
    # "403" as an HTTP status, not inside a port number or an id
    if isinstance(exc, PermissionError) or re.search(r"(?<![:\d])403(?!\d)", low) or any(w in low for w in (
            "credential", "authenticat", "signature", "accessdenied", "forbidden", "invalidaccesskeyid")):
        return (f"object store {uri!r}: authentication failed ({text}); check the credentials in storage_options "
                f"(s3: key/secret; az/abfs: connection_string or account_name + account_key/sas_token)")
    if isinstance(exc, FileNotFoundError) or any(w in low for w in ("nosuchbucket", "containernotfound",
                                                                     "does not exist", "not found")):
        return (f"object store {uri!r}: the bucket/container does not exist ({text}); create it first, or "
                f"check the bucket/container exists under that name in the URI")
    return (f"cannot write to {uri!r} ({text}); check the bucket/container exists and the credentials/endpoint "
            f"(endpoint_url, connection_string) in storage_options, and that the service is reachable")


def _shorten_azure_retry(fs) -> None:
    """azure-storage-blob retries a refused connection for ~80 s per call by default (3 tries from a 15 s
    backoff); our own retries wrap every call, so one quick inner retry keeps a dead store from looking hung."""
    pol = getattr(getattr(getattr(fs, "service_client", None), "_config", None), "retry_policy", None)
    if pol is None or not hasattr(pol, "initial_backoff"):
        return
    pol.initial_backoff, pol.increment_base = 0.5, 1.5
    for name in ("total_retries", "connect_retries", "read_retries", "status_retries"):
        if hasattr(pol, name):
            setattr(pol, name, 1)


def _is_local(fs) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


FORMATS = ("dcp", "tensorstore")


def make_store(uri: str, run_id: str, rank: int, storage_options: dict | None = None, keep_windows: int = 2,
               format: str = "dcp", **kw):
    """The object-store tier for one URI in the chosen on-store format: "dcp" (ObjectTier, default) or
    "tensorstore" (tensorstore_format.TensorstoreTier). tensorstore has no driver for az:// and abfs://:
    those stores say so once and keep the DCP format."""
    if format not in FORMATS:
        raise StoreConfigError(f"unknown object-store format {format!r}: use one of {', '.join(FORMATS)}")
    if format == "tensorstore":
        from .tensorstore_format import NoTensorstoreDriver, TensorstoreTier
        try:
            return TensorstoreTier(uri, run_id, rank, storage_options, keep_windows=keep_windows, **kw)
        except NoTensorstoreDriver as exc:
            if rank == 0:
                log.warning("%s: using the DCP/fsspec format for this store instead", exc)
    return ObjectTier(uri, run_id, rank, storage_options, keep_windows=keep_windows, **kw)


class ObjectTier:
    def __init__(self, uri: str, run_id: str, rank: int, storage_options: dict | None = None,
                 keep_windows: int = 2, attempts: int = 4, backoff_s: float = 0.2, probe: bool = True):
        self.fs, root = open_store(uri, storage_options, probe)
        self.base = f"{root.rstrip('/')}/{run_id}/rank-{rank:05d}"
        self.rank, self.keep, self.attempts, self.backoff = rank, keep_windows, attempts, backoff_s

    def _retry(self, what: str, fn, *args):
        for i in range(self.attempts):
            try:
                return fn(*args)
            except Exception as exc:
                if i == self.attempts - 1:
                    raise
                log.warning("object store %s failed (%s), retry %d/%d", what, exc, i + 1, self.attempts - 1)
                time.sleep(self.backoff * 2 ** i)

    def upload(self, tier: HostTier, window_id: int) -> int:
        """Upload this rank's copy of a committed window (verified locally first); manifest last."""
        wdir = tier.window_dir(window_id)
        man = tier.manifest(window_id)
        dest = f"{self.base}/{window_dirname(window_id)}"
        self._retry("delete", lambda: self.fs.rm(f"{dest}/{MANIFEST_NAME}") if self.fs.exists(f"{dest}/{MANIFEST_NAME}") else None)
        nbytes = 0
        for rel, entry in man.files.items():
            data = (wdir / rel).read_bytes()
            if len(data) != entry.bytes or crc32_bytes(data) != entry.crc32:
                raise RuntimeError(f"local copy of window {window_id} changed under the uploader: {rel}")
            self._retry("upload", self._put, f"{dest}/{rel}", data)
            nbytes += len(data)
        faults.point("upload")
        self._retry("commit", self._put, f"{dest}/{MANIFEST_NAME}", man.to_json().encode())
        self._invalidate()
        return nbytes

    def _put(self, path: str, data: bytes) -> None:
        if _is_local(self.fs):
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        self.fs.pipe_file(path, data)

    def _invalidate(self) -> None:
        if hasattr(self.fs, "invalidate_cache"):
            self.fs.invalidate_cache()

    def window_ids(self) -> list[int]:
        """Windows whose manifest is in the store (a window without one is half-uploaded: invisible)."""
        self._invalidate()
        try:
            entries = self.fs.ls(self.base, detail=False)
        except FileNotFoundError:
            return []
        ids = []
        for e in entries:
            wid = parse_window_dirname(e.rstrip("/").rsplit("/", 1)[-1])
            if wid is not None and self.fs.exists(f"{e.rstrip('/')}/{MANIFEST_NAME}"):
                ids.append(wid)
        return sorted(ids)

    def download(self, window_id: int, tier: HostTier) -> list[str]:
        """Fetch this rank's copy into the host tier, verifying every file; returns problems (empty = ok).
        The local rank manifest is written only after every file verified."""
        src = f"{self.base}/{window_dirname(window_id)}"
        try:
            man = WindowManifest.from_json(self.fs.cat_file(f"{src}/{MANIFEST_NAME}").decode())
        except Exception as exc:
            return [f"manifest unreadable: {exc}"]
        wdir = tier.window_dir(window_id)
        (wdir / rank_manifest_name(self.rank)).unlink(missing_ok=True)
        problems = []
        for rel, entry in man.files.items():
            try:
                data = self._retry("download", self.fs.cat_file, f"{src}/{rel}")
            except Exception as exc:
                problems.append(f"{rel}: {exc}")
                continue
            if len(data) != entry.bytes or crc32_bytes(data) != entry.crc32:
                problems.append(f"{rel}: does not match the manifest (torn or corrupt)")
                continue
            (wdir / rel).parent.mkdir(parents=True, exist_ok=True)
            (wdir / rel).write_bytes(data)
        if not problems:
            (wdir / rank_manifest_name(self.rank)).write_text(man.to_json())
        return problems

    def apply_retention(self) -> list[int]:
        ids = self.window_ids()
        gone = ids[:-self.keep] if self.keep > 0 else []
        for wid in gone:
            d = f"{self.base}/{window_dirname(wid)}"
            self._retry("delete", self.fs.rm, f"{d}/{MANIFEST_NAME}")  # manifest first: never half-visible
            self._retry("delete", self.fs.rm, d, True)
        return gone


class Uploader:
    """Background uploads of committed windows; never blocks the caller."""

    def __init__(self, store: ObjectTier, tier: HostTier, max_pending: int = 2):
        self.store, self.tier = store, tier
        self.q: queue.Queue = queue.Queue()
        self.max_pending = max_pending
        self.uploaded: list[int] = []
        self.dropped = 0
        self.lag_seconds: list[float] = []
        self.bytes = 0
        self.errors: list[str] = []
        self._pending: list = []
        self._lock = threading.Condition()
        threading.Thread(target=self._run, name="tmoe-upload", daemon=True).start()

    def stats(self) -> dict:
        return {"windows_uploaded": len(self.uploaded), "last_window": self.uploaded[-1] if self.uploaded else None,
                "bytes": self.bytes, "dropped": self.dropped,
                "upload_lag_s_max": max(self.lag_seconds, default=0.0), "errors": self.errors[-3:],
                "upload_lag_s": [round(x, 4) for x in self.lag_seconds]}

    def submit(self, window_id: int) -> None:
        with self._lock:
            self._pending.append((window_id, time.perf_counter()))
            while len(self._pending) > self.max_pending:  # a newer window supersedes the oldest pending one
                self._pending.pop(0)
                self.dropped += 1
            self._lock.notify()

    def flush(self, timeout: float = 60.0) -> bool:
        end = time.monotonic() + timeout
        with self._lock:
            while (self._pending or self._busy) and time.monotonic() < end:
                self._lock.wait(0.05)
            return not self._pending and not self._busy

    _busy = False
    _current: int | None = None

    def oldest_needed(self) -> int | None:
        """The oldest window still to be uploaded (the host tier must not collect it yet), or None."""
        with self._lock:
            ids = [w for w, _ in self._pending] + ([self._current] if self._busy else [])
        return min(ids) if ids else None

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._pending:
                    self._lock.wait()
                wid, t0 = self._pending.pop(0)
                self._busy, self._current = True, wid
            while True:  # the store may be down: keep trying (capped backoff) until it is back
                try:
                    self.bytes += self.store.upload(self.tier, wid)
                    self.store.apply_retention()
                    self.uploaded.append(wid)
                    self.lag_seconds.append(time.perf_counter() - t0)
                    break
                except FileNotFoundError as exc:  # the local window was collected meanwhile: nothing to upload
                    self.errors.append(str(exc))
                    break
                except Exception as exc:
                    self.errors.append(str(exc)[:200])
                    time.sleep(1.0)
                    with self._lock:
                        if self._pending:  # a newer window is waiting: it supersedes this one
                            self.dropped += 1
                            break
            with self._lock:
                self._busy = False
                self._lock.notify_all()
