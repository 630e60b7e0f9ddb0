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
from .capture import SchedulerPosition
from .checkpointer import SparseCheckpointer, SparseConfig
from .config import CheckpointConfig, ObjectStoreConfig, TierConfig
from .dcp.run_lock import RunLockedError
from .dcp.tier_health import CheckpointStallError
from .dcp.tiers import Tiers, build_tiers
from .distributed import init_process_group, restart_attempt
from .errors import ConfigError, UncapturedStateError
from .identity import IdentityMismatch, RunIdentity
from .loop import Checkpointer, StepResult
from .operators import Operator, OperatorDiscoveryError, OperatorSpec, discover_operators
from .recovery import RecoveryReport, ReplayDivergence, Replayable, sparse_to_dense
from .replay_log import Replay
from .resume import ResumeResult, recover
from .routing import RouterCounter
from .window import Window

__all__ = [
    # own training loop
    "Checkpointer", "CheckpointConfig", "TierConfig", "ObjectStoreConfig", "SparseConfig", "OperatorSpec",
    "StepResult", "init_process_group", "restart_attempt",
    # frameworks
    "SparseCheckpointer", "Replayable", "Replay", "recover", "ResumeResult", "sparse_to_dense", "RecoveryReport",
    "Tiers", "build_tiers", "Window", "SchedulerPosition", "RouterCounter", "discover_operators", "Operator",
    # errors
    "ConfigError", "UncapturedStateError", "OperatorDiscoveryError", "ReplayDivergence", "RunLockedError",
    "CheckpointStallError", "IdentityMismatch", "RunIdentity",
]
