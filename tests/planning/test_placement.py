"""Peer placement: copies only on other nodes, HSDP replicas first (0 bytes to send), optimal balanced load."""

import itertools
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchmoe_ckpt.planning.placement import Placement, Topology, place_replicas


@st.composite
def topologies(draw, max_ranks=12, max_nodes=4):
    """Any failure-domain map (uneven nodes included) with an HSDP replicate degree dividing the world."""
    n = draw(st.integers(1, max_ranks))
    domains = draw(st.lists(st.integers(0, max_nodes - 1), min_size=n, max_size=n))
    replicate = draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
    return Topology.from_failure_domains(domains, replicate)


def eligible(topo, rank):
    """(replicas on other nodes, non-replica ranks on other nodes) of `rank`."""
    other = [p for p in range(topo.world_size) if topo.node_of[p] != topo.node_of[rank]]
    same = [p for p in other if topo.shard_group_of[p] == topo.shard_group_of[rank]]
    return same, [p for p in other if p not in same]


def brute_force_best_max_load(topo, r):
    """Smallest possible max receive load over every placement that uses the available replicas first."""
    n = topo.world_size
    options = []
    for rank in range(n):
        reps, rest = eligible(topo, rank)
        need = min(r - min(r, len(reps)), len(rest))
        options.append(list(itertools.combinations(rest, need)))
    load, best = [0] * n, [n * r + 1]

    def search(i):
        if i == n:
            best[0] = min(best[0], max(load))
            return
        for combo in options[i]:
            if any(load[p] + 1 >= best[0] for p in combo):
                continue  # cannot beat the best found so far
            for p in combo:
                load[p] += 1
            search(i + 1)
            for p in combo:
                load[p] -= 1

    search(0)
    return best[0]


def check_invariants(topo, pl, r):
    n = topo.world_size
    for rank in range(n):
        peers = pl.peers[rank]
        assert len(set(peers)) == len(peers) and rank not in peers  # no duplicates, not itself
        assert all(topo.node_of[p] != topo.node_of[rank] for p in peers)  # never the owner's node
        reps, rest = eligible(topo, rank)
        assert set(pl.replica_peers[rank]) <= set(reps) and set(pl.send_peers[rank]) <= set(rest)
        assert sorted(pl.replica_peers[rank] + pl.send_peers[rank]) == list(peers)
        assert len(pl.replica_peers[rank]) == min(r, len(reps))  # replicas are used first
        assert len(peers) == min(r, len(reps) + len(rest))  # uses what exists...
        assert pl.shortfall[rank] == r - len(peers)  # ...and records the rest
    assert pl.load == tuple(sum(p in s for s in pl.send_peers) for p in range(n))  # sent copies only


@settings(max_examples=300, deadline=None)
@given(topologies(), st.integers(0, 4))
def test_invariants_on_any_topology(topo, r):
    pl = place_replicas(topo, r)
    check_invariants(topo, pl, r)
    for node in set(topo.node_of):
        expected = all(pl.peers[k] for k in range(topo.world_size) if topo.node_of[k] == node)
        assert pl.survives_node_loss(node, topo) == expected
    again = place_replicas(Topology(topo.world_size, list(topo.node_of), list(topo.shard_group_of)), r)
    assert again == pl  # deterministic: every rank computes the same placement


@settings(max_examples=150, deadline=None)
@given(topologies(max_ranks=6), st.integers(1, 3))
def test_max_load_is_the_brute_force_optimum(topo, r):
    assert max(place_replicas(topo, r).load) == brute_force_best_max_load(topo, r)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 12), st.integers(1, 8), st.integers(0, 3), st.data())
def test_even_nodes_get_copies_on_distinct_nodes_and_even_load(nodes, rpn, r, data):
    world = nodes * rpn
    replicate = data.draw(st.sampled_from([d for d in range(1, world + 1) if world % d == 0]))
    topo = Topology.from_mesh_shape(world, replicate, rpn)
    pl = place_replicas(topo, r)
    check_invariants(topo, pl, r)
    for _rank, peers in enumerate(pl.peers):  # as many failure domains as copies allow
        assert len({topo.node_of[p] for p in peers}) == min(len(peers), nodes - 1)
    assert max(pl.load) - min(pl.load) <= 1 or replicate > 1


def test_pure_fsdp_four_ranks_two_nodes_one_copy_each_balanced():
    pl = place_replicas(Topology.from_mesh_shape(4, 1, 2), 1)
    assert pl.peers == ((2,), (3,), (0,), (1,)) and pl.load == (1, 1, 1, 1)
    assert not any(pl.replica_peers) and pl.send_peers == pl.peers and pl.shortfall == (0, 0, 0, 0)


def test_hsdp_2x2_replicas_on_other_nodes_cover_r_with_nothing_to_send():
    topo = Topology.from_mesh_shape(4, 2, 2)  # shards (0, 1, 0, 1) on nodes (0, 0, 1, 1)
    pl = place_replicas(topo, 1)
    assert pl.replica_peers == ((2,), (3,), (0,), (1,)) and pl.peers == pl.replica_peers
    assert not any(pl.send_peers) and pl.load == (0, 0, 0, 0)
    pl2 = place_replicas(topo, 2)  # the replica first, then one sent copy on the other node
    assert pl2.replica_peers == pl.replica_peers and all(len(s) == 1 for s in pl2.send_peers)
    assert all(set(s).isdisjoint(rp) for s, rp in zip(pl2.send_peers, pl2.replica_peers))
    assert pl2.load == (1, 1, 1, 1)


def test_replicas_on_the_same_node_are_not_used():
    pl = place_replicas(Topology.from_mesh_shape(4, 2, 4), 1)  # HSDP 2x2 on one node
    assert not any(pl.peers) and pl.shortfall == (1, 1, 1, 1)


def test_single_node_has_only_shortfall_and_says_so():
    topo = Topology.from_env_hostnames(["gpu-a"] * 4, 1)
    pl = place_replicas(topo, 2)
    assert not any(pl.peers) and pl.shortfall == (2, 2, 2, 2) and pl.load == (0, 0, 0, 0)
    assert "r=2 cannot be met for ranks [0, 1, 2, 3]: only 0 other node(s)" in pl.describe()
    assert not pl.survives_node_loss(0, topo)


def test_fewer_other_ranks_than_r_uses_what_exists_and_says_so():
    topo = Topology.from_env_hostnames(["a", "b"], 1)
    pl = place_replicas(topo, 2)
    assert pl.peers == ((1,), (0,)) and pl.shortfall == (1, 1)
    assert "r=2 cannot be met for ranks [0, 1]: only 1 other node(s) (1 rank(s))" in pl.describe()
    assert all(pl.survives_node_loss(n, topo) for n in (0, 1))


def test_describe_flags_copies_that_share_a_node():
    pl = place_replicas(Topology.from_mesh_shape(4, 1, 2), 2)  # 2 nodes: both copies on the one other node
    text = pl.describe()
    assert "cannot be met" not in text and "share a node" in text
    assert text.splitlines()[1].startswith("rank 0 (node 0): replicas [] (0 bytes), sent to [2, 3]")


def test_three_even_nodes_r2_spreads_over_both_other_nodes():
    # a plain least-load-first greedy ends with some ranks' two copies on one node here
    topo = Topology.from_mesh_shape(24, 1, 8)
    pl = place_replicas(topo, 2)
    assert pl.load == (2,) * 24
    assert all(
        sorted(topo.node_of[p] for p in peers) == sorted({0, 1, 2} - {topo.node_of[k]})
        for k, peers in enumerate(pl.peers)
    )
    assert "share a node" not in pl.describe()


def test_rebalance_fixes_what_greedy_alone_gets_wrong():
    # three one-rank nodes, r=1: greedy gives 0->1, 1->0, 2->0 (max 2); the optimum is a cycle (max 1)
    assert place_replicas(Topology.from_failure_domains(["x", "y", "z"], 1), 1).load == (1, 1, 1)


def test_r0_places_nothing():
    topo = Topology.from_mesh_shape(8, 2, 2)
    pl = place_replicas(topo, 0)
    assert not any(pl.peers) and pl.shortfall == (0,) * 8 and pl.load == (0,) * 8
    assert not pl.survives_node_loss(0, topo)


def test_constructors_agree():
    by_mesh = Topology.from_mesh_shape(8, 2, 4)
    assert by_mesh.node_of == (0, 0, 0, 0, 1, 1, 1, 1) and by_mesh.shard_group_of == (0, 1, 2, 3) * 2
    assert Topology.from_env_hostnames(["h1"] * 4 + ["h0"] * 4, 2) == by_mesh  # ids by first appearance
    assert Topology.from_failure_domains(["rack7"] * 4 + [3] * 4, 2) == by_mesh
    assert place_replicas(by_mesh, 2) == place_replicas(Topology.from_env_hostnames(["a"] * 4 + ["b"] * 4, 2), 2)


@pytest.mark.parametrize(
    "bad",
    [
        lambda: Topology(3, (0, 0), (0, 1, 2)),
        lambda: Topology(2, (0, 1), (0,)),
        lambda: Topology(0, (), ()),
        lambda: Topology.from_mesh_shape(4, 3, 2),
        lambda: Topology.from_mesh_shape(4, 1, 0),
        lambda: Topology.from_env_hostnames(["a", "b", "c"], 2),
        lambda: place_replicas(Topology.from_mesh_shape(4, 1, 2), -1),
        lambda: place_replicas(Topology.from_mesh_shape(4, 1, 2), 1.5),
        lambda: place_replicas((4, 1, 2), 1),
    ],
)
def test_bad_input_is_one_clear_value_error(bad):
    with pytest.raises(ValueError, match="must|needs"):
        bad()


def test_large_job_is_fast_balanced_and_spread():
    topo = Topology.from_mesh_shape(1024, 1, 8)
    start = time.perf_counter()
    pl = place_replicas(topo, 2)
    assert time.perf_counter() - start < 5.0
    assert set(pl.load) == {2} and all(len({topo.node_of[p] for p in peers}) == 2 for peers in pl.peers)
    assert all(pl.survives_node_loss(node, topo) for node in range(128))
    assert isinstance(pl, Placement)
