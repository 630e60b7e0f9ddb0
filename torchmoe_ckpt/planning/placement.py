"""Where each rank's peer copies go: r copies on ranks of *other* nodes, HSDP replicas first, balanced load.

MoEtion's Algorithm 2, its group being the ranks holding the same shard, never the owner's node (the failure
domain). Deterministic: 1. replica peers (no bytes sent); 2. greedy fill up to r by load; 3. rebalance along
alternating paths to receivers at <= max-2 (the max load is then optimal among replica-first placements); 4. spread
copies over nodes without raising the max.
"""

from __future__ import annotations

from bisect import insort
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


@dataclass(frozen=True)
class Topology:
    world_size: int
    node_of: tuple[int, ...]  # node id (failure domain) per rank
    shard_group_of: tuple[int, ...]  # equal value = bit-identical shard (HSDP replicas); all distinct in FSDP

    def __post_init__(self):
        object.__setattr__(self, "node_of", tuple(self.node_of))
        object.__setattr__(self, "shard_group_of", tuple(self.shard_group_of))
        _require(
            isinstance(self.world_size, int)
            and self.world_size >= 1
            and len(self.node_of) == self.world_size
            and len(self.shard_group_of) == self.world_size,
            f"Topology needs world_size >= 1 and one node id and one shard group per rank: "
            f"world_size={self.world_size!r}, {len(self.node_of)} node ids, "
            f"{len(self.shard_group_of)} shard groups",
        )

    @staticmethod
    def _mesh_groups(world_size: int, replicate: int) -> tuple[int, ...]:
        _require(
            isinstance(replicate, int) and replicate >= 1 and world_size >= 1 and world_size % replicate == 0,
            f"HSDP replicate degree {replicate!r} must be >= 1 and divide the world size {world_size}",
        )
        shard = world_size // replicate
        return tuple(rank % shard for rank in range(world_size))  # mesh (replicate, shard), row-major

    @staticmethod
    def from_mesh_shape(world_size: int, replicate: int, ranks_per_node: int) -> Topology:
        _require(
            isinstance(ranks_per_node, int) and ranks_per_node >= 1,
            f"ranks_per_node must be >= 1, got {ranks_per_node!r}",
        )
        groups = Topology._mesh_groups(world_size, replicate)
        return Topology(world_size, tuple(rank // ranks_per_node for rank in range(world_size)), groups)

    @staticmethod
    def from_failure_domains(domains: list, replicate: int) -> Topology:
        ids = {d: i for i, d in enumerate(dict.fromkeys(domains))}
        groups = Topology._mesh_groups(len(domains), replicate)
        return Topology(len(domains), tuple(ids[d] for d in domains), groups)

    @staticmethod
    def from_env_hostnames(hostnames: list[str], replicate: int) -> Topology:
        """`hostnames[rank]`, e.g. all-gathered `socket.gethostname()`: one host is one failure domain."""
        return Topology.from_failure_domains(list(hostnames), replicate)


@dataclass(frozen=True)
class Placement:
    peers: tuple[tuple[int, ...], ...]  # per rank: ranks holding a copy of its slots (not itself)
    replica_peers: tuple[tuple[int, ...], ...]  # subset of peers that are HSDP replicas: 0 bytes to send
    send_peers: tuple[tuple[int, ...], ...]  # subset of peers that must be sent the bytes
    load: tuple[int, ...]  # per rank: sent copies of other ranks it receives
    shortfall: tuple[int, ...]  # per rank: r - peers on other nodes (> 0: r not met)
    r: int = 0  # requested copies (for describe)
    node_of: tuple[int, ...] = ()  # the topology's failure domains (for describe)

    def survives_node_loss(self, node: int, topo: Topology) -> bool:
        """Every rank on `node` keeps at least one copy on another node."""
        return all(
            any(topo.node_of[p] != node for p in self.peers[rank])
            for rank in range(topo.world_size)
            if topo.node_of[rank] == node
        )

    def describe(self) -> str:
        node = self.node_of or tuple(range(len(self.peers)))
        lines = [
            f"placement: r={self.r} copies per rank on other nodes, {len(self.peers)} ranks on "
            f"{len(set(node))} node(s), max receive load {max(self.load, default=0)}"
        ]
        for rank, (rp, sp) in enumerate(zip(self.replica_peers, self.send_peers)):
            held = sorted({node[p] for p in rp + sp})
            lines.append(
                f"rank {rank} (node {node[rank]}): replicas {list(rp)} (0 bytes), sent to {list(sp)}, "
                f"copies on nodes {held}, receives {self.load[rank]}"
            )
        size, by_gap = Counter(node), {}
        for rank, s in enumerate(self.shortfall):
            if s > 0:  # group by (other nodes, ranks on them) so the report stays short
                by_gap.setdefault((len(size) - 1, len(node) - size[node[rank]]), []).append(rank)
        for (k_nodes, k_ranks), ranks in sorted(by_gap.items()):
            lines.append(
                f"r={self.r} cannot be met for ranks {ranks}: only {k_nodes} other node(s) "
                f"({k_ranks} rank(s)) outside their own, and copies never go to the owner's node; "
                f"{sum(self.shortfall[k] for k in ranks)} copies missing -- add nodes or lower r"
            )
        shared = [rank for rank, p in enumerate(self.peers) if len({node[q] for q in p}) < len(p)]
        if shared:
            lines.append(
                f"note: copies of ranks {shared} share a node (fewer other nodes than copies, or load "
                f"balance won): they survive fewer simultaneous node losses than their copy count"
            )
        return "\n".join(lines)


def place_replicas(topo: Topology, r: int = 2) -> Placement:
    """Algorithm 2: which peers hold each rank's copies (the module doc gives the steps).

    Args:
        topo: the ranks' nodes (failure domains) and HSDP shard groups.
        r: copies of each rank's windows, on other nodes (>= 0).

    Returns:
        The placement: each rank's peers (HSDP replicas first), the load on every receiver, and the shortfall
        where fewer than r eligible peers exist.

    Raises:
        ValueError: `topo` is not a Topology, or `r` is not an integer >= 0.
    """
    _require(isinstance(topo, Topology), f"place_replicas needs a Topology, got {type(topo).__name__}")
    _require(isinstance(r, int) and not isinstance(r, bool) and r >= 0, f"r must be an integer >= 0, got {r!r}")
    n, node, group = topo.world_size, topo.node_of, topo.shard_group_of

    def ok(o: int, p: int) -> bool:  # p may receive a sent copy of o: another node, not a replica (those are free)
        return node[p] != node[o] and group[p] != group[o]

    def cands(o: int):
        return (p for p in range(n) if ok(o, p))

    replicas = _replicas_first(n, node, group, r)
    n_other = len(set(node)) - 1
    load, sends = _least_loaded_sends(n, node, n_other, ok, replicas, r)
    _rebalance(n, cands, sends, load)
    _NodeSpreader(n, node, group, n_other, cands, replicas, sends, load).run()

    peers = tuple(tuple(sorted(replicas[o] + sends[o])) for o in range(n))
    replica_peers, send_peers = (tuple(tuple(sorted(x)) for x in xs) for xs in (replicas, sends))
    return Placement(peers, replica_peers, send_peers, tuple(load), tuple(r - len(p) for p in peers), r, node)


def _replicas_first(n: int, node, group, r: int) -> list[list[int]]:
    """Step 1: each rank's HSDP replicas on other nodes (they hold the same data: a copy there is free), up to r,
    spread over nodes."""
    members: dict[int, list[int]] = {}
    for p in range(n):
        members.setdefault(group[p], []).append(p)
    replicas: list[list[int]] = []
    for o in range(n):
        pool = [p for p in members[group[o]] if node[p] != node[o]]
        chosen: list[int] = []
        while len(chosen) < min(r, len(pool)):
            count = Counter(node[q] for q in chosen)
            chosen.append(min((p for p in pool if p not in chosen), key=lambda p: (count[node[p]], p)))
        replicas.append(chosen)
    return replicas


def _least_loaded_sends(n: int, node, n_other: int, ok, replicas, r: int) -> tuple[list[int], list[list[int]]]:
    """Step 2: the copies still missing, each sent to the least-loaded eligible rank on the node holding the fewest
    of the owner's copies. by_load[L] = ranks receiving L copies, ascending: the scan stops at the first rank whose
    node holds the fewest possible of o's copies, so a pick costs ~(r+1) nodes' ranks, not the world. Returns
    (load per receiver, receivers per owner)."""
    load, sends, by_load = [0] * n, [[] for _ in range(n)], [list(range(n))]
    for o in range(n):
        while len(replicas[o]) + len(sends[o]) < r:
            count = Counter(node[q] for q in replicas[o] + sends[o])
            floor = min(count.values(), default=0) if len(count) >= n_other else 0  # fewest copies any node can hold
            best = _least_loaded(by_load, o, count, floor, node, ok, sends)
            if best is None:
                break  # fewer eligible ranks than r: recorded as shortfall
            by_load[load[best]].remove(best)
            load[best] += 1
            if load[best] == len(by_load):
                by_load.append([])
            insort(by_load[load[best]], best)
            sends[o].append(best)
    return load, sends


def _least_loaded(by_load, o: int, count: Counter, floor: int, node, ok, sends) -> int | None:  # noqa: PLR0913  (Step 2's state, read only)
    """The receiver of o's next copy: the lowest load first, then the node with the fewest of o's copies (a rank
    on a node at `floor` ends the scan). None: no eligible rank."""
    best = None
    for bucket in by_load:
        for p in bucket:
            if ok(o, p) and p not in sends[o] and (best is None or count[node[p]] < count[node[best]]):
                best = p
                if count[node[p]] == floor:
                    break
        if best is not None:
            break
    return best


def _rebalance(n, cands, sends, load) -> None:
    """Step 3: apply alternating paths from a max-loaded receiver to one with load <= max-2 (see module doc)."""
    while load and max(load) - min(load) >= 2:  # otherwise no receiver has load <= max-2: already optimal
        top = max(load)
        holders: list[list[int]] = [[] for _ in range(n)]
        for o, s in enumerate(sends):
            for p in s:
                holders[p].append(o)
        prev: dict[int, tuple[int, int] | None] = {v: None for v in range(n) if load[v] == top}
        queue, target = deque(prev), None
        while queue and target is None:  # BFS over receivers: deterministic order, shortest paths
            v = queue.popleft()
            for o, u in ((x, u) for x in holders[v] for u in cands(x)):
                if u in prev or u in sends[o]:
                    continue
                prev[u] = (v, o)
                if load[u] <= top - 2:
                    target = u
                    break
                queue.append(u)
        if target is None:
            return  # no improving path: max load is optimal
        u = target
        step = prev[u]
        while step is not None:  # back along the path: each owner sends one copy one node further
            v, o = step
            sends[o][sends[o].index(v)] = u
            load[v] -= 1
            load[u] += 1
            u = v
            step = prev[u]


@dataclass(frozen=True)
class _Move:
    """One copy moving: `owner`'s copy held by receiver `src` goes to receiver `dst`."""

    owner: int
    src: int
    dst: int


class _NodeSpreader:
    """Step 4: give owners' copies more distinct nodes, without raising the max receive load.

    The situation it repairs: owner o holds two copies on one node (one of them at receiver v) while another node
    holds none of o's copies. Moving v's copy to a receiver u on the empty node adds a failure domain to o. When
    every such u is already at the max load, u passes one of the copies it holds on to another receiver (its owner
    x keeping or gaining nodes), and so on: a chain of moves found breadth-first, ending at a receiver below the
    max load (or at v, whose load the first move lowered). A chain is kept only if o gains a node, no owner on the
    chain loses one, no owner ends with two copies on one receiver, and the max load is unchanged. Each kept chain
    adds a node to some owner and takes none away, so the loop ends.
    """

    def __init__(  # noqa: PLR0913  (Steps 1-3's results, handed on)
        self,
        n: int,
        node: tuple[int, ...],  # per rank: its node (failure domain)
        group: tuple[int, ...],  # per rank: its HSDP shard group
        n_other: int,  # nodes other than any rank's own: the most distinct nodes an owner's copies can reach
        cands: Callable[[int], Iterable[int]],  # owner -> receivers eligible for a sent copy of it
        replicas: list[list[int]],  # Step 1: per owner, its replica peers (never moved)
        sends: list[list[int]],  # Steps 2-3: per owner, the receivers sent its copies (moved here, in place)
        load: list[int],  # per receiver: sent copies it holds (updated in place)
    ) -> None:
        self.n, self.node, self.group, self.n_other, self.cands = n, node, group, n_other, cands
        self.replicas, self.sends, self.load = replicas, sends, load
        self.top = max(load, default=0)  # the max load that Step 3 reached: never exceeded here
        self.holders: list[set[int]] = [set() for _ in range(n)]  # per receiver: owners whose copy it holds
        for owner, receivers in enumerate(sends):
            for receiver in receivers:
                self.holders[receiver].add(owner)
        self.spread = [self._nodes_of(owner) for owner in range(n)]  # per owner: copies per node

    def run(self) -> None:
        changed = True
        while changed:
            changed = False
            for owner in range(self.n):
                while self._improve(owner):
                    changed = True

    def _nodes_of(self, owner: int) -> Counter:
        return Counter(self.node[q] for q in self.replicas[owner] + self.sends[owner])

    def _improve(self, owner: int) -> bool:
        """One kept chain that adds a node to `owner`'s copies; False when none exists."""
        count = self.spread[owner]
        if len(count) >= self.n_other:
            return False  # already a copy on every other node
        for doubled in [v for v in self.sends[owner] if count[self.node[v]] >= 2]:
            chain = self._find_chain(owner, doubled, count)
            if chain is not None and self._apply_if_kept(owner, count, chain):
                return True
        return False

    def _find_chain(self, owner: int, doubled: int, count: Counter) -> list[_Move] | None:
        """Breadth-first over receivers: the first moves go from `doubled` to a receiver on a node without
        `owner`'s copies; each further move takes one copy off a receiver reached by the previous one."""
        # came_from[b] = (receiver a, owner x): x's copy moved from a to b
        came_from = {
            u: (doubled, owner)
            for u in sorted(self.cands(owner), key=lambda u: (self.load[u], u))
            if count[self.node[u]] == 0
        }
        end = next((u for u in came_from if self.load[u] < self.top), None)
        queue = deque(came_from)
        unvisited: dict[int, dict[int, None]] = {}  # per node, the receivers no move has reached (ordered)
        for b in range(self.n):
            if b not in came_from:
                unvisited.setdefault(self.node[b], {})[b] = None
        while queue and end is None:
            a = queue.popleft()
            for move in self._moves_off(owner, a, unvisited):
                del unvisited[self.node[move.dst]][move.dst]
                came_from[move.dst] = (a, move.owner)
                if self.load[move.dst] < self.top or move.dst == doubled:
                    end = move.dst
                    break
                queue.append(move.dst)
        if end is None:
            return None
        moves: list[_Move] = []
        b = end
        while not moves or moves[-1].owner != owner:  # walk back to owner's own move, the chain's first
            a, x = came_from[b]
            moves.append(_Move(x, a, b))
            b = a
        return moves

    def _moves_off(self, owner: int, a: int, unvisited: dict[int, dict[int, None]]) -> Iterator[_Move]:
        """Copies receiver `a` holds (other owners' than `owner`) that may move to an unvisited receiver without
        costing their owner a node: to the same node, off a node holding two of its copies, or onto a node
        holding none; never to the owner's own node, to a receiver already holding its copy, or to a replica."""
        for x in sorted(self.holders[a] - {owner}):
            copies_of_x = self.spread[x]
            for nd in [
                nd
                for nd in unvisited
                if nd != self.node[x] and (nd == self.node[a] or copies_of_x[self.node[a]] > 1 or copies_of_x[nd] == 0)
            ]:
                for b in [b for b in unvisited[nd] if b not in self.sends[x] and self.group[b] != self.group[x]]:
                    yield _Move(x, a, b)

    def _apply_if_kept(self, owner: int, count: Counter, moves: list[_Move]) -> bool:
        """Apply the chain; keep it if the acceptance test holds (the class docstring), else undo it."""
        before = {m.owner: (list(self.sends[m.owner]), self.spread[m.owner]) for m in moves}
        for m in moves:
            self.sends[m.owner][self.sends[m.owner].index(m.src)] = m.dst
            self.load[m.src], self.load[m.dst] = self.load[m.src] - 1, self.load[m.dst] + 1
        for x in before:
            self.spread[x] = self._nodes_of(x)
        kept = (
            len(self.spread[owner]) > len(count)
            and max(self.load) <= self.top
            and all(
                len(set(self.sends[x])) == len(self.sends[x]) and len(self.spread[x]) >= len(old_count)
                for x, (_, old_count) in before.items()
            )
        )
        if kept:
            for m in moves:
                self.holders[m.src].discard(m.owner)
                self.holders[m.dst].add(m.owner)
            return True
        for m in moves:  # rejected (an owner repeated on the chain): undo
            self.load[m.src], self.load[m.dst] = self.load[m.src] + 1, self.load[m.dst] - 1
        for x, (old_sends, old_count) in before.items():
            self.sends[x], self.spread[x] = old_sends, old_count
        return False
