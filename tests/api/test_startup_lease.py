"""startup.start: a start refused after the tiers are open (here: the checkpointer's host-memory limit) gives the
object store's prefix up at once, so the corrected relaunch takes the lease without waiting out `lease_s`.
In-process, one rank, a real file:// store (the lease is a file in it), the host tier in /dev/shm."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest

from torchmoe_ckpt.capture.host_memory import HostMemoryLimitError
from torchmoe_ckpt.config import SparseConfig, TierConfig
from torchmoe_ckpt.ownership.store_lease import StoreLease
from torchmoe_ckpt.startup import StartupHooks, start
from torchmoe_harness.trainer import RunConfig, Trainer

LEASE_S = 60.0  # long: a lease left behind would make the relaunch wait ~90 s (acquire's deadline), not pass


@pytest.fixture
def shm():
    d = Path("/dev/shm") / f"torchmoe-ckpt-test-{uuid.uuid4().hex[:12]}"
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_refused_start_releases_the_store_lease_for_the_relaunch(tmp_path, shm, monkeypatch, one_rank_group):
    store = {"uri": f"file://{tmp_path / 'store'}", "lease_s": LEASE_S}
    seen = StoreLease(store["uri"], "t", None, LEASE_S, rank=1, job="observer")  # reads the lease file only

    def tiers(name: str) -> TierConfig:  # one host root per launch: the run lock is per host, the lease per store
        return TierConfig(root=str(shm / name), run_id="t", object_store=store)

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    t = Trainer(RunConfig(steps=4))
    held = []
    with pytest.raises(HostMemoryLimitError):  # refused in SparseCheckpointer, after build_tiers took the lease
        start(
            t,
            t.compute_dtype,
            SparseConfig(window=3, host_memory_limit="64 KiB"),
            tiers("a"),
            hooks=StartupHooks(on_tiers=held.append),
        )
    try:
        assert held and held[0].lease is not None  # the refused start did hold the lease ...
        assert seen.read() is None, seen.read()  # ... and gave it up: no lease left in the store
    finally:
        if held and held[0].lease is not None:
            held[0].lease.release()  # without the fix: stop its renewal thread (the assertion above failed)

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")  # the corrected relaunch: another torchrun launch
    t = Trainer(RunConfig(steps=4))
    got = start(t, t.compute_dtype, SparseConfig(window=3), tiers("b"))
    try:
        assert got.tiers is not None and got.tiers.lease is not None
        assert seen.read()["job"] == "torchrun:job-b"  # taken at once: the prefix was free
        assert got.resumed is not None and got.resumed.recovered_step is None  # nothing was written before
    finally:
        got.checkpointer.stop()
        got.tiers.release_store_lease()
