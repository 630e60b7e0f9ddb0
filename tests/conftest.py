import json
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(tryfirst=True)  # before `-m "not matrix"` deselects
def pytest_collection_modifyitems(items):
    """The cases tests/matrix_moves.py lists (a kind the default suite covers) get the `matrix` marker."""
    from matrix_moves import moved  # tests/ is on sys.path for its conftest (rootdir-less import mode)

    for item in items:
        if moved(item.nodeid):
            item.add_marker(pytest.mark.matrix)


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Fault-free reference runs, cached per (world size, run spec) for the whole session: every recovery
    test compares against the same deterministic oracle, so there is no need to train it twice."""
    from torchmoe_harness.launch import run_torchrun

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
    import torch.distributed as dist

    from torchmoe_ckpt import init_process_group

    init_process_group("gloo")  # outside torchrun: a one-process group on an in-memory store
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def moto():
    """A real moto S3 server on 127.0.0.1 with the bucket `tmoe-bucket` (a MotoServer: .storage_options)."""
    from torchmoe_harness.servers import create_bucket, moto_server

    with moto_server() as server:
        create_bucket(server.storage_options, "tmoe-bucket")
        yield server


@pytest.fixture(scope="session")
def azurite():
    """A real Azurite blob server (installed into .azurite/ by `make setup`) with the container `tmoe`."""
    from torchmoe_harness.servers import azurite_server, create_container

    with azurite_server() as server:
        create_container(server.connection_string, "tmoe")
        yield server


_FAULTS: list[tuple[str, int, str]] = []  # (case, faults injected, outcome) from the failure tests


@pytest.fixture
def fault_summary():
    """Record one failure-test outcome: "recovered exactly", "refused with one line" (another run's state, or a
    state no rank can rebuild, refused at start, nothing loaded or overwritten), "started fresh" (a new run,
    nothing of another loaded), "ended within its timeout" (a hang bounded by the configured timeout), "failed
    loudly", "data lost" (a window some rank still held was not used: a
    fresh start or an older window) or "silently wrong"."""
    return lambda case, injected, outcome: _FAULTS.append((case, injected, outcome))


def pytest_terminal_summary(terminalreporter):
    if not _FAULTS:
        return
    count = lambda o: sum(1 for f in _FAULTS if f[2] == o)  # noqa: E731
    tr = terminalreporter
    tr.section("fault injection summary")
    for case, injected, outcome in _FAULTS:
        tr.write_line(f"  {case}: {injected} fault(s) injected -> {outcome}")
    tr.write_line(
        f"faults injected: {sum(f[1] for f in _FAULTS)}, jobs: {len(_FAULTS)}, recovered exactly: "
        f"{count('recovered exactly')}, refused with one line: {count('refused with one line')}, "
        f"started fresh: {count('started fresh')}, "
        f"ended within its timeout: {count('ended within its timeout')}, "
        f"failed loudly: {count('failed loudly')}, "
        f"data lost: {count('data lost')} (must be 0), "
        f"silently wrong: {count('silently wrong')} (must be 0)"
    )
