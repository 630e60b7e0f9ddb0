"""Build the storage tiers of one rank from a `TierConfig`, and find + fetch the window to recover from.

    TierConfig(root="/dev/shm/torchmoe-ckpt", run_id="job", ranks_per_node=2, replicas=1)

`ranks_per_node` sets the failure domains (default: LOCAL_WORLD_SIZE, i.e. one node per torchrun agent).
Each node gets its own host directory `<root>/node-N/` -- on one machine this emulates separate nodes, so a
"lost node" is a wiped directory. `replicas` is r, the number of peers that hold a copy of each window.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..config import TierConfig
from ..placement import Topology, place_replicas
from .host_tier import HostTier
from .object_tier import make_store
from .peer_tier import PeerReplicator


def node_of(rank: int, ranks_per_node: int) -> int:
    return rank // ranks_per_node


class Tiers(NamedTuple):
    """One rank's storage tiers: host memory (always), peers and object store (optional)."""
    host: HostTier
    replicator: "PeerReplicator | None"
    store: object | None  # object_tier.ObjectTier / tensorstore_format.TensorstoreTier


def build_tiers(cfg: TierConfig | dict, rank: int, world: int, hsdp_replicate: int = 1) -> Tiers:
    """(HostTier, PeerReplicator or None, ObjectTier or None). Collective when replicas > 0 (creates the
    peer gloo group). A dict is read as `TierConfig.from_dict` (the job-spec form)."""
    if isinstance(cfg, dict):
        cfg = TierConfig.from_dict(cfg)
    rpn = int(cfg.ranks_per_node or os.environ.get("LOCAL_WORLD_SIZE", world))
    run_id = cfg.resolved_run_id()
    tier = HostTier(Path(cfg.root) / f"node-{node_of(rank, rpn)}", run_id, rank, world)
    store = None
    if cfg.object_store is not None:
        o = cfg.object_store
        store = make_store(o.uri, run_id, rank, o.storage_options or None, keep_windows=o.keep, format=o.format)
    if cfg.replicas <= 0:
        return Tiers(tier, None, store)
    placement = place_replicas(Topology.from_mesh_shape(world, hsdp_replicate, rpn), cfg.replicas)
    group = dist.new_group(backend="gloo") if dist.is_initialized() else None
    return Tiers(tier, PeerReplicator(tier, placement, group), store)


def recover_from_tiers(tier: HostTier, replicator, ops: dict, compute_dtype: torch.dtype, rounds: int = 3,
                       store=None):
    """Agree on the newest window every rank can get (its own verified copy, or a peer's), pull the missing
    copies from peers, check that every rank now has a verified copy, and load this rank's. A window that
    fails after the pull is excluded and the next newest is tried. Returns (Window or None, report).
    Collective."""
    report: dict = {"unusable_copies": {w: p[0] for w in tier.window_ids() if (p := tier.verify(w))}}
    excluded: set[int] = set()
    for _ in range(rounds):
        local = [w for w in tier.window_ids() if not tier.verify(w)]
        held = replicator.holdings() if replicator is not None else {}
        everyone = all_gather_objects((local, held))
        world = len(everyone)
        avail = [set(everyone[r][0]).union(*(everyone[h][1].get(r, ()) for h in range(world))) - excluded
                 for r in range(world)]
        common = set.intersection(*avail)
        if not common:
            return _from_store(tier, store, ops, compute_dtype, report)
        wid = max(common)
        needers = {r: min(h for h in range(world) if wid in everyone[h][1].get(r, ()))
                   for r in range(world) if wid not in everyone[r][0]}
        if needers:
            replicator.pull(wid, needers)
        problems = tier.verify(wid)
        if not any(all_gather_objects(bool(problems))):
            src = f"peer {needers[tier.rank]}" if tier.rank in needers else "host"
            report.update(source=src, pulled_from_peers={str(k): v for k, v in needers.items()})
            return tier.load_window(wid, ops, compute_dtype), report
        report.setdefault("failed_pulls", {})[wid] = problems[:1]
        excluded.add(wid)
    return _from_store(tier, store, ops, compute_dtype, report)


def _from_store(tier: HostTier, store, ops: dict, compute_dtype: torch.dtype, report: dict):
    """Last tier: the newest window every rank has in the object store, downloaded and verified."""
    if store is None:
        return None, dict(report, source=None)
    listed = all_gather_objects(store.window_ids())
    candidates = sorted(set.intersection(*map(set, listed)), reverse=True)
    for wid in candidates:
        problems = store.download(wid, tier)
        if not any(all_gather_objects(bool(problems))):
            return tier.load_window(wid, ops, compute_dtype), dict(report, source="object store")
        report.setdefault("failed_downloads", {})[wid] = problems[:1]
    return None, dict(report, source=None)


def all_gather_objects(obj) -> list:
    """Every rank's `obj` (a one-element list without a process group)."""
    if not dist.is_initialized():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
