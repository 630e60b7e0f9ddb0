"""Why an object store cannot be used, said once at start with the fix: below the store formats (DCP files
in `object_tier`, tensorstore in `tensorstore_format`), which both probe a store when they open it."""

from __future__ import annotations

import re

from ..errors import TorchmoeError


class StoreConfigError(TorchmoeError, ValueError):
    """The object-store URI or its options cannot work; the message names the fix."""


def explain(uri: str, exc: BaseException) -> str:
    """One message naming the likely fix for a store that cannot be written at start."""
    text = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    low = text.lower()
    if isinstance(exc, ConnectionError) or any(
        w in low
        for w in ("could not connect", "connection refused", "endpointconnectionerror", "name or service not known")
    ):
        return (
            f"object store {uri!r}: the endpoint is not reachable ({text}); check endpoint_url / "
            f"connection_string in storage_options and that the service is running and reachable"
        )
    # "403" as an HTTP status, not inside a port number or an id
    if (
        isinstance(exc, PermissionError)
        or re.search(r"(?<![:\d])403(?!\d)", low)
        or any(
            w in low
            for w in ("credential", "authenticat", "signature", "accessdenied", "forbidden", "invalidaccesskeyid")
        )
    ):
        return (
            f"object store {uri!r}: authentication failed ({text}); check the credentials in storage_options "
            f"(s3: key/secret; az/abfs: connection_string or account_name + account_key/sas_token)"
        )
    if isinstance(exc, FileNotFoundError) or any(
        w in low for w in ("nosuchbucket", "containernotfound", "does not exist", "not found")
    ):
        return (
            f"object store {uri!r}: the bucket/container does not exist ({text}); create it first, or "
            f"check the bucket/container exists under that name in the URI"
        )
    return (
        f"cannot write to {uri!r} ({text}); check the bucket/container exists and the credentials/endpoint "
        f"(endpoint_url, connection_string) in storage_options, and that the service is reachable"
    )
