"""The library's error types, below every module that raises them."""

from __future__ import annotations

__all__ = ["TorchmoeError", "ConfigError", "UncapturedStateError", "UnusableCheckpointError"]


class TorchmoeError(Exception):
    """Base of every error this library raises on purpose: `except TorchmoeError` catches them all."""


class ConfigError(TorchmoeError, ValueError):
    """A configuration value that cannot work; the message names the field and the fix."""


class UncapturedStateError(TorchmoeError, ValueError):
    """Training state the slot format cannot hold (an optimizer kind, a scheduler, a parameter without
    optimizer state): refused up front, so nothing is ever restored at a wrong value."""


class UnusableCheckpointError(TorchmoeError, RuntimeError):
    """Windows exist for this run but every one was rejected (corrupt, torn, or its replay diverged): resuming
    is refused on every rank rather than silently starting over from step 0 and overwriting them. The message
    lists each window and why, and the fixes; `CheckpointConfig(on_unusable_checkpoint="restart")` (TorchTitan:
    `[sparse_checkpoint] on_unusable_checkpoint = "restart"`) or a new run id starts over deliberately."""
