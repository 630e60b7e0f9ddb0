"""The host tier's direct persist (storage_format/slot_files.py): on CPU a slot's buffers ARE its shared-memory data
file, so the snapshot copy is the persist. A committed window is never overwritten by a later one (the pool hands out
a set only once no window links its files), a failure while the next window is half-written recovers the
previous one bit-exactly, and after a process restart the files are read back (also by stock dcp.load)."""

import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchmoe_ckpt.config import SparseConfig
from torchmoe_ckpt.core.records import SlotInfo
from torchmoe_ckpt.dcp.raw_storage import RawReader, RawWriter
from torchmoe_ckpt.dcp.slot_planner import SlotSavePlanner
from torchmoe_ckpt.persist.build_tiers import Tiers
from torchmoe_ckpt.persist.persist_thread import FlushJob
from torchmoe_ckpt.sparse_checkpointer import RunContext, SparseCheckpointer
from torchmoe_ckpt.storage_format.layout import DATA_FILE
from torchmoe_ckpt.storage_format.slot_files import backing
from torchmoe_ckpt.tiers.host_tier import HostTier
from torchmoe_harness.trainer import RunConfig, Trainer

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast


def _checkpointer(root, window=3, steps=40):
    t = Trainer(RunConfig(steps=steps))
    tier = HostTier(root, "run", 0, 1)
    ck = SparseCheckpointer(
        t.model, t.optimizer, t.compute_dtype, SparseConfig(window=window), RunContext(tiers=Tiers(tier, None, None))
    )
    return t, tier, ck.attach(t)


def _inodes(slots) -> set[int]:
    return {os.stat(backing(s).path).st_ino for s in slots}


def _committed_inodes(tier: HostTier) -> dict[int, set[int]]:
    """Inodes of the committed windows' data files. The writer thread collects old windows meanwhile (manifest
    first, then the files): a file that vanished between listing and stat belongs to a collected window."""
    out: dict[int, set[int]] = {}
    for w in tier.window_ids():
        for f in tier.window_dir(w).glob("slot-*/rank-00000/*.distcp"):
            try:
                out.setdefault(w, set()).add(f.stat().st_ino)
            except FileNotFoundError:
                assert w not in tier.window_ids(), f"window {w} is committed but its file {f} is gone"
    return out


def _verified(tier: HostTier, step: int) -> None:
    """Every committed window verifies (one the writer collected while it was being read is no longer listed)."""
    for wid in tier.window_ids():
        problems = tier.verify(wid)
        assert problems == [] or wid not in tier.window_ids(), (step, wid, problems)


class _Gate:
    """A job that holds the host tier's writer thread until released (a slow writer, for real)."""

    def __init__(self):
        self.release = threading.Event()

    def set(self):
        self.release.wait(30)


def test_persist_links_the_snapshot_file_and_metadata_matches_a_dcp_save(tmp_path, one_rank_group):
    t, tier, ck = _checkpointer(tmp_path, steps=4)
    for _ in range(4):
        ck.after_step(t.train_step())
    ck.flush()
    assert tier.window_ids() == [0] and tier.verify(0) == []
    for s in ck.committed.slots:  # no second copy: the window's data file is the slot's own buffer file
        assert backing(s) is not None
        assert os.path.samefile(backing(s).path, tier.slot_dir(0, s.index) / DATA_FILE)
    # The once-pickled layout record unpickles to the Metadata a full DCP save through RawWriter writes.
    s = ck.committed.slots[1]
    info = SlotInfo(0, 1, 0, step=s.step)
    got = RawReader(tier.slot_dir(0, 1)).read_metadata()
    plain = tmp_path / "plain"
    dcp.save(
        {}, storage_writer=RawWriter(plain, checksum_algo="sum64b512"), planner=SlotSavePlanner(s, info), no_dist=True
    )
    want = RawReader(plain).read_metadata()
    assert got.state_dict_metadata == want.state_dict_metadata
    assert [(k, v.length, v.checksum) for k, v in got.storage_data.items()] == [
        (k, v.length, v.checksum) for k, v in want.storage_data.items()
    ]
    mine = got.planner_data["torchmoe_ckpt"]
    assert mine["window"] == 0 and mine["slot"] == 1 and mine["step"] == s.step
    assert sorted(mine["checksums"].values()) == sorted(v.checksum for v in got.storage_data.values())
    assert len(mine["checksums"]) == len(s.items)
    # stock dcp.load with our reader reads the persisted slot into a plain dict
    item = next(i for i in s.items if i.role == "master")
    full = torch.zeros(item.piece.global_shape)
    dcp.load({item.key: full}, storage_reader=RawReader(tier.slot_dir(0, 1)), no_dist=True)
    region = full[tuple(slice(o, o + n) for o, n in zip(item.piece.global_offset, item.piece.shape))]
    assert torch.equal(region, item.buffer)
    ck.stop()


def test_pool_never_hands_out_a_committed_windows_files(tmp_path, one_rank_group):
    t, tier, ck = _checkpointer(tmp_path, window=2, steps=30)
    gate = None
    for step in range(1, 31):
        if step == 9:  # the writer stalls for three windows: the sets still linked must not be reused meanwhile
            gate = _Gate()
            ck.persist.jobs.put(FlushJob(gate))  # a flush that holds the writer until released
        if step == 15:
            gate.release.set()
        ck.after_step(t.train_step())
        live = _inodes(ck.current.slots)
        for wid, inodes in _committed_inodes(tier).items():
            assert not inodes & live, f"step {step}: window {wid}'s files handed to window {ck.current.id}"
        _verified(tier, step)
    ck.flush()
    assert len(tier.window_ids()) >= 1 and all(tier.verify(w) == [] for w in tier.window_ids())
    # the stall made the pool allocate more sets; afterwards they rotate (not a new file per window: 15 windows)
    files = list((tmp_path / "run" / ".slots" / "rank-00000").glob("*.distcp"))
    assert 2 * 3 <= len(files) <= 2 * 7, len(files)
    ck.stop()


def test_failure_while_next_window_half_written_recovers_previous_bit_exactly(tmp_path, one_rank_group):
    t, tier, ck = _checkpointer(tmp_path, window=3, steps=20)
    want, gate = {}, _Gate()
    for step in range(1, 12):
        if step == 8:  # the writer stalls from here: window 1 is the last one it commits before the failure
            ck.flush(commit=False)
            ck.persist.jobs.put(FlushJob(gate))  # a flush that holds the writer until released
        ck.after_step(t.train_step())
        if ck.committed is not None and ck.committed.id not in want:  # what each window must read back as
            want[ck.committed.id] = [[it.buffer.clone() for it in s.items] for s in ck.committed.slots]
    # window 3 (steps 10..12) is half-captured into reused or new slot files; then the process "dies"
    ck.before_update()  # the copy in flight done, as the next update would wait for it
    ck.abandon()
    gate.release.set()
    assert ck.current.id == 3 and ck.current.captured == 2 and ck.committed.id == 2
    fresh = HostTier(tmp_path, "run", 0, 1)  # what a restarted process sees
    assert fresh.window_ids()[-1] == 1, fresh.window_ids()
    for wid in fresh.window_ids():  # every window still committed on the host reads back bit-exactly
        assert fresh.check(wid, ck.identity) == [], wid
        win = fresh.load_window(wid, ck.op_by_name, t.compute_dtype, ck.identity)
        for slot, bufs in zip(win.slots, want[wid]):
            assert all(torch.equal(it.buffer, b) for it, b in zip(slot.items, bufs))


RESTART = r"""
import os, sys, torch
from torchmoe_ckpt import init_process_group
from torchmoe_ckpt.config import SparseConfig
from torchmoe_ckpt.sparse_checkpointer import RunContext, SparseCheckpointer
from torchmoe_ckpt.tiers.host_tier import HostTier
from torchmoe_ckpt.persist.build_tiers import Tiers
from torchmoe_harness.trainer import RunConfig, Trainer
init_process_group("gloo")
t = Trainer(RunConfig(steps=8))
tier = HostTier(sys.argv[1], "run", 0, 1)
run = RunContext(tiers=Tiers(tier, None, None))
ck = SparseCheckpointer(t.model, t.optimizer, t.compute_dtype, SparseConfig(window=3), run)
ck.attach(t)
for _ in range(8):
    ck.after_step(t.train_step())
ck.flush(commit=False)
torch.save({"id": ck.committed.id, "slots": [[it.buffer.clone() for it in s.items] for s in ck.committed.slots]},
           sys.argv[2])
os._exit(0)  # no cleanup: the slot files stay behind as after a kill
"""


def test_host_files_are_read_back_after_a_process_restart(tmp_path, one_rank_group):
    out = tmp_path / "want.pt"
    subprocess.run(
        [sys.executable, "-c", RESTART, str(tmp_path), str(out)],
        check=True,
        timeout=50,
        env=dict(os.environ, MASTER_PORT=str(29500 + os.getpid() % 1000)),
    )
    want = torch.load(out)
    stale = list((tmp_path / "run" / ".slots" / "rank-00000").glob("*.distcp"))
    assert stale  # the dead process's slot files
    t, tier, ck = _checkpointer(tmp_path, steps=8)
    _ = tier.slot_files  # a new process takes over: the dead one's names go, its committed windows stay readable
    assert not any(p.exists() for p in stale)
    assert want["id"] in tier.window_ids() and tier.verify(want["id"]) == []
    win = tier.load_window(want["id"], ck.op_by_name, t.compute_dtype)
    for slot, bufs in zip(win.slots, want["slots"]):
        assert all(torch.equal(it.buffer, b) for it, b in zip(slot.items, bufs))
    item = next(i for i in win.slots[-1].items if i.role == "master")
    full = torch.zeros(item.piece.global_shape)
    dcp.load({item.key: full}, storage_reader=RawReader(tier.slot_dir(want["id"], 2)), no_dist=True)
    region = full[tuple(slice(o, o + n) for o, n in zip(item.piece.global_offset, item.piece.shape))]
    assert torch.equal(region, item.buffer)
    tier.collect(want["id"] + 1)  # collected: the windows' memory comes back (no spare kept for a direct run)
    assert tier.window_ids() == [] and not list((tmp_path / "run").glob(".spare/rank-00000/*.distcp"))
    ck.stop()


def test_a_new_plan_reuses_the_free_files_of_the_old_one_and_every_window_reads_back(tmp_path, one_rank_group):
    t, tier, ck = _checkpointer(tmp_path, window=3, steps=40)
    want = {}
    for step in range(1, 41):
        if step in (10, 22):  # W changes at the next window boundary: a new plan, new layouts (and back)
            ck.cfg.window = 2 if step == 10 else 3
        ck.after_step(t.train_step())
        live = _inodes(ck.current.slots)
        for wid, inodes in _committed_inodes(tier).items():
            assert not inodes & live, f"step {step}: window {wid}'s files handed to window {ck.current.id}"
        if ck.committed is not None and ck.committed.id not in want:
            want[ck.committed.id] = [[it.buffer.clone() for it in s.items] for s in ck.committed.slots]
        if step % 3 == 0:
            ck.flush(commit=False)
            for wid in tier.window_ids():  # recycled files: the padding is zero again, every item verifies
                win = tier.load_window(wid, ck.op_by_name, t.compute_dtype, ck.identity)
                for slot, bufs in zip(win.slots, want[wid]):
                    assert all(torch.equal(it.buffer, b) for it, b in zip(slot.items, bufs)), (step, wid)
    assert {w.W for w in ck.counters.windows} == {2, 3}
    files = list((tmp_path / "run" / ".slots" / "rank-00000").glob("*.distcp"))
    assert len(files) <= 2 * 6 * 3, len(files)  # bounded: sets rotate and are recycled across plans
    ck.stop()
