"""The peer tier as a DCP StorageWriter/StorageReader over tiers.peer_tier.PeerTier: PeerWriter pushes a committed
window to the placed peers, PeerReader first pulls what its node lost from a holder. DCP's `finish` runs on the
coordinator only, so the transfers run in `write_data` / `prepare_local_plan` on every rank (use a gloo group).
Under HSDP DCP writes a replicated item once, so every placed peer gets the data (`replicas_hold_data=False`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..planning.placement import Placement
from ..storage_format.layout import METADATA, parse_slot_path, rank_of_writer, slot_dirname, writer_name, writer_rank
from ..storage_format.slot_format import load_metadata, merge_metadata
from ..tiers.host_tier import HostTier
from ..tiers.peer_tier import PeerTier
from .raw_storage import RawWriter, run_tier
from .tier_storage import HostReader, HostWriter


def _slot_path(path: str) -> tuple[str, int, int]:
    where = parse_slot_path(path)
    if where is None:
        raise ValueError(f"{path}: the peer tier keeps whole windows: give the slot directory, schedule.slot_path()")
    return where


def _peers(path: str, group=None) -> tuple[PeerTier, int, int]:
    """The peer tier of this rank for the run directory of slot path `path`, its window and slot."""
    run, window, slot = _slot_path(str(path))
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    tier = run_tier(run, rank, world, store=False)
    assert isinstance(tier, HostTier)  # store=False: the run directory's host tier
    return PeerTier(tier, None, group), window, slot


def held_copies(path: str | os.PathLike) -> dict[int, Path]:
    """Rank -> the window directory on this node holding that writer's committed copy of the window of slot path
    `path`: its own writers' copies and those this rank holds for others."""
    peers, window, _ = _peers(str(path))
    return peers.copies(window)


class PeerWriter(HostWriter):
    """Host copy at `path` plus r peer copies placed by `placement` (`place_replicas(topology, r)`)."""

    collective = True  # a TieredWriter must not swallow a failed push: every rank takes part in it

    def __init__(self, path: str | os.PathLike, placement: Placement, group=None):
        """Args:
        path: a slot path on the host tier (`schedule.slot_path(root, step)`).
        placement: which ranks hold each rank's copies (`place_replicas(topology, r)`).
        group: the gloo group the copies travel over (default: the default group).
        """
        super().__init__(path)
        self.placement, self.group = placement, group
        self.bytes_sent = 0  # to peers, this save

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        fut = super().write_data(plan, planner)
        self.write_from(self)
        return fut

    def write_from(self, first: RawWriter) -> int:
        """Push `first`'s window to the peers when its save was the window's last slot (collective: every rank
        saves the same slot, so every rank is here); returns the bytes sent."""
        _slot_path(first.path)
        self.bytes_sent = 0
        if not first.closes_window or first.window is None:
            return 0
        assert isinstance(first.tier, HostTier)  # a HostWriter's window save
        peers = PeerTier(first.tier, self.placement, self.group, replicas_hold_data=False)
        peers.push(first.window, first.committed)  # None (not committed here): this rank sends nothing
        self.bytes_sent = peers.bytes_sent
        return self.bytes_sent


class PeerReader(HostReader):
    """Read a slot on every rank from this node's copies, fetching from peers what this node lost."""

    def __init__(self, path: str | os.PathLike, group=None, verify: bool = True):
        super().__init__(path, verify)
        self.group = group
        self.fetched: dict[int, int] = {}  # rank whose files this rank fetched -> rank it fetched them from
        self.bytes_fetched = 0

    def _gather(self, obj) -> list:
        every: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(every, obj, group=self.group)
        return every

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's rank-local retry: the merged metadata is global already
            raise FileNotFoundError("PeerReader has no rank-local metadata mode")
        self.peers, self.window, self.slot = _peers(self.path, self.group)
        offer = {}
        for src, wdir in self.peers.copies(self.window).items():
            try:
                offer[src] = (wdir / slot_dirname(self.slot) / writer_name(src) / METADATA).read_bytes()
            except OSError:
                pass
        every = self._gather(offer)  # every rank calls read_metadata: collective
        self.holders: dict[int, list[int]] = {}
        pieces: dict[int, Metadata] = {}
        for rank, got in enumerate(every):
            for src, raw in got.items():
                self.holders.setdefault(src, []).append(rank)
                pieces.setdefault(src, load_metadata(raw, f"{self.path} (rank {src}'s piece, held by rank {rank})"))
        if not pieces:
            raise FileNotFoundError(f"{self.path}: no node holds a committed copy of this checkpoint")
        md = merge_metadata({writer_name(s): pieces[s] for s in sorted(pieces)}, self.path)
        assert md.storage_meta is not None  # merge_metadata records one
        md.storage_meta.load_id = self.load_id
        return md

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Pull the windows of the writers whose files this rank's reads need and its node lacks (collective)."""
        me = dist.get_rank()
        owners = {rank_of_writer(self.storage_data[r.storage_index].relative_path.split("/", 1)[0]) for r in plan.items}
        every = self._gather(sorted(owners - set(self.peers.copies(self.window))))
        transfers = []
        for dst, wants in enumerate(every):
            for src in wants:
                holder = min(self.holders.get(src, [dst]))
                if holder != dst:  # else nobody holds it: read_data fails, naming the missing file
                    transfers.append((holder, dst, src))
        self.peers.pull(self.window, transfers)
        self._where = self.peers.copies(self.window)
        for holder, dst, src in transfers:
            if dst == me:
                self.fetched[src] = holder
                self.bytes_fetched += self.peers.held(src).manifest(self.window).total_bytes if src != me else 0
        return plan

    def read_file(self, rel: str):
        src = writer_rank(rel.split("/", 1)[0])
        d = None if src is None else self._where.get(src)
        if d is None:
            raise FileNotFoundError(f"{self.path}: no node holds {rel}")
        return bytearray((d / slot_dirname(self.slot) / rel).read_bytes())  # items are verified on read
