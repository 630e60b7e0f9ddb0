"""Build the storage tiers of one rank from a `TierConfig` (recover.py finds + fetches the window to recover).

    TierConfig(root="/dev/shm/torchmoe-ckpt", run_id="job", ranks_per_node=2, replicas=1)

`ranks_per_node` sets the failure domains (default: LOCAL_WORLD_SIZE, i.e. one node per torchrun agent).
Each node gets its own host directory `<root>/node-N/` -- on one machine this emulates separate nodes, so a
"lost node" is a wiped directory. `replicas` is r, the number of peers that hold a copy of each window.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import NamedTuple

import torch.distributed as dist

from ..config import TierConfig
from ..placement import Topology, place_replicas
from . import run_lock
from .host_tier import HostTier
from .layout import node_dirname
from .object_tier import make_store
from .peer_tier import PeerTier

log = logging.getLogger("torchmoe_ckpt.tiers")


def node_of(rank: int, ranks_per_node: int) -> int:
    return rank // ranks_per_node


class Tiers(NamedTuple):
    """One rank's storage tiers: host memory (always), peers and object store (optional)."""

    host: HostTier
    replicator: PeerTier | None  # the peer tier
    store: object | None  # object_tier.ObjectTier / tensorstore_tier.TensorstoreTier


def build_tiers(cfg: TierConfig | dict, rank: int, world: int, hsdp_replicate: int = 1) -> Tiers:
    """(HostTier, PeerTier or None, ObjectTier/TensorstoreTier or None). Collective when replicas > 0 (creates the
    peer gloo group). A dict is read as `TierConfig.from_dict` (the job-spec form)."""
    if isinstance(cfg, dict):
        cfg = TierConfig.from_dict(cfg)
    rpn = int(cfg.ranks_per_node or os.environ.get("LOCAL_WORLD_SIZE", world))
    run_id = cfg.resolved_run_id()
    tier = HostTier(Path(cfg.root) / node_dirname(node_of(rank, rpn)), run_id, rank, world)
    run_lock.acquire(tier.dir, leader=rank % rpn == 0, world=world)  # one job per run directory (run_lock.py)
    tier.stall_policy = (cfg.stall_iterations, cfg.on_stall)  # read by its PersistThread (tier_health.py)
    tier.upload_backlog, tier.spare_windows = cfg.upload_backlog, cfg.spare_windows  # host memory (host_memory.py)
    store = None
    if cfg.object_store is not None:
        o = cfg.object_store
        store = make_store(o.uri, run_id, rank, o.storage_options or None, keep_windows=o.keep, format=o.format)
    if cfg.replicas <= 0:
        return Tiers(tier, None, store)
    placement = place_replicas(Topology.from_mesh_shape(world, hsdp_replicate, rpn), cfg.replicas)
    group = dist.new_group(backend="gloo") if dist.is_initialized() else None
    return Tiers(tier, PeerTier(tier, placement, group), store)
