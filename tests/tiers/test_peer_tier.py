"""Peer tier: each committed window reaches r peers on other nodes (nodes emulated by separate host
directories on this machine). Losing a node wipes its directory; its ranks pull their window back from
their peers and recovery is still bit-exact. Under HSDP the peers are replicas: no slot data is sent."""

import pytest

from torchmoe_harness.launch import compare, run_torchrun

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast


def spec(root, hsdp, lose_node=1, steps=12, dtype="fp32"):
    return {
        "run": {"steps": steps, "hsdp": hsdp, "dtype": dtype},
        "checkpoint": {"window": 3},
        "failures": [{"step": 9, "phase": "update", "lose_node": lose_node}],
        "host_tier": {"root": str(root), "run_id": "t", "ranks_per_node": 2, "replicas": 1},
    }


@pytest.mark.parametrize(
    "hsdp", [pytest.param(1, id="fsdp-r1", marks=pytest.mark.matrix), pytest.param(2, id="hsdp2x2")]
)
def test_node_loss_recovers_from_peers(tmp_path, reference, hsdp):
    ref = reference(4, {"steps": 12, "hsdp": hsdp, "dtype": "fp32"})
    run = run_torchrun(4, spec(tmp_path / "shm", hsdp), tmp_path / "run")
    rec = run.report["recoveries"][0]
    assert rec["lost"].startswith("node 1") and not rec.get("cold_start"), rec
    # ranks 2 and 3 lived on node 1: they got their window back from a peer on node 0
    assert set(rec["pulled_from_peers"]) == {"2", "3"}
    assert all(int(h) in (0, 1) for h in rec["pulled_from_peers"].values())
    peers = run.report["checkpoint"]["peers"]
    assert peers["windows_replicated"] >= 1
    if hsdp == 2:
        # the replica on the other node already holds the identical shard: only small files travel
        assert peers["data_bytes_sent"] == 0 and peers["replica_verified"] >= 1 and peers["replica_mismatch"] == 0
    else:
        assert peers["data_bytes_sent"] == peers["replicas"] * peers["own_data_bytes"] > 0  # r x slot bytes
    cmp = compare(ref, run)
    assert cmp.bit_exact, cmp.mismatches[:10]
