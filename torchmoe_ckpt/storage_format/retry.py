"""Retry with exponential backoff, one implementation for every store operation that may fail transiently."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger("torchmoe_ckpt.storage")
T = TypeVar("T")


def retry(what: str, fn: Callable[..., T], *args, attempts: int = 2, backoff_s: float = 0.2) -> T:
    """`fn(*args)`, tried up to `attempts` times, waiting `backoff_s` x 2^i between; the last error is raised.
    Logged at DEBUG: the tier's owner (TierHealth, RunStatus) warns once per outage, not per retry."""
    for i in range(attempts):
        try:
            return fn(*args)
        except Exception as exc:
            if i == attempts - 1:
                raise
            log.debug("store %s failed (%s), retry %d/%d", what, exc, i + 1, attempts - 1)
            time.sleep(backoff_s * 2**i)
    raise ValueError(f"store {what}: attempts must be >= 1, got {attempts}")
