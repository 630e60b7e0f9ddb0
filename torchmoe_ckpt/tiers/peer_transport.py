"""The peer tier's byte transport: named files sent from one rank to another over a gloo group, in messages of at
most CHUNK bytes through one reused buffer (contracts.py: the `PeerTransport` contract). What to send to whom, and
where a received copy goes, is the peer tier's policy (peer_tier.py), as torchft splits its CheckpointTransport
from its Manager."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..core.errors import PeerTimeoutError
from .contracts import PeerTransport

if TYPE_CHECKING:
    from .contracts import FileWriter

log = logging.getLogger("torchmoe_ckpt.peer_tier")
CHUNK = 64 << 20  # bytes per gloo message: the two transfer buffers stay this small whatever the slot files' size


class GlooTransport(PeerTransport):
    """Point-to-point file transfer over a gloo group (`dist.isend`/`dist.irecv`; collective per pair: the sender's
    `send` and the receiver's `recv` run at the same point of both ranks' pair order). One uint8 tensor is reused
    for every chunk sent or received, grown to the largest (at most CHUNK bytes).

    Every message waits at most `timeout_s` for its partner (None: the group's own timeout), then raises
    PeerTimeoutError; gloo has closed the pair by then, so the caller stops using this group."""

    def __init__(self, timeout_s: float | None = None):
        self.t = torch.empty(0, dtype=torch.uint8)
        self.timeout_s = timeout_s

    def _wait(self, work, op: str, peer: int, nbytes: int) -> None:
        if self.timeout_s is None:
            work.wait()
            return
        try:
            work.wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:  # gloo: "Timed out waiting ...ms for recv operation to complete"
            if "timed out" not in str(exc).lower():
                raise
            raise PeerTimeoutError(
                f"peer tier: rank {peer} did not answer within peer_timeout_s={self.timeout_s:g} s ({op} of "
                f"{nbytes} bytes); the peer copies stop until the job restarts (fix: a slower link needs a larger "
                f"TierConfig.peer_timeout_s, a frozen peer a restart)"
            ) from None

    def _send(self, t: torch.Tensor, dst: int, group) -> None:
        self._wait(dist.isend(t, dst, group=group), "send", dst, t.numel() * t.element_size())

    def _recv(self, t: torch.Tensor, src: int, group) -> None:
        self._wait(dist.irecv(t, src, group=group), "receive", src, t.numel() * t.element_size())

    def view(self, n: int) -> memoryview:
        if n > self.t.numel():
            self.t = torch.empty(n, dtype=torch.uint8)
        return self.t.numpy().data[:n]  # a memoryview of the tensor's bytes

    def send(self, files: list[tuple[str, Path]], dst: int, group, meta: dict) -> int:
        """Send named files to `dst`: a JSON header (names, sizes, `meta`), then each non-empty file in messages of
        at most CHUNK bytes read into this buffer (cheaper per byte than mapping the file). Returns the bytes sent."""
        sizes = [os.stat(path).st_size for _, path in files]
        header = json.dumps({"meta": meta, "files": [[rel, n] for (rel, _), n in zip(files, sizes)]}).encode()
        self._send(torch.tensor([len(header)], dtype=torch.int64), dst, group)
        self._send(torch.frombuffer(bytearray(header), dtype=torch.uint8), dst, group)
        short = []
        for (_rel, path), n in zip(files, sizes):
            if not n:
                continue
            got = 0
            with open(path, "rb", buffering=0) as f:
                for off in range(0, n, CHUNK):
                    m = min(CHUNK, n - off)
                    got += f.readinto(self.view(m)) or 0
                    self._send(self.t[:m], dst, group)
            if got != n:  # shrank since the header: still send n bytes, the receiver (and the pair order) waits
                short.append(f"{path}: {got} bytes read, {n} announced")
        if short:  # not raised: the rest of the exchange must go on; the copy fails verification where it is used
            log.warning("file(s) changed while being sent to rank %d, its copy is torn: %s", dst, short)
        return 8 + len(header) + sum(sizes)

    def buffer_bytes(self) -> int:
        """Host memory held by the reused buffer."""
        return self.t.numel()

    def recv(self, src: int, group, write: FileWriter) -> dict:
        """Receive one `send` transfer; `write(rel, size, chunks)` stores each file from its (offset, view)
        chunks (a view is valid until the next one). Returns the sender's `meta`."""
        n = torch.zeros(1, dtype=torch.int64)
        self._recv(n, src, group)
        header = torch.empty(int(n.item()), dtype=torch.uint8)
        self._recv(header, src, group)
        header = json.loads(header.numpy().tobytes())
        for rel, size in header["files"]:
            write(rel, size, self._chunks(src, group, size))
        return header["meta"]

    def _chunks(self, src: int, group, size: int) -> Iterator[tuple[int, memoryview]]:
        for off in range(0, size, CHUNK):
            m = min(CHUNK, size - off)
            view = self.view(m)
            self._recv(self.t[:m], src, group)
            yield off, view
