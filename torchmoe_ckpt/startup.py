"""The start-up sequence, written once for every entry point (own loop, TorchTitan, harness): who this run is,
its storage tiers, the recovery, the checkpointer. What differs is passed as a few option groups: the identity
parts (`IdentityParts`: data, seed, steps, HSDP replicas), the recovery (`recovery.resume.RecoveryOptions`), the
checkpointer's process groups (`sparse_checkpointer.PlanningGroups`) and three hooks (`StartupHooks`: `on_tiers`,
the harness damages copies; `recover_with`, a recovery of another kind; `cold_start`, the trainer to start over
with when nothing was recovered). Collective.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import SparseConfig, TierConfig
from .core.operator import Operator
from .model.identity import RunIdentity, TorchSeed, build_identity, given_seed, mesh_replicate
from .model.operators import discover_operators
from .ops.status import log_recovery
from .persist.build_tiers import Tiers, build_tiers
from .recovery.resume import RecoveryOptions, ResumeResult, recover
from .recovery.sparse_to_dense import Replayable
from .runtime.agreement import all_gather_objects
from .runtime.distributed import refusal_notes_restarts
from .sparse_checkpointer import PlanningGroups, RunContext, SparseCheckpointer

log = logging.getLogger("torchmoe_ckpt.startup")

__all__ = ["IdentityParts", "PlanningGroups", "RecoveryOptions", "Started", "StartupHooks", "start"]

# A recovery of another kind: (the tiers or None, the run identity) -> what it resumed and the trainer holding it,
# or None for the usual recovery from the tiers.
RecoverHook = Callable[[Tiers | None, RunIdentity], "tuple[ResumeResult, Replayable] | None"]


@dataclass
class IdentityParts:
    """What the run identity names besides the model, optimizer, dtype, run id and world size (identity.py)."""

    data: str | None = None  # the data identity: a job on other data with the same run id never resumes this one
    seed: int | TorchSeed | None = None  # a TorchSeed: the seed the user gave torch, gathered from every rank
    steps: int | None = None  # the planned steps (recorded, not checked: they may grow)
    hsdp_replicate: int | None = None  # HSDP replicas (None: read from the model's device mesh)


@dataclass
class StartupHooks:
    """The entry points' own steps in the sequence."""

    on_tiers: Callable[[Tiers], None] | None = None  # called with the opened tiers (the harness damages copies)
    # A recovery of another kind (pipeline stages, a JIT copy, an in-memory window); returning None leaves the
    # recovery to the tiers.
    recover_with: RecoverHook | None = None
    cold_start: Callable[[], Replayable] | None = None  # nothing recovered: the trainer to start over with


@dataclass
class Started:
    checkpointer: SparseCheckpointer  # built on `trainer`'s model and optimizer; threads running
    trainer: Replayable  # the trainer passed in, or the one a hook gave (`recover_with`, `cold_start`)
    identity: RunIdentity
    tiers: Tiers | None  # None: windows in this process only
    resumed: ResumeResult | None  # None: no recovery was tried (no tiers and no hook, or resume=False)

    @property
    def recovered(self) -> bool:
        return self.resumed is not None and self.resumed.recovered_step is not None


@refusal_notes_restarts  # under torchrun a refusal repeats --max-restarts times: it says so
def start(  # noqa: PLR0913 (the front door: four positional essentials, then one keyword per option group)
    trainer: Replayable,
    compute_dtype: torch.dtype,
    config: SparseConfig | None,
    tiers: TierConfig | dict | None,
    *,
    ops: list[Operator] | None = None,
    identity: IdentityParts | None = None,
    resume: bool = True,
    recovery: RecoveryOptions | None = None,
    hooks: StartupHooks | None = None,
    groups: PlanningGroups | None = None,
) -> Started:
    """Build this run's identity, open its tiers, recover, and build the checkpointer. Collective, every rank.

    Args:
        trainer: what is recovered into and checkpointed.
        compute_dtype: the dtype slots are captured in.
        config: the checkpointer's `SparseConfig` (None: defaults).
        tiers: a `TierConfig`, its dict form, or None (windows in this process only).
        ops: operators already discovered (default: discovered from `trainer.model` and its optimizer).
        identity: `IdentityParts` (data, seed, steps, HSDP replicas).
        resume: False: no recovery is tried.
        recovery: `RecoveryOptions` for the recovery from the tiers.
        hooks: `StartupHooks` (on_tiers, recover_with, cold_start).
        groups: `PlanningGroups` for the checkpointer.

    Returns:
        `Started`: the checkpointer (threads running), the trainer to train, the identity, the tiers and what was
        resumed.

    Raises:
        IdentityMismatch, UnusableCheckpointError: from `recovery.resume`; HostMemoryLimitError, ConfigError: the
            checkpointer refused (in each case the store lease is released first).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    hooks, parts = hooks or StartupHooks(), identity or IdentityParts()
    model = trainer.model
    ops = ops if ops is not None else discover_operators(model, optimizer=trainer.optimizer)
    hsdp = parts.hsdp_replicate if parts.hsdp_replicate is not None else mesh_replicate(model)
    cfg = TierConfig.from_dict(tiers) if isinstance(tiers, dict) else tiers
    # Who this run is: written into every window, and what a window must match to be loaded.
    run_id = cfg.resolved_run_id() if cfg is not None else None
    seed = _resolve_seed(parts.seed)
    ident = build_identity(
        model, trainer.optimizer, compute_dtype, ops, run_id, world, hsdp, data=parts.data, steps=parts.steps, seed=seed
    )
    opened = build_tiers(cfg, rank, world, hsdp) if cfg is not None else None
    # Everything from here to a running checkpointer may refuse (recovery, host memory, device staging): the store
    # lease taken by build_tiers is released then, or the corrected relaunch would wait out `lease_s`.
    with _lease_released_on_error(opened):
        if opened is not None and hooks.on_tiers is not None:
            hooks.on_tiers(opened)
        resumed = None
        if resume:
            got = hooks.recover_with(opened, ident) if hooks.recover_with is not None else None
            if got is not None:
                resumed, trainer = got
            elif opened is not None:
                resumed = _recover_from_tiers(trainer, compute_dtype, ops, opened, ident, recovery)
        if hooks.cold_start is not None and (resumed is None or resumed.recovered_step is None):
            trainer = hooks.cold_start()  # nothing recovered: the trainer recovery was tried on is not the one to use
        if trainer.model is not model:  # a hook handed over another trainer: its state is the one checkpointed
            ops = discover_operators(trainer.model, optimizer=trainer.optimizer)
        ck = SparseCheckpointer(
            trainer.model,
            trainer.optimizer,
            compute_dtype,
            config,
            RunContext(tiers=opened, resumed=resumed, identity=ident, ops=ops),
            groups,
        )
    return Started(ck, trainer, ident, opened, resumed)


@contextmanager
def _lease_released_on_error(opened: Tiers | None) -> Iterator[None]:
    """Refused or failed before anything was written: the store prefix is free again."""
    try:
        yield
    except Exception:
        if opened is not None:
            opened.release_store_lease()
        raise


def _recover_from_tiers(trainer, compute_dtype, ops, opened: Tiers, identity: RunIdentity, recovery) -> ResumeResult:
    resumed = recover(trainer, opened, {o.name: o for o in ops}, compute_dtype, identity=identity, options=recovery)
    if resumed.window is not None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        log_recovery(resumed.report, rank)  # where the copy came from; every replayed loss matched
    return resumed


def _resolve_seed(seed: int | TorchSeed | None) -> int | None:
    """Collective (every rank gathers, whatever it was given). A `TorchSeed` becomes the seed the user gave torch or
    None (`identity.given_seed`: it needs every rank's value); an int or None is taken as it is."""
    auto = seed.value if isinstance(seed, TorchSeed) else None
    every_rank = all_gather_objects(auto)
    if isinstance(seed, TorchSeed):
        return given_seed(seed.value, every_rank)
    return seed
