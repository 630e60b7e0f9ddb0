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
import sys
import types
from typing import TYPE_CHECKING


def _by_module(table: dict[str, str]) -> dict[str, str]:
    return {name: module for module, names in table.items() for name in names.split()}


# public name -> the module that defines it, imported on first use
_EXPORTS = _by_module(
    {
        "capture": "SchedulerPosition",
        "checkpointer": "Checkpointer StepResult",
        "config": "CheckpointConfig ObjectStoreConfig SparseConfig TierConfig",
        "distributed": "init_process_group restart_attempt",
        "errors": "ConfigError UncapturedStateError UnusableCheckpointError",
        "host_memory": "HostMemoryLimitError",
        "identity": "IdentityMismatch RunIdentity",
        "operators": "Operator OperatorDiscoveryError OperatorSpec discover_operators",
        "optim_state": "Optimizers UpdateRule optimizer_list register_update_rule",
        "placement": "Placement Topology place_replicas",
        "recovery": "ResumeResult recover",
        "replay_check": "ReplayPolicy",
        "replay_log": "IterationRecord Replay",
        "routing": "RouterCounter",
        "sparse_checkpointer": "SparseCheckpointer",
        "sparse_to_dense": "RecoveryReport Replayable ReplayDivergence sparse_to_dense",
        "storage.run_lock": "RunLockedError",
        "storage.tier_health": "CheckpointStallError",
        "storage.tiers": "Tiers build_tiers",
        "window": "Window",
    }
)
# The DCP users' names: dcp.__all__ (tests/unit/test_layering.py keeps them equal), imported on first use too
_DCP_EXPORTS = _by_module(
    {
        "dcp.sparse_planner": "SparseSchedule SparseSavePlanner SparseLoadPlanner load_sparse_window",
        "dcp.tier_storage": "HostWriter HostReader StoreWriter StoreReader TieredWriter TieredReader",
        "dcp.peer_storage": "PeerWriter PeerReader held_copies",
        "dcp.raw_storage": "RawWriter RawReader has_checkpoint committed_windows",
        "storage.slot_format": "CorruptCopyError",
        "dcp": "CorruptItemError",
    }
)

# ruff: noqa: F401 (the imports below are for type checkers; __all__ is built from the tables above)
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
    """`sparse_to_dense` is a submodule and the function it exports: importing the submodule would set the package
    attribute to it (and `__getattr__` is then never asked); a property on the package's class keeps the function."""

    @property
    def sparse_to_dense(self):
        return importlib.import_module(".sparse_to_dense", __name__).sparse_to_dense

    @sparse_to_dense.setter
    def sparse_to_dense(self, _submodule) -> None:
        pass


sys.modules[__name__].__class__ = _Package


__all__ = [*_EXPORTS, *_DCP_EXPORTS]  # every public name (dcp.__all__ included)
