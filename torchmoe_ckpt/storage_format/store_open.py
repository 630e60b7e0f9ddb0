"""Opening an object store, one function for every user of one (the object tier, the JIT copies, dense
exports, inspect/verify, the DCP adapters): `open_store` checks the URI (a scheme without '//' is a typo that
would become a local directory), names the package a scheme needs, shortens the clients' own retries, probes
the store once with a small write, and turns what fails into one `StoreConfigError` naming the fix."""

from __future__ import annotations

import logging
import re
import uuid

from ..core.config_values import check_uri
from ..core.errors import StoreConfigError

_S3, _AZURE = "s3fs (pip install 'torchmoe-ckpt[s3]')", "adlfs (pip install 'torchmoe-ckpt[azure]')"
KNOWN = {"file": None, "memory": None, "s3": _S3, "s3a": _S3, "az": _AZURE, "abfs": _AZURE, "abfss": _AZURE}
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
        while lg is not None and lg is not root and not configured:
            configured, lg = lg.level != logging.NOTSET, lg.parent
        if not configured:
            logging.getLogger(name).setLevel(logging.WARNING)


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
            if is_local(fs):  # on object stores makedirs would silently *create* a missing bucket
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
    """botocore retries a refused connection 4 times (up to ~15 s per call) under our own retries: a store that
    is down would be noticed a minute late. One inner try and a 5 s connect timeout, unless the user set them."""
    opts = dict(options or {})
    cfg = dict(opts.get("config_kwargs") or {})
    cfg.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
    cfg.setdefault("connect_timeout", 5)
    opts["config_kwargs"] = cfg
    return opts


def is_local(fs) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


_UNREACHABLE = ("could not connect", "connection refused", "endpointconnectionerror", "name or service not known")
_DENIED = ("credential", "authenticat", "signature", "accessdenied", "forbidden", "invalidaccesskeyid")
_MISSING = ("nosuchbucket", "containernotfound", "does not exist", "not found")


def explain(uri: str, exc: BaseException) -> str:
    """One message naming the likely fix for a store that cannot be written at start."""
    text = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    low = text.lower()
    if isinstance(exc, ConnectionError) or any(w in low for w in _UNREACHABLE):
        return (
            f"object store {uri!r}: the endpoint is not reachable ({text}); check endpoint_url / "
            f"connection_string in storage_options and that the service is running and reachable"
        )
    # "403" as an HTTP status, not inside a port number or an id
    if isinstance(exc, PermissionError) or re.search(r"(?<![:\d])403(?!\d)", low) or any(w in low for w in _DENIED):
        return (
            f"object store {uri!r}: authentication failed ({text}); check the credentials in storage_options "
            f"(s3: key/secret; az/abfs: connection_string or account_name + account_key/sas_token)"
        )
    if isinstance(exc, FileNotFoundError) or any(w in low for w in _MISSING):
        return (
            f"object store {uri!r}: the bucket/container does not exist ({text}); create it first, or "
            f"check the bucket/container exists under that name in the URI"
        )
    return (
        f"cannot write to {uri!r} ({text}); check the bucket/container exists and the credentials/endpoint "
        f"(endpoint_url, connection_string) in storage_options, and that the service is reachable"
    )
