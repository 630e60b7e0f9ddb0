"""Stop the library's background threads before the interpreter finalizes.

The snapshot copy and host-tier threads are daemon threads, so a forgotten `close()` never hangs an exit.
But a daemon thread still inside a torch or gloo call while the interpreter finalizes aborts the process
("terminate called without an active exception", exit code 134: under torchrun a finished run is reported
as failed). Their owners register here; at exit (atexit runs before finalization) each is asked to finish
its job in flight and stop, for at most `JOIN_S` seconds.
"""

from __future__ import annotations

import atexit
import weakref

JOIN_S = 10.0
_OWNERS: weakref.WeakSet = weakref.WeakSet()


def stop_at_exit(owner) -> None:
    """`owner.stop(timeout_s)` is called at interpreter exit if the owner is still alive then."""
    _OWNERS.add(owner)


@atexit.register
def _stop_all() -> None:
    for owner in list(_OWNERS):
        try:
            owner.stop(JOIN_S)
        except Exception:  # exiting anyway: one owner's failure must not keep the others running
            pass
