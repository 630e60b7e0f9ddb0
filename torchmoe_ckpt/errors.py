"""The library's error types, below every module that raises them."""
from __future__ import annotations

__all__ = ["ConfigError", "UncapturedStateError", "UnusableCheckpointError"]


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the field and the fix."""


class UncapturedStateError(ValueError):
    """Training state the slot format cannot hold (an optimizer kind, a scheduler, a parameter without
    optimizer state): refused up front, so nothing is ever restored at a wrong value."""


class UnusableCheckpointError(RuntimeError):
    """Windows exist for this run but every one was rejected (corrupt, torn, or its replay diverged): resuming
    is refused on every rank rather than silently starting over from step 0 and overwriting them. The message
    lists each window and why, and the fixes; `CheckpointConfig(on_unusable_checkpoint="restart")` (TorchTitan:
    `[sparse_checkpoint] on_unusable_checkpoint = "restart"`) or a new run id starts over deliberately."""
