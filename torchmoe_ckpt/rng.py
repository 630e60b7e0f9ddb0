"""The random state an iteration starts from, logged so that its replay draws the same numbers.

Logged per iteration: torch's CPU generator, always; with CUDA, the default generator of the current device
(dropout, router jitter, any CUDA random op without a generator of its own; DTensor's random ops too in torch
>= 2.9, whose tracker keeps only offsets on top of that generator); and the per-name states of DTensor's RNG
tracker in torch versions that keep their own (`rng_states`). Reading or setting a generator's state touches
only its seed and offset on the host: no device synchronisation. A CPU run logs the CPU state alone, exactly
as before (`device_states` is None).
"""

from __future__ import annotations

import sys

import torch

from .errors import TorchmoeError

__all__ = ["RngMismatch", "capture", "device_generators", "restore"]

DTENSOR_PREFIX = "dtensor."


class RngMismatch(TorchmoeError, RuntimeError):
    """The window logged a generator this process does not have (e.g. a GPU run recovered on a CPU-only one)."""


def device_generators() -> dict[str, torch.Generator]:
    """The device generators this process draws from: the current CUDA device's default generator once CUDA
    is in use, else none. (A process that never initialised CUDA draws nothing on a GPU.)"""
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # CUDA only
        return {"cuda": torch.cuda.default_generators[torch.cuda.current_device()]}
    return {}


def _dtensor_tracker_states() -> dict:
    """DTensor's tracker states where this torch keeps them apart from the device generator (older versions)."""
    mod = sys.modules.get("torch.distributed.tensor._random")
    tracker = getattr(mod, "_rng_tracker", None) if mod is not None else None
    states = getattr(tracker, "rng_states", None)
    return states if isinstance(states, dict) else {}


def capture(generators: dict[str, torch.Generator] | None = None) -> tuple[torch.Tensor, dict | None]:
    """(CPU state, {name: state} of the device generators and DTensor's tracker, or None when there are none).
    `generators` replaces `device_generators()` (tests, or a model that draws from generators of its own)."""
    gens = device_generators() if generators is None else generators
    states = {name: g.get_state() for name, g in gens.items()}
    states.update({DTENSOR_PREFIX + k: v.clone() for k, v in _dtensor_tracker_states().items()})
    return torch.get_rng_state(), states or None


def restore(
    cpu_state: torch.Tensor, device_states: dict | None, generators: dict[str, torch.Generator] | None = None
) -> None:
    """Set every generator `capture` read back to the logged state. A logged generator this process lacks is
    refused: the replay would draw other numbers."""
    torch.set_rng_state(cpu_state)
    if not device_states:
        return
    gens = device_generators() if generators is None else generators
    tracker = _dtensor_tracker_states()
    for name, state in device_states.items():
        if name.startswith(DTENSOR_PREFIX) and name[len(DTENSOR_PREFIX) :] in tracker:
            tracker[name[len(DTENSOR_PREFIX) :]] = state.clone()
        elif name in gens:
            gens[name].set_state(state)
        else:
            raise RngMismatch(
                f"the window logged the random state of generator {name!r}, which this process does not have "
                f"(it has {sorted(gens) or 'the CPU generator only'}): recover on the kind of device that wrote it"
            )
