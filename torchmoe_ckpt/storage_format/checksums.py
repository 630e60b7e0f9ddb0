"""Every checksum the storage writes and checks. What is recorded names its algorithm ("crc32:<hex>",
"sum64b512:<hex>", a manifest entry's "algo"), so a reader checks whichever one a file was written with.

sum64b512 (slot data files; one vectorised pass, ~9x cheaper than CRC32): the bytes, zero-padded to a multiple of
512, are cut into 512-byte blocks; each block's 64 little-endian int64 words are summed (wrapping); the digest is
the CRC32 of those block sums followed by the byte length (8 bytes, little endian). Detects a change confined to a
block, a zeroed or stale page, bytes moved between blocks, another length (unless sums or CRC32 collide); not
words reordered within a block, nor an adversary. Items at 512-byte offsets with zero padding between them get
their digests and the whole file's from the same block sums. CRC32 stays for small files and tensorstore pieces.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..core.errors import TorchmoeError
from ..core.rejection import Rejection, RejectionKind

BLOCK = 512  # bytes per summed block (64 int64 words); also the item alignment of files that use sum64b512
SUM64 = "sum64b512"
CRC32 = "crc32"
ALGOS = (CRC32, SUM64)
CHUNK = 1 << 20  # bytes per read of a streamed file: one chunk stays in cache between its copy and its checksum


class UnknownChecksum(TorchmoeError, ValueError):
    """A checksum named by an algorithm this version does not know (written by another tool)."""


def crc32_bytes(data, crc: int = 0) -> int:
    return zlib.crc32(data, crc) & 0xFFFFFFFF


def crc32_tensor(t: torch.Tensor) -> int:
    return crc32_bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def block_sums(data) -> np.ndarray:
    """Per-512-byte-block wrapping int64 sums of a bytes-like object (zero-padded), little-endian int64."""
    mv = memoryview(data).cast("B")
    full = len(mv) // BLOCK * BLOCK
    sums = np.frombuffer(mv[:full], dtype="<i8").reshape(-1, BLOCK // 8).sum(1, dtype="<i8")
    if len(mv) > full:
        last = bytearray(BLOCK)
        last[: len(mv) - full] = mv[full:]
        sums = np.append(sums, np.frombuffer(last, dtype="<i8").sum(dtype="<i8")).astype("<i8", copy=False)
    return sums


def tensor_block_sums(t: torch.Tensor) -> torch.Tensor:
    """The same sums of a contiguous uint8 CPU tensor whose length is a multiple of 512 (one torch pass)."""
    return t.view(torch.int64).view(-1, BLOCK // 8).sum(1)


def digest_blocks(sums, nbytes: int) -> int:
    """sum64b512 digest of `nbytes` bytes from their block sums (a bytes-like object of little-endian int64)."""
    return zlib.crc32(nbytes.to_bytes(8, "little"), zlib.crc32(sums)) & 0xFFFFFFFF


def digest(data, algo: str) -> int:
    """The 32-bit digest of a bytes-like object under `algo`."""
    if algo == CRC32:
        return crc32_bytes(data)
    if algo == SUM64:
        return digest_blocks(block_sums(data), len(memoryview(data).cast("B")))
    raise UnknownChecksum(f"unknown checksum algorithm {algo!r}: use one of {ALGOS}")


def checksum(data, algo: str = CRC32) -> str:
    """'<algo>:<8 hex digits>' of a bytes-like object."""
    return f"{algo}:{digest(data, algo):08x}"


def matches(data, want) -> bool:
    """Whether `data` has the checksum `want`: a named string, or a bare CRC32 int (older slot metadata)."""
    if isinstance(want, int):
        return crc32_bytes(data) == want
    algo, _, hexd = want.partition(":")
    if algo not in ALGOS:
        raise UnknownChecksum(f"unknown checksum algorithm {algo!r}: written by another tool")
    return digest(data, algo) == int(hexd, 16)


@dataclass
class FileEntry:
    """A file's size and 32-bit digest, as the write that produced it reported them (manifests list these)."""

    bytes: int
    crc32: int  # the file's digest under `algo` (a CRC32 unless `algo` names another one)
    algo: str = CRC32  # "sum64b512" for slot data files (computed at memory speed)

    def matches(self, data) -> bool:
        """Whether `data` (the whole file) has this entry's size and digest."""
        return len(data) == self.bytes and digest(data, self.algo) == self.crc32

    def problem(self, rel: str, got: FileEntry) -> Rejection | None:
        """Why a file of size and digest `got` is not this one (torn or corrupt); None when it is."""
        if got.bytes != self.bytes:
            why = f"{rel}: {got.bytes} bytes, manifest says {self.bytes} (torn)"
            return Rejection(RejectionKind.TORN, why, file=rel)
        if got.crc32 != self.crc32:
            why = f"{rel}: {self.algo} {got.crc32:08x} != {self.crc32:08x} (corrupt)"
            return Rejection(RejectionKind.CORRUPT, why, file=rel)
        return None


class Digester:
    """A file's digest under `algo`, fed chunk by chunk (all but the last a multiple of 512 bytes) by a copy loop."""

    def __init__(self, algo: str = CRC32):
        if algo not in ALGOS:
            raise UnknownChecksum(f"unknown checksum algorithm {algo!r}")
        self.algo, self.size, self._crc, self._sums = algo, 0, 0, []

    def update(self, chunk) -> None:
        if self.size % BLOCK and self.algo == SUM64:
            raise ValueError("sum64b512 chunks must be multiples of 512 bytes, all but the last")
        if self.algo == CRC32:
            self._crc = zlib.crc32(chunk, self._crc)
        else:
            self._sums.append(block_sums(chunk))
        self.size += len(memoryview(chunk).cast("B"))

    def entry(self) -> FileEntry:
        if self.algo == CRC32:
            return FileEntry(self.size, self._crc & 0xFFFFFFFF)
        sums = np.concatenate(self._sums) if self._sums else np.zeros(0, dtype="<i8")
        return FileEntry(self.size, digest_blocks(sums, self.size), self.algo)


def file_entry(path: Path, algo: str = CRC32) -> FileEntry:
    """Size and digest of a file on disk, read in chunks into one reused buffer."""
    d, buf = Digester(algo), bytearray(CHUNK)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            d.update(memoryview(buf)[:n])
    return d.entry()
