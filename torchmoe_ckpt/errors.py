"""The library's error types, below every module that raises them."""
from __future__ import annotations

__all__ = ["ConfigError", "UncapturedStateError"]


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the field and the fix."""


class UncapturedStateError(ValueError):
    """Training state the slot format cannot hold (an optimizer kind, a scheduler, a parameter without
    optimizer state): refused up front, so nothing is ever restored at a wrong value."""
