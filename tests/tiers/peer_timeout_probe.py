"""Two ranks, each its own node, replicas = 1, over the real gloo transport: rank 1 never takes part in the peer
exchange (a frozen peer); rank 0 pushes twice with peer_timeout_s = TIMEOUT. For tests/tiers/test_peer_timeout.py:
rank 0 writes to $PEER_TIMEOUT_OUT/rank0.json how long each push took, and why its peer tier stopped."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from torchmoe_ckpt.planning.placement import Topology, place_replicas
from torchmoe_ckpt.tiers.host_tier import HostTier, HostTierOptions
from torchmoe_ckpt.tiers.peer_tier import PeerTier

TIMEOUT = 2.0


def main(root: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tier = HostTier(Path(root) / f"node-{rank}", "run", rank, world, HostTierOptions())
    peers = PeerTier(tier, place_replicas(Topology.from_mesh_shape(world, 1, 1), 1), timeout_s=TIMEOUT)
    out = Path(os.environ["PEER_TIMEOUT_OUT"])
    if rank == 1:  # frozen: never sends nor receives; alive until rank 0 is done (its side of the pair stays open)
        while not (out / "rank0.json").exists():
            time.sleep(0.1)
        return
    took = []
    for window in (0, 1):
        t0 = time.perf_counter()
        peers.push(window, None)  # a header only: what every rank sends when it has nothing new
        took.append(time.perf_counter() - t0)
    (out / "rank0.json.tmp").write_text(json.dumps({"took_s": took, "stopped": peers.stopped, "timeout_s": TIMEOUT}))
    (out / "rank0.json.tmp").rename(out / "rank0.json")


if __name__ == "__main__":
    main(sys.argv[1])
