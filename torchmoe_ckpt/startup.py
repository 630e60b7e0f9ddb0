"""The start-up sequence, written once for every entry point (own loop, TorchTitan, harness): who this run is,
its storage tiers, the recovery, the checkpointer. What differs is passed as parameters: identity parts (`data`,
`seed`, `steps`), the recovery check, and three hooks: `on_tiers` (the harness damages copies), `recover_with`
(a recovery of another kind: pipeline stages, a JIT copy, an in-memory window) and `cold_start` (the trainer to
start over with when nothing was recovered). Collective.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import SparseConfig, TierConfig
from .core.operator import Operator
from .core.window import Window
from .model.identity import RunIdentity, TorchSeed, build_identity, given_seed, mesh_replicate
from .model.operators import discover_operators
from .ops.status import log_recovery
from .recovery.recover import ResumeResult, recover
from .recovery.replay_check import ReplayPolicy
from .recovery.sparse_to_dense import Replayable
from .sparse_checkpointer import SAME_GROUP, SparseCheckpointer
from .storage.recover import all_gather_objects
from .storage.tiers import Tiers, build_tiers

log = logging.getLogger("torchmoe_ckpt.startup")

__all__ = ["Started", "start"]

# A recovery of another kind: (the tiers or None, the run identity) -> what it resumed and the trainer holding it,
# or None for the usual recovery from the tiers.
RecoverHook = Callable[[Tiers | None, RunIdentity], "tuple[ResumeResult, Replayable] | None"]


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


def start(
    trainer: Replayable,
    compute_dtype: torch.dtype,
    config: SparseConfig | None,
    tiers: TierConfig | dict | None,
    *,
    ops: list[Operator] | None = None,
    hsdp_replicate: int | None = None,
    data: str | None = None,
    seed: int | TorchSeed | None = None,
    steps: int | None = None,
    resume: bool = True,
    on_unusable: str = "fail",
    replay_check: ReplayPolicy | None = None,
    before_replay: Callable[[Window], None] | None = None,
    watchdog=None,
    on_tiers: Callable[[Tiers], None] | None = None,
    recover_with: RecoverHook | None = None,
    cold_start: Callable[[], Replayable] | None = None,
    group: dist.ProcessGroup | None = None,
    agree_group: dist.ProcessGroup | None | object = SAME_GROUP,
    sum_counts: bool = False,
) -> Started:
    """Collective, every rank. `trainer` is what is recovered into and checkpointed; `tiers`: a `TierConfig`, its
    dict form, or None (in this process only). `on_unusable`, `replay_check`, `before_replay` and `watchdog` go to
    `recovery.recover` (with tiers and `resume`); `group`, `agree_group` and `sum_counts` to the SparseCheckpointer.
    `recover_with` returning None leaves the recovery to the tiers."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    model, optimizer = trainer.model, trainer.optimizer
    ops = ops if ops is not None else discover_operators(model)
    hsdp = hsdp_replicate if hsdp_replicate is not None else mesh_replicate(model)
    cfg = TierConfig.from_dict(tiers) if isinstance(tiers, dict) else tiers
    # Who this run is: written into every window, and what a window must match to be loaded.
    run_id = cfg.resolved_run_id() if cfg is not None else None
    seed = _resolve_seed(seed)
    identity = build_identity(
        model, optimizer, compute_dtype, ops, run_id, world, hsdp, data=data, steps=steps, seed=seed
    )
    opened = build_tiers(cfg, rank, world, hsdp) if cfg is not None else None
    if opened is not None and on_tiers is not None:
        on_tiers(opened)
    resumed = None
    try:
        if resume:
            got = recover_with(opened, identity) if recover_with is not None else None
            if got is not None:
                resumed, trainer = got
            elif opened is not None:
                resumed = recover(
                    trainer,
                    opened,
                    {o.name: o for o in ops},
                    compute_dtype,
                    rank,
                    before_replay=before_replay,
                    identity=identity,
                    watchdog=watchdog,
                    on_unusable=on_unusable,
                    replay_check=replay_check,
                )
                if resumed.window is not None:
                    log_recovery(resumed.report, rank)  # where the copy came from; every replayed loss matched
    except Exception:
        if opened is not None:  # refused or failed before anything was written: the store prefix is free again
            opened.release_store_lease()
        raise
    if cold_start is not None and (resumed is None or resumed.recovered_step is None):
        trainer = cold_start()  # nothing recovered: the trainer recovery was tried on is not the one to train
    if trainer.model is not model:  # a hook handed over another trainer: its state is the one checkpointed
        model, optimizer = trainer.model, trainer.optimizer
        ops = discover_operators(model)
    ck = SparseCheckpointer(
        model,
        optimizer,
        compute_dtype,
        config,
        tiers=opened,
        resumed=resumed,
        identity=identity,
        ops=ops,
        group=group,
        agree_group=agree_group,
        sum_counts=sum_counts,
    )
    return Started(ck, trainer, identity, opened, resumed)


def _resolve_seed(seed: int | TorchSeed | None) -> int | None:
    """Collective (every rank gathers, whatever it was given). A `TorchSeed` becomes the seed the user gave torch or
    None (`identity.given_seed`: it needs every rank's value); an int or None is taken as it is."""
    auto = seed.value if isinstance(seed, TorchSeed) else None
    every_rank = all_gather_objects(auto)
    return given_seed(auto, every_rank) if auto is not None else seed
