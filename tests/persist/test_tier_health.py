"""A host tier that cannot write (a REAL full tmpfs, a read-only remount) is a visible health state: one
warning per change of state with the reason, a counter, no half-written window left behind, retry with
backoff, and once the tier can write again new windows commit again. The stall policy warns or ends the job
(in the training thread) when no window commits durably for N iterations."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.events import Event, find

from torchmoe_ckpt.config import ConfigError, SparseConfig, TierConfig
from torchmoe_ckpt.model.operators import discover_operators
from torchmoe_ckpt.persist.build_tiers import Tiers, build_tiers
from torchmoe_ckpt.persist.tier_health import CheckpointStallError
from torchmoe_ckpt.sparse_checkpointer import RunContext, SparseCheckpointer
from torchmoe_ckpt.storage_format.layout import manifest_name, writer_name
from torchmoe_harness.trainer import RunConfig, Trainer

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast


@pytest.fixture
def tmpfs(tmp_path):
    """A real 8 MiB tmpfs (root only): a full disk is a full disk, not a mock."""
    d = tmp_path / "mnt"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8M", "tmpfs", str(d)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield d
    subprocess.run(["umount", "-l", str(d)], capture_output=True)


def _checkpointer(root: Path, **policy):
    t = Trainer(RunConfig(steps=60))
    tiers = build_tiers(TierConfig(root=str(root), run_id="run", **policy), 0, 1)
    ck = SparseCheckpointer(t.model, t.optimizer, t.compute_dtype, SparseConfig(window=3), RunContext(tiers=tiers))
    return t, ck.attach(t), tiers.host


def _steps(t, ck, n: int) -> None:
    for _ in range(n):
        ck.after_step(t.train_step())


def _fill(mnt: Path) -> Path:
    filler = mnt / "filler"
    subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k"], capture_output=True)
    return filler


def _events(caplog, name: str) -> list[Event]:
    return find(caplog.text, name)


def test_full_tmpfs_is_visible_cleaned_and_checkpointing_resumes(tmpfs, one_rank_group, caplog):
    caplog.set_level(logging.WARNING)
    t, ck, tier = _checkpointer(tmpfs)
    _steps(t, ck, 7)  # windows 0 and 1 commit while there is space
    ck.flush(commit=False)
    assert ck.persist.persisted == {0, 1}
    filler = _fill(tmpfs)  # the disk is full now
    _steps(t, ck, 12)
    ck.flush(commit=False)
    st = ck.stats()["host_tier"]["health"]
    assert st["state"] == "failing" and st["failed_writes"] >= 1, st
    assert "No space left on device" in st["reason"], st["reason"]
    assert st["last_durable_window"] == {"window_id": 1, "last_step": 6}
    assert ck.persist.persisted == {0, 1}
    warned = _events(caplog, "tier_unhealthy")
    assert len(warned) == 1 and "No space left on device" in warned[0]["reason"], warned  # once per state change
    # Nothing torn is left: every window directory on disk is committed, except the one being written now.
    inflight = ck.current.id if ck.current is not None else None
    for wdir in tier.dir.glob("window-*"):
        wid = int(wdir.name.split("-")[1])
        assert (wdir / manifest_name(writer_name(0))).exists() or wid == inflight, sorted(
            p.name for p in tier.dir.iterdir()
        )
    assert all(tier.verify(w) == [] for w in tier.window_ids())
    os.unlink(filler)  # space is back: new windows commit again (after the backoff)
    _steps(t, ck, 12)
    ck.flush(commit=False)
    st = ck.stats()["host_tier"]["health"]
    assert st["state"] == "ok" and st["last_durable_window"]["window_id"] > 1, st
    assert len(_events(caplog, "tier_recovered")) == 1
    assert all(tier.verify(w) == [] for w in tier.window_ids()) and max(tier.window_ids()) > 1
    assert "last durable window" in ck.persist.summary()
    ck.stop()


def test_stall_policy_fail_ends_the_job_in_the_training_thread(tmpfs, one_rank_group):
    t, ck, tier = _checkpointer(tmpfs, stall_iterations=4, on_stall="fail")
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)  # cannot write: EROFS
    try:
        with pytest.raises(CheckpointStallError) as err:
            _steps(t, ck, 8)
        assert t.step == 5  # iteration 5 is the first with more than 4 iterations and no durable window
        msg = str(err.value)
        assert "\n" not in msg and "no window committed durably" in msg and "on_stall='warn'" in msg, msg
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True)
        ck.stop()


def test_stall_policy_warn_trains_on_and_says_it_once(tmpfs, one_rank_group, caplog):
    caplog.set_level(logging.WARNING)
    t, ck, tier = _checkpointer(tmpfs, stall_iterations=4, on_stall="warn")
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    try:
        _steps(t, ck, 10)
        ck.flush(commit=False)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True)
    assert t.step == 10
    stalls = _events(caplog, "checkpoint_stall")
    assert len(stalls) == 1 and stalls[0]["last_durable"] == "none", stalls
    st = ck.stats()["host_tier"]["health"]
    assert st["state"] == "failing" and "Read-only file system" in st["reason"], st
    assert list(tier.dir.glob("window-*")) == [] or ck.current is not None
    ck.stop()


def test_exit_line_names_the_durable_window_when_this_attempt_committed_none(tmpfs, one_rank_group, caplog):
    """An attempt whose every host write fails (ENOSPC) must not say "nothing a restart could resume from"
    while an earlier attempt's window is committed on the same host tier: the exit line names it."""
    t, ck, tier = _checkpointer(tmpfs)
    _steps(t, ck, 7)  # the first attempt: windows 0 and 1 commit while there is space
    ck.flush(commit=False)
    ck.stop()
    caplog.set_level(logging.WARNING)
    t2, ck2, _ = _checkpointer(tmpfs)  # the next attempt (it takes the run lock while there is space)
    ck2._next_id = 2  # windows after the existing ones, as after a recovery
    filler = _fill(tmpfs)  # then the tier is full: none of its windows can commit
    _steps(t2, ck2, 7)
    summ = ck2.close(upload_timeout_s=0.0)
    os.unlink(filler)
    assert summ["windows_committed"] == 0 and summ["durable_on_host"] == [0, 1], summ
    said = [r.getMessage() for r in caplog.records if "exit:" in r.getMessage()]
    assert len(said) == 1 and "window 1 (committed earlier) is the newest" in said[0], said
    assert "nothing a restart could resume from" not in said[0] and "a restart resumes from it" in said[0], said


@pytest.mark.parametrize(
    "bad", [{"stall_iterations": 0}, {"stall_iterations": -3}, {"stall_iterations": True}, {"on_stall": "ignore"}]
)
def test_stall_policy_is_validated(bad):
    with pytest.raises(ConfigError, match="stall_iterations|on_stall"):
        TierConfig(run_id="r", **bad)


# ---- a bad host directory at start: one line before training, or the unhealthy tier and training goes on ----
@pytest.mark.parametrize("where", ["a_file", "under_proc", "read_only_new_run"])
def test_impossible_host_root_is_one_line_before_training(tmpfs, tmp_path, where):
    if where == "a_file":
        root = tmp_path / "root-file"
        root.write_text("not a directory")
    elif where == "under_proc":
        root = Path("/proc/torchmoe-nope")
    else:
        root = tmpfs
        subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    try:
        with pytest.raises(ConfigError) as err:
            build_tiers(TierConfig(root=str(root), run_id="run"), 0, 1)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True)
    msg = str(err.value)
    assert "\n" not in msg and "cannot create the run directory" in msg and "fix: TierConfig(root=...)" in msg, msg


_FIRST_ATTEMPT = """
import sys
import torch.distributed as dist
from torchmoe_ckpt import init_process_group
from torchmoe_ckpt.config import SparseConfig, TierConfig
from torchmoe_ckpt.sparse_checkpointer import RunContext, SparseCheckpointer
from torchmoe_ckpt.persist.build_tiers import build_tiers
from torchmoe_harness.trainer import RunConfig, Trainer
init_process_group("gloo")
t = Trainer(RunConfig(steps=60))
tiers = build_tiers(TierConfig(root=sys.argv[1], run_id="run"), 0, 1)
run = RunContext(tiers=tiers)
ck = SparseCheckpointer(t.model, t.optimizer, t.compute_dtype, SparseConfig(window=3), run).attach(t)
for _ in range(7):
    ck.after_step(t.train_step())
ck.flush(commit=False)
assert tiers.host.window_ids() == [0, 1], tiers.host.window_ids()
"""


@pytest.mark.parametrize("how", ["read_only", "full"])
def test_unwritable_host_root_holding_a_run_recovers_and_trains_on(tmpfs, one_rank_group, caplog, how):
    """A read-only remount or a full tmpfs under a committed run: no traceback from the lock file; the
    committed window is recovered, training goes on with the tier unhealthy, and the stall policy applies."""
    from torchmoe_ckpt.recovery.agreed_window import recover_from_tiers

    # The first attempt commits windows 0 and 1, in a process of its own: a remount needs its files closed.
    first = subprocess.run([sys.executable, "-c", _FIRST_ATTEMPT, str(tmpfs)], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-3000:]
    ops = {o.name: o for o in discover_operators(Trainer(RunConfig(steps=60)).model)}
    filler = None
    if how == "read_only":
        subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    else:
        filler = _fill(tmpfs)
    caplog.set_level(logging.WARNING)
    try:
        t2 = Trainer(RunConfig(steps=60), init_seed=7777)
        tiers = build_tiers(TierConfig(root=str(tmpfs), run_id="run", stall_iterations=4, on_stall="fail"), 0, 1)
        window, rep = recover_from_tiers(Tiers(tiers.host, None, None), ops, t2.compute_dtype, identity=None)
        assert window is not None and window.id == 1 and rep.outcome == "recovered", rep
        ck2 = SparseCheckpointer(
            t2.model, t2.optimizer, t2.compute_dtype, SparseConfig(window=3), RunContext(tiers=tiers)
        )
        ck2.attach(t2)
        t2.set_step(6)
        with pytest.raises(CheckpointStallError) as stall:  # the documented policy, in the training thread
            _steps(t2, ck2, 12)
        ck2.stop()
    finally:
        if filler is not None:
            os.unlink(filler)
        subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True)
    unhealthy = _events(caplog, "tier_unhealthy")
    assert unhealthy and unhealthy[0]["reason"].startswith("run lock of "), unhealthy
    assert "\n" not in str(stall.value) and "no window committed durably" in str(stall.value)


def test_a_small_tmpfs_gets_only_the_dense_sets_it_has_room_for(tmp_path, one_rank_group):
    """The dense slot sets reserved before the first step (FileSlotPool.reserve) stop while the file system would
    keep less than RESERVE_HEADROOM sets free: on a REAL tmpfs of ~5 sets, two are reserved (not
    DENSE_SETS, which would leave nothing for windows), and the run still commits its dense snapshots."""
    from torchmoe_ckpt.capture.file_slot_pool import RESERVE_HEADROOM
    from torchmoe_ckpt.sparse_checkpointer import DENSE_SETS

    t = Trainer(RunConfig(steps=12))
    probe = SparseCheckpointer(t.model, t.optimizer, t.compute_dtype, SparseConfig(window=1, policy="sparse"))
    one = probe.slots.set_bytes(probe.planner.dense_plan()[0])
    probe.stop()
    d = tmp_path / "small"
    d.mkdir()
    size = (RESERVE_HEADROOM + 1) * one + (64 << 10)  # 5 sets and a little: room to reserve 2, not 3
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        tiers = build_tiers(TierConfig(root=str(d), run_id="run"), 0, 1)
        cfg = SparseConfig(window=1, policy="sparse")
        ck = SparseCheckpointer(t.model, t.optimizer, t.compute_dtype, cfg, RunContext(tiers=tiers)).attach(t)
        assert ck.slots.prepared == 2 < DENSE_SETS, ck.slots.prepared
        for _ in range(6):
            ck.after_step(t.train_step())
        ck.flush()
        assert ck.counters.windows_committed >= 5
        ck.stop()
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)
