"""The recovery sequence, written once (harness, TorchTitan and `Checkpointer` call `recover`): find the newest
window every rank can get from the tiers, verify it, and convert it to the dense state by replay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..core.errors import UnusableCheckpointError, is_collective_failure
from ..core.operator import Operator
from ..core.window import Window, sliding_suffix
from ..model.identity import IdentityMismatch, RunIdentity, allowed_changes, build_identity, refusal
from ..model.optim_state import describe_optimizer_state
from ..storage.recover import all_gather_objects, recover_from_tiers
from ..storage.tiers import Tiers
from .replay_check import ReplayPolicy, replay_verdict
from .sparse_to_dense import RecoveryReport, Replayable, replay_slots, sparse_to_dense

log = logging.getLogger("torchmoe_ckpt.recovery")

__all__ = ["ResumeResult", "recover"]


@dataclass
class ResumeResult:
    window: Window | None  # the window recovered from (the checkpointer's fallback until the next commits)
    recovered_step: int | None  # iterations completed after recovery; None = no window anywhere
    report: dict = field(default_factory=dict)
    # Where new window ids start (None: after `window`, else 0); set by a recovery that hands no window over
    # (pipeline stages, a JIT copy), so that new windows sort after those on the tiers.
    next_window_id: int | None = None

    @property
    def recovered(self) -> bool:
        return self.window is not None


def recover(
    trainer: Replayable,
    tiers: Tiers,
    ops: dict[str, Operator],
    compute_dtype: torch.dtype,
    rank: int = 0,
    before_replay: Callable[[Window], None] | None = None,
    identity: RunIdentity | None = None,
    watchdog=None,
    on_unusable: str = "fail",
    replay_check: ReplayPolicy | None = None,
) -> ResumeResult:
    """Collective. Loads the newest usable window into `trainer` (freshly built) and replays it; with no window
    on any tier returns `recovered_step=None`, trainer untouched. `before_replay(window)` runs before the load.
    `identity` (default: built from the trainer) is what a window must have been written by. A window that fails
    a check, its load or its replay is rejected on every rank and the next newest is tried. Windows that all
    belong to another run raise `IdentityMismatch`; windows all rejected raise `UnusableCheckpointError` with
    `on_unusable="fail"`, or start over with "restart". `watchdog` watches the whole recovery."""
    with watchdog.watch("recovery") if watchdog is not None else nullcontext():
        t0 = time.perf_counter()
        describe_optimizer_state(trainer.model, ops, trainer.optimizer)  # the slots' layout of the optimizer state
        if identity is None:
            world = dist.get_world_size() if dist.is_initialized() else 1
            identity = build_identity(trainer.model, trainer.optimizer, compute_dtype, ops, tiers.host.dir.name, world)
        done: dict = {}

        def replay(window: Window) -> None:
            done["find"] = time.perf_counter() - t0  # listed, checked, agreed and read from the tier
            # When every window fails, the caller gets its trainer back as it was, not half-replayed: one host
            # copy per recovery (a failed window's state is overwritten by the next one's load): "safety_copy".
            if "saved" not in done:
                s0 = time.perf_counter()
                done["saved"] = _snapshot(trainer)
                done["safety_copy"] = time.perf_counter() - s0
            if before_replay is not None:
                before_replay(window)
            rep = _replay_tail(trainer, tiers.host, window, ops, compute_dtype, identity, replay_check)
            done["report"] = rep if rep is not None else sparse_to_dense(trainer, window, replay_check)

        window, found = recover_from_tiers(
            tiers.host, tiers.peers, ops, compute_dtype, store=tiers.store, identity=identity, use=replay
        )
        fetch_s = time.perf_counter() - t0
        if window is None:
            if "saved" in done:  # every window tried failed its replay: the caller's trainer back as it was
                _restore(trainer, done["saved"])
            _no_window(found, tiers, identity, rank, on_unusable)
            return ResumeResult(None, None, dict(found, fetch_seconds=fetch_s))
        rep = done["report"]
        rep.phases = {"find": done["find"], "safety_copy": done["safety_copy"], **rep.phases}
        rep.phases["rebuild"] += max(0.0, fetch_s - done["find"] - done["safety_copy"] - rep.seconds)
        report = dict(rep.to_dict(), **found, fetch_seconds=fetch_s, total_seconds=time.perf_counter() - t0)
        if rank == 0:
            rejected = sorted(w for w in _rejected_windows(found) if w != window.id)  # by any rank (gathered)
            try:
                written_by = tiers.host.manifest(window.id).identity
            except (OSError, ValueError):
                written_by = None
            changed = allowed_changes(written_by, identity)
            if changed:
                report["allowed_changes"] = changed
                log.info(
                    f"event=allowed_change run={identity.run_id} window={window.id}: {'; '.join(changed)} "
                    "(not part of the run identity: accepted)"
                )
            log.info(
                f"event=recovered run={identity.run_id} window={window.id} source={found.get('source')} steps="
                f"{rep.start_step}..{rep.recovered_step} replayed={rep.replayed_iterations} bytes={rep.bytes_loaded} "
                f"seconds={report['total_seconds']:.3f} rejected={rejected or 'none'}: {replay_verdict(report)}"
            )
        return ResumeResult(window, rep.recovered_step, report)


def _replay_tail(trainer, host, window: Window, ops, compute_dtype, identity, replay_check) -> RecoveryReport | None:
    """Collective. With sliding plans, the replay of `window` on to the newest uncommitted slot after it that every
    rank has (`HostTier.load_partial`) and that covers every operator; None on every rank when some rank has none
    or the replay fails on any (the committed window alone is next)."""
    if not window.plan.sliding:
        return None
    nxt = None
    try:
        nxt = host.load_partial(
            window.id + 1, window.start_step + window.plan.window, ops, compute_dtype, identity.fingerprint
        )
    except Exception as exc:  # noqa: BLE001  (an unreadable partial copy is one that does not count)
        log.info("event=partial_window_unusable window=%d: %s", window.id + 1, exc)
    k = min(all_gather_objects(nxt.captured if nxt is not None else 0))
    if k == 0:
        return None
    nxt.captured = k
    suffix = sliding_suffix(window, nxt)
    rep, why = None, None
    try:
        rep = replay_slots(
            trainer, suffix.seq, suffix.start_step, suffix.record, window.id + 1, suffix.label, replay_check
        )
    except Exception as exc:  # noqa: BLE001  (ReplayDivergence, a torn item: the committed window is next)
        if is_collective_failure(exc):  # a peer frozen or gone: no verdict on the window (storage/recover._try)
            raise
        why = f"{type(exc).__name__}: {exc}"
    whys = [w for w in all_gather_objects(why) if w]
    if whys:
        log.warning(
            "event=sliding_replay_failed window=%d: %s; replaying window %d alone", window.id + 1, whys[0], window.id
        )
        return None
    return rep


def _no_window(found: dict, tiers: Tiers, identity: RunIdentity, rank: int, on_unusable: str) -> None:
    """Say why nothing was recovered; refuse when every window there belongs to another run, and (by default)
    when windows exist but every one was rejected: restarting from step 0 would overwrite them."""
    rejected = dict(found.get("unusable_copies", {}))
    for w, per_rank in found.get("rejected", {}).items():
        rejected.setdefault(w, next(iter(per_rank.values())))
    foreign = [why.split("identity: ", 1)[1] for why in rejected.values() if "identity: " in why]
    # Agreed, so that every rank refuses or none does (a rank that went on alone would hang its peers).
    refuse = [f for f in all_gather_objects(foreign[-1] if foreign and len(foreign) == len(rejected) else None) if f]
    if refuse:
        raise IdentityMismatch(refusal(identity.run_id, foreign[-1] if foreign else refuse[0]))
    # "no usable window" is the same on every rank (tiers.py gathers every rank's damaged copies): agreed.
    if found.get("outcome") == "no usable window":
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


def _rejected_windows(found: dict) -> dict[int, dict[str, list]]:
    """window -> {reason: [ranks]}: every rank's damaged copies and every window rejected by agreement."""
    out: dict[int, dict[str, list]] = {}
    by_rank = found.get("unusable_by_rank") or {"this rank": found.get("unusable_copies", {})}
    damaged = [(w, r, why) for r, copies in by_rank.items() for w, why in copies.items()]
    agreed = [(w, r, why) for w, per_rank in found.get("rejected", {}).items() for r, why in per_rank.items()]
    for w, r, why in damaged + agreed:
        out.setdefault(w, {}).setdefault(why, []).append(r)
    return out


MAX_LISTED = 6  # windows listed in a message; the rest are counted (a reason is never cut)


def _listing(windows: dict[int, dict[str, list]], sep: str) -> str:
    ids = sorted(windows, reverse=True)
    parts = []
    for w in ids[:MAX_LISTED]:
        whys = [
            f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}: {why}" if ranks != ["this rank"] else why
            for why, ranks in windows[w].items()
        ]
        parts.append(f"window {w}: " + " | ".join(whys[:2]) + (f" (+{len(whys) - 2} more)" if len(whys) > 2 else ""))
    if len(ids) > MAX_LISTED:
        parts.append(f"... and {len(ids) - MAX_LISTED} older window(s): {', '.join(map(str, ids[MAX_LISTED:]))}")
    return sep.join(parts)


def unusable_message(run_id: str | None, run_dir, windows: dict[int, dict[str, list]]) -> str:
    """The refusal: each window and why, the likely cause, and how to start over deliberately."""
    text = " ".join(why for whys in windows.values() for why in whys)
    if windows and all(why.startswith("no copy:") for whys in windows.values() for why in whys):
        return _lost_part_message(run_id, run_dir, windows)
    if "ReplayDivergence" in text:
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


def _lost_part_message(run_id: str | None, run_dir, windows: dict[int, dict[str, list]]) -> str:
    """One line: windows some ranks still hold, that other ranks have no copy of on any tier."""
    lost = sorted({r for whys in windows.values() for ranks in whys.values() for r in ranks}, key=str)
    return (
        f"run id {run_id!r} cannot resume: window(s) {', '.join(map(str, sorted(windows, reverse=True)))} are "
        f"still held by some ranks, but rank(s) {', '.join(map(str, lost))} have no copy of their part on any "
        "tier (their host's copies are gone; no peer (replicas) or object store holds them); refusing to start "
        "over, which would overwrite the copies that are left (nothing was deleted or overwritten); fix: start "
        "this job with a new run id, or set on_unusable_checkpoint='restart' to start from step 0 deliberately"
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
            if torch.is_tensor(v):  # state created by the recovery attempt: back to a fresh optimizer's zeros
                v.copy_(was[k]) if was is not None and k in was else v.zero_()
    trainer.set_step(0)
