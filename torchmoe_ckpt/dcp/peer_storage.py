"""Peer tier as a DCP StorageWriter/StorageReader: `dcp.save`/`dcp.load` drive the peer replication.

    PeerWriter  writes this rank's host copy (a HostWriter's raw bytes in node-local shared memory) and pushes
                it to the peers `torchmoe_ckpt.placement` picked for the rank (r copies on other failure
                domains, HSDP replicas first), over `peer_tier.send_files`, the same point-to-point transfer the
                SparseCheckpointer's peer tier uses.
    PeerReader  reads a slot back on every rank: a rank whose own copy is gone (a restarted node with an empty
                /dev/shm) fetches it from the host memory of a peer that holds it, then reads and verifies the
                per-item checksums like HostReader.

Where the cross-rank work happens. DCP calls `finish` on the coordinator only, so nothing collective may run
there. `write_data` and `read_metadata`/`prepare_local_plan`/`read_data` run on every rank between DCP's own
collectives, so the transfers happen there, every rank walking the same (src, dst) list. Because the global
`.metadata` only exists once `finish` ran on the coordinator, every rank also writes a *rank metadata*
(`__R_0.rankmd`: the DCP metadata of its own items, per-item checksums included) after its data file, and that
file is what a peer copy commits with (written last, atomically). Reading, the rank metadatas that survive on
any node are gathered and merged into the checkpoint's metadata, so a lost coordinator node loses nothing.

Under HSDP, DCP's dedup writes each replicated item once (on one replica), so a replica peer does not hold the
bytes by itself here: every placed peer, replica or not, is sent the file. Use a gloo group (`group=`): the
transfers are CPU tensors; with `dcp.async_save` pass a dedicated group, since the writes run off-thread.

Layout under a slot's host path: own files `__R_0.distcp`, `__R_0.rankmd` (+ `.metadata` on the coordinator's
node), and the copies this node holds for others under `peers/from-SSSSS/`.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .. import faults
from ..placement import Placement
from ..storage.peer_tier import Buffer, Inbox, exchange, pack_files, send_files, unpack_files, write_file
from .raw_storage import PLANNER_KEY, done
from .tier_storage import HostReader, HostWriter

RANK_MD = "_0.rankmd"


def rank_md_name(rank: int) -> str:
    return f"__{rank}{RANK_MD}"


def _commit(dest: Path, files: list[tuple[str, bytes]]) -> None:
    """Data first, the rank metadata last (renamed into place): a torn copy has no metadata and is not held."""
    dest.mkdir(parents=True, exist_ok=True)
    md = [f for f in files if f[0].endswith(RANK_MD)]
    for rel, data in [f for f in files if not f[0].endswith(RANK_MD)] + md:
        if rel.endswith(RANK_MD):
            (dest / rel).unlink(missing_ok=True)
        tmp = dest / f".{rel}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, dest / rel)


def _put(dest: Path, rel: str, data) -> None:
    """One received file, renamed into place (a rank metadata, sent last, commits the copy)."""
    tmp = dest / f".{rel}.tmp"
    write_file(tmp, data)
    os.replace(tmp, dest / rel)


def held_copies(path: str | os.PathLike) -> dict[int, Path]:
    """Rank -> directory, for every rank whose committed files (rank metadata present) this slot path holds:
    its own ranks' copies and the peer copies under `peers/from-SSSSS/`."""
    root, out = Path(path), {}
    for d in [root] + sorted(root.glob("peers/from-*")):
        for md in d.glob(f"__*{RANK_MD}"):
            out.setdefault(int(md.name[2 : -len(RANK_MD)]), d)
    return out


def rank_metadata(plan: SavePlan, results: list[WriteResult], planner: SavePlanner) -> Metadata:
    """The DCP metadata of the items one rank wrote (what `finish` would build from this rank alone)."""
    sd: dict = {}
    for wi in plan.items:
        if wi.type == WriteItemType.BYTE_IO:
            sd[wi.index.fqn] = BytesStorageMetadata()
        else:
            td = wi.tensor_data
            sd.setdefault(wi.index.fqn, TensorStorageMetadata(td.properties, td.size, [])).chunks.append(td.chunk)
    info = getattr(planner, "info", None)  # SparseSavePlanner: window/slot/step/plan, identical on every rank
    return Metadata(
        sd,
        planner_data={PLANNER_KEY: dict(info)} if isinstance(info, dict) else None,
        storage_data={r.index: r.storage_data for r in results},
    )


def merge_metadata(pieces: list[Metadata]) -> Metadata:
    """The checkpoint's metadata from its ranks' metadatas (chunks and storage entries united)."""
    sd: dict = {}
    storage: dict = {}
    for md in pieces:
        for fqn, tm in md.state_dict_metadata.items():
            if isinstance(tm, TensorStorageMetadata):
                have = sd.setdefault(fqn, TensorStorageMetadata(tm.properties, tm.size, []))
                seen = {tuple(c.offsets) for c in have.chunks}
                have.chunks.extend(c for c in tm.chunks if tuple(c.offsets) not in seen)
            else:
                sd.setdefault(fqn, tm)
        storage.update(md.storage_data)
    out = Metadata(sd, planner_data=pieces[0].planner_data, storage_data=storage)
    out.storage_meta, out.version = StorageMeta(), "1.0.0"
    return out


class PeerWriter(HostWriter):
    """Host copy at `path` plus r peer copies placed by `placement` (`place_replicas(topology, r)`)."""

    def __init__(self, path: str | os.PathLike, placement: Placement, group=None, item_checksums: bool = True):
        super().__init__(path, item_checksums)
        self.placement, self.group = placement, group
        self.bytes_sent = 0  # to peers, this save
        self._out, self._in = Buffer(), Inbox()  # reused across saves: no allocation per transfer

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()
        self._replicate(plan, results, planner)
        return done(results)

    def write_from(self, first, plan: SavePlan, results: list[WriteResult], planner: SavePlanner) -> int:
        """As a later tier of a TieredWriter: take the files the first (host) tier just wrote, then push them.
        Returns the bytes sent to peers."""
        src, root = Path(first.path), Path(self.path)
        if src.resolve() != root.resolve():
            root.mkdir(parents=True, exist_ok=True)
            for rel in first.written:
                shutil.copyfile(src / rel, root / rel)
        self.written = dict(first.written)
        self._replicate(plan, results, planner)
        return self.bytes_sent

    def _replicate(self, plan: SavePlan, results: list[WriteResult], planner: SavePlanner) -> None:
        me = dist.get_rank()
        root = Path(self.path)
        md = rank_md_name(me)
        _commit(root, [(md, pickle.dumps(rank_metadata(plan, results, planner)))])  # this rank's host copy is complete
        mine = [(rel, root / rel) for rel in self.written] + [(md, root / md)]  # the rank metadata last
        pairs = [(src, dst) for src in range(len(self.placement.peers)) for dst in self.placement.peers[src]]
        # Every rank is inside write_data here (between DCP's plan scatter and result gather): a safe point.
        # The files stream from this node's copy to the peer's (send_files: one reused buffer each side).
        self.bytes_sent = 0
        for src, dst in pairs:
            if me == src:
                faults.point("replication")
                self.bytes_sent += send_files(mine, dst, self.group, buf=self._out)
            elif me == dst:
                dest = root / "peers" / f"from-{src:05d}"
                dest.mkdir(parents=True, exist_ok=True)
                (dest / rank_md_name(src)).unlink(missing_ok=True)  # uncommitted until its rank metadata is back
                self._in.recv(src, self.group, lambda rel, data, dest=dest: _put(dest, rel, data))


class PeerReader(HostReader):
    """Read a slot on every rank from this node's copies, fetching from peers what this node lost."""

    def __init__(self, path: str | os.PathLike, group=None, verify: bool = True):
        super().__init__(path, verify)
        self.group = group
        self.fetched: dict[int, int] = {}  # rank whose files this rank fetched -> rank it fetched them from
        self.bytes_fetched = 0

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's rank-local retry: the merged metadata is global already
            raise FileNotFoundError("PeerReader has no rank-local metadata mode")
        held = held_copies(self.path)
        offer = {}
        for src, d in held.items():
            try:
                offer[src] = (d / rank_md_name(src)).read_bytes()
            except OSError:
                pass
        every: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(every, offer, group=self.group)  # every rank calls read_metadata: collective
        self.holders: dict[int, list[int]] = {}
        pieces: dict[int, Metadata] = {}
        for rank, got in enumerate(every):
            for src, raw in got.items():
                self.holders.setdefault(src, []).append(rank)
                pieces.setdefault(src, pickle.loads(raw))
        if not pieces:
            raise FileNotFoundError(f"{self.path}: no node holds a committed copy of this checkpoint")
        self.owner = {info.relative_path: src for src, md in pieces.items() for info in md.storage_data.values()}
        md = merge_metadata([pieces[s] for s in sorted(pieces)])
        md.storage_meta.load_id = self.load_id
        return md

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Fetch the files this rank's reads need and its node lacks (collective: every rank calls it)."""
        held = held_copies(self.path)
        need = sorted({self.owner[self.storage_data[r.storage_index].relative_path] for r in plan.items} - set(held))
        every: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(every, need, group=self.group)
        wanted: dict[tuple[int, int], list[int]] = {}  # (holder, needer) -> ranks whose files it sends
        for dst, wants in enumerate(every):
            for src in wants:
                holder = min(self.holders.get(src, [dst]))
                if holder != dst:  # else nobody holds it: read_data fails, naming the missing file
                    wanted.setdefault((holder, dst), []).append(src)
        me, root = dist.get_rank(), Path(self.path)

        def payload(dst: int):
            return pack_files(
                [(p.name, p.read_bytes()) for src in wanted[(me, dst)] for p in sorted(held[src].glob(f"__{src}_*"))]
            )

        def store(holder: int, t) -> None:
            files = unpack_files(t)
            for src in wanted[(holder, me)]:  # restores this node's copy, rank metadata last
                _commit(root / "peers" / f"from-{src:05d}", [f for f in files if f[0].startswith(f"__{src}_")])
                self.fetched[src] = holder
            self.bytes_fetched += t.numel()

        exchange(sorted(wanted), payload, store, self.group)
        self._where = {rel: held_copies(self.path).get(src) for rel, src in self.owner.items()}
        return plan

    def read_file(self, rel: str) -> bytearray:
        d = self._where.get(rel)
        if d is None:
            raise FileNotFoundError(f"{self.path}: no node holds {rel} (rank {self.owner.get(rel)}'s copy)")
        return bytearray((d / rel).read_bytes())  # RawReader.read_data verifies each item's checksum
