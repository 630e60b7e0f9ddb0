"""The recovery sequence, written once: find the newest window every rank can get from the tiers (host
memory, then peers, then the object store), verify it, and convert it to the dense state by replay.

The harness, TorchTitan's trainer and the own-loop `Checkpointer` all call `recover`.
"""
from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from .dcp.tiers import Tiers, all_gather_objects, recover_from_tiers
from .identity import IdentityMismatch, RunIdentity, allowed_changes, build_identity, refusal
from .operators import Operator
from .recovery import Replayable, sparse_to_dense
from .window import Window

log = logging.getLogger("torchmoe_ckpt.resume")

__all__ = ["ResumeResult", "recover"]


@dataclass
class ResumeResult:
    window: Window | None          # the window recovered from (the checkpointer's fallback until the next commits)
    recovered_step: int | None     # iterations completed after recovery; None = no window anywhere
    report: dict = field(default_factory=dict)

    @property
    def recovered(self) -> bool:
        return self.window is not None


def recover(trainer: Replayable, tiers: Tiers, ops: dict[str, Operator], compute_dtype: torch.dtype,
            rank: int = 0, before_replay: Callable[[Window], None] | None = None,
            identity: RunIdentity | None = None, watchdog=None) -> ResumeResult:
    """Collective. Loads the newest usable window into `trainer` (freshly built) and replays it; with no
    window on any tier returns `recovered_step=None` and leaves the trainer untouched. `before_replay` is
    called with the fetched window before anything is loaded into the trainer.

    `identity` (default: built from the trainer's model and optimizer, `compute_dtype`, the world size and the
    host tier's run id) is what a window must have been written by. A window that fails any check, load or
    its replay is rejected on every rank and the next newest is tried (a failed replay leaves nothing behind:
    the next window's load overwrites every operator's state). When windows exist but all belong to another
    run, `IdentityMismatch` is raised with one line naming the difference and the fix."""
    # `watchdog` (a CollectiveWatchdog) watches the whole recovery: a rank frozen during fetch, agreement or
    # replay ends the others within its timeout instead of the process-group timeout.
    with watchdog.watch("recovery") if watchdog is not None else nullcontext():
        return _recover(trainer, tiers, ops, compute_dtype, rank, before_replay, identity)


def _recover(trainer, tiers, ops, compute_dtype, rank, before_replay, identity) -> ResumeResult:
    t0 = time.perf_counter()
    if identity is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        identity = build_identity(trainer.model, trainer.optimizer, compute_dtype, ops, tiers.host.dir.name, world)
    done: dict = {}

    def replay(window: Window) -> None:
        if "saved" not in done:  # a failed replay must not leave a half-replayed trainer behind
            done["saved"] = _snapshot(trainer)
        if before_replay is not None:
            before_replay(window)
        done["report"] = sparse_to_dense(trainer, window)

    window, found = recover_from_tiers(tiers.host, tiers.replicator, ops, compute_dtype, store=tiers.store,
                                       identity=identity, use=replay)
    fetch_s = time.perf_counter() - t0
    if window is None:
        if "saved" in done:  # every window tried failed its replay: give the caller its trainer back as it was
            _restore(trainer, done["saved"])
        _no_window(found, tiers, identity, rank)
        return ResumeResult(None, None, dict(found, fetch_seconds=fetch_s))
    rep = done["report"]
    report = dict(rep.to_dict(), **found, fetch_seconds=fetch_s, total_seconds=time.perf_counter() - t0)
    if rank == 0:
        changed = allowed_changes(_identity_of(tiers, window.id), identity)
        if changed:
            report["allowed_changes"] = changed
            log.info("event=allowed_change run=%s window=%d: %s (not part of the run identity: accepted)",
                     identity.run_id, window.id, "; ".join(changed))
        log.info("event=recovered run=%s window=%d source=%s steps=%d..%d replayed=%d bytes=%d seconds=%.3f rejected=%s: "
                 "every replayed loss matched the original run bit for bit", identity.run_id, window.id,
                 found.get("source"), rep.start_step, rep.recovered_step, rep.replayed_iterations, rep.bytes_loaded,
                 report["total_seconds"], sorted(found.get("rejected", {})) or "none")
    return ResumeResult(window, rep.recovered_step, report)


def _identity_of(tiers: Tiers, window_id: int) -> dict | None:
    try:
        return tiers.host.manifest(window_id).identity
    except (OSError, ValueError):
        return None


def _no_window(found: dict, tiers: Tiers, identity: RunIdentity, rank: int) -> None:
    """Say why nothing was recovered; refuse (one line) when every window there belongs to another run."""
    rejected = {w: why for w, why in found.get("unusable_copies", {}).items()}
    for w, per_rank in found.get("rejected", {}).items():
        rejected.setdefault(w, next(iter(per_rank.values())))
    foreign = [why.split("identity: ", 1)[1] for why in rejected.values() if "identity: " in why]
    # Agreed, so that every rank refuses or none does (a rank that went on alone would hang its peers).
    refuse = [f for f in all_gather_objects(foreign[-1] if foreign and len(foreign) == len(rejected) else None) if f]
    if refuse:
        raise IdentityMismatch(refusal(identity.run_id, foreign[-1] if foreign else refuse[0]))
    if found.get("outcome") == "no usable window" and rank == 0:
        log.warning("event=no_usable_window run=%s run_dir=%s: windows exist but every one was rejected (%s); "
                    "a new run starts", identity.run_id, tiers.host.dir,
                    "; ".join(f"window {w}: {why}" for w, why in sorted(rejected.items())))
    elif rank == 0:
        log.info("event=no_window run=%s run_dir=%s: nothing to recover, a new run starts", identity.run_id,
                 tiers.host.dir)


def _params(trainer) -> list:
    return [p for g in trainer.optimizer.param_groups for p in g["params"]]


def _snapshot(trainer) -> tuple[list, dict]:
    """A host-memory copy of what a replay changes: parameters, buffers, optimizer state (taken once per
    recovery, in host memory so that a GPU run does not need twice its state on the device)."""
    m, o = trainer.model, trainer.optimizer
    tensors = [_host(t) for t in [*m.parameters(), *m.buffers()]]
    state = {id(p): {k: _host(v) if torch.is_tensor(v) else v for k, v in o.state[p].items()}
             for p in _params(trainer) if p in o.state}
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
