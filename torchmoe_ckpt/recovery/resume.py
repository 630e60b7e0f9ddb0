"""The recovery sequence, written once (harness, TorchTitan and `Checkpointer` call `recover`): find the newest
window every rank can get from the tiers, verify it, and convert it to the dense state by replay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from ..core.errors import UnusableCheckpointError
from ..core.operator import Operator
from ..core.rejection import Rejection, RejectionKind
from ..core.window import Window, sliding_suffix
from ..model.identity import IdentityMismatch, RunIdentity, allowed_changes, build_identity, refusal
from ..model.optim_state import attach_optimizer_state
from ..persist.build_tiers import Tiers
from ..runtime.agreement import all_gather_objects, gather_failures, run_everywhere
from ..runtime.watchdog import CollectiveWatchdog
from ..tiers.host_tier import HostTier
from .agreed_window import SearchResult, TierOutcome, recover_from_tiers
from .replay_check import ReplayPolicy, replay_verdict
from .sparse_to_dense import RecoveryReport, Replayable, replay_slots, sparse_to_dense

log = logging.getLogger("torchmoe_ckpt.recovery")

__all__ = ["RecoveryOptions", "RecoveryOutcome", "ResumeResult", "recover"]


@dataclass
class RecoveryOptions:
    """How a recovery from the tiers behaves (`recover`, `startup.start`)."""

    # Every window there rejected: "fail" raises UnusableCheckpointError; "restart" starts over from step 0
    # (overwriting them).
    on_unusable: Literal["fail", "restart"] | str = "fail"
    replay_check: ReplayPolicy | None = None  # how each replayed iteration is compared (default: exact)
    before_replay: Callable[[Window], None] | None = None  # called with each window before its load into the trainer
    watchdog: CollectiveWatchdog | None = None  # watches the whole recovery


@dataclass
class RecoveryOutcome:
    """What a recovery from the tiers did; `to_dict()` is the JSON report (`ResumeResult.report`)."""

    tiers: TierOutcome  # where the window came from, what was rejected and why
    replay: RecoveryReport | None = None  # the conversion to the dense state (None: nothing recovered)
    fetch_seconds: float = 0.0  # from the start of the recovery to the end of the search over the tiers
    total_seconds: float | None = None  # the whole recovery (None: nothing recovered)
    allowed_changes: list[str] | None = None  # settings changed since the window was written (rank 0 only)

    def to_dict(self) -> dict:
        out = self.replay.to_dict() if self.replay is not None else {}
        out.update(self.tiers.to_dict(), fetch_seconds=self.fetch_seconds)
        if self.total_seconds is not None:
            out["total_seconds"] = self.total_seconds
        if self.allowed_changes:
            out["allowed_changes"] = self.allowed_changes
        return out


@dataclass
class ResumeResult:
    window: Window | None  # the window recovered from (the checkpointer's fallback until the next commits)
    recovered_step: int | None  # iterations completed after recovery; None = no window anywhere
    # The JSON report: a view of `outcome` (its to_dict()), or another recovery's; code reads `outcome`.
    report: dict = field(default_factory=dict)
    # Where new window ids start (None: after `window`, else 0); set by a recovery that hands no window over
    # (pipeline stages, a JIT copy), so that new windows sort after those on the tiers.
    next_window_id: int | None = None
    outcome: RecoveryOutcome | None = None  # a recovery from the tiers: the report's typed form

    @property
    def recovered(self) -> bool:
        return self.window is not None


def recover(
    trainer: Replayable,
    tiers: Tiers,
    ops: dict[str, Operator],
    compute_dtype: torch.dtype,
    *,
    identity: RunIdentity | None = None,
    options: RecoveryOptions | None = None,
) -> ResumeResult:
    """Load the newest usable window into `trainer` (freshly built) and replay it. Collective, every rank.

    A window that fails a check, its load or its replay is rejected on every rank and the next newest is tried.

    Args:
        trainer: what is recovered into; untouched when nothing is recovered.
        tiers: the opened tiers (`persist.build_tiers.build_tiers`).
        ops: the operators by name.
        compute_dtype: the dtype the slots were captured in.
        identity: what a window must have been written by (default: built from the trainer).
        options: `RecoveryOptions` (on_unusable, replay_check, before_replay, watchdog).

    Returns:
        A `ResumeResult`; `recovered_step=None` when there is no window on any tier.

    Raises:
        IdentityMismatch: every window there belongs to another run.
        UnusableCheckpointError: windows exist but every one was rejected, with `on_unusable="fail"`.
    """
    opts = options or RecoveryOptions()
    with opts.watchdog.watch("recovery") if opts.watchdog is not None else nullcontext():
        return _recover(trainer, tiers, ops, compute_dtype, identity, opts)


def _recover(trainer, tiers: Tiers, ops, compute_dtype, identity: RunIdentity | None, opts: RecoveryOptions):
    t0 = time.perf_counter()
    attach_optimizer_state(trainer.model, ops, trainer.optimizer)  # the slots' layout of the optimizer state
    if identity is None:
        identity = _identity_of(trainer, tiers, ops, compute_dtype)
    replay = _ReplayEachWindow(trainer, _Source(tiers.host, ops, compute_dtype, identity), opts, t0)
    window, found = recover_from_tiers(tiers, ops, compute_dtype, identity=identity, use=replay)
    fetch_s = time.perf_counter() - t0
    rank = dist.get_rank() if dist.is_initialized() else 0
    if window is None:
        replay.undo()  # every window tried failed its replay: the caller's trainer back as it was
        _no_window(found, tiers, identity, rank, opts.on_unusable)
        outcome = RecoveryOutcome(found, fetch_seconds=fetch_s)
        return ResumeResult(None, None, outcome.to_dict(), outcome=outcome)
    rep = replay.timed_report(fetch_s)
    outcome = RecoveryOutcome(found, rep, fetch_s, total_seconds=time.perf_counter() - t0)
    if rank == 0:
        outcome.allowed_changes = _log_recovered(window, tiers.host, identity, outcome)
    return ResumeResult(window, rep.recovered_step, outcome.to_dict(), outcome=outcome)


def _identity_of(trainer, tiers: Tiers, ops, compute_dtype) -> RunIdentity:
    world = dist.get_world_size() if dist.is_initialized() else 1
    return build_identity(trainer.model, trainer.optimizer, compute_dtype, ops, tiers.host.dir.name, world)


@dataclass(frozen=True)
class _Source:
    """Where the windows are read from, and what they must hold: the host tier, operators, dtype and identity."""

    host: HostTier
    ops: dict[str, Operator]
    compute_dtype: torch.dtype
    identity: RunIdentity


class _ReplayEachWindow:
    """The `use` hook of `recover_from_tiers`: replays each window tried into the trainer, and keeps the phase
    clock. When every window fails, the caller gets its trainer back as it was, not half-replayed: one host copy
    per recovery (a failed window's state is overwritten by the next one's load), taken before the first replay."""

    def __init__(self, trainer, source: _Source, opts: RecoveryOptions, t0: float):
        self.trainer, self.source, self.opts, self.t0 = trainer, source, opts, t0
        self.find_s = 0.0  # listed, checked, agreed and read from the tier
        self.safety_copy_s = 0.0
        self.saved: tuple[list, dict] | None = None
        self.report: RecoveryReport | None = None

    def __call__(self, window: Window) -> None:
        self.find_s = time.perf_counter() - self.t0
        if self.saved is None:
            s0 = time.perf_counter()
            self.saved = _snapshot(self.trainer)
            self.safety_copy_s = time.perf_counter() - s0
        if self.opts.before_replay is not None:
            self.opts.before_replay(window)
        rep = _replay_tail(self.trainer, self.source, window, self.opts.replay_check)
        self.report = rep if rep is not None else sparse_to_dense(self.trainer, window, self.opts.replay_check)

    def undo(self) -> None:
        if self.saved is not None:
            _restore(self.trainer, self.saved)

    def timed_report(self, fetch_s: float) -> RecoveryReport:
        """The successful replay's report with the recovery's phases: find and safety_copy first, the rest of
        the search counted as rebuild."""
        rep = self.report
        assert rep is not None  # a window was recovered: its replay ran
        rep.phases.find, rep.phases.safety_copy = self.find_s, self.safety_copy_s
        rep.phases.rebuild += max(0.0, fetch_s - self.find_s - self.safety_copy_s - rep.seconds)
        return rep


def _log_recovered(window: Window, host: HostTier, identity: RunIdentity, outcome: RecoveryOutcome) -> list[str]:
    """Rank 0's lines after a recovery; returns the allowed changes since the window was written."""
    found, rep = outcome.tiers, outcome.replay
    assert rep is not None
    rejected = sorted(w for w in _rejected_windows(found) if w != window.id)  # by any rank (gathered)
    changed = allowed_changes(_written_by(host, window.id), identity)
    if changed:
        log.info(
            f"event=allowed_change run={identity.run_id} window={window.id}: {'; '.join(changed)} "
            "(not part of the run identity: accepted)"
        )
    log.info(
        f"event=recovered run={identity.run_id} window={window.id} source={found.source} steps="
        f"{rep.start_step}..{rep.recovered_step} replayed={rep.replayed_iterations} bytes={rep.bytes_loaded} "
        f"seconds={outcome.total_seconds:.3f} rejected={rejected or 'none'} exact={str(rep.exact).lower()}: "
        f"{replay_verdict(rep.to_dict())}"
    )
    return changed


def _written_by(host: HostTier, wid: int) -> dict | None:
    """The identity in window `wid`'s manifest, as written (None: unreadable)."""
    try:
        return host.manifest(wid).identity
    except (OSError, ValueError):
        return None


def _replay_tail(trainer, source: _Source, window: Window, replay_check: ReplayPolicy | None) -> RecoveryReport | None:
    """Collective. With sliding plans, the replay of `window` on to the newest uncommitted slot after it that every
    rank has (`HostTier.load_partial`) and that covers every operator; None on every rank when some rank has none
    or the replay fails on any (the committed window alone is next)."""
    if not window.plan.sliding:
        return None
    nxt = None
    try:
        nxt = source.host.load_partial(
            window.id + 1,
            window.start_step + window.plan.window,
            source.ops,
            source.compute_dtype,
            source.identity.fingerprint,
        )
    except Exception as exc:  # an unreadable partial copy is one that does not count
        log.info("event=partial_window_unusable window=%d: %s", window.id + 1, exc)
    captured = nxt.captured if nxt is not None else 0
    k = min(all_gather_objects(captured))
    if k == 0 or nxt is None:  # nxt is None only where k == 0: the same branch on every rank
        return None
    nxt.captured = k
    suffix = sliding_suffix(window, nxt)
    assert suffix is not None
    # ReplayDivergence, a torn item: the committed window is next (a failed collective ends the recovery).
    rep, failures = run_everywhere(
        replay_slots,
        trainer,
        suffix.seq,
        suffix.start_step,
        suffix.record,
        window.id + 1,
        suffix.label,
        replay_check,
        reason=_whole_reason,
    )
    if failures:
        log.warning(
            "event=sliding_replay_failed window=%d: %s; replaying window %d alone",
            window.id + 1,
            next(iter(failures.values())),
            window.id,
        )
        return None
    return rep


def _whole_reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _no_window(found: TierOutcome, tiers: Tiers, identity: RunIdentity, rank: int, on_unusable: str) -> None:
    """Say why nothing was recovered; refuse when every window there belongs to another run, and (by default)
    when windows exist but every one was rejected: restarting from step 0 would overwrite them."""
    rejected = dict(found.unusable_copies)
    for w, per_rank in found.rejected.items():
        rejected.setdefault(w, next(iter(per_rank.values())))
    foreign = [why.detail for why in rejected.values() if why.kind is RejectionKind.FOREIGN]
    all_foreign = foreign[-1] if foreign and len(foreign) == len(rejected) else None
    # Agreed, so that every rank refuses or none does (a rank that went on alone would hang its peers).
    refusing = gather_failures(all_foreign)
    if refusing:
        raise IdentityMismatch(refusal(identity.run_id, foreign[-1] if foreign else next(iter(refusing.values()))))
    # "no usable window" is the same on every rank (agreed_window.py gathers every rank's damaged copies): agreed.
    if found.outcome is SearchResult.NO_USABLE_WINDOW:
        windows = _rejected_windows(found)
        if on_unusable != "restart":
            raise UnusableCheckpointError(unusable_message(identity.run_id, tiers.host.dir, windows))
        if rank == 0:
            log.warning(
                f"event=no_usable_window run={identity.run_id} run_dir={tiers.host.dir}: windows exist but every one "
                f"was rejected ({_listing(windows, '; ')}); on_unusable_checkpoint='restart': a new run starts from "
                "step 0 and overwrites them"
            )
    elif rank == 0:
        log.info(
            f"event=no_window run={identity.run_id} run_dir={tiers.host.dir}: nothing to recover, a new run starts"
        )


def _rejected_windows(found: TierOutcome) -> dict[int, dict[Rejection, list]]:
    """window -> {reason: [ranks]}: every rank's damaged copies and every window rejected by agreement."""
    out: dict[int, dict[Rejection, list]] = {}
    by_rank: dict = found.unusable_by_rank or {"this rank": found.unusable_copies}
    damaged = [(w, r, why) for r, copies in by_rank.items() for w, why in copies.items()]
    agreed = [(w, r, why) for w, per_rank in found.rejected.items() for r, why in per_rank.items()]
    for w, r, why in damaged + agreed:
        out.setdefault(w, {}).setdefault(why, []).append(r)
    return out


MAX_LISTED = 6  # windows listed in a message; the rest are counted (a reason is never cut)


def _listing(windows: dict[int, dict[Rejection, list]], sep: str) -> str:
    ids = sorted(windows, reverse=True)
    parts = []
    for w in ids[:MAX_LISTED]:
        whys = [_why_with_ranks(why, ranks) for why, ranks in windows[w].items()]
        parts.append(f"window {w}: " + " | ".join(whys[:2]) + (f" (+{len(whys) - 2} more)" if len(whys) > 2 else ""))
    if len(ids) > MAX_LISTED:
        parts.append(f"... and {len(ids) - MAX_LISTED} older window(s): {', '.join(map(str, ids[MAX_LISTED:]))}")
    return sep.join(parts)


def _why_with_ranks(why: Rejection, ranks: list) -> str:
    """ "ranks 0, 2: why" ("this rank": the reason alone)."""
    if ranks == ["this rank"]:
        return str(why)
    label = "ranks" if len(ranks) > 1 else "rank"
    return f"{label} {', '.join(map(str, ranks))}: {why}"


def unusable_message(run_id: str | None, run_dir, windows: dict[int, dict[Rejection, list]]) -> str:
    """The refusal: each window and why, the likely cause, and how to start over deliberately."""
    kinds = {why.kind for whys in windows.values() for why in whys}
    if windows and kinds <= {RejectionKind.NO_COPY, RejectionKind.STRANDED}:
        return _lost_part_message(run_id, run_dir, windows)
    if RejectionKind.REPLAY_DIVERGENCE in kinds:
        cause = (
            "a replay did not reproduce the logged loss: the step function depends on something the checkpoint "
            "does not capture, most often randomness outside torch's CPU generator (random.random(), numpy, "
            "an RNG of your own inside forward: draw it from torch instead), a non-persistent buffer or Python "
            "attribute that changes during training, or a non-deterministic kernel (on a GPU: turn on deterministic "
            "kernels, docs/gpu.md, or accept a bounded deviation with replay_check='tolerant'); fix that and the "
            "next run's windows replay exactly"
        )
    else:
        cause = (
            "the copies are damaged (a corrupt or torn file, e.g. a disk or memory error, or files changed "
            "after they were written); every tier that holds the window was tried"
        )
    listed = _listing(windows, "\n  ")
    return (
        f"run id {run_id!r} has checkpoint windows in {run_dir} but every one was rejected; refusing to "
        f"resume (starting over from step 0 would overwrite them):\n  {listed}\n"
        f"Cause: {cause}.\nTo start over deliberately: start this job with a new run id (TierConfig(run_id=...), "
        "[sparse_checkpoint] run_id), or set on_unusable_checkpoint='restart' (CheckpointConfig, "
        '[sparse_checkpoint] on_unusable_checkpoint = "restart"), which starts from step 0 and overwrites these '
        "windows. Nothing was deleted or overwritten."
    )


def _lost_part_message(run_id: str | None, run_dir, windows: dict[int, dict[Rejection, list]]) -> str:
    """One line: windows some ranks still hold, that other ranks have no copy of on any tier."""

    def ranks(stranded: bool) -> str:
        got = {
            r
            for whys in windows.values()
            for why, rs in whys.items()
            if (why.kind is RejectionKind.STRANDED) == stranded
            for r in rs
        }
        return ", ".join(map(str, sorted(got, key=str)))

    ids = ", ".join(map(str, sorted(windows, reverse=True)))
    lost, stranded = ranks(False), ranks(True)
    # parts on another host under an older node numbering (a renumbered survivor, replicas = 0): they exist but
    # cannot be sent; said apart from the parts that are gone, with the setting that would have sent them
    where = (
        f"rank(s) {lost} have no copy of their part on any tier (their host's copies are gone; no peer (replicas) "
        "or object store holds them)"
        if lost
        else ""
    )
    if stranded:
        where += (
            f"{'; and ' if lost else ''}rank(s) {stranded} have their part only on another host, under an older node "
            "numbering, and no peer tier (replicas = 0) can send it (replicas >= 1 or an object store would)"
        )
    return (
        f"run id {run_id!r} cannot resume: window(s) {ids} are still held by some ranks, but {where}; refusing to "
        "start over, which would overwrite the copies that are left (nothing was deleted or overwritten); fix: "
        "start this job with a new run id, or set on_unusable_checkpoint='restart' to start from step 0 "
        "deliberately"
    )


def _params(trainer) -> list:
    return [p for g in trainer.optimizer.param_groups for p in g["params"]]


def _snapshot(trainer) -> tuple[list, dict]:
    """A host-memory copy of what a replay changes: parameters, buffers, optimizer state."""
    m, o = trainer.model, trainer.optimizer
    tensors = [_host(t) for t in [*m.parameters(), *m.buffers()]]
    state = {
        id(p): {k: _host(v) if torch.is_tensor(v) else v for k, v in o.state[p].items()}
        for p in _params(trainer)
        if p in o.state
    }
    return tensors, state


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


@torch.no_grad()
def _restore(trainer, saved: tuple[list, dict]) -> None:
    tensors, state = saved
    m, o = trainer.model, trainer.optimizer
    for t, s in zip([*m.parameters(), *m.buffers()], tensors):
        t.copy_(s)
    for p in _params(trainer):
        if p not in o.state:
            continue
        st, was = o.state[p], state.get(id(p))
        for k, v in st.items():
            if not torch.is_tensor(v):
                continue
            if was is not None and k in was:
                v.copy_(was[k])
            else:  # state created by the recovery attempt: back to a fresh optimizer's zeros
                v.zero_()
    trainer.set_step(0)
