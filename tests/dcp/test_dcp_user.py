"""A DCP user's loop (examples/dcp_user.py): `dcp.save(sd, planner=SparseSavePlanner, storage_writer=<tier>)`
every iteration, a failure, then `dcp.load` with our planner and reader + sparse-to-dense, bit-exact
(torch.equal) against the fault-free run, under torchrun (2 ranks, gloo), FSDP2 and HSDP, for each tier."""

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

import torchmoe_ckpt as tmc
from torchmoe_ckpt.dcp.sparse_planner import dcp_key
from torchmoe_ckpt.model.operators import local_tensor
from torchmoe_harness.launch import torchrun

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "dcp_user.py")
STEPS = 12


def run(tmp: Path, name: str, *args: str, restarts: int = 0) -> tuple[list, str]:
    out = tmp / name
    log = torchrun(
        2,
        [EXAMPLE, "--steps", str(STEPS), "--out", str(out), *args],
        tmp / f"{name}.log",
        timeout=55,
        max_restarts=restarts,
    )
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)], log


def assert_bit_exact(ref: list, got: list) -> None:
    for r, (a, b) in enumerate(zip(ref, got)):
        bad = [k for k in a["state"] if not torch.equal(a["state"][k], b["state"][k])]
        assert not bad, f"rank {r}: {bad[:5]}"
        assert b["losses"] and all(torch.equal(a["losses"][s], b["losses"][s]) for s in b["losses"])


def tiers(tmp: Path, tier: str) -> list[str]:
    return ["--tier", tier, "--host", str(tmp / "shm"), "--store", f"file://{tmp / 'store'}"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache = {}

    def get(hsdp: int):
        if hsdp not in cache:
            tmp = tmp_path_factory.mktemp(f"dcp-ref-{hsdp}")
            cache[hsdp] = run(tmp, "ref", "--hsdp", str(hsdp), *tiers(tmp, "host"))[0]
        return cache[hsdp]

    return get


def test_sigkill_then_dcp_load_and_sparse_to_dense_is_bit_exact(tmp_path, reference):
    """FSDP2, tiered writer (host + store): rank 1 is SIGKILLed in iteration 9, torchrun restarts both."""
    got, log = run(tmp_path, "run", "--kill-at", "9", *tiers(tmp_path, "tiered"), restarts=1)
    assert "recovered window 1: state after iteration 6, 2 replayed" in log
    assert "SIGKILL" in log or "-9" in log
    assert sorted(got[0]["losses"]) == list(range(7, STEPS + 1))
    assert_bit_exact(reference(1), got)


@pytest.mark.parametrize(
    "hsdp,tier",
    [
        (2, "store"),
        pytest.param(1, "host", marks=pytest.mark.matrix),
        pytest.param(2, "tiered", marks=pytest.mark.matrix),
    ],
)
def test_stopped_job_resumes_from_the_tier_bit_exactly(tmp_path, reference, hsdp, tier):
    """The job stops after iteration 8 (window 2 incomplete); a new job loads window 1 and finishes."""
    args = ["--hsdp", str(hsdp), *tiers(tmp_path, tier)]
    run(tmp_path, "first", "--stop-at", "8", *args)
    if tier == "tiered":  # the node's shared memory is gone: the store's verified copy is read instead
        shutil.rmtree(tmp_path / "shm")
    got, log = run(tmp_path, "second", "--resume", *args)
    assert "recovered window 1: state after iteration 6" in log
    assert_bit_exact(reference(hsdp), got)


@pytest.mark.parametrize("hsdp", [pytest.param(2, id="hsdp"), pytest.param(1, id="fsdp2", marks=pytest.mark.matrix)])
def test_sigkill_and_wiped_host_memory_then_dcp_load_reads_the_peer_copy_bit_exactly(tmp_path, reference, hsdp):
    """Every iteration dcp.save through TieredWriter([HostWriter, PeerWriter, StoreWriter]) (each rank its own
    node); rank 1 is SIGKILLed in iteration 9 and comes back with empty shared memory: dcp.load through
    TieredReader([HostReader, PeerReader]) fetches its slots from rank 0's host memory (no store read)."""
    got, log = run(
        tmp_path, "run", "--hsdp", str(hsdp), "--kill-at", "9", "--wipe-host", *tiers(tmp_path, "peer"), restarts=1
    )
    assert "SIGKILL" in log or "-9" in log
    assert "rank 1: host memory wiped" in log
    assert "rank 1 fetched the copies of ranks [0, 1] from peers [0]" in log  # its own slot came from a peer
    assert "recovered window 1: state after iteration 6, 2 replayed" in log
    assert sorted(got[0]["losses"]) == list(range(7, STEPS + 1))
    assert_bit_exact(reference(hsdp), got)


def _saved_slot(tmp_path):
    """One rank (no process group): three iterations saved with our planner and writers, window W=3."""
    from torchmoe_ckpt.core.records import IterationRecord
    from torchmoe_harness.trainer import RunConfig, Trainer

    t = Trainer(RunConfig(steps=3, dtype="bf16"))
    sch = tmc.SparseSchedule(t.model, 3, t.compute_dtype)
    for step in (1, 2, 3):
        res = t.train_step()
        rec = IterationRecord(res.step, res.tokens, res.grad_norm, res.lr, res.loss, res.rng_state)
        m, o = get_state_dict(t.model, t.optimizer)
        writer = tmc.TieredWriter([tmc.HostWriter(tmp_path / "shm"), tmc.StoreWriter(f"file://{tmp_path}/store")])
        dcp.save(
            {"model": m, "optim": o},
            planner=tmc.SparseSavePlanner(sch, step, rec),
            storage_writer=writer,
            checkpoint_id=sch.slot_name(step),
        )
    return t, sch


def test_stock_dcp_load_with_our_reader_reads_a_slot_into_a_plain_dict(tmp_path, one_rank_group):
    t, sch = _saved_slot(tmp_path)
    slot = sch.slot_items(2)
    item = next(i for i in slot.items if i.role == "master")
    key = dcp_key(item)
    full = torch.zeros(item.piece.global_shape)
    # stock DefaultLoadPlanner, our reader: regions the slot does not hold stay untouched
    dcp.load({key: full}, storage_reader=tmc.HostReader(sch.slot_path(tmp_path / "shm", 3)))
    region = full[tuple(slice(o, o + s) for o, s in zip(item.piece.global_offset, item.piece.shape))]
    live = dict(t.model.named_parameters())[item.piece.fqn]
    assert torch.equal(region, local_tensor(live)[item.piece.local_slices])
    # the documented stock-reader path: our planner with DCP's own FileSystemWriter, read by stock dcp.load
    m, o = get_state_dict(t.model, t.optimizer)
    dcp.save({"model": m, "optim": o}, planner=tmc.SparseSavePlanner(sch, 3), checkpoint_id=tmp_path / "stock")
    again = torch.zeros(item.piece.global_shape)
    dcp.load({key: again}, checkpoint_id=tmp_path / "stock")
    assert torch.equal(again, full)


def test_corrupt_host_copy_is_never_loaded_and_the_store_copy_is_read(tmp_path, one_rank_group):
    t, sch = _saved_slot(tmp_path)
    data = next((tmp_path / "shm" / sch.slot_name(3)).glob("rank-*/*.distcp"))  # this writer's piece
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    slot = sch.slot_items(2, alloc=lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    with pytest.raises(BaseException, match="item checksums do not match"):  # DCP wraps it: CheckpointException
        dcp.load(
            {},
            storage_reader=tmc.HostReader(sch.slot_path(tmp_path / "shm", 3)),
            planner=tmc.SparseLoadPlanner(sch, 3, into=slot),
        )
    reader = tmc.TieredReader([tmc.HostReader(tmp_path / "shm"), tmc.StoreReader(f"file://{tmp_path}/store")])
    dcp.load(
        {}, storage_reader=reader, planner=tmc.SparseLoadPlanner(sch, 3, into=slot), checkpoint_id=sch.slot_name(3)
    )
    assert reader.source == 1 and "item checksums" in reader.skipped[-1]
    live = dict(t.model.named_parameters())
    it = next(i for i in slot.items if i.role == "master")
    assert torch.equal(it.buffer, local_tensor(live[it.piece.fqn])[it.piece.local_slices])


def test_peer_copy_commits_with_its_window_manifest_and_every_item_is_verified(tmp_path, one_rank_group):
    """One rank: the PeerReader reads a copy this node holds for a writer (as a peer keeps it, under `.peers/`,
    committed by the window manifest written last) when the writer's own copy is gone; a torn copy (no
    manifest) is not held; a flipped byte is refused."""
    from torchmoe_ckpt.core.records import IterationRecord
    from torchmoe_harness.trainer import RunConfig, Trainer

    t = Trainer(RunConfig(steps=3, dtype="bf16"))
    sch = tmc.SparseSchedule(t.model, 3, t.compute_dtype)
    placement = tmc.place_replicas(tmc.Topology.from_mesh_shape(1, 1, 1), r=0)
    host = tmp_path / "shm"
    for step in (1, 2, 3):
        res = t.train_step()
        rec = IterationRecord(res.step, res.tokens, res.grad_norm, res.lr, res.loss, res.rng_state)
        m, o = get_state_dict(t.model, t.optimizer)
        dcp.save(
            {"model": m, "optim": o},
            planner=tmc.SparseSavePlanner(sch, step, rec),
            storage_writer=tmc.PeerWriter(sch.slot_path(host, step), placement),
        )  # standalone (the torchrun cases: in a TieredWriter)
    copy = host / ".peers" / "rank-00000" / "from-rank-00000"  # as if a peer had sent it: this node lost its own
    copy.mkdir(parents=True)
    (host / "window-000000").rename(copy / "window-000000")
    assert tmc.held_copies(sch.slot_path(host, 3)) == {0: copy / "window-000000"}

    def load():
        slot = sch.slot_items(2, alloc=lambda shape, dtype: torch.zeros(shape, dtype=dtype))
        dcp.load(
            {}, storage_reader=tmc.PeerReader(sch.slot_path(host, 3)), planner=tmc.SparseLoadPlanner(sch, 3, into=slot)
        )
        return slot

    live = dict(t.model.named_parameters())
    for it in (i for i in load().items if i.role == "master"):
        assert torch.equal(it.buffer, local_tensor(live[it.piece.fqn])[it.piece.local_slices])
    data = copy / "window-000000" / "slot-02" / "rank-00000" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(BaseException, match="item checksums do not match"):
        load()
    (copy / "window-000000" / "MANIFEST.rank-00000.json").unlink()  # torn: files without the window manifest
    assert tmc.held_copies(sch.slot_path(host, 3)) == {}
    with pytest.raises(BaseException, match="no node holds a committed copy"):
        load()


def test_async_save_with_our_planner_and_writer_recovers_bit_exactly(tmp_path, one_rank_group):
    """dcp.async_save drives the same planner and writer (DCP stages the state dict, then writes off-thread)."""
    from torchmoe_ckpt.core.records import IterationRecord
    from torchmoe_harness.trainer import RunConfig, Trainer

    cfg = RunConfig(steps=6, dtype="bf16")
    t = Trainer(cfg)
    sch = tmc.SparseSchedule(t.model, 3, t.compute_dtype)
    pending = None
    for step in range(1, 7):
        res = t.train_step()
        if pending is not None:
            pending.result()
        rec = IterationRecord(res.step, res.tokens, res.grad_norm, res.lr, res.loss, res.rng_state)
        m, o = get_state_dict(t.model, t.optimizer)
        pending = dcp.async_save(
            {"model": m, "optim": o},
            planner=tmc.SparseSavePlanner(sch, step, rec),
            storage_writer=tmc.HostWriter(sch.slot_path(tmp_path, step)),
        )
    pending.result()
    fresh = Trainer(cfg)
    window = tmc.load_sparse_window(sch, 1, lambda s: tmc.HostReader(sch.slot_path(tmp_path, s)))
    rep = tmc.sparse_to_dense(fresh, window)
    assert rep.recovered_step == 6
    want, got = t.export_state(), fresh.export_state()
    assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.matrix
def test_store_writer_and_reader_on_s3(tmp_path, one_rank_group, moto):
    """The store tier on a real S3 API (moto server): storage options reach fsspec, metadata is put last."""
    from torchmoe_harness.trainer import RunConfig, Trainer

    t = Trainer(RunConfig(steps=1, dtype="bf16"))
    sch = tmc.SparseSchedule(t.model, 3, t.compute_dtype)
    t.train_step()
    m, o = get_state_dict(t.model, t.optimizer)
    uri = f"s3://tmoe-bucket/{tmp_path.name}/{sch.slot_name(1)}"
    dcp.save(
        {"model": m, "optim": o},
        planner=tmc.SparseSavePlanner(sch, 1),
        storage_writer=tmc.StoreWriter(uri, storage_options=moto.storage_options),
    )
    assert tmc.has_checkpoint(uri, moto.storage_options)
    slot = sch.slot_items(0, alloc=lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    dcp.load(
        {},
        storage_reader=tmc.StoreReader(uri, storage_options=moto.storage_options),
        planner=tmc.SparseLoadPlanner(sch, 1, into=slot),
    )
    live = dict(t.model.named_parameters())
    for it in (i for i in slot.items if i.role == "master"):
        assert torch.equal(it.buffer, local_tensor(live[it.piece.fqn])[it.piece.local_slices])


def test_cli_inspect_and_verify_read_a_dcp_users_checkpoint(tmp_path, one_rank_group, capsys):
    """A DCP user's `dcp.save` writes the layout and the window manifests the checkpointer writes, so the CLI
    checks it the same way, on the host tier and in the store: verify exits 0 while every byte verifies and 1
    once one data byte is flipped, naming the file."""
    from torchmoe_ckpt.ops.cli import main

    _saved_slot(tmp_path)
    for location in (str(tmp_path / "shm"), f"file://{tmp_path}/store"):
        assert main(["verify", location]) == 0, capsys.readouterr()
        capsys.readouterr()
        assert main(["inspect", location]) == 0
        out, _ = capsys.readouterr()
        assert "1 window(s)" in out and "window 0: verified; steps 1..3, W=3, ranks [0]/1" in out, out
        assert out.count("checksummed items") == 3, out  # every slot's items listed with their checksums
    data = next((tmp_path / "shm" / "window-000000" / "slot-01").glob("rank-*/*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    assert main(["verify", str(tmp_path / "shm")]) == 1
    _, err = capsys.readouterr()
    assert "window 0 rank 0: slot-01/rank-00000/__0_0.distcp: sum64b512" in err and "(corrupt)" in err, err


def test_a_corrupt_newest_window_falls_back_to_the_previous_one(tmp_path, reference):
    """What docs/dcp-user.md tells a DCP user to do when load_sparse_window raises CorruptItemError (no tier
    holds a verified copy of a slot): load the previous window; examples/dcp_user.py does it, bit-exactly."""
    run(tmp_path, "stopped", "--stop-at", "9", *tiers(tmp_path, "host"))
    data = max((tmp_path / "shm" / "window-000002" / "slot-01").glob("rank-*/*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    got, log = run(tmp_path, "resumed", "--resume", *tiers(tmp_path, "host"))
    assert "window 2 is unusable" in log and "falling back to window 1" in log, log[-3000:]
    assert "recovered window 1" in log, log[-3000:]
    assert_bit_exact(reference(1), got)
