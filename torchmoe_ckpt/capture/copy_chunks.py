"""A slot copy that yields the copy engine: bounded chunks with a spacer kernel between them
(`SparseConfig.copy_chunk_bytes`).

Why: every device-to-host copy of every stream goes through one copy engine, which runs one stream's back-to-back
memcpys as one uninterrupted block. The training stream's own small device-to-host reads (a router's `.item()`,
`.tolist()`, a `bincount` on CUDA) then wait behind the slot's leading fp32 block, and the step stalls while the
GPU idles: the leading hypothesis for the 19% of the first H200 run (docs/gpu.md). A kernel launched between two
memcpys lets the engine serve the other stream; chunking alone does not (torchrec's `chunked_copy_`, the GPU
check's phase 4 measures both). So each same-dtype item is cut into flat chunks of at most `chunk_bytes`, and
between two consecutive memcpys goes a spacer: a 1-element device-to-device cast, a kernel. Items whose copy
casts (fp32 -> bf16 compute weights) are cut too, into chunks of at most `chunk_bytes` of the destination: a
device-to-host cast is a cast kernel into a device temporary, then its memcpy (Copy.cu), so a whole 64 MiB bf16
embedding would be one ~1.2 ms block on the engine; each cast chunk launches its own kernel before its memcpy
and needs no spacer.

The chunks and spacers are plain (source, destination) pairs in the same two lists `torch._foreach_copy_` takes,
so the copy thread still issues the whole slot from C++ with the GIL released. On a CPU the same lists are built
(the spacers are CPU tensors): the code path is tested there, and the copy stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ChunkedCopy", "chunk_copy_lists"]


@dataclass
class ChunkedCopy:
    """One slot's copy as issued: `srcs[i]` goes into `dsts[i]`; `item_ends[k]` is where item k's pairs end (the
    tear point of a fault test is counted in items); `host_bytes` what lands on the host (the spacers not
    counted); `chunks` the same-dtype memcpys, `cast_chunks` the pieces of cast items (each a kernel, then its
    memcpy), `spacers` the kernels put between memcpys."""

    srcs: list[torch.Tensor]
    dsts: list[torch.Tensor]
    item_ends: list[int]
    host_bytes: int
    chunks: int
    spacers: int
    cast_chunks: int = 0

    def split_at_item(self, k: int) -> int:
        """The position in `srcs` after the first `k` items."""
        return self.item_ends[k - 1] if k > 0 else 0


def _spacer(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A 1-element fp32 -> bf16 copy on `device`: a cast kernel, no copy engine."""
    return torch.zeros(1, device=device), torch.zeros(1, device=device, dtype=torch.bfloat16)


def chunk_copy_lists(srcs: list[torch.Tensor], dsts: list[torch.Tensor], chunk_bytes: int | None) -> ChunkedCopy:
    """The copy of `srcs` into `dsts` as chunks of at most `chunk_bytes` (of the destination) with a spacer between
    consecutive memcpys; `chunk_bytes=None`: the items as they are (one copy each, back to back)."""
    if chunk_bytes is not None and chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be a positive number of bytes or None, got {chunk_bytes}")
    out_s: list[torch.Tensor] = []
    out_d: list[torch.Tensor] = []
    ends: list[int] = []
    host_bytes = chunks = spacers = cast_chunks = 0
    spacer: tuple[torch.Tensor, torch.Tensor] | None = None
    last_was_memcpy = False
    for src, dst in zip(srcs, dsts):
        host_bytes += dst.numel() * dst.element_size()
        memcpy = src.dtype == dst.dtype
        if chunk_bytes is None or not (src.is_contiguous() and dst.is_contiguous()):
            pieces = [(src, dst)]
        else:  # the destination's bytes: a cast item's host (bf16) size, what the engine moves
            step = max(1, chunk_bytes // max(1, dst.element_size()))
            flat_s, flat_d = src.reshape(-1), dst.reshape(-1)
            pieces = [(flat_s[i : i + step], flat_d[i : i + step]) for i in range(0, flat_s.numel(), step)] or [
                (src, dst)
            ]
        for s, d in pieces:
            if chunk_bytes is not None and memcpy and last_was_memcpy:
                if spacer is None:
                    spacer = _spacer(src.device)
                out_s.append(spacer[0])
                out_d.append(spacer[1])
                spacers += 1
            out_s.append(s)
            out_d.append(d)
            chunks += memcpy
            cast_chunks += not memcpy
            last_was_memcpy = memcpy
        ends.append(len(out_s))
    return ChunkedCopy(out_s, out_d, ends, host_bytes, chunks, spacers, cast_chunks)
