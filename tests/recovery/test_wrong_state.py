"""Never load the wrong state (issue 20): every window is bound to its run (identity), commits only what was
written, and any failure while fetching, checking, loading or replaying a window falls back to the next
newest one. Each test attacks a run's windows and checks, with torch.equal against the right run, that no
state from another run or window is ever loaded: recovery ends exact from the newest valid window, or the
job is refused at start with one line naming the mismatch and the fix."""

from __future__ import annotations

import json
import logging
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support.events import find
from torch.distributed.checkpoint import FileSystemReader

import torchmoe_ckpt as tmc
from torchmoe_ckpt.checkpointer import _Replay
from torchmoe_ckpt.model.identity import IdentityMismatch, build_identity
from torchmoe_ckpt.ops.inspection import verify_location
from torchmoe_ckpt.persist.build_tiers import build_tiers
from torchmoe_ckpt.recovery.resume import recover
from torchmoe_ckpt.storage_format.checksums import crc32_bytes
from torchmoe_ckpt.storage_format.manifest import content_checksum, record_digest
from torchmoe_ckpt.storage_format.slot_format import PLANNER_KEY
from torchmoe_harness.launch import run_torchrun
from torchmoe_harness.model import TinyMoE, TinyMoEConfig

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast

STEPS, RUN = 10, "a"  # W = 3: windows 0 (steps 1-3), 1 (4-6), 2 (7-9) committed; 1 and 2 kept on the tier


def build(seed: int = 0, lr: float = 3e-3, betas=(0.9, 0.999), init_seed: int | None = None, **model_kw):
    """The run's model, optimizer, scheduler and step function. `seed`: the run's seed (torch.manual_seed, part
    of its identity); `init_seed`: other initial weights for a restarted attempt of the same run, so what
    recovery forgets to restore shows up as a mismatch."""
    torch.manual_seed(seed)
    model = TinyMoE(TinyMoEConfig(load_balance_coeff=None, **model_kw))
    model.init_weights(seed if init_seed is None else init_seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 3))

    def forward_backward(tokens):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss

    return model, opt, sched, forward_backward


def batch(step: int, data: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1000 * data + step))


def state_of(model, opt, sched) -> dict:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": v.clone() for k, v in st.items() if torch.is_tensor(v)})
    out["sched"] = torch.tensor(sched.last_epoch)
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def config(root: Path, run_id: str = RUN, **kw) -> tmc.CheckpointConfig:
    return tmc.CheckpointConfig(
        tiers=tmc.TierConfig(root=str(root), run_id=run_id), window=tmc.SparseConfig(window=3), max_grad_norm=1.0, **kw
    )


def train(
    root: Path,
    run_id: str = RUN,
    steps: int = STEPS,
    data: int | None = 0,
    seed: int = 0,
    states: dict | None = None,
    after_step=None,
    **build_kw,
):
    """One attempt of a run: resume what the tiers hold, train to `steps`. Returns (Checkpointer, resumed step).
    `after_step(step, ck)`: called after each step (a test's fault at a chosen moment)."""
    model, opt, sched, fb = build(seed, **build_kw)
    ident = None if data is None else f"data={data}"  # None: the caller names no data (the seed still counts)
    with tmc.Checkpointer(model, opt, fb, sched, config(root, run_id), data_identity=ident) as ck:
        start = ck.resume()
        if states is not None:
            states[start] = state_of(model, opt, sched)
        for step in range(start + 1, steps + 1):
            ck.step(batch(step, data or 0))
            if states is not None:
                states[step] = state_of(model, opt, sched)
            if after_step is not None:
                after_step(step, ck)
    return ck, start


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Run `a` written once: its host directory and the exact state after every step (the reference)."""
    root = tmp_path_factory.mktemp("written")
    ref: dict = {}
    train(root, states=ref)
    return root, ref


def copy_run(written, tmp_path: Path) -> Path:
    root, _ = written
    dest = tmp_path / "root"
    shutil.copytree(root, dest)
    return dest


def resume_and_finish(root: Path, ref: dict, run_id: str = RUN, **kw):
    """A restarted attempt (other initial weights) on `root`: recover, check, train to the end, check."""
    got: dict = {}
    ck, start = train(root, run_id, init_seed=7777, states=got, **kw)
    exact = start > 0 and same(got[start], ref[start]) and same(got[STEPS], ref[STEPS])
    return ck.resumed.report, start, exact


def run_dir(root: Path, run_id: str = RUN) -> Path:
    return root / "node-0" / run_id


def resign(wdir: Path, edit) -> None:
    """Rewrite rank 0's manifest after `edit(dict)` with CRCs and checksum recomputed (an attacker's copy:
    every checksum in it matches)."""
    path = wdir / "MANIFEST.rank-00000.json"
    d = json.loads(path.read_text())
    edit(d)
    for rel in d["files"]:
        data = (wdir / rel).read_bytes()
        d["files"][rel] = {"bytes": len(data), "crc32": crc32_bytes(data)}
    d["checksum"] = content_checksum(d)
    path.write_text(json.dumps(d, indent=1, sort_keys=True))


def outcome(exact: bool) -> str:
    return "recovered exactly" if exact else "silently wrong"


# ---- (b) a whole window directory from another run ----------------------------------------------------
def test_window_directory_of_another_run_is_rejected(written, tmp_path, fault_summary):
    root = copy_run(written, tmp_path)
    other = tmp_path / "other"
    train(other, run_id="b", data=1)
    shutil.rmtree(run_dir(root) / "window-000002")
    shutil.copytree(run_dir(other, "b") / "window-000002", run_dir(root) / "window-000002")
    rep, start, exact = resume_and_finish(root, written[1])
    fault_summary("foreign_window_directory", 1, outcome(exact))
    assert start == 6 and rep["window_id"] == 1, rep
    assert "run id 'b' != 'a'" in rep["unusable_copies"][2], rep
    assert exact


# ---- (c) a slot file of another window, with matching CRCs in the manifest (last slot) ---------------------
def test_slot_file_from_another_window_is_rejected(written, tmp_path, fault_summary):
    root = copy_run(written, tmp_path)
    wdir = run_dir(root) / "window-000002"
    src = run_dir(root) / "window-000001" / "slot-02" / "rank-00000"
    shutil.rmtree(wdir / "slot-02" / "rank-00000")
    shutil.copytree(src, wdir / "slot-02" / "rank-00000")
    resign(wdir, lambda d: None)  # the manifest's CRCs now match the copied file
    ok, info = verify_location(str(run_dir(root)))
    assert not ok and any("another window or run" in p for p in info["problems"]), info["problems"]
    rep, start, exact = resume_and_finish(root, written[1])
    fault_summary("slot_file_of_another_window", 1, outcome(exact))
    assert start == 6 and "written for window 1" in rep["unusable_copies"][2], rep
    assert exact


# ---- (c2) a forged replay record of the last replayed step, every checksum recomputed ------------------------
def _forge_record(wdir: Path, what: str) -> None:
    path = wdir / "replay" / "rank-00000.pt"
    records = torch.load(path, weights_only=True)
    last = max(records, key=lambda r: r["step"])  # nothing is replayed after it: no later loss would differ
    if what == "lr_x10":
        last["lr"] *= 10
        last["lrs"] = [lr * 10 for lr in last["lrs"]] if last.get("lrs") else last["lrs"]
    else:
        last["grad_norm"] = last["grad_norm"] * 0.5
    torch.save(records, path)
    resign(wdir, lambda d: None)  # the record file's CRC and the manifest's checksum match the forgery


@pytest.mark.parametrize("what", ["lr_x10", "grad_norm_half"])
def test_forged_replay_record_is_rejected_not_replayed(written, tmp_path, what, fault_summary):
    root = copy_run(written, tmp_path)
    _forge_record(run_dir(root) / "window-000002", what)
    rep, start, exact = resume_and_finish(root, written[1])
    fault_summary(f"forged_replay_record_{what}", 1, outcome(exact and start == 6))
    assert start == 6 and rep["window_id"] == 1, rep
    assert "replay record of step 9 is not the one slot 2 was written with" in str(rep["rejected"][2]), rep
    assert exact


# ---- (c3) `torchmoe-ckpt verify` runs recovery's checks: what resume() rejects, verify reports ---------------
def _resign_world_size(wdir: Path) -> None:
    resign(wdir, lambda d: d.update(world_size=d["world_size"] + 1))  # the run's identity still says 1


FORGED = {
    "manifest_resigned_world_size": _resign_world_size,
    "replay_record_forged": lambda w: _forge_record(w, "lr_x10"),
}


@pytest.mark.parametrize("forgery", list(FORGED))
def test_verify_reports_what_recovery_rejects(written, tmp_path, forgery):
    root = copy_run(written, tmp_path)
    FORGED[forgery](run_dir(root) / "window-000002")
    ok, info = verify_location(str(run_dir(root)))
    rep, start, exact = resume_and_finish(root, written[1])
    assert start == 6 and rep["window_id"] == 1 and exact, rep  # recovery rejected window 2
    recovery_says = rep["unusable_copies"].get(2) or json.dumps(rep["rejected"].get(2))
    assert not ok and [w["window_id"] for w in info["windows"] if w["problems"]] == [2], info["problems"]
    verify_says = next(w for w in info["windows"] if w["window_id"] == 2)["problems"][0]  # rank 0's
    assert any(p in recovery_says for p in verify_says), (verify_says, recovery_says)  # the same check's words


# ---- (d) a slot write that fails (ENOSPC) -----------------------------------------------------------------
@pytest.fixture
def tmpfs(tmp_path):
    """A real 16 MiB tmpfs (root only): a full disk is a full disk, not a mock."""
    d = tmp_path / "mnt"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16M", "tmpfs", str(d)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield d
    subprocess.run(["umount", "-l", str(d)], capture_output=True)


def test_failed_slot_write_never_commits_its_window(written, tmp_path, tmpfs, fault_summary):
    """The host tier's tmpfs is full while window 2's second slot is written: that write fails with a real
    ENOSPC (part of its bytes on the disk). The space comes back before the third slot and the commit, so only
    the failed write can keep window 2 from committing (the tier, unhealthy, removes the half-written window), and
    it must; the restart resumes exactly from window 1."""
    filler = tmpfs / "filler"

    def disk_full_for_slot_1_of_window_2(step: int, ck) -> None:
        ck.sparse.persist.flush()  # each slot's write done before the disk changes
        if step == 7:  # window 2's slot 0 is on the disk: fill it
            subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=4k"], capture_output=True)
        elif step == 8:  # slot 1's write failed: room again for slot 2 and the commit
            filler.unlink()

    root = tmpfs / "root"
    ck, _ = train(root, after_step=disk_full_for_slot_1_of_window_2)
    assert any("No space left" in e for e in ck.sparse.persist.errors), ck.sparse.persist.errors
    assert not (run_dir(root) / "window-000002" / "MANIFEST.rank-00000.json").exists()
    rep, start, exact = resume_and_finish(root, written[1])
    fault_summary("slot_write_failed_enospc", 1, outcome(exact))
    assert start == 6 and rep["window_id"] == 1, rep
    assert exact


# ---- (e) damaged manifests, plans and items: rejected with a reason, older window used -------------------
def _flip_start_step(wdir: Path) -> None:
    path = wdir / "MANIFEST.rank-00000.json"
    d = json.loads(path.read_text())
    d["start_step"] ^= 1  # one bit; the manifest's own checksum is left as written
    path.write_text(json.dumps(d, indent=1, sort_keys=True))


def _flip_start_step_resigned(wdir: Path) -> None:
    resign(wdir, lambda d: d.update(start_step=d["start_step"] ^ 1))


def _edit_plan(wdir: Path) -> None:
    def swap(d):
        s = d["plan"]["slots"]
        s[0]["active"], s[1]["active"] = s[1]["active"], s[0]["active"]

    resign(wdir, swap)


def _bad_item_good_file(wdir: Path) -> None:
    slot = wdir / "slot-01" / "rank-00000"
    info = max(FileSystemReader(slot).read_metadata().storage_data.values(), key=lambda i: i.length)
    data = slot / info.relative_path
    raw = bytearray(data.read_bytes())
    raw[info.offset + info.length // 2] ^= 0x10  # inside the largest item's tensor bytes
    data.write_bytes(bytes(raw))
    resign(wdir, lambda d: None)  # file CRC re-computed: only the per-item CRC can tell


def _replay_diverges(wdir: Path) -> None:
    """A window whose replay does not reproduce its logged loss. Editing the record alone is now refused at
    load (its digest in the slot's metadata no longer matches: test_forged_replay_record_...), so the
    slots' record digests are rewritten too, as a divergence that no checksum can see would look."""
    path = wdir / "replay" / "rank-00000.pt"
    recs = torch.load(path, weights_only=True)
    recs[-1]["loss"] = recs[-1]["loss"] + 1.0
    torch.save(recs, path)
    by_step = {r["step"]: r for r in recs}
    for meta in wdir.glob("slot-*/rank-00000/.metadata"):
        md = pickle.loads(meta.read_bytes())
        info = md.planner_data[PLANNER_KEY]
        if info.get("record") is not None:
            info["record"] = record_digest(by_step[info["step"]])
        meta.write_bytes(pickle.dumps(md))
    resign(wdir, lambda d: None)


DAMAGE = {
    "start_step_one_bit": (_flip_start_step, "checksum"),
    "start_step_one_bit_resigned": (_flip_start_step_resigned, "expected"),
    "plan_edited": (_edit_plan, "plan"),
    "item_crc_bad_file_crc_good": (_bad_item_good_file, "item checksums"),
    "replay_diverges": (_replay_diverges, "ReplayDivergence"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_window_falls_back_to_the_older_one(written, tmp_path, damage, fault_summary):
    root = copy_run(written, tmp_path)
    edit, reason = DAMAGE[damage]
    edit(run_dir(root) / "window-000002")
    ok, info = verify_location(str(run_dir(root)))  # item CRCs and replay are only checked when loading
    assert ok == (damage in ("item_crc_bad_file_crc_good", "replay_diverges")), info["problems"]
    rep, start, exact = resume_and_finish(root, written[1])
    fault_summary(f"damaged_{damage}", 1, outcome(exact))
    why = rep["unusable_copies"].get(2) or json.dumps(rep["rejected"].get(2))
    assert start == 6 and rep["window_id"] == 1 and reason in why, rep
    assert rep["outcome"] == "recovered"
    assert exact


def _files(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.glob("window-*/**/*")) if p.is_file()}


def _flip_data_file(wdir: Path) -> None:
    data = max(
        (p for p in (wdir / "slot-00").rglob("*") if p.is_file() and p.name != ".metadata"),
        key=lambda p: p.stat().st_size,
    )
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", ["replay_diverges", "flip_one_byte"])
def test_every_window_damaged_is_refused_with_the_reasons_and_nothing_touched(written, tmp_path, damage):
    root = copy_run(written, tmp_path)
    for w in (1, 2):
        (_replay_diverges if damage == "replay_diverges" else _flip_data_file)(run_dir(root) / f"window-00000{w}")
    before_files = _files(run_dir(root))
    model, opt, sched, fb = build(init_seed=7777)
    before = state_of(model, opt, sched)
    with tmc.Checkpointer(model, opt, fb, sched, config(root), data_identity="data=0") as ck:
        with pytest.raises(tmc.UnusableCheckpointError) as exc:
            ck.resume()
    msg = str(exc.value)
    assert "window 2: " in msg and "window 1: " in msg and "new run id" in msg, msg
    assert "on_unusable_checkpoint='restart'" in msg and "Nothing was deleted or overwritten" in msg, msg
    if damage == "replay_diverges":  # the usual cause is named, and the library's own reason is not cut
        assert "ReplayDivergence" in msg and "randomness outside torch's CPU generator" in msg, msg
        assert "The window is not loaded" in msg, msg
    else:
        assert "(corrupt)" in msg and "damaged" in msg, msg
    assert _files(run_dir(root)) == before_files  # nothing deleted or overwritten
    after = state_of(model, opt, sched)  # the failed replays left nothing behind
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("model."))


def test_every_window_damaged_with_restart_opt_in_starts_over(written, tmp_path, caplog):
    root = copy_run(written, tmp_path)
    for w in (1, 2):
        _replay_diverges(run_dir(root) / f"window-00000{w}")
    model, opt, sched, fb = build(init_seed=7777)
    cfg = config(root, on_unusable_checkpoint="restart")
    with caplog.at_level(logging.WARNING, logger="torchmoe_ckpt.recovery"):
        with tmc.Checkpointer(model, opt, fb, sched, cfg, data_identity="data=0") as ck:
            assert ck.resume() == 0
    assert ck.resumed.report["outcome"] == "no usable window"
    assert find(caplog.text, "no_usable_window") and "ReplayDivergence" in caplog.text
    assert "randomness outside torch's CPU generator" in caplog.text  # reasons are never cut
    assert "a new run starts from step 0" in caplog.text


# ---- (f) same run id, another model / optimizer / dtype / world size: one line, no load -----------------
MISMATCH = {
    "experts": ({"num_experts": 8}, {}, "expert count 4 != 8 in layers.0.moe"),
    "hidden": ({"dim": 64}, {}, "shape of layers.0.attention.wq.weight"),
    "betas": ({"betas": (0.9, 0.95)}, {}, "optimizer betas (0.9, 0.999) != (0.9, 0.95)"),
    "dtype": ({}, {"compute_dtype": torch.bfloat16}, "dtype float32 != bfloat16"),
}


@pytest.mark.parametrize("what", list(MISMATCH))
def test_same_run_id_other_model_is_refused_with_one_line(written, tmp_path, what, fault_summary):
    root = copy_run(written, tmp_path)
    build_kw, cfg_kw, words = MISMATCH[what]
    model, opt, sched, fb = build(**build_kw)
    ck = tmc.Checkpointer(model, opt, fb, sched, config(root, **cfg_kw), data_identity="data=0")
    with pytest.raises(IdentityMismatch) as exc:
        ck.resume()
    ck.close()
    msg = str(exc.value)
    fault_summary(f"same_run_id_other_{what}", 1, "refused with one line")
    assert "\n" not in msg and "new run id" in msg and "'a'" in msg, msg
    assert words in msg or (what == "hidden" and "shape of" in msg), msg


def test_same_run_id_other_world_size_is_refused_with_one_line(written, tmp_path, fault_summary):
    root = copy_run(written, tmp_path)
    model, opt, sched, fb = build(init_seed=7777)
    ck = tmc.Checkpointer(model, opt, fb, sched, config(root), data_identity="data=0")
    tiers = build_tiers(config(root).tiers, 0, 1)
    ident = build_identity(model, opt, torch.float32, ck.ops, RUN, world_size=2, hsdp_replicate=1, data="data=0")
    with pytest.raises(IdentityMismatch) as exc:
        recover(_Replay(ck), tiers, ck.op_by_name, torch.float32, identity=ident)
    fault_summary("same_run_id_other_world_size", 1, "refused with one line")
    assert "\n" not in str(exc.value) and "world size 1 != 2" in str(exc.value), exc.value


# ---- (g) more steps and another LR: allowed, and said in the log -----------------------------------------
def test_more_steps_and_another_lr_are_accepted_and_logged(written, tmp_path, caplog, fault_summary):
    root = copy_run(written, tmp_path)
    got: dict = {}
    with caplog.at_level(logging.INFO, logger="torchmoe_ckpt.recovery"):
        ck, start = train(root, steps=STEPS + 3, init_seed=7777, states=got, lr=1e-3)
    exact = start == 9 and same(got[9], written[1][9])
    fault_summary("more_steps_other_lr", 0, outcome(exact))
    assert exact and STEPS + 3 in got
    changed = find(caplog.text, "allowed_change")
    assert changed and "learning rate (0.003) -> (0.001)" in changed[0].prose, caplog.text
    assert ck.resumed.report["allowed_changes"]


# ---- (h) the seed is part of the identity without the caller naming its data ----------------------------
@pytest.fixture(scope="module")
def written_no_data(tmp_path_factory):
    """Run `a` (seed 0) written by a caller that names no data identity."""
    root = tmp_path_factory.mktemp("written-no-data")
    train(root, data=None)
    return root


def test_relaunch_with_another_seed_is_refused_without_a_data_identity(written_no_data, tmp_path, fault_summary):
    root = tmp_path / "root"
    shutil.copytree(written_no_data, root)
    before = _files(run_dir(root))
    model, opt, sched, fb = build(seed=1)
    ck = tmc.Checkpointer(model, opt, fb, sched, config(root))  # no data_identity: the seed alone tells
    with pytest.raises(IdentityMismatch) as exc:
        ck.resume()
    ck.close()
    msg = str(exc.value)
    fault_summary("relaunch_other_seed_no_data_identity", 1, "refused with one line")
    assert "\n" not in msg and "seed 0 != 1" in msg and "new run id" in msg, msg
    assert _files(run_dir(root)) == before  # nothing touched


def test_window_of_a_run_with_another_seed_copied_in_is_rejected(written_no_data, written, tmp_path, fault_summary):
    """Same run id, same model, same (unnamed) data: only the seed differs. The copied window is rejected
    with the reason, `verify` names it, and recovery ends exact from the run's own older window."""
    root = tmp_path / "root"
    shutil.copytree(written_no_data, root)
    other = tmp_path / "other"
    train(other, data=None, seed=1)
    shutil.rmtree(run_dir(root) / "window-000002")
    shutil.copytree(run_dir(other) / "window-000002", run_dir(root) / "window-000002")
    ok, info = verify_location(str(run_dir(root)))
    assert not ok and any("window(s) [2]" in p and "different runs" in p for p in info["problems"]), info["problems"]
    rep, start, exact = resume_and_finish(root, written[1], data=None)
    fault_summary("window_of_another_seed_copied_in", 1, outcome(exact))
    assert start == 6 and rep["window_id"] == 1 and "seed 1 != 0" in rep["unusable_copies"][2], rep
    assert exact


def test_checkpointer_seed_argument(written_no_data, tmp_path):
    """`seed=` names the run's seed instead of the process's; a wrong type is one ConfigError."""
    model, opt, sched, fb = build(seed=5)
    with pytest.raises(tmc.ConfigError, match="seed must be"):
        tmc.Checkpointer(model, opt, fb, sched, seed="0")
    root = tmp_path / "root"
    shutil.copytree(written_no_data, root)
    with tmc.Checkpointer(model, opt, fb, sched, config(root), seed=0) as ck:
        assert ck.resume() == 9  # the windows of seed 0 are this run's


# ---- (a) a second job, other seed, same run id (real torchrun, 2 ranks) ------------------------------------
def _spec(root: Path, seed: int, run_id: str | None, resume: bool = True) -> dict:
    host = {"root": str(root)} if run_id is None else {"root": str(root), "run_id": run_id}
    return {
        "run": {"steps": 6, "seed": seed},
        "checkpoint": {"window": 3},
        "host_tier": host,
        "resume": resume,
        "timeout_s": 20,
    }


def test_second_job_other_seed_same_run_id_is_refused(tmp_path, fault_summary):
    run_torchrun(2, _spec(tmp_path / "shm", 0, "t"), tmp_path / "first", timeout=50)
    with pytest.raises(RuntimeError) as exc:
        run_torchrun(2, _spec(tmp_path / "shm", 1, "t"), tmp_path / "second", timeout=50)
    log = (tmp_path / "second" / "torchrun.log").read_text()
    refused = [ev.prose for ev in find(log, "refused")]
    fault_summary(
        "second_job_other_seed_same_run_id",
        1,
        "refused with one line" if refused and not (tmp_path / "second" / "rank0.pt").exists() else "silently wrong",
    )
    assert refused, str(exc.value)[-2000:]
    assert "data/seed identity seed=0 != seed=1" in refused[0] and "new run id" in refused[0], refused[0]
    assert "torchmoe_ckpt/recovery/resume.py" not in log  # one line, no traceback of ours


def test_jobs_without_a_run_id_never_share_one(tmp_path, fault_summary):
    first = run_torchrun(2, _spec(tmp_path / "shm", 0, None), tmp_path / "first", timeout=50)
    second = run_torchrun(2, _spec(tmp_path / "shm", 1, None), tmp_path / "second", timeout=50)
    runs = [p.name for p in (tmp_path / "shm" / "node-0").iterdir() if p.is_dir()]
    fault_summary(
        "second_job_derived_run_id", 1, "started fresh" if not second.report["recoveries"] else "silently wrong"
    )
    assert len(runs) == 2, runs  # torchrun's run id: one directory per launch
    assert not first.report["recoveries"] and not second.report["recoveries"], second.report["recoveries"]
    cold = find(second.log, "cold_start")
    assert cold and "a new run starts" in cold[0].prose, second.log[-3000:]
    logged = {ev["run"] for ev in find(first.log + second.log) if "run" in ev.fields}
    assert set(runs) <= logged, (runs, logged)


# ---- tier by tier: every host copy lost, the newest store copy damaged: the older store window is used ------
def test_store_fallback_after_host_loss_and_a_damaged_store_window(written, tmp_path, fault_summary):
    root, store = tmp_path / "root", tmp_path / "store"
    model, opt, sched, fb = build()
    cfg = config(root)
    cfg.tiers.object_store = tmc.ObjectStoreConfig(uri=f"file://{store}", keep=2)
    with tmc.Checkpointer(model, opt, fb, sched, cfg, data_identity="data=0") as ck:
        for step in range(ck.resume() + 1, STEPS + 1):
            ck.step(batch(step))
    shutil.rmtree(run_dir(root))  # every host copy lost
    data = next((store / RUN / "window-000002" / "slot-02" / "rank-00000").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-10])  # the newest store window is torn
    got: dict = {}
    model, opt, sched, fb = build(init_seed=7777)
    with tmc.Checkpointer(model, opt, fb, sched, cfg, data_identity="data=0") as ck:
        start = ck.resume()
        got[start] = state_of(model, opt, sched)
        for step in range(start + 1, STEPS + 1):
            ck.step(batch(step))
    rep = ck.resumed.report
    exact = start == 6 and same(got[6], written[1][6]) and same(state_of(model, opt, sched), written[1][STEPS])
    fault_summary("store_fallback_torn_newest", 1, outcome(exact))
    assert rep["source"] == "object store" and rep["window_id"] == 1 and 2 in rep["rejected"], rep
    assert exact
