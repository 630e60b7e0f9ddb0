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
nothing else, so a process that needs one piece does not import all the others.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING


def _by_module(table: dict[str, str]) -> dict[str, str]:
    return {name: module for module, names in table.items() for name in names.split()}


# public name -> the module that defines it, imported on first use
_EXPORTS = _by_module(
    {
        "model.coverage": "SchedulerPosition",
        "checkpointer": "Checkpointer StepResult",
        "config": "CheckpointConfig ObjectStoreConfig SparseConfig TierConfig",
        "runtime.distributed": "init_process_group restart_attempt",
        "runtime.watchdog": "CollectiveWatchdog",
        "core.errors": "ConfigError UncapturedStateError UnusableCheckpointError",
        "capture.host_memory": "HostMemoryLimitError",
        "model.identity": "IdentityMismatch RunIdentity",
        "core.operator": "Operator",
        "model.operators": "OperatorDiscoveryError OperatorSpec discover_operators",
        "model.optim_state": "Optimizers UpdateRule optimizer_list register_update_rule",
        "planning.placement": "Placement Topology place_replicas",
        "recovery.resume": "RecoveryOptions ResumeResult recover",
        "recovery.rng": "track_generator untrack_generator",
        "recovery.replay_check": "ReplayPolicy",
        "core.records": "IterationRecord",
        "recovery.replay_log": "Replay",
        "model.routing": "RouterCounter",
        "sparse_checkpointer": "SparseCheckpointer",
        "recovery.sparse_to_dense": "RecoveryReport Replayable ReplayDivergence sparse_to_dense",
        "ownership.run_lock": "RunLockedError",
        "persist.tier_health": "CheckpointStallError",
        "persist.build_tiers": "Tiers build_tiers",
        "core.window": "Window",
        "export.hf_folder": "HFExportOptions HFExportReport export_hf",
        "export.hf_plan": "IncompleteExportError",
    }
)
# The DCP users' names: dcp.__all__ (tests/api/test_layering.py keeps them equal), imported on first use too
_DCP_EXPORTS = _by_module(
    {
        "dcp.sparse_planner": "SparseSchedule SparseSavePlanner SparseLoadPlanner load_sparse_window",
        "dcp.tier_storage": "HostWriter HostReader StoreWriter StoreReader TieredWriter TieredReader",
        "dcp.peer_storage": "PeerWriter PeerReader held_copies",
        "dcp.raw_storage": "RawWriter RawReader has_checkpoint committed_windows",
        "storage_format.slot_format": "CorruptCopyError",
        "dcp": "CorruptItemError",
    }
)

# ruff: noqa: F401 (the imports below are for type checkers; __all__ is built from the tables above)
if TYPE_CHECKING:  # the names for type checkers and IDEs; at run time they come from __getattr__
    from .capture.host_memory import HostMemoryLimitError
    from .checkpointer import Checkpointer, StepResult
    from .config import CheckpointConfig, ObjectStoreConfig, SparseConfig, TierConfig
    from .core.errors import ConfigError, UncapturedStateError, UnusableCheckpointError
    from .core.operator import Operator
    from .core.records import IterationRecord
    from .core.window import Window
    from .export.hf_folder import HFExportOptions, HFExportReport, export_hf
    from .export.hf_plan import IncompleteExportError
    from .model.coverage import SchedulerPosition
    from .model.identity import IdentityMismatch, RunIdentity
    from .model.operators import OperatorDiscoveryError, OperatorSpec, discover_operators
    from .model.optim_state import Optimizers, UpdateRule, optimizer_list, register_update_rule
    from .model.routing import RouterCounter
    from .ownership.run_lock import RunLockedError
    from .persist.build_tiers import Tiers, build_tiers
    from .persist.tier_health import CheckpointStallError
    from .planning.placement import Placement, Topology, place_replicas
    from .recovery.replay_check import ReplayPolicy
    from .recovery.replay_log import Replay
    from .recovery.resume import RecoveryOptions, ResumeResult, recover
    from .recovery.rng import track_generator, untrack_generator
    from .recovery.sparse_to_dense import RecoveryReport, Replayable, ReplayDivergence, sparse_to_dense
    from .runtime.distributed import init_process_group, restart_attempt
    from .runtime.watchdog import CollectiveWatchdog
    from .sparse_checkpointer import SparseCheckpointer


def __getattr__(name: str):
    module = _EXPORTS.get(name) or _DCP_EXPORTS.get(name)
    if module is None:
        if name == "dcp":  # the DCP users' subpackage, as `torchmoe_ckpt.dcp` after `import torchmoe_ckpt`
            return importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_DCP_EXPORTS))


__all__ = [*_EXPORTS, *_DCP_EXPORTS]  # pyright: ignore[reportUnsupportedDunderAll]  (every public name, dcp.__all__ included: built from the tables)
