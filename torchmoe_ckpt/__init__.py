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
import sys
import types
from typing import TYPE_CHECKING

_EXPORTS = {  # public name -> the module that defines it, imported on first use
    "SchedulerPosition": "capture",
    "Checkpointer": "checkpointer",
    "StepResult": "checkpointer",
    "CheckpointConfig": "config",
    "ObjectStoreConfig": "config",
    "SparseConfig": "config",
    "TierConfig": "config",
    "init_process_group": "distributed",
    "restart_attempt": "distributed",
    "ConfigError": "errors",
    "UncapturedStateError": "errors",
    "UnusableCheckpointError": "errors",
    "HostMemoryLimitError": "host_memory",
    "IdentityMismatch": "identity",
    "RunIdentity": "identity",
    "Operator": "operators",
    "OperatorDiscoveryError": "operators",
    "OperatorSpec": "operators",
    "discover_operators": "operators",
    "Optimizers": "optim_state",
    "UpdateRule": "optim_state",
    "optimizer_list": "optim_state",
    "register_update_rule": "optim_state",
    "Placement": "placement",
    "Topology": "placement",
    "place_replicas": "placement",
    "ResumeResult": "recovery",
    "recover": "recovery",
    "ReplayPolicy": "replay_check",
    "IterationRecord": "replay_log",
    "Replay": "replay_log",
    "RouterCounter": "routing",
    "SparseCheckpointer": "sparse_checkpointer",
    "RecoveryReport": "sparse_to_dense",
    "Replayable": "sparse_to_dense",
    "ReplayDivergence": "sparse_to_dense",
    "sparse_to_dense": "sparse_to_dense",
    "RunLockedError": "storage.run_lock",
    "CheckpointStallError": "storage.tier_health",
    "Tiers": "storage.tiers",
    "build_tiers": "storage.tiers",
    "Window": "window",
}
# The DCP users' names: dcp.__all__ (tests/unit/test_layering.py keeps them equal), imported on first use too
_DCP_EXPORTS = {
    "SparseSchedule": "dcp.sparse_planner",
    "SparseSavePlanner": "dcp.sparse_planner",
    "SparseLoadPlanner": "dcp.sparse_planner",
    "load_sparse_window": "dcp.sparse_planner",
    "HostWriter": "dcp.tier_storage",
    "HostReader": "dcp.tier_storage",
    "StoreWriter": "dcp.tier_storage",
    "StoreReader": "dcp.tier_storage",
    "TieredWriter": "dcp.tier_storage",
    "TieredReader": "dcp.tier_storage",
    "PeerWriter": "dcp.peer_storage",
    "PeerReader": "dcp.peer_storage",
    "held_copies": "dcp.peer_storage",
    "RawWriter": "dcp.raw_storage",
    "RawReader": "dcp.raw_storage",
    "has_checkpoint": "dcp.raw_storage",
    "committed_windows": "dcp.raw_storage",
    "CorruptCopyError": "storage.slot_format",
    "CorruptItemError": "dcp",
}

if TYPE_CHECKING:  # the names for type checkers and IDEs; at run time they come from __getattr__
    from .capture import SchedulerPosition
    from .checkpointer import Checkpointer, StepResult
    from .config import CheckpointConfig, ObjectStoreConfig, SparseConfig, TierConfig
    from .distributed import init_process_group, restart_attempt
    from .errors import ConfigError, UncapturedStateError, UnusableCheckpointError
    from .host_memory import HostMemoryLimitError
    from .identity import IdentityMismatch, RunIdentity
    from .operators import Operator, OperatorDiscoveryError, OperatorSpec, discover_operators
    from .optim_state import Optimizers, UpdateRule, optimizer_list, register_update_rule
    from .placement import Placement, Topology, place_replicas
    from .recovery import ResumeResult, recover
    from .replay_check import ReplayPolicy
    from .replay_log import IterationRecord, Replay
    from .routing import RouterCounter
    from .sparse_checkpointer import SparseCheckpointer
    from .sparse_to_dense import RecoveryReport, Replayable, ReplayDivergence, sparse_to_dense
    from .storage.run_lock import RunLockedError
    from .storage.tier_health import CheckpointStallError
    from .storage.tiers import Tiers, build_tiers
    from .window import Window


def __getattr__(name: str):
    module = _EXPORTS.get(name) or _DCP_EXPORTS.get(name)
    if module is None:
        if name in ("dcp", "storage"):  # the subpackages, as `torchmoe_ckpt.dcp` after `import torchmoe_ckpt`
            return importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_DCP_EXPORTS))


class _Package(types.ModuleType):
    """`sparse_to_dense` is a submodule and the function it exports. Imported eagerly, the package attribute was the
    function; imported lazily, the import system would set it to the submodule once anything imports that (and
    `__getattr__` is then never asked). A property on the package's class keeps it the function; the submodule
    stays in sys.modules, where `from torchmoe_ckpt.sparse_to_dense import ...` finds it."""

    @property
    def sparse_to_dense(self):
        return importlib.import_module(".sparse_to_dense", __name__).sparse_to_dense

    @sparse_to_dense.setter
    def sparse_to_dense(self, _submodule) -> None:
        pass


sys.modules[__name__].__class__ = _Package


__all__ = [
    # own training loop
    "Checkpointer",
    "CheckpointConfig",
    "TierConfig",
    "ObjectStoreConfig",
    "SparseConfig",
    "OperatorSpec",
    "StepResult",
    "Optimizers",
    "optimizer_list",
    "UpdateRule",
    "register_update_rule",
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
    # DCP users: sparse planners on a standard state dict, one StorageWriter/Reader per tier (+ dcp.__all__)
    "Topology",
    "place_replicas",
    "Placement",
    "IterationRecord",
    # errors
    "ConfigError",
    "UncapturedStateError",
    "OperatorDiscoveryError",
    "ReplayDivergence",
    "ReplayPolicy",
    "RunLockedError",
    "CheckpointStallError",
    "IdentityMismatch",
    "RunIdentity",
    "UnusableCheckpointError",
    "HostMemoryLimitError",
] + list(_DCP_EXPORTS)  # the DCP users' names (dcp.__all__)
