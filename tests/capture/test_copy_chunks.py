"""The yielding slot copy (capture/copy_chunks.py): chunks of at most `chunk_bytes`, a spacer kernel between two
consecutive memcpys, none before a cast; cast items cut too; the copy through `torch._foreach_copy_` lands bit for
bit."""

from __future__ import annotations

import pytest
import torch

from torchmoe_ckpt.capture.copy_chunks import chunk_copy_lists


def _items():
    g = torch.Generator().manual_seed(0)
    srcs = [
        torch.randn(1000, generator=g),  # fp32 -> fp32: 4000 bytes, memcpys
        torch.randn(30, 7, generator=g),  # fp32 -> fp32, 2-D: 840 bytes
        torch.randn(500, generator=g),  # fp32 -> bf16: a cast (its own kernel)
        torch.randn(3, generator=g),  # fp32 -> fp32, smaller than a chunk
    ]
    dsts = [torch.empty(1000), torch.empty(30, 7), torch.empty(500, dtype=torch.bfloat16), torch.empty(3)]
    return srcs, dsts


@pytest.mark.parametrize("chunk", [None, 1024, 4096, 1 << 20, 4])
def test_chunked_copy_is_exact(chunk):
    srcs, dsts = _items()
    plan = chunk_copy_lists(srcs, dsts, chunk)
    torch._foreach_copy_(plan.dsts, plan.srcs)
    for s, d in zip(srcs, dsts):
        assert torch.equal(d, s.to(d.dtype))
    assert plan.host_bytes == sum(d.numel() * d.element_size() for d in dsts)
    assert len(plan.item_ends) == 4 and plan.item_ends[-1] == len(plan.srcs)


def test_chunks_and_spacers():
    srcs, dsts = _items()
    none = chunk_copy_lists(srcs, dsts, None)
    assert (len(none.srcs), none.chunks, none.spacers) == (4, 3, 0)  # as before: one copy per item
    plan = chunk_copy_lists(srcs, dsts, 1024)
    # 4000 B -> 4 chunks (256 floats each), 840 B -> 1, the cast as is, 12 B -> 1
    assert plan.chunks == 6
    # a spacer between consecutive memcpys: 3 inside item 0, 1 before item 1; none before the cast (a kernel
    # itself) and none before the memcpy after it
    assert plan.spacers == 4
    assert [s.numel() for s in plan.srcs[:7]] == [256, 1, 256, 1, 256, 1, 232]
    assert max(d.numel() * d.element_size() for d in plan.dsts) <= 1024  # the cast item (500 x bf16) fits one
    assert plan.cast_chunks == 1 and none.cast_chunks == 1
    assert plan.split_at_item(0) == 0 and plan.split_at_item(2) == plan.item_ends[1]


def test_bad_chunk_size_is_refused():
    srcs, dsts = _items()
    with pytest.raises(ValueError, match="chunk_bytes"):
        chunk_copy_lists(srcs, dsts, 0)


def _cover_once(plan, dsts) -> None:
    """Each item's pieces (between its item_ends, the spacers aside) tile its destination exactly once, in order."""
    start = 0
    for dst, end in zip(dsts, plan.item_ends):
        base = dst.untyped_storage().data_ptr()
        pieces = [d for d in plan.dsts[start:end] if d.untyped_storage().data_ptr() == base]
        spans = [(d.storage_offset(), d.storage_offset() + d.numel()) for d in pieces]
        assert spans[0][0] == dst.storage_offset() and spans[-1][1] == dst.storage_offset() + dst.numel()
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # no gap, no overlap
        assert len(plan.dsts[start:end]) - len(pieces) <= len(pieces)  # the rest are spacers, one per memcpy at most
        start = end


@pytest.mark.parametrize("chunk", [2, 1000, 1024, 4096, 1 << 20])
def test_cast_items_are_cut_into_chunks_of_the_destination_bytes(chunk):
    """fp32 -> bf16 compute weights: a 64 MiB embedding must not be one block on the copy engine."""
    g = torch.Generator().manual_seed(1)
    srcs = [torch.randn(5000, generator=g), torch.randn(37, 11, generator=g), torch.randn(700, generator=g)]
    dsts = [torch.empty(5000, dtype=torch.bfloat16), torch.empty(37, 11, dtype=torch.bfloat16), torch.empty(700)]
    plan = chunk_copy_lists(srcs, dsts, chunk)
    assert max(d.numel() * d.element_size() for d in plan.dsts) <= max(chunk, 4)  # (a 1-element fp32 at 2 bytes)
    casts = sum(-(-(d.numel() * 2) // max(2, chunk - chunk % 2)) for d in dsts[:2])
    assert plan.cast_chunks == casts and (chunk >= 10000 or plan.cast_chunks > 2)
    _cover_once(plan, dsts)
    torch._foreach_copy_(plan.dsts, plan.srcs)
    for s, d in zip(srcs, dsts):  # bit for bit a plain per-item copy
        assert torch.equal(d, torch.empty_like(d).copy_(s))
    assert plan.host_bytes == sum(d.numel() * d.element_size() for d in dsts)


def test_chunked_cast_items_recover_exactly(one_rank_group):
    """bf16 compute weights (FSDP2 mixed precision on a 1-rank gloo group) with copy_chunk_bytes: the cast items
    are copied in chunks too, and a loss after iteration 8 recovers torch.equal to a run that never failed."""
    from torchmoe_ckpt.config import SparseConfig
    from torchmoe_ckpt.sparse_checkpointer import SparseCheckpointer
    from torchmoe_harness.baselines.common import lose_state
    from torchmoe_harness.trainer import RunConfig, Trainer

    run = {"steps": 10, "model": {"num_experts": 4}, "dtype": "bf16"}
    ref = Trainer(RunConfig(**run))
    while ref.step < 10:
        ref.train_step()
    tr = Trainer(RunConfig(**run))
    assert tr.compute_dtype == torch.bfloat16
    ck = SparseCheckpointer(tr.model, tr.optimizer, tr.compute_dtype, SparseConfig(window=3, copy_chunk_bytes=256))
    ck.attach(tr)
    plans, failed = {}, False
    while tr.step < 10:
        ck.after_step(tr.train_step())
        plans.update((id(v[2].copy), v[2].copy) for v in ck.engine._sources.values())
        if tr.step == 8 and not failed:
            failed = True
            ck.before_update()  # iteration 9 fails before its update
            lose_state(tr)
            assert ck.recover_in_memory(tr).recovered_step == 6
    ck.close()
    casts = [(s, d) for p in plans.values() for s, d in zip(p.srcs, p.dsts) if s.dtype != d.dtype]
    # the compute weights really cast, every piece within the chunk size (the embedding alone is 2 KiB in bf16)
    assert casts and max(d.numel() * d.element_size() for _, d in casts) <= 256
    assert sum(p.cast_chunks + p.spacers for p in plans.values()) == len(casts)  # (a spacer is a 1-element cast)
    assert sum(p.cast_chunks for p in plans.values()) > sum(p.spacers == 0 for p in plans.values())
    a, b = tr.export_state(), ref.export_state()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert a.keys() == b.keys() and not bad, bad[:5]
