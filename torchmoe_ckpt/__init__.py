"""torchmoe-ckpt: checkpoint every iteration of Mixture-of-Experts training, recover bit-exactly.

Own training loop (FSDP2, HSDP or a single process):

    import torchmoe_ckpt as tmc
    tmc.init_process_group()                                  # restart-safe under torchrun
    ckpt = tmc.Checkpointer(model, optimizer, forward_backward, scheduler,
                            tmc.CheckpointConfig(tiers=tmc.TierConfig(run_id="my-run"), max_grad_norm=1.0))
    for step in range(ckpt.resume() + 1, steps + 1):
        ckpt.step(batch_for(step))
    ckpt.close()

Frameworks (TorchTitan) implement `Replayable` and drive `SparseCheckpointer` and `recover` themselves.

Every public name is imported on first use (PEP 562 module ``__getattr__``): ``import torchmoe_ckpt`` imports
nothing else, and a process that needs one piece (a TorchTitan launcher checking its job file, a restarted
worker) does not import all the others (DCP planners, tiers, pipeline code) before its first step.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {  # public name -> the module that defines it, imported on first use
    "SchedulerPosition": "capture",
    "Checkpointer": "checkpointer",
    "StepResult": "checkpointer",
    "CheckpointConfig": "config",
    "ObjectStoreConfig": "config",
    "SparseConfig": "config",
    "TierConfig": "config",
    "PeerReader": "dcp.peer_storage",
    "PeerWriter": "dcp.peer_storage",
    "held_copies": "dcp.peer_storage",
    "CorruptItemError": "dcp.raw_storage",
    "RawReader": "dcp.raw_storage",
    "RawWriter": "dcp.raw_storage",
    "has_checkpoint": "dcp.raw_storage",
    "RunLockedError": "dcp.run_lock",
    "SparseLoadPlanner": "dcp.sparse_planner",
    "SparseSavePlanner": "dcp.sparse_planner",
    "SparseSchedule": "dcp.sparse_planner",
    "load_sparse_window": "dcp.sparse_planner",
    "CheckpointStallError": "dcp.tier_health",
    "HostReader": "dcp.tier_storage",
    "HostWriter": "dcp.tier_storage",
    "StoreReader": "dcp.tier_storage",
    "StoreWriter": "dcp.tier_storage",
    "TieredReader": "dcp.tier_storage",
    "TieredWriter": "dcp.tier_storage",
    "Tiers": "dcp.tiers",
    "build_tiers": "dcp.tiers",
    "init_process_group": "distributed",
    "restart_attempt": "distributed",
    "ConfigError": "errors",
    "UncapturedStateError": "errors",
    "UnusableCheckpointError": "errors",
    "IdentityMismatch": "identity",
    "RunIdentity": "identity",
    "Operator": "operators",
    "OperatorDiscoveryError": "operators",
    "OperatorSpec": "operators",
    "discover_operators": "operators",
    "Placement": "placement",
    "Topology": "placement",
    "place_replicas": "placement",
    "ResumeResult": "recovery",
    "recover": "recovery",
    "IterationRecord": "replay_log",
    "Replay": "replay_log",
    "RouterCounter": "routing",
    "SparseCheckpointer": "sparse_checkpointer",
    "RecoveryReport": "sparse_to_dense",
    "Replayable": "sparse_to_dense",
    "ReplayDivergence": "sparse_to_dense",
    "sparse_to_dense": "sparse_to_dense",
    "Window": "window",
}

if TYPE_CHECKING:  # the names for type checkers and IDEs; at run time they come from __getattr__
    from .capture import SchedulerPosition
    from .checkpointer import Checkpointer, StepResult
    from .config import CheckpointConfig, ObjectStoreConfig, SparseConfig, TierConfig
    from .dcp.peer_storage import PeerReader, PeerWriter, held_copies
    from .dcp.raw_storage import CorruptItemError, RawReader, RawWriter, has_checkpoint
    from .dcp.run_lock import RunLockedError
    from .dcp.sparse_planner import SparseLoadPlanner, SparseSavePlanner, SparseSchedule, load_sparse_window
    from .dcp.tier_health import CheckpointStallError
    from .dcp.tier_storage import HostReader, HostWriter, StoreReader, StoreWriter, TieredReader, TieredWriter
    from .dcp.tiers import Tiers, build_tiers
    from .distributed import init_process_group, restart_attempt
    from .errors import ConfigError, UncapturedStateError, UnusableCheckpointError
    from .identity import IdentityMismatch, RunIdentity
    from .operators import Operator, OperatorDiscoveryError, OperatorSpec, discover_operators
    from .placement import Placement, Topology, place_replicas
    from .recovery import ResumeResult, recover
    from .replay_log import IterationRecord, Replay
    from .routing import RouterCounter
    from .sparse_checkpointer import SparseCheckpointer
    from .sparse_to_dense import RecoveryReport, Replayable, ReplayDivergence, sparse_to_dense
    from .window import Window


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    # own training loop
    "Checkpointer",
    "CheckpointConfig",
    "TierConfig",
    "ObjectStoreConfig",
    "SparseConfig",
    "OperatorSpec",
    "StepResult",
    "init_process_group",
    "restart_attempt",
    # frameworks
    "SparseCheckpointer",
    "Replayable",
    "Replay",
    "recover",
    "ResumeResult",
    "sparse_to_dense",
    "RecoveryReport",
    "Tiers",
    "build_tiers",
    "Window",
    "SchedulerPosition",
    "RouterCounter",
    "discover_operators",
    "Operator",
    # DCP users: sparse planners on a standard state dict, one StorageWriter/Reader per tier
    "SparseSchedule",
    "SparseSavePlanner",
    "SparseLoadPlanner",
    "load_sparse_window",
    "HostWriter",
    "HostReader",
    "StoreWriter",
    "StoreReader",
    "TieredWriter",
    "TieredReader",
    "RawWriter",
    "RawReader",
    "has_checkpoint",
    "PeerWriter",
    "PeerReader",
    "held_copies",
    "Topology",
    "place_replicas",
    "Placement",
    "IterationRecord",
    # errors
    "ConfigError",
    "UncapturedStateError",
    "OperatorDiscoveryError",
    "ReplayDivergence",
    "RunLockedError",
    "CheckpointStallError",
    "IdentityMismatch",
    "RunIdentity",
    "CorruptItemError",
    "UnusableCheckpointError",
]
