"""Boundary logging and localized replay on `torch.distributed.pipelining`'s stock schedules.

`LoggingPipelineStage` hooks the stage's four send/recv-op getters: every sent tensor is logged into a
`BoundaryLog` (the caller sets `stage.iteration` before each `schedule.step()`); with `replay_io` set, input
from a neighbour that is not running comes from its log and sends to it are not issued, so a replayed stage runs
the same schedule code on bit-identical inputs. Needs static shapes (`_user_meta`): with `local_vote` the
warm-up vote is decided locally. One tensor per boundary (what TorchTitan's stages send).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.pipelining import PipelineStage

try:
    from torch.distributed.pipelining._utils import InferenceMode
except ImportError:  # torch < 2.13 (e.g. 2.11) has no warm-up vote: the two vote overrides below are never called
    InferenceMode = None

from .boundary_log import BoundaryLog, LogReader


@dataclass
class ReplayIO:
    """Where a replaying stage's inputs come from: a neighbour's log, or None (live peer / pipeline end)."""

    up: LogReader | None  # forward activations entering this stage (the upstream stage's forward log)
    down: LogReader | None  # gradients entering this stage (the downstream stage's backward log)


class LoggingPipelineStage(PipelineStage):
    def __init__(self, *args, boundary_log: BoundaryLog, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_logging(boundary_log)

    @classmethod
    def adopt(cls, stage: PipelineStage, boundary_log: BoundaryLog, local_vote: bool = False) -> LoggingPipelineStage:
        """Turn a stage someone else built (TorchTitan's pipeline split) into a logging one, in place."""
        if type(stage) is not PipelineStage:
            raise TypeError(f"boundary logging wraps torch's PipelineStage, got {type(stage).__name__}")
        stage.__class__ = cls
        stage._init_logging(boundary_log, local_vote)  # pyright: ignore[reportAttributeAccessIssue]  (its class is cls now)
        return stage  # pyright: ignore[reportReturnType]  (its class is cls now)

    def _init_logging(self, boundary_log: BoundaryLog, local_vote: bool = False) -> None:
        self.boundary_log = boundary_log
        self.iteration = 0  # set by the training loop before each schedule.step()
        self.replay_io: ReplayIO | None = None
        self.local_vote = local_vote

    # ---- receives: from a log while replaying --------------------------------------------------------
    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        io = self.replay_io
        if io is None or io.up is None or self.is_first:
            return super().get_fwd_recv_ops(fwd_chunk_id)
        for info in self.args_recv_info[fwd_chunk_id]:
            info.buffer = io.up.get(self.iteration, fwd_chunk_id, "fwd").to(self.device)
        return []

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        io = self.replay_io
        if io is None or io.down is None or self.is_last or not self.has_backward:
            return super().get_bwd_recv_ops(bwd_chunk_id)
        for info in self.grad_recv_info[bwd_chunk_id]:
            info.buffer = io.down.get(self.iteration, bwd_chunk_id, "bwd").to(self.device)
        return []

    # ---- sends: always logged; not issued towards a neighbour that is not running ----------------------
    def get_fwd_send_ops(self, fwd_chunk_id: int):
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        self._log(ops, fwd_chunk_id, "fwd")
        return [] if self.replay_io is not None and self.replay_io.down is not None else ops

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        self._log(ops, bwd_chunk_id, "bwd")
        return [] if self.replay_io is not None and self.replay_io.up is not None else ops

    def _log(self, ops, mb: int, direction: str) -> None:
        if len(ops) > 1:
            # One tensor per boundary is what the entry naming supports (TorchTitan's stages send one).
            raise NotImplementedError(
                f"stage {self.stage_index} sends {len(ops)} tensors per micro-batch; boundary logging supports one"
            )
        for op in ops:
            self.boundary_log.record(self.iteration, mb, direction, op.tensor)

    # ---- the warm-up vote, decided locally when every stage has static shapes --------------------------
    def _warmup_forward_vote(self, has_backward: bool, received_acc: torch.Tensor | None = None) -> torch.Tensor:
        if not self.local_vote:
            return super()._warmup_forward_vote(has_backward, received_acc)
        if InferenceMode.needs_dynamic(self._user_meta, has_backward):  # pyright: ignore[reportOptionalMemberAccess]  (local_vote needs it)
            raise RuntimeError(f"stage {self.stage_index}: local_vote needs static shapes (_user_meta)")
        return torch.ones(1, dtype=torch.int32, device=self.device)

    def _warmup_backward_result(self, received_result: torch.Tensor | None = None) -> torch.Tensor:
        if not self.local_vote:
            return super()._warmup_backward_result(received_result)
        return received_result if received_result is not None else torch.ones(1, dtype=torch.int32, device=self.device)
