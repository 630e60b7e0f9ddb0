"""Item and file checksums, named by algorithm in what is recorded ("crc32:<hex>", "sum64b512:<hex>"), so a
reader checks whichever one a file was written with (files written with CRC32 keep verifying).

sum64b512 (the host tier's, computed at memory speed: one vectorised int64 sum pass, ~9x cheaper than CRC32
on the CPUs we measured): the bytes, zero-padded to a multiple of 512, are cut into 512-byte blocks; each
block's 64 little-endian int64 words are summed (wrapping, mod 2**64); the digest is the CRC32 of those block
sums followed by the byte length (8 bytes, little endian). Detects: any change confined to one block (a bit
flip, a changed word: the block sum changes by a non-zero amount), a zeroed or stale page (torn write), bytes
moved between blocks, a different length; each unless the block sums collide (mod 2**64) or their CRC32 does
(2**-32). Does not detect words reordered within one 512-byte block. Not cryptographic: guards against
corruption and torn writes, not against an adversary.

Because an item's digest is a function of its padded blocks, a data file whose items start at 512-byte
offsets with zero padding between them has, as a whole, the same kind of digest, computed from the same block
sums in the same pass (`block_sums` over the file, then `digest_blocks` over each item's range and the whole).
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from ..errors import TorchmoeError

BLOCK = 512  # bytes per summed block (64 int64 words); also the item alignment of files that use sum64b512
SUM64 = "sum64b512"
CRC32 = "crc32"
ALGOS = (CRC32, SUM64)


class UnknownChecksum(TorchmoeError, ValueError):
    """A checksum named by an algorithm this version does not know (written by another tool)."""


def block_sums(data) -> np.ndarray:
    """Per-512-byte-block wrapping int64 sums of a bytes-like object (zero-padded), little-endian int64."""
    mv = memoryview(data).cast("B")
    n = len(mv)
    full = n // BLOCK * BLOCK
    parts = []
    if full:
        parts.append(np.frombuffer(mv[:full], dtype="<i8").reshape(-1, BLOCK // 8).sum(1, dtype="<i8"))
    if n > full:
        last = bytearray(BLOCK)
        last[: n - full] = mv[full:]
        parts.append(np.frombuffer(bytes(last), dtype="<i8").sum(dtype="<i8").reshape(1))
    return np.concatenate(parts).astype("<i8", copy=False) if parts else np.zeros(0, dtype="<i8")


def tensor_block_sums(t: torch.Tensor) -> torch.Tensor:
    """The same sums of a contiguous uint8 CPU tensor whose length is a multiple of 512 (one torch pass)."""
    return t.view(torch.int64).view(-1, BLOCK // 8).sum(1)


def digest_blocks(sums, nbytes: int) -> int:
    """sum64b512 digest of `nbytes` bytes from their block sums (a bytes-like object of little-endian int64)."""
    return zlib.crc32(nbytes.to_bytes(8, "little"), zlib.crc32(sums)) & 0xFFFFFFFF


def digest(data, algo: str) -> int:
    """The 32-bit digest of a bytes-like object under `algo`."""
    if algo == CRC32:
        return zlib.crc32(data) & 0xFFFFFFFF
    if algo == SUM64:
        return digest_blocks(block_sums(data), len(memoryview(data).cast("B")))
    raise UnknownChecksum(f"unknown checksum algorithm {algo!r}: use one of {ALGOS}")


def checksum(data, algo: str = CRC32) -> str:
    """'<algo>:<8 hex digits>' of a bytes-like object."""
    return f"{algo}:{digest(data, algo):08x}"


def parse(want: str) -> tuple[str, int]:
    algo, _, hexd = want.partition(":")
    if algo not in ALGOS:
        raise UnknownChecksum(f"unknown checksum algorithm {algo!r}: written by another tool")
    return algo, int(hexd, 16)


def matches(data, want: str) -> bool:
    algo, value = parse(want)
    return digest(data, algo) == value
