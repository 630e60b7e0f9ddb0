import json
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Fault-free reference runs, cached per (world size, run spec) for the whole session: every recovery
    test compares against the same deterministic oracle, so there is no need to train it twice."""
    from torchmoe_ckpt.harness.launch import run_torchrun
    cache: dict = {}

    def get(world: int, run: dict):
        key = (world, json.dumps(run, sort_keys=True))
        if key not in cache:
            cache[key] = run_torchrun(world, {"run": run}, tmp_path_factory.mktemp("reference"))
        return cache[key]

    return get


@pytest.fixture(scope="session")
def one_rank_group():
    """A 1-rank gloo process group in the test process, for in-process tests of distributed code."""
    import socket

    import torch.distributed as dist

    from torchmoe_ckpt.harness.parallel import init_distributed
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    init_distributed()
    yield
    dist.destroy_process_group()
