"""Peer tier: every window a rank commits on its host tier also reaches r peers on other nodes.

Placement (`torchmoe_ckpt.placement`) picks, per rank, HSDP replica peers first and then other ranks on
other nodes. A *replica* peer already holds bit-identical slot data (HSDP replicas apply the same update to
the same shard), so it is sent only what differs: the rank's manifest, its replay records (each replica
trains on its own batches) and the small DCP `.metadata` files; it verifies, by comparing CRC32s, that its
own slot data equals the sender's. Any other peer receives the full window.

Push (after each commit) and pull (at restart) run over a dedicated gloo group, rank pairs in one global
order, so every rank issues matching send/recv calls without deadlock. Received copies live in the
receiver's host directory under `peers/rank-RRRRR/from-SSSSS/<run>/window-NNNNNN/`, manifest written last.

What a push costs (it runs on the tier thread, beside training, on the same cores): a small JSON header, then
each file as one gloo message, read into one reused buffer, received into another and written over the data
files of a collected copy (`.spare/`: their pages are reused, not allocated and zeroed again). Per byte: one
read, one socket copy each way and one write, into warm memory; no pickling, no joined payload, no checksum
pass (a copy is verified when it is used: `holdings`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from .. import faults
from .host_tier import HostTier
from .manifest import WindowManifest, rank_manifest_name, window_dirname
from .spare_files import keep_spares, place_new_file, pwrite_all
from .spare_files import spares as spare_list

log = logging.getLogger("torchmoe_ckpt.peer_tier")
MAX_SPARES = 8  # data files of collected peer copies kept per sender for reuse


def _is_data(rel: str) -> bool:
    return rel.endswith(".distcp")


def send_files(
    files: list[tuple[str, Path]], dst: int, group, meta: dict | None = None, buf: Buffer | None = None
) -> int:
    """Send named files to `dst`: a JSON header (names, sizes, `meta`), then each non-empty file as one message,
    read into `buf` (reused: no allocation, no page faults; one copy from the page cache, cheaper than mapping
    the file, whose page-table setup and teardown cost more per byte here). Returns the bytes sent (8-byte
    length + header + file bytes)."""
    buf = buf or Buffer()
    sizes = [os.stat(path).st_size for _, path in files]
    header = json.dumps({"meta": meta or {}, "files": [[rel, n] for (rel, _), n in zip(files, sizes)]}).encode()
    _send(torch.frombuffer(bytearray(header), dtype=torch.uint8), dst, group)
    short = []
    for (_rel, path), n in zip(files, sizes):
        if n:
            with open(path, "rb", buffering=0) as f:
                got = f.readinto(buf.view(n))
            if got != n:  # shrank since the header: still send n bytes, the receiver (and the pair order) waits
                short.append(f"{path}: {got} bytes read, {n} announced")
            dist.send(buf.t[:n], dst, group=group)
    if short:  # not raised: the rest of the exchange must go on; the copy fails verification where it is used
        log.warning("file(s) changed while being sent to rank %d, its copy is torn: %s", dst, short)
    return 8 + len(header) + sum(sizes)


class Buffer:
    """One uint8 tensor reused for every file sent or received, grown to the largest (then no allocation and
    no page faults)."""

    def __init__(self):
        self.t = torch.empty(0, dtype=torch.uint8)

    def view(self, n: int) -> memoryview:
        if n > self.t.numel():
            self.t = torch.empty(n, dtype=torch.uint8)
        return memoryview(self.t.numpy())[:n]


class Inbox(Buffer):
    """The receiving side of `send_files`."""

    def recv(self, src: int, group, write) -> dict:
        """Receive one `send_files` transfer; `write(rel, view)` stores each file (the view is only valid during
        the call). Returns the sender's `meta`."""
        header = json.loads(_recv(src, group).numpy().tobytes())
        for rel, n in header["files"]:
            view = self.view(n)
            if n:
                dist.recv(self.t[:n], src, group=group)
            write(rel, view)
        return header["meta"]


def write_file(path: Path, data: memoryview, spare: Path | None = None) -> None:
    """Write `data` to `path`, over `spare` (a collected copy's file, renamed into place) when given: writing
    over existing shared-memory pages skips allocating and zeroing new ones. Never writes into another file
    that was at `path` (on a host tier it may be a link to live slot buffers): that name is replaced."""
    place_new_file(path, spare)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        pwrite_all(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def _window_files(manifest: WindowManifest, source, data: bool = True) -> list[tuple[str, Path]]:
    """A rank's window files, `source(rel)` giving each one's path; `data=False` leaves the slot data out."""
    return [(rel, Path(source(rel))) for rel in sorted(manifest.files) if data or not _is_data(rel)]


def _send(t: torch.Tensor, dst: int, group) -> None:
    dist.send(torch.tensor([t.numel()], dtype=torch.int64), dst, group=group)
    dist.send(t, dst, group=group)


def _recv(src: int, group) -> torch.Tensor:
    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, src, group=group)
    t = torch.empty(int(n.item()), dtype=torch.uint8)
    dist.recv(t, src, group=group)
    return t


def pack_files(files: list[tuple[str, bytes]]) -> torch.Tensor:
    """Named files as one uint8 tensor: [8-byte header length][JSON header][file bytes...]."""
    header = json.dumps({"files": [[r, len(b)] for r, b in files]}).encode()
    raw = len(header).to_bytes(8, "little") + header + b"".join(b for _, b in files)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def unpack_files(payload: torch.Tensor) -> list[tuple[str, bytes]]:
    raw = payload.numpy().tobytes()
    n = int.from_bytes(raw[:8], "little")
    pos, out = 8 + n, []
    for rel, size in json.loads(raw[8 : 8 + n])["files"]:
        out.append((rel, raw[pos : pos + size]))
        pos += size
    return out


def exchange(pairs: list[tuple[int, int]], payload_for, on_recv, group=None) -> int:
    """Point-to-point transfers `(src, dst)` in one global order: every rank walks the same list, so matching
    send/recv calls never deadlock. `payload_for(dst)` builds what this rank sends, `on_recv(src, tensor)` stores
    what it gets. Collective over `group`; returns the bytes this rank sent."""
    me, sent = dist.get_rank(), 0
    for src, dst in pairs:
        if me == src:
            t = payload_for(dst)
            faults.point("replication")
            _send(t, dst, group)
            sent += t.numel()
        elif me == dst:
            on_recv(src, _recv(src, group))
    return sent


class PeerReplicator:
    def __init__(self, tier: HostTier, placement, group=None):
        self.tier, self.placement, self.group = tier, placement, group
        self.pairs = [
            (src, dst, dst in placement.replica_peers[src])
            for src in range(tier.world_size)
            for dst in placement.peers[src]
        ]
        self.bytes_sent = 0  # all bytes this rank sent to peers
        self.data_bytes_sent = 0  # of which slot data (0 when every peer is an HSDP replica)
        self.own_data_bytes = 0  # slot data of the windows this rank pushed (sent r times without replicas)
        self.replica_verified = 0
        self.replica_mismatch = 0
        self.inbox, self.outbox = Inbox(), Buffer()

    def peer_dir(self, src: int) -> Path:
        """Where this rank keeps what `src` sent it (per receiving rank: ranks of one node share the root)."""
        return self._mine() / f"from-{src:05d}" / self.tier.dir.name

    def _mine(self) -> Path:
        return self.tier.dir.parent / "peers" / f"rank-{self.tier.rank:05d}"

    def push(self, window_id: int, manifest: WindowManifest) -> None:
        """Send this rank's committed window to its peers and store what peers send (all ranks, in order)."""
        me = self.tier.rank
        self.own_data_bytes += sum(f.bytes for r, f in manifest.files.items() if _is_data(r))
        for src, dst, replica in self.pairs:
            if me == src:
                wdir = self.tier.window_dir(window_id)
                files = _window_files(manifest, lambda rel: wdir / rel, data=not replica)  # noqa: B023
                faults.point("replication")
                self.bytes_sent += send_files(files, dst, self.group, {"manifest": manifest.to_json()}, self.outbox)
                if not replica:
                    self.data_bytes_sent += sum(f.bytes for r, f in manifest.files.items() if _is_data(r))
            elif me == dst:
                dest = self.peer_dir(src) / window_dirname(window_id)
                theirs = self._receive(src, dest, src, self._spare_dir(src))
                if replica:
                    self._verify_replica(window_id, theirs, src)
                self._collect(src, window_id)

    def _verify_replica(self, window_id: int, theirs: WindowManifest, src: int) -> None:
        mine = self.tier.manifest(window_id)
        me = self.tier.rank
        ours = {r.replace(f"rank-{me:05d}", f"rank-{src:05d}"): f.crc32 for r, f in mine.files.items() if _is_data(r)}
        same = all(ours.get(r) == f.crc32 for r, f in theirs.files.items() if _is_data(r))
        marker = self.peer_dir(src) / window_dirname(window_id) / "REPLICA_VERIFIED"
        if same:
            self.replica_verified += 1
            marker.write_text(str(me))
        else:  # not bit-identical after all: this copy cannot stand in for the sender's
            self.replica_mismatch += 1
            log.warning("rank %d's window %d differs from replica rank %d's: not counted as a copy", src, window_id, me)

    def _receive(self, holder: int, dest: Path, rank: int, spares: Path | None = None) -> WindowManifest:
        """One window copy of `rank` from `holder` into `dest`, its data files written over spares when there
        are; the rank manifest goes last (a torn copy has none and is not held)."""
        (dest / rank_manifest_name(rank)).unlink(missing_ok=True)  # incomplete until the manifest is back
        kept = spare_list(spares) if spares is not None else []

        def write(rel: str, data: memoryview) -> None:
            write_file(dest / rel, data, kept.pop() if kept and _is_data(rel) else None)

        man = WindowManifest.from_json(self.inbox.recv(holder, self.group, write)["manifest"])
        (dest / rank_manifest_name(rank)).write_text(man.to_json())  # last: the copy is complete
        return man

    def _spare_dir(self, src: int) -> Path:
        return self.peer_dir(src) / ".spare"  # not a window-* name: never listed as a window

    def _collect(self, src: int, newest: int) -> None:
        """Drop copies older than the two newest; their data files are kept (bounded) for the next copies."""
        base, spare = self.peer_dir(src), self._spare_dir(src)
        for p in base.glob("window-*"):
            if int(p.name[7:]) < newest - 1:
                (p / rank_manifest_name(src)).unlink(missing_ok=True)  # first: never a half-deleted copy held
                keep_spares(sorted(p.glob("slot-*/rank-*/*.distcp")), spare, MAX_SPARES, p.name)
                shutil.rmtree(p, ignore_errors=True)

    def holdings(self) -> dict[int, list[int]]:
        """src rank -> windows this rank can provide for it (a full copy, or a verified replica copy)."""
        out: dict[int, list[int]] = {}
        for d in self._mine().glob("from-*"):
            src = int(d.name[5:])
            peer = HostTier.__new__(HostTier)
            peer.dir, peer.rank, peer.world_size = d / self.tier.dir.name, src, self.tier.world_size
            ok = []
            for wid in peer.window_ids():
                wdir = peer.window_dir(wid)
                if (wdir / "REPLICA_VERIFIED").exists():
                    if self.tier.verify(wid) == [] and not [p for p in peer.verify(wid) if ".distcp" not in p]:
                        ok.append(wid)
                elif not peer.verify(wid):
                    ok.append(wid)
            if ok:
                out[src] = ok
        return out

    def pull(self, window_id: int, needers: dict[int, int]) -> None:
        """Restore missing copies: `needers` maps a rank without a usable local copy of `window_id` to the
        rank that sends it. Collective over the group (every rank calls it with the same arguments)."""
        me = self.tier.rank
        for dst, holder in sorted(needers.items()):
            if me == holder:
                wdir = self.peer_dir(dst) / window_dirname(window_id)
                man = WindowManifest.from_json((wdir / rank_manifest_name(dst)).read_text())
                if (wdir / "REPLICA_VERIFIED").exists():
                    # Small files from the stored copy; slot data from our own, verified-identical slots.
                    own = self.tier.window_dir(window_id)

                    def source(rel: str) -> Path:
                        return own / rel.replace(f"rank-{dst:05d}", f"rank-{me:05d}") if _is_data(rel) else wdir / rel  # noqa: B023
                else:

                    def source(rel: str) -> Path:
                        return wdir / rel  # noqa: B023

                send_files(_window_files(man, source), dst, self.group, {"manifest": man.to_json()})
            elif me == dst:
                self._receive(holder, self.tier.window_dir(window_id), me)
