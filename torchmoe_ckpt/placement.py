"""Where each rank's copies go: r peers on *other* nodes (failure domains), HSDP replicas first.

This is MoEtion's Algorithm 2 with its two printed inconsistencies fixed: the "group" of a rank is the set
of ranks that hold the *same shard* (its HSDP replicas), not a pipeline column; and every choice respects
the receive load. A replica already holds a bit-identical copy of the shard, so choosing it costs no slot
bytes; other peers are chosen least-loaded first, so the largest receive load stays as small as the greedy
allows. A copy never goes to the owner's own node: losing that node would lose both.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    world_size: int
    node_of: tuple[int, ...]          # failure domain of each rank
    shard_group_of: tuple[int, ...]   # equal values = ranks holding a bit-identical shard (HSDP replicas)

    def __post_init__(self):
        if len(self.node_of) != self.world_size or len(self.shard_group_of) != self.world_size:
            raise ValueError(f"topology needs one node and one shard group per rank ({self.world_size} ranks)")

    @staticmethod
    def _shards(world_size: int, replicate: int) -> tuple[int, ...]:
        if replicate < 1 or world_size % replicate:
            raise ValueError(f"HSDP replicate degree {replicate} must divide the world size {world_size}")
        shard = world_size // replicate
        return tuple(rank % shard for rank in range(world_size))  # mesh (replicate, shard), row-major

    @staticmethod
    def from_mesh_shape(world_size: int, replicate: int, ranks_per_node: int) -> "Topology":
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
        return Topology(world_size, tuple(r // ranks_per_node for r in range(world_size)),
                        Topology._shards(world_size, replicate))

    @staticmethod
    def from_failure_domains(domains: list, replicate: int) -> "Topology":
        ids = {d: i for i, d in enumerate(dict.fromkeys(domains))}
        return Topology(len(domains), tuple(ids[d] for d in domains), Topology._shards(len(domains), replicate))

    @staticmethod
    def from_env_hostnames(hostnames: list[str], replicate: int) -> "Topology":
        return Topology.from_failure_domains(hostnames, replicate)


@dataclass(frozen=True)
class Placement:
    peers: tuple[tuple[int, ...], ...]
    replica_peers: tuple[tuple[int, ...], ...]
    send_peers: tuple[tuple[int, ...], ...]
    load: tuple[int, ...]            # copies each rank receives over the network
    shortfall: tuple[int, ...]       # copies each rank is missing (r could not be met on other nodes)

    def survives_node_loss(self, node: int, topo: Topology) -> bool:
        return all(any(topo.node_of[p] != node for p in self.peers[r])
                   for r in range(topo.world_size) if topo.node_of[r] == node)

    def describe(self) -> str:
        lines = [f"rank {r}: peers {list(p)} (replicas {list(rp)}, sent to {list(sp)})"
                 for r, (p, rp, sp) in enumerate(zip(self.peers, self.replica_peers, self.send_peers))]
        short = [r for r, s in enumerate(self.shortfall) if s > 0]
        if short:
            lines.append(f"requested copies cannot be placed on other nodes for ranks {short} "
                         f"(missing {max(self.shortfall)} at most): add nodes or lower replicas")
        return "\n".join(lines)


def place_replicas(topo: Topology, r: int = 2) -> Placement:
    if r < 0:
        raise ValueError(f"replicas must be >= 0, got {r}")
    n = topo.world_size
    load = [0] * n
    peers, replicas, sends, short = [], [], [], []
    for rank in range(n):
        others = [p for p in range(n) if topo.node_of[p] != topo.node_of[rank]]
        reps = [p for p in others if topo.shard_group_of[p] == topo.shard_group_of[rank]]
        # one copy per other node first (spreads failure domains), replicas before other ranks
        chosen: list[int] = []
        for p in sorted(reps, key=lambda p: (topo.node_of[p], p)):
            if len(chosen) < r and all(topo.node_of[c] != topo.node_of[p] for c in chosen):
                chosen.append(p)
        while len(chosen) < r:
            cands = [p for p in others if p not in chosen]
            if not cands:
                break
            used_nodes = [topo.node_of[c] for c in chosen]
            p = min(cands, key=lambda p: (used_nodes.count(topo.node_of[p]), p not in reps, load[p], p))
            chosen.append(p)
        send = [p for p in chosen if p not in reps]
        for p in send:
            load[p] += 1
        peers.append(tuple(chosen))
        replicas.append(tuple(p for p in chosen if p in reps))
        sends.append(tuple(send))
        short.append(r - len(chosen))
    return Placement(tuple(peers), tuple(replicas), tuple(sends), tuple(load), tuple(short))
