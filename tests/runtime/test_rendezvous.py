"""Process groups across torchrun restarts and host replacement, on real TCPStores
(torchmoe_ckpt/runtime/distributed.py).

torchrun's agent hosts one store for every rendezvous round; each round's workers must see only their own keys
(torch >= 2.5 stopped prefixing them: a restart read the previous attempt's gloo addresses). A prefix from
TORCHELASTIC_RESTART_COUNT is not enough: each agent counts its own restarts, so a replacement host (0) and a
survivor (1) never met. Two real torchrun agents replacing a host: tests/recovery/test_node_replacement.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from torchmoe_ckpt.runtime.distributed import ROUND_STORE_KEY, round_store

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast

T = timedelta(seconds=20)


def _ranks(agent_port: int, seqs: list[int], restart_counts: list[int], delays: list[float]):
    """Every rank of one round in a thread (each with its own restart count and start delay: a rank may read
    the advertisement before rank 0 of its round has written it). Returns each rank's store."""
    import time

    out: dict[int, dist.Store] = {}
    errors: list[BaseException] = []

    def one(rank: int) -> None:
        try:
            time.sleep(delays[rank])
            os.environ["TORCHELASTIC_RESTART_COUNT"] = str(restart_counts[rank])  # per agent, and ignored
            agent = dist.TCPStore("127.0.0.1", agent_port, is_master=False, timeout=T)  # one client per process
            out[rank] = round_store(agent, "127.0.0.1", rank, len(seqs), T, seqs[rank])
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(seqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return out


def test_each_round_gets_a_store_of_its_own():
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T)
    # Round 0: both hosts start together.
    first = _ranks(agent.port, [0, 0], [0, 0], [0.0, 0.0])
    first[1].set("rank_1_address", "of round 0")
    assert first[0].get("rank_1_address") == b"of round 0"  # one store for the round
    del first  # round 0's rank 0 dies, and its store with it
    # Round 1: host 0 was replaced (restart count 0) while host 1 restarted (restart count 1), and rank 1 reads
    # the advertisement before the new rank 0 has written its own: the stale one names a dead server.
    second = _ranks(agent.port, [0, 0], [0, 1], [1.0, 0.0])
    assert not second[0].check(["rank_1_address"])  # nothing of round 0 is readable in round 1
    second[0].set("rank_0_address", "of round 1")
    assert second[1].get("rank_0_address") == b"of round 1"
    # The agent's store holds nothing but the advertisements: no group key a later round could read.
    assert all(k.startswith(ROUND_STORE_KEY) for k in agent.list_keys()), agent.list_keys()


def test_unshared_store_untouched(monkeypatch):
    """Without torchrun's shared agent store (torch's opt-out), each round already has a fresh store."""
    import importlib

    from torchmoe_ckpt.runtime.distributed import key_rendezvous_by_attempt

    rdzv = importlib.import_module("torch.distributed.rendezvous")
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=T)
    monkeypatch.setattr(rdzv, "_create_c10d_store", rdzv._create_c10d_store)  # restored after the test
    key_rendezvous_by_attempt()
    key_rendezvous_by_attempt()  # idempotent: one wrapper, not two
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert type(rdzv._create_c10d_store("127.0.0.1", server.port, 1, 2, T)) is dist.TCPStore
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # shared: a round store, not the agent's
    store = rdzv._create_c10d_store("127.0.0.1", server.port, 0, 1, T)
    store.set("rank_0", "x")
    assert not server.check(["rank_0"])


_LATE = """
import os, sys
import torch.distributed as dist
from torchmoe_ckpt.runtime.distributed import default_group_keyed, key_groups_by_attempt
dist.init_process_group("gloo")  # as TorchTitan's stock entry point does, before any override module is imported
assert not default_group_keyed()
assert key_groups_by_attempt() and default_group_keyed() and not key_groups_by_attempt()  # once
dist.new_group(backend="gloo")
print("ok")
"""


def test_a_default_group_made_before_us_keys_later_groups():
    """The stock entry point's fallback: TorchTitan made the default group unkeyed; every later group is keyed."""
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=T)
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(server.port),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT="1",
    )
    proc = subprocess.run([sys.executable, "-c", _LATE], env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "ok", proc.stderr[-3000:]
    keys = server.list_keys()
    default = [k for k in keys if "/torchmoe/" not in k]  # the default group's own (made before us)
    later = [k for k in keys if "/torchmoe/round-" in k]
    assert len(default) == 1 and later and len(default) + len(later) == len(keys), keys
