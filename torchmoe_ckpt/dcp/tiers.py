"""Build the storage tiers of one rank from a small config, and find + fetch the window to recover from.

    {"root": "/dev/shm/torchmoe-ckpt", "run_id": "job", "ranks_per_node": 2, "replicas": 1}

`ranks_per_node` sets the failure domains (default: LOCAL_WORLD_SIZE, i.e. one node per torchrun agent).
Each node gets its own host directory `<root>/node-N/` -- on one machine this emulates separate nodes, so a
"lost node" is a wiped directory. `replicas` is r, the number of peers that hold a copy of each window.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from .host_tier import HostTier


def node_of(rank: int, ranks_per_node: int) -> int:
    return rank // ranks_per_node


def build_tiers(cfg: dict, rank: int, world: int, hsdp_replicate: int = 1):
    """(HostTier, PeerReplicator or None). Collective when replicas > 0 (creates the peer gloo group)."""
    rpn = int(cfg.get("ranks_per_node") or os.environ.get("LOCAL_WORLD_SIZE", world))
    tier = HostTier(Path(cfg["root"]) / f"node-{node_of(rank, rpn)}", cfg.get("run_id", "run"), rank, world)
    r = int(cfg.get("replicas", 0))
    if r <= 0:
        return tier, None
    from ..placement import Topology, place_replicas
    from .peer_tier import PeerReplicator
    placement = place_replicas(Topology.from_mesh_shape(world, hsdp_replicate, rpn), r)
    group = dist.new_group(backend="gloo") if dist.is_initialized() else None
    return tier, PeerReplicator(tier, placement, group)


def recover_from_tiers(tier: HostTier, replicator, ops: dict, compute_dtype: torch.dtype):
    """Agree on the newest window every rank can get (its own verified copy, or a peer's), pull the missing
    copies from peers, and load this rank's. Returns (Window or None, report). Collective."""
    local = [w for w in tier.window_ids() if not tier.verify(w)]
    held = replicator.holdings() if replicator is not None else {}
    everyone = [(local, held)]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (local, held))
    world = len(everyone)
    avail = []
    for r in range(world):
        got = set(everyone[r][0])
        for h in range(world):
            got |= set(everyone[h][1].get(r, ()))
        avail.append(got)
    common = set.intersection(*avail) if avail else set()
    report: dict = {"unusable_copies": {w: p[0] for w in tier.window_ids() if (p := tier.verify(w))}}
    if not common:
        return None, dict(report, source=None)
    wid = max(common)
    needers = {r: min(h for h in range(world) if wid in everyone[h][1].get(r, ()))
               for r in range(world) if wid not in everyone[r][0]}
    if needers:
        replicator.pull(wid, needers)
    src = f"peer {needers[tier.rank]}" if tier.rank in needers else "host"
    report.update(source=src, pulled_from_peers={str(k): v for k, v in needers.items()})
    return tier.load_window(wid, ops, compute_dtype), report
