"""The random state an iteration starts from, logged so that its replay draws the same numbers.

Logged: torch's CPU generator; with CUDA, the current device's default generator; DTensor's tracker states where
this torch keeps its own; generators the model tracks (`track_generator`). Reading or setting them does not
synchronise the device.
"""

from __future__ import annotations

import sys

import torch

from ..core.errors import TorchmoeError

__all__ = ["RngMismatch", "capture", "device_generators", "restore", "track_generator", "untrack_generator"]

DTENSOR_PREFIX = "dtensor."
_tracked: dict[str, torch.Generator] = {}  # generators of the model's own (track_generator)


class RngMismatch(TorchmoeError, RuntimeError):
    """The window logged a generator this process does not have (e.g. a GPU run recovered on a CPU-only one)."""


def track_generator(name: str, generator: torch.Generator) -> None:
    """Log and restore a generator the model draws from with every iteration. Call before training, in every
    process, with the same names."""
    if name == "cuda" or name.startswith(DTENSOR_PREFIX) or not isinstance(generator, torch.Generator):
        raise ValueError(
            "track_generator(name, generator) takes a torch.Generator and a name other than 'cuda'/'dtensor.*'"
        )
    _tracked[name] = generator


def untrack_generator(name: str) -> None:
    """Stop logging a generator `track_generator` added (its windows then no longer recover in this process)."""
    _tracked.pop(name, None)


def device_generators() -> dict[str, torch.Generator]:
    """The generators besides the CPU one: the CUDA device's default (once initialised) and the tracked ones
    (`track_generator`)."""
    out = dict(_tracked)
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # CUDA only
        out["cuda"] = torch.cuda.default_generators[torch.cuda.current_device()]
    return out


def _dtensor_tracker_states() -> dict:
    """DTensor's tracker states where this torch keeps them apart from the device generator (older versions)."""
    mod = sys.modules.get("torch.distributed.tensor._random")
    tracker = getattr(mod, "_rng_tracker", None) if mod is not None else None
    states = getattr(tracker, "rng_states", None)
    return states if isinstance(states, dict) else {}


def capture(generators: dict[str, torch.Generator] | None = None) -> tuple[torch.Tensor, dict | None]:
    """(CPU state, {name: state} of the other generators or None); `generators` replaces `device_generators()`."""
    gens = device_generators() if generators is None else generators
    states = {name: g.get_state() for name, g in gens.items()}
    states.update({DTENSOR_PREFIX + k: v.clone() for k, v in _dtensor_tracker_states().items()})
    return torch.get_rng_state(), states or None


def restore(
    cpu_state: torch.Tensor, device_states: dict | None, generators: dict[str, torch.Generator] | None = None
) -> None:
    """Set every generator `capture` read back; a logged generator this process lacks is refused."""
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
