"""Build the storage tiers of one rank from a `TierConfig` (recovery/agreed_window.py finds and fetches the window
to recover). Each node (`ranks_per_node`, default LOCAL_WORLD_SIZE) gets its own host directory `<root>/node-N/`: on one
machine this emulates separate nodes. `replicas` is r, the number of peers that hold a copy of each window."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import NamedTuple

import torch.distributed as dist

from ..core.config_values import DEFAULT_HOST_ROOT
from ..core.errors import ConfigError
from ..core.tier_config import TierConfig
from ..ownership import run_lock
from ..ownership.store_lease import StoreLease, StoreLeasedError, local_job_key
from ..planning.placement import Topology, place_replicas
from ..runtime.background import stop_at_exit
from ..runtime.distributed import library_group, library_new_group
from ..storage_format.layout import node_dirname
from ..tiers.contracts import ObjectStore
from ..tiers.host_tier import HostTier, HostTierOptions
from ..tiers.object_tier import make_store
from ..tiers.orphans import OrphanCopies
from ..tiers.peer_tier import PeerTier

log = logging.getLogger("torchmoe_ckpt.tiers")


def node_of(rank: int, ranks_per_node: int) -> int:
    return rank // ranks_per_node


class Tiers(NamedTuple):
    """One rank's storage tiers: host memory (always), peers and object store (optional; tiers/contracts.py)."""

    host: HostTier
    peers: PeerTier | None  # the peer tier: each committed window also on r peers
    store: ObjectStore | None  # object_tier.ObjectTier / tensorstore_tier.TensorstoreTier
    lease: StoreLease | None = None  # this job's writer lease on the store's run prefix (store_lease.py)

    def release_store_lease(self) -> None:
        """Give the store prefix up now (a job that refuses to start wrote nothing there: the next job on the prefix
        need not wait for the lease to expire). Only the rank that holds the lease does anything."""
        if self.lease is not None:
            self.lease.release()


def build_tiers(cfg: TierConfig | dict, rank: int, world: int, hsdp_replicate: int = 1) -> Tiers:
    """Build one rank's tiers; takes the run lock (run_lock.py) and the store lease (store_lease.py).

    Collective when replicas > 0 (creates the peer gloo group) or an object store is configured (`job_key`).

    Args:
        cfg: the tiers' configuration; a dict is read as `TierConfig.from_dict`.
        rank, world: this rank and the job's size.
        hsdp_replicate: the HSDP replicate degree (replica peers hold the same slot data: placement.py).

    Returns:
        `Tiers(host, peers, store, lease)`.

    Raises:
        ConfigError: the host root cannot be written; RunLockedError: another live job holds the run directory;
            StoreLeasedError: another live job writes the store's run prefix.
    """
    if isinstance(cfg, dict):
        cfg = TierConfig.from_dict(cfg)
    rpn = int(cfg.ranks_per_node or os.environ.get("LOCAL_WORLD_SIZE", world))
    run_id, node = cfg.resolved_run_id(), node_of(rank, rpn)
    node_dir = Path(cfg.root) / node_dirname(node)
    try:
        (node_dir / run_id).mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # the root is a file, under /proc, read-only or not ours: one line, before training
        raise ConfigError(
            f"host tier root {cfg.root!r}: cannot create the run directory {node_dir / run_id} "
            f"({type(exc).__name__}: {exc.strerror or exc}); fix: TierConfig(root=...) a writable node-local "
            f"directory, e.g. {DEFAULT_HOST_ROOT}"
        ) from None
    run_lock.acquire(node_dir / run_id, leader=rank % rpn == 0, world=world)  # one job per run directory
    options = HostTierOptions(
        orphans=OrphanCopies.find(Path(cfg.root), run_id, rank, rpn, world),  # an older numbering's copies
        node_ranks=list(range(node * rpn, min(world, (node + 1) * rpn))),  # recorded: verify expects them all
        stall_iterations=cfg.stall_iterations,  # read by its PersistThread (tier_health.py)
        on_stall=cfg.on_stall,
        upload_backlog=cfg.upload_backlog,  # host memory (host_memory.py)
        spare_windows=cfg.spare_windows,
        peer_max_lag_windows=cfg.peer_max_lag_windows,  # read by its PersistThread (peer_lag.py)
        peer_interval=cfg.peer_interval,  # read by its PersistThread (peer_interval.py)
        peer_link_share=cfg.peer_link_share,
    )
    tier = HostTier(node_dir, run_id, rank, world, options)
    store, lease = None, None
    if cfg.object_store is not None:
        o = cfg.object_store
        store = make_store(o.uri, run_id, rank, o.storage_options or None, keep_windows=o.keep, format=o.format)
        lease = _lease(o, run_id, rank, job_key())
    if cfg.replicas <= 0:
        return Tiers(tier, None, store, lease)
    placement = place_replicas(Topology.from_mesh_shape(world, hsdp_replicate, rpn), cfg.replicas)
    group = library_new_group() if dist.is_initialized() else None
    return Tiers(tier, PeerTier(tier, placement, group, timeout_s=cfg.peer_timeout_s), store, lease)


def job_key() -> str:
    """Collective: rank 0's `local_job_key()`, the same on every rank of this launch (store_lease.py)."""
    key = [local_job_key()]
    if dist.is_initialized():
        dist.broadcast_object_list(key, src=0, group=library_group())
    return key[0]


def _lease(o, run_id: str, rank: int, job: str) -> StoreLease | None:
    """This job's writer lease on the store's run prefix (store_lease.py). A store that cannot be reached now is
    the store's outage (the uploads retry and say so), not a reason to stop the job: then no lease is held."""
    lease = StoreLease(o.uri, run_id, o.storage_options or None, o.lease_s, rank, job)
    try:
        lease.acquire()
    except StoreLeasedError:
        raise
    except Exception as exc:
        log.warning(
            "event=store_lease_unavailable rank=%d store=%s: %s: %s; training goes on without the writer lease",
            rank,
            lease.where,
            type(exc).__name__,
            exc,
        )
        return None
    stop_at_exit(lease)
    return lease
