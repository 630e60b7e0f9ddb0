"""Object-store tier: committed windows uploaded to any fsspec URI (file://, s3:// via s3fs, az:// and
abfs:// via adlfs, memory://), off the training path, with the manifest written last as the commit.

Layout: `<uri>/<run>/rank-RRRRR/window-NNNNNN/<the rank's window files>` and `.../MANIFEST.json` last, so
every rank uploads and fetches only its own pieces. Storage options are passed explicitly to fsspec
(DCP's `reset(checkpoint_id)` path would drop them). Uploads retry with exponential backoff; a store that
is down or slow only delays the upload queue, never training (the queue keeps the newest windows).
"""

from __future__ import annotations

import logging
import os
import re
import time
import uuid
from pathlib import Path

from .. import faults
from .host_tier import HostTier
from .manifest import (
    CHUNK,
    MANIFEST_NAME,
    Digester,
    FileEntry,
    WindowManifest,
    parse_window_dirname,
    rank_manifest_name,
    window_dirname,
)
from .spare_files import keep_spares, place_new_file, pwrite_all, spares
from .store_open import StoreConfigError, explain
from .tensorstore_tier import NoTensorstoreDriver, TensorstoreTier

log = logging.getLogger("torchmoe_ckpt.object_tier")
KNOWN = {
    "file": None,
    "memory": None,
    "s3": "s3fs (pip install 'torchmoe-ckpt[s3]')",
    "s3a": "s3fs (pip install 'torchmoe-ckpt[s3]')",
    "az": "adlfs (pip install 'torchmoe-ckpt[azure]')",
    "abfs": "adlfs (pip install 'torchmoe-ckpt[azure]')",
    "abfss": "adlfs (pip install 'torchmoe-ckpt[azure]')",
}
# Store clients that log every HTTP request at INFO (azure-core: thousands of lines per run under a framework
# that sets the root logger to INFO). Parents first: a child whose parent is set inherits it.
QUIET_LOGGERS = (
    "azure",
    "azure.core.pipeline.policies.http_logging_policy",
    "botocore",
    "aiobotocore",
    "s3fs",
    "fsspec",
)


def quiet_third_party_loggers() -> None:
    """Set the store clients' loggers to WARNING, except where the user configured them or an ancestor
    (any level other than NOTSET): theirs wins. Idempotent."""
    root = logging.getLogger()
    for name in QUIET_LOGGERS:
        lg: logging.Logger | None = logging.getLogger(name)
        configured = False
        while lg is not None and lg is not root:
            configured = configured or lg.level != logging.NOTSET
            lg = lg.parent
        if not configured:
            logging.getLogger(name).setLevel(logging.WARNING)


_SCHEME_WITHOUT_SLASHES = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):(?!//)(.*)$")


def check_uri(uri: str) -> None:
    """A scheme without '//' ("s3:/bucket", "s3:bucket", "file:/tmp/x") is a typo that fsspec reads as a local
    path (./s3:/bucket), so uploads would "succeed" into a directory of the working dir: refused, naming the
    URI meant. (One letter before ':' is a Windows drive, not a scheme.)"""
    m = _SCHEME_WITHOUT_SLASHES.match(uri) if isinstance(uri, str) else None
    if m is None:
        return
    scheme, rest = m.group(1), m.group(2).lstrip("/")
    meant = f"{scheme}:///{rest}" if scheme.lower() == "file" else f"{scheme}://{rest}"
    raise StoreConfigError(
        f"object-store URI {uri!r} has a scheme ({scheme}:) but no '//' after it, so it would "
        f"be read as a local directory named {uri!r}: did you mean {meant!r}? (a local "
        "directory: give its path, or file:///absolute/path)"
    )


def open_store(uri: str, storage_options: dict | None = None, probe: bool = True):
    """(fsspec filesystem, root path) for `uri`, checked once at start."""
    import fsspec

    check_uri(uri)
    quiet_third_party_loggers()
    scheme = uri.split("://", 1)[0] if "://" in uri else "file"
    if scheme not in KNOWN:
        raise StoreConfigError(
            f"unknown object-store URI scheme {scheme!r} in {uri!r}: use one of {', '.join(s + '://' for s in KNOWN)}"
        )
    if scheme in ("s3", "s3a"):
        storage_options = _short_s3_retry(storage_options)
    try:
        fs, root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    except ImportError as exc:
        raise StoreConfigError(f"{uri!r} needs {KNOWN[scheme]}: {exc}") from None
    except (TypeError, ValueError) as exc:  # an option the filesystem does not take
        raise StoreConfigError(
            f"{uri!r}: invalid storage_options {sorted(storage_options or {})} ({exc}); "
            f"remove or fix the option it names"
        ) from None
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
            raise StoreConfigError(explain(uri, exc)) from None
    return fs, root


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


def _short_s3_retry(options: dict | None) -> dict:
    """botocore retries a refused connection 4 times with exponential backoff (up to ~15 s per call) and our
    uploads retry every call again: a store that is down would be noticed only a minute later. One inner
    retry and a 5 s connect timeout (the uploader retries whole windows anyway), unless the user set them."""
    opts = dict(options or {})
    cfg = dict(opts.get("config_kwargs") or {})
    cfg.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
    cfg.setdefault("connect_timeout", 5)
    opts["config_kwargs"] = cfg
    return opts


def _is_local(fs) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


FORMATS = ("dcp", "tensorstore")
MAX_SPARES = 8  # data files of deleted windows kept per rank in a local store, to be written over


def make_store(
    uri: str,
    run_id: str,
    rank: int,
    storage_options: dict | None = None,
    keep_windows: int = 2,
    format: str = "dcp",
    **kw,
):
    """The object-store tier for one URI in the chosen on-store format: "dcp" (ObjectTier, default) or
    "tensorstore" (tensorstore_format.TensorstoreTier). tensorstore has no driver for az:// and abfs://:
    those stores say so once and keep the DCP format."""
    if format not in FORMATS:
        raise StoreConfigError(f"unknown object-store format {format!r}: use one of {', '.join(FORMATS)}")
    check_uri(uri)
    quiet_third_party_loggers()
    if format == "tensorstore":
        try:
            return TensorstoreTier(uri, run_id, rank, storage_options, keep_windows=keep_windows, **kw)
        except NoTensorstoreDriver as exc:
            if rank == 0:
                log.warning("%s: using the DCP/fsspec format for this store instead", exc)
    return ObjectTier(uri, run_id, rank, storage_options, keep_windows=keep_windows, **kw)


class ObjectTier:
    def __init__(
        self,
        uri: str,
        run_id: str,
        rank: int,
        storage_options: dict | None = None,
        keep_windows: int = 2,
        attempts: int = 2,
        backoff_s: float = 0.2,
        probe: bool = True,
    ):
        self.fs, root = open_store(uri, storage_options, probe)
        self.uri = uri
        self.base = f"{root.rstrip('/')}/{run_id}/rank-{rank:05d}"
        self.rank, self.keep, self.attempts, self.backoff = rank, keep_windows, attempts, backoff_s
        self._buf = bytearray(CHUNK)  # the upload thread's one chunk buffer (a local store streams through it)

    def _retry(self, what: str, fn, *args):
        for i in range(self.attempts):
            try:
                return fn(*args)
            except Exception as exc:
                if i == self.attempts - 1:
                    raise
                # DEBUG: the uploader's TierHealth / RunStatus warn once per outage, not once per retry
                log.debug("object store %s failed (%s), retry %d/%d", what, exc, i + 1, self.attempts - 1)
                time.sleep(self.backoff * 2**i)

    def upload(self, tier: HostTier, window_id: int) -> int:
        """Upload this rank's copy of a committed window (verified locally first); manifest last."""
        wdir = tier.window_dir(window_id)
        man = tier.manifest(window_id)
        dest = f"{self.base}/{window_dirname(window_id)}"
        self._retry(
            "delete",
            lambda: self.fs.rm(f"{dest}/{MANIFEST_NAME}") if self.fs.exists(f"{dest}/{MANIFEST_NAME}") else None,
        )
        nbytes = 0
        for rel, entry in man.files.items():
            if _is_local(self.fs):  # one pass: each chunk is copied, checksummed and written while in cache
                self._retry("upload", self._stream, wdir / rel, f"{dest}/{rel}", entry, window_id)
            else:
                data = (wdir / rel).read_bytes()
                if not entry.matches(data):  # size and digest (CRC32, or the algorithm the entry names)
                    raise RuntimeError(f"local copy of window {window_id} changed under the uploader: {rel}")
                self._retry("upload", self._put, f"{dest}/{rel}", data)
            nbytes += entry.bytes
        faults.point("upload")
        self._check_complete(dest, man, window_id)
        self._retry("commit", self._put, f"{dest}/{MANIFEST_NAME}", man.to_json().encode())
        self._invalidate()
        return nbytes

    def _check_complete(self, dest: str, man: WindowManifest, window_id: int) -> None:
        """Before the manifest: every file is in the store at its size. A store that restarted (even empty)
        during the upload lost the files written before; a manifest over them would list a torn window as good.
        Raises, so the uploader uploads the whole window again."""
        self._invalidate()
        found = self._retry("list", lambda: self.fs.find(dest, detail=True))
        sizes = {p[len(dest) + 1 :] if p.startswith(dest + "/") else p: info.get("size") for p, info in found.items()}
        torn = [rel for rel, e in man.files.items() if sizes.get(rel) != e.bytes]
        if torn:
            raise RuntimeError(
                f"window {window_id} is torn in the store ({len(torn)} of {len(man.files)} file(s) "
                f"missing or short, e.g. {torn[0]}; did the store restart?): uploading it again"
            )

    def _stream(self, src, path: str, entry: FileEntry, window_id: int) -> None:
        """Copy a host-tier file to a local store through one reused buffer, checksumming exactly the bytes
        written; a file that does not match its manifest entry raises (no manifest is written over it). A data
        file is written over a spare (a deleted window's file): on a page-cache or tmpfs store that reuses its
        pages instead of allocating and zeroing new ones."""
        kept = spares(self._spare_dir()) if path.endswith(".distcp") else []
        place_new_file(Path(path), kept[-1] if kept else None)
        d, mv = Digester(entry.algo), memoryview(self._buf)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            with open(src, "rb", buffering=0) as f:
                pos = 0
                while n := f.readinto(self._buf):
                    d.update(mv[:n])
                    pwrite_all(fd, mv[:n], pos)
                    pos += n
            os.ftruncate(fd, pos)  # a longer spare's tail
        finally:
            os.close(fd)
        if d.entry() != entry:  # size and digest (CRC32, or the algorithm the entry names)
            raise RuntimeError(f"local copy of window {window_id} changed under the uploader: {path}")

    def _spare_dir(self):
        return Path(f"{self.base}/.spare")  # not a window-* name: never listed as a window

    def _keep_spares(self, window_dir: str) -> None:
        """A deleted window's data files, kept (bounded) to be written over by the next uploads (local stores)."""
        d = Path(window_dir)
        keep_spares(sorted(d.glob("**/*.distcp")), self._spare_dir(), MAX_SPARES, d.name)

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
            if not entry.matches(data):
                problems.append(f"{rel}: does not match the manifest (torn or corrupt)")
                continue
            out = wdir / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(f".{out.name}.download")
            tmp.write_bytes(data)
            os.replace(tmp, out)  # a new file: never written into one at that name (it may link live slot buffers)
        if not problems:
            (wdir / rank_manifest_name(self.rank)).write_text(man.to_json())
        return problems

    def apply_retention(self) -> list[int]:
        ids = self.window_ids()
        gone = ids[: -self.keep] if self.keep > 0 else []
        for wid in gone:
            d = f"{self.base}/{window_dirname(wid)}"
            self._retry("delete", self.fs.rm, f"{d}/{MANIFEST_NAME}")  # manifest first: never half-visible
            if _is_local(self.fs):
                self._keep_spares(d)
            self._retry("delete", self.fs.rm, d, True)
        self._remove_leftovers(ids[-self.keep :] if ids else [])
        return gone

    def _remove_leftovers(self, kept: list[int]) -> None:
        """Window directories without a manifest older than the oldest kept window: uploads cut off by an outage
        or an exit (invisible to recovery, but they take space). Only this rank writes under `base`."""
        if not kept:
            return
        try:
            entries = self.fs.ls(self.base, detail=False)
        except FileNotFoundError:
            return
        for e in entries:
            wid = parse_window_dirname(e.rstrip("/").rsplit("/", 1)[-1])
            if wid is not None and wid < min(kept) and not self.fs.exists(f"{e.rstrip('/')}/{MANIFEST_NAME}"):
                self._retry("delete", self.fs.rm, e.rstrip("/"), True)
