"""Host synchronisations counted where they happen, for the GPU check.

torch's CUDA sync debug mode (`torch.cuda.set_sync_debug_mode("warn")`) warns at every synchronising CUDA call it
knows (`.item()`, `.cpu()`, `.tolist()`, a blocking copy, a stream or device synchronize). `SyncCounter` turns those
warnings into counts: per iteration on the training thread (the thread that made the counter), on other threads in
total, and by the Python line that made the call, so a report says *where* a sync came from. Host waits that are
not CUDA calls (a lock, an event of our copy thread) are not syncs in this sense: the bench times them as the
training thread's blocked time. Without CUDA the counter is off (`enabled` False) and counts nothing."""

from __future__ import annotations

import threading
import warnings
from collections import Counter

import torch

MESSAGE = "synchronizing CUDA operation"  # c10's warn_or_error_on_sync: "called a synchronizing CUDA operation"


class SyncCounter:
    def __init__(self, enabled: bool = True):
        self.enabled = bool(enabled) and torch.cuda.is_available()
        self.step = 0  # the iteration the training thread is in (set by the loop)
        self.by_step: dict[int, int] = {}  # training thread: syncs per iteration
        self.other_threads = 0
        self.sites: Counter[str] = Counter()  # "file:line" -> count, training thread
        self._thread = threading.get_ident()
        self._show = None
        self._filters = None

    def __enter__(self) -> SyncCounter:
        if not self.enabled:
            return self
        self._filters = warnings.filters[:]
        warnings.filterwarnings("always", message=f".*{MESSAGE}")  # every one, not once per line
        self._show = warnings.showwarning
        warnings.showwarning = self._seen
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled or self._show is None:
            return
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._show
        warnings.filters[:] = self._filters
        self._show = None

    def _seen(self, message, category, filename, lineno, file=None, line=None) -> None:
        if MESSAGE not in str(message):
            self._show(message, category, filename, lineno, file, line)
            return
        if threading.get_ident() != self._thread:
            self.other_threads += 1
            return
        self.by_step[self.step] = self.by_step.get(self.step, 0) + 1
        self.sites[f"{filename}:{lineno}"] += 1

    def report(self) -> dict:
        return {
            "enabled": self.enabled,
            "by_step": {str(k): v for k, v in sorted(self.by_step.items())},
            "other_threads": self.other_threads,
            "sites": dict(self.sites.most_common(12)),
        }


def added_syncs(plain: dict, checkpointed: dict, steps: list[int]) -> dict:
    """Syncs per iteration the checkpointer adds on the training thread: `checkpointed` minus `plain` (two
    `SyncCounter.report()`s of the same loop, with and without it) over `steps` (the steady-state iterations)."""
    a, b = plain.get("by_step", {}), checkpointed.get("by_step", {})
    per = {s: b.get(str(s), 0) - a.get(str(s), 0) for s in steps}
    n = max(1, len(steps))
    return {
        "steps": steps,
        "plain_per_iteration": sum(a.get(str(s), 0) for s in steps) / n,
        "checkpointed_per_iteration": sum(b.get(str(s), 0) for s in steps) / n,
        "added_per_iteration": sum(per.values()) / n,
        "iterations_with_added_syncs": sorted(s for s, d in per.items() if d > 0),
    }
