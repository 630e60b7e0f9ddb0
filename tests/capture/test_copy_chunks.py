"""The yielding slot copy (capture/copy_chunks.py): chunks of at most `chunk_bytes`, a spacer kernel between two
consecutive memcpys, none before a cast; the copy through `torch._foreach_copy_` lands bit for bit."""

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
    assert max(d.numel() * d.element_size() for d in plan.dsts) <= 2000  # the cast item (500 x bf16) is whole
    assert plan.split_at_item(0) == 0 and plan.split_at_item(2) == plan.item_ends[1]


def test_bad_chunk_size_is_refused():
    srcs, dsts = _items()
    with pytest.raises(ValueError, match="chunk_bytes"):
        chunk_copy_lists(srcs, dsts, 0)
