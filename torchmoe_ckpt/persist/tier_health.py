"""Health of a tier that writes in the background (the host tier's writer, the uploader): a tier that cannot write
must never stop checkpointing silently. State "ok"/"failing" with its reason (a warning on each change), counters,
capped exponential backoff (after n failures in a row the next 2^(n-1)-1 windows, at most 8, are skipped; the
uploader, which retries one window, waits 0.5 s x 2^(n-1), at most 5 s), and the stall policy
(`TierConfig.stall_iterations` / `on_stall`: "warn" once, or "fail": `CheckpointStallError` in the training thread).
"""

from __future__ import annotations

import logging

from ..core.errors import TorchmoeError

log = logging.getLogger("torchmoe_ckpt.tier_health")
STALL_POLICIES = ("warn", "fail")


class CheckpointStallError(TorchmoeError, RuntimeError):
    """No window committed durably for `stall_iterations` iterations and the policy is "fail"."""


class TierHealth:
    backoff_s, backoff_cap_s, backoff_cap_windows = 0.5, 5.0, 8

    def __init__(self, tier: str, rank: int, stall_iterations: int | None = None, on_stall: str = "warn"):
        if on_stall not in STALL_POLICIES:
            raise ValueError(f"on_stall {on_stall!r} is not one of {STALL_POLICIES}")
        self.tier, self.rank = tier, rank
        self.stall_iterations, self.on_stall = stall_iterations, on_stall
        self.state, self.reason = "ok", None
        self.failures = 0  # failed writes (every one, also while already failing)
        self.consecutive = 0  # failed attempts since the last success (sets the backoff)
        self.skipped = 0  # windows not attempted while backing off
        self.state_changes = 0
        self.retry_delay_s = 0.0  # the uploader's wait before it retries
        self._skip_left = 0  # windows still to skip before the next attempt
        self.last_durable: tuple[int, int | None] | None = None  # (window id, its last step)
        self._first_step: int | None = None
        self._stalled = False

    def try_window(self) -> bool:
        """At a window's first write: attempt it, or skip it (counted) while backing off."""
        if self._skip_left > 0:
            self._skip_left -= 1
            self.skipped += 1
            return False
        return True

    def failed(self, what: str, exc: BaseException) -> None:
        self.failures += 1
        self.consecutive += 1
        exc = root_cause(exc)
        self.reason = f"{what}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        # The first retry is the next window; then twice as many windows are skipped each time, up to the cap.
        self._skip_left = min(2 ** (self.consecutive - 1) - 1, self.backoff_cap_windows)
        self.retry_delay_s = min(self.backoff_s * 2 ** (self.consecutive - 1), self.backoff_cap_s)
        if self.state != "failing":
            self.state, self.state_changes = "failing", self.state_changes + 1
            log.warning(
                "event=tier_unhealthy tier=%s rank=%d reason=%r: windows are not persisted on this tier "
                "until it can write again (half-written ones are removed; retried with backoff)",
                self.tier,
                self.rank,
                self.reason,
            )

    def succeeded(self, window_id: int, last_step: int | None = None) -> None:
        self.last_durable = (window_id, last_step)
        self.consecutive, self._skip_left, self._stalled = 0, 0, False
        if self.state != "ok":
            self.state, self.state_changes = "ok", self.state_changes + 1
            log.warning(
                "event=tier_recovered tier=%s rank=%d window=%d: writing again after %d failed write(s) (last: %s)",
                self.tier,
                self.rank,
                window_id,
                self.failures,
                self.reason,
            )

    def check_stall(self, step: int) -> None:
        """Called with each iteration's step; warns once or raises per the policy when stalled."""
        if self._first_step is None:
            self._first_step = step
        if self.stall_iterations is None:
            return
        ld = self.last_durable
        since = ld[1] if ld and ld[1] is not None else self._first_step - 1
        if step - since <= self.stall_iterations or self._stalled:
            return
        self._stalled = True  # once per stall; a durable commit re-arms it
        last = f"last durable window {ld[0]} (step {ld[1]})" if ld else "no durable window yet"
        text = (
            f"checkpointing stalled on rank {self.rank}: no window committed durably on the {self.tier} tier "
            f"for {step - since} iterations ({last}; {self.reason or 'writes are slower than training'}); "
            f"fix the tier (space, permissions, store), or set TierConfig(on_stall='warn') to train on"
        )
        if self.on_stall == "fail":
            raise CheckpointStallError(text)
        log.warning(
            "event=checkpoint_stall tier=%s rank=%d iterations=%d last_durable=%s: %s",
            self.tier,
            self.rank,
            step - since,
            ld[0] if ld else "none",
            text,
        )

    def stats(self) -> dict:
        ld = self.last_durable
        return {
            "state": self.state,
            "reason": self.reason,
            "failed_writes": self.failures,
            "windows_skipped": self.skipped,
            "state_changes": self.state_changes,
            "last_durable_window": None if ld is None else {"window_id": ld[0], "last_step": ld[1]},
        }


def root_cause(exc: BaseException) -> BaseException:
    """The error worth naming: DCP's CheckpointException wraps each rank's (exception, traceback) and prints
    the traceback as its message; an OSError (ENOSPC, EACCES, EROFS) in the chain says what to fix."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            exc = inner
    seen = set()
    while id(exc) not in seen and not isinstance(exc, OSError):
        seen.add(id(exc))
        nxt = exc.__cause__ or exc.__context__
        if nxt is None:
            break
        exc = nxt
    return exc
