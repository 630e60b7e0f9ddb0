"""Boundary logging for `torch.distributed.pipelining`'s stock schedules (ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B and the other runtime schedules).

Every stock schedule gets its sends from `stage.get_fwd_send_ops(mb)` and `stage.get_bwd_send_ops(mb)`.
`LoggingPipelineStage` logs each tensor of those ops on the sender, tagged (iteration, micro-batch,
direction), into a `BoundaryLog`: the same host-memory log, byte accounting, bound and collection as the
explicit schedule of `pipeline.py`. With interleaving, each virtual stage has its own log (its own stage
index). The caller sets `stage.iteration` before each `schedule.step()`.

What this does not give: a localized *replay* through the stock schedule. The replay is done by
`pipeline.StageTrainer`, which must reproduce the stock arithmetic (loss scaling by `scale_grads`, the
gradient division in `perform_reduce_grad`) to be exact; that equivalence is not built or tested.
"""
from __future__ import annotations

from torch.distributed.pipelining import PipelineStage

from .pipeline_log import BoundaryLog


class LoggingPipelineStage(PipelineStage):
    def __init__(self, *args, boundary_log: BoundaryLog, **kwargs):
        super().__init__(*args, **kwargs)
        self.boundary_log = boundary_log
        self.iteration = 0  # set by the training loop before each schedule.step()

    def get_fwd_send_ops(self, fwd_chunk_id: int):
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        self._log(ops, fwd_chunk_id, "fwd")
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        self._log(ops, bwd_chunk_id, "bwd")
        return ops

    def _log(self, ops, mb: int, direction: str) -> None:
        if len(ops) > 1:
            # One tensor per boundary is what the entry naming supports (TorchTitan's stages send one).
            raise NotImplementedError(f"stage {self.stage_index} sends {len(ops)} tensors per micro-batch; "
                                      f"boundary logging supports one")
        for op in ops:
            self.boundary_log.record(self.iteration, mb, direction, op.tensor)
