"""The library's error types, below every module that raises them."""

from __future__ import annotations

__all__ = ["TorchmoeError", "ConfigError", "UncapturedStateError", "UnusableCheckpointError"]


class TorchmoeError(Exception):
    """Base of every error this library raises on purpose: `except TorchmoeError` catches them all."""


class ConfigError(TorchmoeError, ValueError):
    """A configuration value that cannot work; the message names the field and the fix."""


class UncapturedStateError(TorchmoeError, ValueError):
    """Training state the slot format cannot hold: refused up front, so nothing is restored at a wrong value."""


class UnusableCheckpointError(TorchmoeError, RuntimeError):
    """Windows exist for this run but every one was rejected (corrupt, torn, or its replay diverged): resuming is
    refused on every rank rather than starting over and overwriting them; the message lists each and the fixes."""
