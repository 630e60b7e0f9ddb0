"""Peer tier: every window a rank commits on its host tier also reaches r peers on other nodes.

Placement (`torchmoe_ckpt.placement`) picks, per rank, HSDP replica peers first and then other ranks on
other nodes. A *replica* peer already holds bit-identical slot data (HSDP replicas apply the same update to
the same shard), so it is sent only what differs: the rank's manifest, its replay records (each replica
trains on its own batches) and the small DCP `.metadata` files; it verifies, by comparing CRC32s, that its
own slot data equals the sender's. Any other peer receives the full window.

Push (after each commit) and pull (at restart) run over a dedicated gloo group, rank pairs in one global
order, so every rank issues matching send/recv calls without deadlock. Received copies live in the
receiver's host directory under `peers/rank-RRRRR/from-SSSSS/<run>/window-NNNNNN/`, manifest written last.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from .. import faults
from .host_tier import HostTier
from .manifest import WindowManifest, rank_manifest_name, window_dirname

log = logging.getLogger("torchmoe_ckpt.peer_tier")


def _is_data(rel: str) -> bool:
    return rel.endswith(".distcp")


def pack(manifest: WindowManifest, source, data: bool = True) -> torch.Tensor:
    """A rank's window files as one uint8 tensor: [8-byte header length][JSON header][file bytes...].
    `source(rel)` gives the path to read each file from; `data=False` leaves the slot data files out."""
    files = [rel for rel in sorted(manifest.files) if data or not _is_data(rel)]
    blobs = [Path(source(rel)).read_bytes() for rel in files]
    header = json.dumps({"manifest": manifest.to_json(), "files": [[r, len(b)] for r, b in zip(files, blobs)]}).encode()
    raw = len(header).to_bytes(8, "little") + header + b"".join(blobs)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def unpack(payload: torch.Tensor, dest: Path, rank: int) -> WindowManifest:
    raw = payload.numpy().tobytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    pos = 8 + n
    (dest / rank_manifest_name(rank)).unlink(missing_ok=True)  # incomplete until the manifest is back
    for rel, size in header["files"]:
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(raw[pos:pos + size])
        pos += size
    man = WindowManifest.from_json(header["manifest"])
    (dest / rank_manifest_name(rank)).write_text(man.to_json())  # last: the copy is complete
    return man


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
    """Named files as one uint8 tensor (same framing as `pack`, without a window manifest)."""
    header = json.dumps({"files": [[r, len(b)] for r, b in files]}).encode()
    raw = len(header).to_bytes(8, "little") + header + b"".join(b for _, b in files)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def unpack_files(payload: torch.Tensor) -> list[tuple[str, bytes]]:
    raw = payload.numpy().tobytes()
    n = int.from_bytes(raw[:8], "little")
    pos, out = 8 + n, []
    for rel, size in json.loads(raw[8:8 + n])["files"]:
        out.append((rel, raw[pos:pos + size]))
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
        self.pairs = [(src, dst, dst in placement.replica_peers[src])
                      for src in range(tier.world_size) for dst in placement.peers[src]]
        self.bytes_sent = 0          # all bytes this rank sent to peers
        self.data_bytes_sent = 0     # of which slot data (0 when every peer is an HSDP replica)
        self.own_data_bytes = 0      # slot data of the windows this rank pushed (sent r times without replicas)
        self.replica_verified = 0
        self.replica_mismatch = 0

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
                payload = pack(manifest, lambda rel: wdir / rel, data=not replica)
                faults.point("replication")
                _send(payload, dst, self.group)
                self.bytes_sent += payload.numel()
                if not replica:
                    self.data_bytes_sent += sum(f.bytes for r, f in manifest.files.items() if _is_data(r))
            elif me == dst:
                dest = self.peer_dir(src) / window_dirname(window_id)
                theirs = unpack(_recv(src, self.group), dest, src)
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
            log.warning("rank %d's window %d differs from replica rank %d's: not counted as a copy", src,
                        window_id, me)

    def _collect(self, src: int, newest: int) -> None:
        base = self.peer_dir(src)
        for p in base.glob("window-*"):
            if int(p.name[7:]) < newest - 1:
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
                        return own / rel.replace(f"rank-{dst:05d}", f"rank-{me:05d}") if _is_data(rel) else wdir / rel
                else:
                    def source(rel: str) -> Path:
                        return wdir / rel
                _send(pack(man, source), dst, self.group)
            elif me == dst:
                unpack(_recv(holder, self.group), self.tier.window_dir(window_id), me)
