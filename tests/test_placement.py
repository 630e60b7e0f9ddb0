"""Peer placement: copies only on other nodes, HSDP replicas first (0 bytes to send), balanced load."""
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchmoe_ckpt.placement import Topology, place_replicas


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([(2, 1), (4, 1), (4, 2), (8, 2), (8, 4), (6, 3), (6, 2)]), st.sampled_from([1, 2, 3]),
       st.integers(0, 3))
def test_copies_never_on_the_owners_node_and_replicas_first(shape, rpn, r):
    world, rep = shape
    topo = Topology.from_mesh_shape(world, rep, rpn)
    pl = place_replicas(topo, r)
    for rank in range(world):
        peers = pl.peers[rank]
        assert len(set(peers)) == len(peers) and rank not in peers
        assert all(topo.node_of[p] != topo.node_of[rank] for p in peers)
        assert set(pl.replica_peers[rank]) | set(pl.send_peers[rank]) == set(peers)
        assert all(topo.shard_group_of[p] == topo.shard_group_of[rank] for p in pl.replica_peers[rank])
        reps_available = [p for p in range(world)
                          if topo.node_of[p] != topo.node_of[rank] and topo.shard_group_of[p] == topo.shard_group_of[rank]]
        assert len(pl.replica_peers[rank]) == min(r, len(reps_available))  # replicas are used first
        others = {p for p in range(world) if topo.node_of[p] != topo.node_of[rank]}
        assert pl.shortfall[rank] == r - min(r, len(others))
    assert sum(pl.load) == sum(len(s) for s in pl.send_peers)
    if all(len(p) for p in pl.peers):
        assert all(pl.survives_node_loss(n, topo) for n in set(topo.node_of))
    assert place_replicas(topo, r) == pl  # deterministic


def test_pure_fsdp_two_nodes_one_copy_each_balanced():
    pl = place_replicas(Topology.from_mesh_shape(4, 1, 2), 1)
    assert pl.peers == ((2,), (3,), (0,), (1,)) and pl.load == (1, 1, 1, 1) and not any(pl.replica_peers)


def test_hsdp_replicas_on_other_nodes_cover_r_with_nothing_to_send():
    pl = place_replicas(Topology.from_mesh_shape(4, 2, 2), 1)
    assert pl.replica_peers == ((2,), (3,), (0,), (1,)) and not any(pl.send_peers) and pl.load == (0, 0, 0, 0)


def test_single_node_cannot_meet_r_and_says_so():
    pl = place_replicas(Topology.from_mesh_shape(4, 1, 4), 2)
    assert pl.shortfall == (2, 2, 2, 2) and not any(pl.peers)
    assert "cannot be placed on other nodes" in pl.describe()


def test_max_load_is_within_one_of_the_best_assignment():
    topo = Topology.from_mesh_shape(6, 1, 2)  # 3 nodes of 2 ranks
    pl = place_replicas(topo, 2)
    options = [[p for p in range(6) if topo.node_of[p] != topo.node_of[r]] for r in range(6)]
    best = min(max(sum(p in c for c in choice) for p in range(6))
               for choice in itertools.product(*[list(itertools.combinations(o, 2)) for o in options]))
    assert max(pl.load) <= best + 1


def test_bad_input_is_one_clear_error():
    with pytest.raises(ValueError, match="divide"):
        Topology.from_mesh_shape(4, 3, 2)
    with pytest.raises(ValueError, match="replicas"):
        place_replicas(Topology.from_mesh_shape(4, 1, 2), -1)
