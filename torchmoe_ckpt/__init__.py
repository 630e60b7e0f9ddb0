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
"""

from . import dcp
from .capture import SchedulerPosition
from .checkpointer import Checkpointer, StepResult
from .config import CheckpointConfig, ObjectStoreConfig, SparseConfig, TierConfig
from .dcp import *  # noqa: F403  (the DCP users' names: dcp.__all__)
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
] + dcp.__all__
