"""The order of the checkpointer's own device-to-host reads when they land late, on a CPU: a stand-in for a CUDA
copy stream (`LateCopyStream`) treats the caller's tensors as device tensors and fills the pinned copies it hands
out only when told to (`land()`), as a side stream busy with a multi-GB slot copy does. Both CUDA bugs of the
review (gpu-check-review.md, findings 3 and 4) are checked here: the replay record must hold the batch, not a
snapshot of a buffer that had not landed yet, and no `_foreach_copy_` may mix dtypes."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchmoe_ckpt.capture.device_staging import staging_need
from torchmoe_ckpt.capture.snapshot import SnapshotEngine, StateAccess, _Job
from torchmoe_ckpt.checkpointer import StepResult
from torchmoe_ckpt.core.slot import Slot
from torchmoe_ckpt.runtime.deferred_reads import HostReads
from torchmoe_ckpt.runtime.device_copy import CopyStream, copy_by_dtype
from torchmoe_ckpt.sparse_checkpointer import _record


class LateCopyStream(CopyStream):
    """On a CPU: every tensor it did not hand out counts as a device tensor; its "pinned" copies are filled with
    a sentinel (as deterministic mode fills fresh memory) until `land()`."""

    def __init__(self):
        super().__init__("cpu")
        self.handed: set[int] = set()
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_host(self, t: torch.Tensor) -> bool:
        return t.data_ptr() in self.handed

    def to_host_after(self, clones):
        outs = []
        for c in clones:
            o = torch.full_like(c, -7) if not c.is_floating_point() else torch.full_like(c, float("nan"))
            self.handed.add(o.data_ptr())
            self.pending.append((o, c))
            outs.append(o)
        return outs

    def land(self) -> None:
        for o, c in self.pending:
            o.copy_(c)
        self.pending.clear()


def _step(tokens) -> StepResult:
    return StepResult(
        step=1,
        loss=torch.tensor(2.5),
        grad_norm=torch.tensor(0.75),
        lr=0.1,
        lrs=(0.1,),
        tokens=tokens,
        rng_state=torch.zeros(1, dtype=torch.uint8),
        expert_counts=torch.zeros(1, 1),
        expert_probs=torch.zeros(1, 1),
        seconds=0.0,
    )


def test_the_replay_record_holds_the_batch_when_its_read_lands_after_the_record_is_taken():
    """The own loop's order (checkpointer._iteration, then sparse_checkpointer._record): the batch is read into
    a pinned buffer on the copy stream, and the record is built from that buffer while its copy is still queued."""
    copier = LateCopyStream()
    reads = HostReads(copier, on_copy_stream=True)
    batch = torch.arange(24, dtype=torch.int64).view(4, 6)
    logged = reads.copy(batch, clone_cpu=True)  # checkpointer._iteration
    record = _record(_step(logged), reads)  # after_step, the copy still in flight
    batch.add_(1000)  # the caller reuses its batch buffer
    copier.land()
    assert torch.equal(record.tokens, torch.arange(24, dtype=torch.int64).view(4, 6))
    assert torch.equal(record.loss, torch.tensor(2.5)) and torch.equal(record.grad_norm, torch.tensor(0.75))


class _ForeachDtypes(TorchDispatchMode):
    """Records the (source dtypes, destination dtypes) of every `_foreach_copy_` call in this thread."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[set, set]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten._foreach_copy_:
            self.calls.append(({t.dtype for t in args[1]}, {t.dtype for t in args[0]}))
        return func(*args, **(kwargs or {}))


def test_copy_by_dtype_makes_one_single_dtype_call_per_pair_of_dtypes_with_per_item_values():
    srcs = [torch.randn(5), torch.randn(3, 2), torch.randn(7), torch.arange(4), torch.randn(2, dtype=torch.bfloat16)]
    dsts = [torch.empty(5), torch.empty(3, 2, dtype=torch.bfloat16), torch.empty(7, dtype=torch.bfloat16)]
    dsts += [torch.empty(4, dtype=torch.int64), torch.empty(2, dtype=torch.bfloat16)]
    with _ForeachDtypes() as mode:
        calls = copy_by_dtype(dsts, srcs)
    assert calls == 4 and len(mode.calls) == 4
    assert all(len(s) == 1 and len(d) == 1 for s, d in mode.calls)
    for s, d in zip(srcs, dsts):
        assert torch.equal(d, s.to(d.dtype))


def test_the_copy_stream_reads_clone_each_dtype_in_its_own_call():
    copier = LateCopyStream()
    reads = HostReads(copier, on_copy_stream=True)
    tree = (torch.arange(6), torch.randn(3), torch.randn(2, dtype=torch.bfloat16), torch.arange(2))
    with _ForeachDtypes() as mode:
        out = reads.copy(tree)
    assert len(mode.calls) == 3 and all(len(s) == 1 and len(d) == 1 for s, d in mode.calls)
    copier.land()
    assert all(torch.equal(a, b) for a, b in zip(out, tree))


def test_device_staging_copies_each_dtype_pair_in_its_own_call():
    """The staged copy of a slot with fp32 full-state items and bf16 compute weights (the review's finding 3):
    the engine's own `_stage`, on a staging buffer carved as for a real window, run in this thread so the mode
    sees its calls. One mixed call is what the CUDA fast path got wrong before pytorch#173531."""
    model = torch.nn.Linear(4, 3)
    engine = SnapshotEngine(StateAccess(model, torch.optim.SGD(model.parameters())), staging=True)
    try:
        assert engine.staging is not None
        srcs = [model.weight.detach(), model.bias.detach(), model.weight.detach(), model.bias.detach()]
        dsts = [torch.empty(3, 4), torch.empty(3), torch.empty(3, 4, dtype=torch.bfloat16)]
        dsts.append(torch.empty(3, dtype=torch.bfloat16))
        engine.staging.admit(staging_need(dsts), window_id=0)
        job = _Job(
            slot=Slot(0, (), (), []), step=1, ready=None, keep=[], kept=[], stage=(srcs, engine.staging.views(dsts))
        )
        with _ForeachDtypes() as mode:
            engine._stage(job)
        assert len(mode.calls) == 2 and all(len(s) == 1 and len(d) == 1 for s, d in mode.calls), mode.calls
        assert job.stage is not None
        for s, staged in zip(srcs, job.stage[1]):
            assert torch.equal(staged, s.to(staged.dtype))
    finally:
        engine.stop(5.0)
