"""The library's error types, below every module that raises them."""

from __future__ import annotations

import sys

__all__ = [
    "TorchmoeError",
    "ConfigError",
    "UncapturedStateError",
    "UnusableCheckpointError",
    "StoreConfigError",
    "PeerTimeoutError",
    "is_collective_failure",
]


class TorchmoeError(Exception):
    """Base of every error this library raises on purpose: `except TorchmoeError` catches them all."""

    # A start refused under torchrun: how many more times torchrun starts the job (each start refuses the same way
    # unless the cause goes away); None elsewhere (runtime/distributed.py, `note_restarts`).
    restarts_left: int | None = None


class ConfigError(TorchmoeError, ValueError):
    """A configuration value that cannot work; the message names the field and the fix."""


class StoreConfigError(TorchmoeError, ValueError):
    """The object-store URI or its options cannot work; the message names the fix."""


class UncapturedStateError(TorchmoeError, ValueError):
    """Training state the slot format cannot hold: refused up front, so nothing is restored at a wrong value."""


class UnusableCheckpointError(TorchmoeError, RuntimeError):
    """Windows exist for this run but every one was rejected (corrupt, torn, or its replay diverged): resuming is
    refused on every rank rather than starting over and overwriting them; the message lists each and the fixes."""


class PeerTimeoutError(TorchmoeError, TimeoutError):
    """A peer-tier transfer got no answer from its partner rank within `TierConfig.peer_timeout_s`. gloo closes
    the pair on a timeout, so the peer tier stops for the rest of this process (its copies count as not durable);
    a restart builds the group again."""


# gloo raises a plain RuntimeError ("[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms
# for recv operation to complete", "[.../pair.cc:553] Connection closed by peer"), not dist.DistError.
_COLLECTIVE_MARKERS = ("gloo", "nccl", "timed out", "connection closed", "connection reset", "broken pipe")


def is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective that failed (a peer gone or frozen past the process group's timeout): the
    job cannot go on, so recovery does not treat it as a bad window and the watchdog ends the process. Never
    imports torch (the watchdog's exit path calls it)."""
    if isinstance(exc, PeerTimeoutError):  # a peer transfer past peer_timeout_s: the pair is closed
        return True
    dist = sys.modules.get("torch.distributed")
    if dist is not None and isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _COLLECTIVE_MARKERS)
