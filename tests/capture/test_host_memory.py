"""Host memory (host_memory.py, slot_pool.py, slot_alloc.py): every host byte the checkpointer holds is counted from
its owners and equals what is really allocated (arena sizes, and the /dev/shm bytes read from the file system);
a window start allocates nothing per item (nothing at all in steady state); a long run stays flat; the limit
refuses an over-budget plan with the figure (the SparseCheckpointer and the own-loop Checkpointer), caps auto W, and
refuses a window start that would go over it. In-process, one rank, the host tier in /dev/shm."""

from __future__ import annotations

import gc
import os
import re
import shutil
import uuid
import weakref
from pathlib import Path

import pytest
import torch
from support.tiny_moe import TOP_K, Net, batch_for, forward_backward  # tests/ is on sys.path under pytest

import torchmoe_ckpt as tmc
from torchmoe_ckpt.capture.file_slot_pool import _backings
from torchmoe_ckpt.capture.host_memory import HostMemoryLimitError, parse_bytes
from torchmoe_ckpt.config import CheckpointConfig, ConfigError, SparseConfig, TierConfig
from torchmoe_ckpt.persist.build_tiers import Tiers
from torchmoe_ckpt.recovery.resume import ResumeResult
from torchmoe_ckpt.sparse_checkpointer import DENSE_SETS, RunContext, SparseCheckpointer
from torchmoe_ckpt.storage_format.slot_files import backing
from torchmoe_ckpt.tiers.host_tier import HostTier
from torchmoe_harness.trainer import RunConfig, Trainer

FILE_PARTS = ("slot_sets", "window_files", "upload_backlog", "spares")


@pytest.fixture
def shm():
    """A run root in /dev/shm (what the host tier's bytes are), removed afterwards."""
    d = Path("/dev/shm") / f"torchmoe-ckpt-test-{uuid.uuid4().hex[:12]}"
    yield d
    shutil.rmtree(d, ignore_errors=True)


def du(root: Path) -> int:
    """What the file system says the files under `root` hold: allocated blocks, every inode once."""
    seen, total = set(), 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            st = os.lstat(os.path.join(dirpath, n))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def checkpointer(root, steps=40, window=3, arena=False, **sparse):
    t = Trainer(RunConfig(steps=steps))
    tier = None if root is None else HostTier(root, "run", 0, 1)
    # arena: the CUDA allocator (one arena per set, the tier copies it into its files), unpinned on CPU
    cfg = SparseConfig(window=window, host_buffers="arena" if arena else "auto", **sparse)
    ck = SparseCheckpointer(
        t.model, t.optimizer, t.compute_dtype, cfg, RunContext(tiers=None if tier is None else Tiers(tier, None, None))
    ).attach(t)
    return t, ck


def stop(ck):
    ck.flush()  # the last window committed and written, then the threads end (close() without the exit summary)
    ck.stop()


def arena_storages(ck) -> int:
    """Bytes of every distinct storage the arena allocator's slot items are views of (what is really allocated)."""
    seen = {}
    for s in ck.slots.sets:
        st = s.arena.t.untyped_storage()  # a set allocated ahead (prepare) has no slots assembled yet
        seen[st.data_ptr()] = st.nbytes()
        for sl in s.slots:
            for it in sl.items:
                st = it.buffer.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def deleted_but_mapped(root: Path) -> int:
    """Resident bytes of this process's mappings of files under `root` that were deleted (/proc/self/smaps): memory
    no directory shows."""
    total, cur = 0, ""
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:
            cur = line
        elif line.startswith("Rss:") and str(root) in cur and "(deleted)" in cur:
            total += int(head[1]) * 1024
    return total


@pytest.mark.parametrize(
    "arena, spares", [(False, 1), (True, 1), (True, 0)], ids=["shm-files", "arena+tier", "arena+tier-no-spares"]
)
def test_account_equals_what_is_allocated(shm, one_rank_group, arena, spares):
    t, ck = checkpointer(shm, window=3, arena=arena)
    ck.persist.tier.spare_windows = spares
    for step in range(1, 25):
        ck.after_step(t.train_step())
        if step % 4:
            continue
        ck.flush(commit=False)  # the persist thread idle: the files are what they are
        acct = ck.memory.account()
        parts = acct["parts"]
        assert acct["total"] == sum(parts.values()) > 0
        # /dev/shm: the run directory's blocks are exactly the slot sets' files plus the tier's other files
        assert sum(parts[k] for k in FILE_PARTS) - (arena and parts["slot_sets"]) == du(shm / "run"), (step, parts)
        assert deleted_but_mapped(shm) == parts["unlinked_mappings"] == 0  # nothing outside the directory
        if arena:  # the arenas: one allocation per set, every item a view into it
            assert parts["slot_sets"] == sum(s.arena.capacity for s in ck.slots.sets) == arena_storages(ck)
            # collected windows' files kept to be written over by the next window: at most one window's
            assert parts["spares"] <= ck.slots.file_bytes(ck.current.plan, 512)
        else:
            assert parts["spares"] == 0  # slot files are reused whole: no spares
        assert parts["replay_logs"] == sum(
            r.nbytes()
            for w in {id(w): w for w in (ck.current, ck.committed) if w}.values()
            for r in w.log.records.values()
        )
    assert ck.memory.account()["peak"] >= ck.memory.account()["total"]
    stop(ck)
    ck.persist.tier.collect(ck.committed.id + 1)  # a collect drops its files' mappings at once, spares or not
    assert deleted_but_mapped(shm) == ck.memory.account()["parts"]["unlinked_mappings"] == 0


def test_no_allocation_at_a_window_start_in_steady_state(one_rank_group, monkeypatch):
    t, ck = checkpointer(None, window=3)  # plain arenas (no tier), popularity reorders on
    calls = []
    real_empty = torch.empty

    def counting(*a, **kw):
        calls.append(a)
        return real_empty(*a, **kw)

    real = ck.slots.slots_for

    def slots_for(plan):
        monkeypatch.setattr(torch, "empty", counting)
        try:
            return real(plan)
        finally:
            monkeypatch.setattr(torch, "empty", real_empty)

    ck.slots.slots_for = slots_for
    per_start = []
    for step in range(1, 31):
        before = len(calls)
        ck.after_step(t.train_step())
        if ck.current is not None and ck.current.start_step == step:
            per_start.append(len(calls) - before)
    # the first window start allocates its arena (one call); the second set is allocated ahead, on the pool's
    # helper thread (pinning is slow on CUDA); then nothing, reorders included
    assert per_start[0] == 1 and per_start[1:] == [0] * (len(per_start) - 1), per_start
    assert ck.slots.allocations == 2 and ck.slots.prepared == 1
    assert ck.memory.account()["alloc_seconds"]["helper"] > 0
    stop(ck)


def test_a_growing_window_is_pinned_ahead_off_the_training_thread(one_rank_group):
    """W grows (here: the copy bandwidth drops to nothing): the next window's larger set is allocated a window
    ahead on the pool's helper thread (WindowPlanner.next_plan, slot_pool.prepare), never by the training thread at
    the window start (on CUDA that is seconds of pinning and a device-wide sync). Auto W with the bandwidth given,
    plain arenas, W = 1 first: a window start every step."""
    import dataclasses

    t, ck = checkpointer(None, window=None, bandwidth_bytes_per_s=1e15, policy="sparse")  # its subject is W
    ws = []
    for step in range(1, 8):
        if step == 3:  # a real config change: every later budget is 1 byte, so W goes as high as the rule allows
            ck.planner.cfg = dataclasses.replace(ck.planner.cfg, bandwidth_bytes_per_s=1.0)
        ck.after_step(t.train_step())
        if ck.current is not None and ck.current.start_step == step:
            ws.append(ck.current.plan.window)
    assert ws[:2] == [1, 1] and max(ws) > 1, ws  # W grew (one window after the change: agreed a window ahead)
    counts = ck.memory.account()["alloc_count"]
    # the first window start allocates its arena; every later set (the W = 1 spare, the grown ones) on the helper
    assert counts["training_thread"] == 1 and counts["helper"] >= 2, counts
    stop(ck)


def test_a_long_run_stays_flat(shm, one_rank_group):
    """45 windows with popularity reorders: unlimited, at most four slot sets (current, committed, the previous one
    retention keeps, one whose collect is pending at a window start); limited to the figure less the restart
    allowance, exactly three (a window start waits for the collect instead), and the total never moves after."""
    for limited in (False, True):
        t, ck = checkpointer(shm / str(limited), steps=90, window=2, host_memory_limit=1 << 40)
        need = ck.memory.plan_need(plan_for(ck, 2))
        # no restart here: the limit checked at window starts is the figure without the inherited window's share
        limit = ck.memory.limit = sum(need.values()) - need["inherited_window"] if limited else None
        totals, allocs, held = [], [], []
        for step in range(1, 91):
            ck.after_step(t.train_step())
            if ck.current is not None and ck.current.start_step == step:
                ck.flush(commit=False)
                totals.append(ck.memory.total())
                allocs.append(ck.slots.allocations)
                held.append(len(ck.slots.sets))
        settled = allocs.index(allocs[-1])
        # flat once every set exists
        assert set(totals[settled:]) == {totals[-1]} == {max(totals)}, (limit, allocs, totals)
        # a reorder may replace a set whose files do not fit it (an allocation, not a set more): count sets held
        assert max(held) <= 4 if limit is None else max(held) == 3 and max(totals) <= limit, (limit, held, allocs)
        assert ck.planner.reorders > 0 or limit is not None
        stop(ck)


def test_plan_changes_leave_no_memory_behind(shm, one_rank_group):
    """New plans (W 2..5) recycle and drop slot sets: a dropped set's files must not stay mapped (the copy engine's
    cache kept them: 41 MB of deleted /dev/shm files against 7 MB held in this run before the fix)."""
    t, ck = checkpointer(shm, steps=120, window=2)
    for step in range(1, 121):
        if step % 9 == 0:
            ck.cfg.window = 2 + (step // 9) % 4
        ck.after_step(t.train_step())
    ck.flush(commit=False)
    assert len({w.W for w in ck.counters.windows}) == 4
    assert deleted_but_mapped(shm) == ck.memory.account()["parts"]["unlinked_mappings"] == 0
    parts = ck.memory.account()["parts"]
    assert sum(parts[k] for k in FILE_PARTS) == du(shm / "run")
    stop(ck)


def test_a_recycled_set_keeps_its_mapped_files(shm, one_rank_group):
    """A new plan built from a free set's files: every new slot's `backing` is the file its buffers are views of (what
    the host tier links into a window and sums), one file per slot, and an old slot whose file was taken says so."""
    t, ck = checkpointer(shm, steps=4, window=2)
    files, ops, dtype = ck.slots.slot_files, ck.slots.ops, ck.slots.compute_dtype
    old = files.build(plan_for(ck, 2), ops, dtype)
    new = files.build(plan_for(ck, 3), ops, dtype, recycle=[old])
    taken = {b.path for b in map(backing, old) if b is not None and b.reused}
    assert taken, "no file of the free set was recycled"
    backs = [backing(s) for s in new]
    assert all(b is not None for b in backs) and len({b.path for b in backs}) == len(new)
    for s, b in zip(new, backs):
        assert os.stat(b.path).st_ino == os.fstat(b.fd).st_ino
        lo, hi = b.t.data_ptr(), b.t.data_ptr() + b.t.numel()
        assert all(lo <= it.buffer.data_ptr() and it.buffer.data_ptr() + it.nbytes <= hi for it in s.items), s.index
    assert taken <= {b.path for b in backs}
    stop(ck)


def test_limit_refuses_an_over_budget_plan_with_the_figure(shm, one_rank_group):
    t = Trainer(RunConfig(steps=40))
    with pytest.raises(HostMemoryLimitError) as err:
        SparseCheckpointer(
            t.model,
            t.optimizer,
            t.compute_dtype,
            SparseConfig(window=3, host_memory_limit="64 KiB"),
            RunContext(tiers=Tiers(HostTier(shm, "run", 0, 1), None, None)),
        )
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("host_memory_limit 64.0 KiB per rank is below"), msg
    for knob in ("window", "max_window", "replicas", "upload_backlog", "spare_windows"):
        assert knob in msg, knob
    figure = int(re.search(r"at least .* \((\d+) bytes\)", msg).group(1))
    # a run limited to that figure trains within it (a window start waits for the persist thread rather than
    # taking a fourth slot set)
    t, ck = checkpointer(shm / "capped", steps=40, window=3, host_memory_limit=figure)
    for _ in range(40):
        ck.after_step(t.train_step())
        assert ck.memory.total() <= figure
    assert ck.memory.need["total"] == figure
    stop(ck)


def test_limit_caps_auto_window(shm, one_rank_group):
    # policy "sparse": auto W of windows (under "auto" the policy itself may choose dense snapshots)
    t, free = checkpointer(
        None, window=None, bandwidth_bytes_per_s=1.0, policy="sparse"
    )  # a copy budget that wants the largest W
    for _ in range(3):
        free.after_step(t.train_step())
    big = free.counters.windows[-1].W
    stop(free)
    assert big >= 3
    t, probe = checkpointer(None, window=None, bandwidth_bytes_per_s=1.0, host_memory_limit=1 << 40, policy="sparse")
    need2 = sum(probe.memory.plan_need(plan_for(probe, 2)).values())
    stop(probe)
    t, ck = checkpointer(None, window=None, bandwidth_bytes_per_s=1.0, host_memory_limit=need2, policy="sparse")
    assert ck.planner.w_cap == 2 and ck.memory.need["window"] == 2
    for _ in range(8):
        ck.after_step(t.train_step())
    assert {w.W for w in ck.counters.windows} == {2}
    stop(ck)


def plan_for(ck, w):
    from torchmoe_ckpt.planning.schedule import plan_window

    full, comp = ck.planner.op_sizes()
    return plan_window(ck.planner.operator_order(), full, comp, float("inf"), forced_window=w, warn=False)


def test_window_start_over_the_limit_is_refused_with_the_parts(shm, one_rank_group):
    t, probe = checkpointer(None, window=3, host_memory_limit=1 << 40)
    limit = 2 * sum(probe.memory.plan_need(plan_for(probe, 3)).values())
    stop(probe)
    t, ck = checkpointer(shm, window=3, host_memory_limit=limit)
    junk = shm / "run" / "window-999999" / "slot-00" / "rank-00000" / "__0_0.distcp"  # the tier holds more
    junk.parent.mkdir(parents=True)
    with open(junk, "wb") as f:
        f.truncate(limit)
        os.posix_fallocate(f.fileno(), 0, limit)
    with pytest.raises(HostMemoryLimitError) as err:
        ck.after_step(t.train_step())
    msg = str(err.value)
    assert "\n" not in msg and "reached at the start of window 0" in msg and "window_files" in msg, msg
    assert ck.memory.drain_waits == 1
    stop(ck)


def test_inherited_window_is_let_go_at_the_next_commit(one_rank_group):
    t, ck = checkpointer(None, window=2)
    for _ in range(4):
        ck.after_step(t.train_step())
    win = ck.committed
    t2 = Trainer(RunConfig(steps=10))
    resumed = ResumeResult(win, win.start_step + win.plan.window - 1)  # as a recovery hands it over
    new = SparseCheckpointer(
        t2.model, t2.optimizer, t2.compute_dtype, SparseConfig(window=2), RunContext(resumed=resumed)
    )
    del resumed
    new.attach(t2)
    stop(ck)
    del ck
    held = new.memory.account()["parts"]["inherited_window"]
    assert held == sum(s.nbytes for s in win.slots) > 0
    ref = weakref.ref(win)
    del win
    for _ in range(4):
        new.after_step(t2.train_step())
    gc.collect()
    assert new.memory.account()["parts"]["inherited_window"] == 0 and ref() is None
    stop(new)


# ---- the own-loop Checkpointer ---------------------------------------------------------------------------------
def own_loop(root, limit, steps=12):
    model = Net(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    cfg = tmc.CheckpointConfig(
        tiers=TierConfig(root=str(root), run_id="own"),
        window=tmc.SparseConfig(window=3),
        router_top_k=TOP_K,
        host_memory_limit=limit,
    )
    ckpt = tmc.Checkpointer(model, opt, forward_backward(model), None, cfg)
    try:
        for step in range(ckpt.resume() + 1, steps + 1):
            ckpt.step(batch_for(step))
        return ckpt.stats()["host_memory"]
    finally:
        ckpt.close()


def test_own_loop_refuses_then_trains_within_the_limit(shm):
    with pytest.raises(HostMemoryLimitError) as err:
        own_loop(shm, "4 KiB")
    msg = str(err.value)
    assert "host_memory_limit 4.0 KiB per rank is below" in msg and "\n" not in msg
    figure = int(re.search(r"\((\d+) bytes\)", msg).group(1))
    acct = own_loop(shm / "b", figure)
    assert acct["limit"] == figure and 0 < acct["peak"] <= figure and acct["allocator"] == "shm-files"


def test_settings_are_checked():
    assert parse_bytes("64 GiB") == 64 << 30 and parse_bytes("1.5M") == 3 << 19 and parse_bytes(4096) == 4096
    for bad in ("lots", -1, 0, True, "12 XB"):
        with pytest.raises(ConfigError):
            parse_bytes(bad)
    cfg = CheckpointConfig(host_memory_limit="2 GiB")
    assert cfg.window.host_memory_limit == 2 << 30
    with pytest.raises(ConfigError, match="set twice"):
        CheckpointConfig(host_memory_limit="2 GiB", window=SparseConfig(host_memory_limit="1 GiB"))
    with pytest.raises(ConfigError, match="max_window"):
        SparseConfig(max_window=0)
    with pytest.raises(ConfigError, match="host_buffers"):
        SparseConfig(host_buffers="huge-pages")
    for name in ("upload_backlog", "spare_windows"):
        with pytest.raises(ConfigError, match=name):
            TierConfig(run_id="x", **{name: -1})


def test_torchtitan_section_maps_the_memory_settings():
    from titan_integration.sparse_config import JobConfigError, SparseCheckpointSection

    sec = SparseCheckpointSection.from_table(
        {"enable": True, "run_id": "r", "host_memory_limit": "8 GiB", "max_window": 5, "spare_windows": 0}
    )
    core = sec.core_config()
    assert core.host_memory_limit == 8 << 30 and core.max_window == 5
    assert sec.tiers_config() == {"root": "/dev/shm/torchmoe-ckpt", "run_id": "r", "replicas": 0, "spare_windows": 0}
    assert TierConfig.from_dict(sec.tiers_config()).spare_windows == 0
    assert SparseCheckpointSection.from_table({}).core_config().host_memory_limit is None
    for table, needle in (
        (
            {"host_memory_limit": "lots"},
            "host_memory_limit = 'lots': 'lots' is not a size: write bytes or e.g. '64 GiB'",
        ),
        ({"spare_windows": -1}, "spare_windows = -1: must be >= 0"),
        ({"upload_backlog": "4"}, "upload_backlog = '4': must be an integer"),
    ):
        with pytest.raises(JobConfigError) as err:
            SparseCheckpointSection.from_table(table)
        assert needle in str(err.value) and "; fix: " in str(err.value)


@pytest.mark.parametrize(
    "policy, window, reserved",
    [
        ("auto", None, DENSE_SETS),
        ("sparse", 1, DENSE_SETS),
        ("dense", None, DENSE_SETS),
        ("auto", 3, 0),
        ("sparse", 3, 0),
    ],
)
def test_dense_slot_sets_are_built_before_the_first_step(shm, one_rank_group, policy, window, reserved):
    """Where dense snapshots may be taken, their slot sets exist before training (a set built at a window start
    maps its pages on the training thread: ~0.5 s per 133 MB under training on this machine), mapped in whole; a
    dense snapshot every iteration then allocates nothing on the training thread. Windows asked for (a forced
    W >= 2, under "auto" too) reserve none."""
    t, ck = checkpointer(shm, steps=20, window=window, policy=policy)
    assert ck.slots.prepared == reserved and ck.slots.alloc_count["training_thread"] == 0
    for b in _backings(ck.slots.sets):  # allocated whole (a full /dev/shm fails here, not in a copy)
        assert os.fstat(b.fd).st_blocks * 512 >= b.t.numel()
    if window == 1:
        ck.force_policy("sparse")
        for _ in range(12):
            ck.after_step(t.train_step())
        assert ck.counters.slots == 12 and ck.slots.alloc_count["training_thread"] == 0
    stop(ck)


def test_a_reservation_stays_within_host_memory_limit(shm, one_rank_group):
    """Reserved sets are counted against host_memory_limit like any other (only those that fit are built), and a
    run at the construction check's own figure stays within it."""
    with pytest.raises(HostMemoryLimitError) as err:  # the check's own figure, from its message
        checkpointer(shm / "a", steps=4, window=1, policy="sparse", host_memory_limit=1)
    need = int(re.search(r"\((\d+) bytes\)", str(err.value)).group(1))
    t, ck = checkpointer(shm / "b", steps=10, window=1, policy="sparse", host_memory_limit=need)
    assert 1 <= ck.slots.prepared <= DENSE_SETS and ck.memory.total() <= need
    for _ in range(10):  # the reserved sets count like any other: the run stays within the limit
        ck.after_step(t.train_step())
        assert ck.memory.total() <= need
    assert ck.counters.windows_committed >= 8
    stop(ck)


def test_a_mapped_file_is_mapped_in_before_its_first_copy(shm):
    """map_file populates its pages (MADV_POPULATE_WRITE): the first copy into it takes no page faults (without,
    one per 4 KiB page). Skipped where the kernel lacks the call (older than 5.14)."""
    import resource

    from torchmoe_ckpt.storage_format.mapped_files import map_file, populate

    shm.mkdir(parents=True)
    fd = os.open(shm / "f", os.O_RDWR | os.O_CREAT, 0o644)
    mm, t = map_file(fd, 32 << 20)
    os.close(fd)
    if not populate(mm):
        pytest.skip("this kernel cannot populate a mapping (MADV_POPULATE_WRITE, Linux 5.14+)")
    src = torch.ones(32 << 20, dtype=torch.uint8)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    t.copy_(src)
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    assert faults < (32 << 20) // 4096 // 20, faults  # 8192 pages: without populate every one faults (measured)
    del t, mm
