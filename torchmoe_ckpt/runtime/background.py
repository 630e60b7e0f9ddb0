"""Stop the library's background threads before the interpreter finalizes: a daemon thread still inside a torch
or gloo call then aborts the process (exit 134, a failed run under torchrun). Owners register here; at exit each
is asked to stop, for at most `JOIN_S` seconds.
"""

from __future__ import annotations

import atexit
import weakref
from contextlib import suppress

JOIN_S = 10.0
_OWNERS: weakref.WeakSet = weakref.WeakSet()


def stop_at_exit(owner) -> None:
    """`owner.stop(timeout_s)` is called at interpreter exit if the owner is still alive then."""
    _OWNERS.add(owner)


@atexit.register
def _stop_all() -> None:
    for owner in list(_OWNERS):
        with suppress(Exception):  # exiting anyway: one owner's failure must not keep the others running
            owner.stop(JOIN_S)
