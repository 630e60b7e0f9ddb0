"""Each piece of start-up work runs once between `Checkpointer(...)` and the end of the first step, on a new run and
on a run that recovers a window: operator discovery, the optimizer-state attachment (checks, state creation and the
pieces slots hold), the run identity, and the checkpointer's parts (`build_parts`). Counted by wrapping the real
functions where each caller looks them up; in-process, one rank, a host tier under tmp_path."""

from __future__ import annotations

import collections

import pytest
import torch
from support.tiny_moe import TOP_K, Net, batch_for, forward_backward  # tests/ is on sys.path under pytest

import torchmoe_ckpt as tmc
from torchmoe_ckpt import checkpointer, sparse_checkpointer, startup
from torchmoe_ckpt.model import optim_state
from torchmoe_ckpt.recovery import resume as resume_mod

# (module, name): every place start-up looks each piece up (a second caller would show as a second count).
COUNTED = {
    "discover_operators": [(checkpointer, "discover_operators"), (startup, "discover_operators")],
    "attach (work done)": [(optim_state, "_assign_state")],
    "build_identity": [
        (startup, "build_identity"),
        (resume_mod, "build_identity"),
        (sparse_checkpointer, "build_identity"),
    ],
    "build_parts": [(sparse_checkpointer, "build_parts")],
}


def _counting(monkeypatch) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for what, places in COUNTED.items():
        for module, name in places:
            real = getattr(module, name)

            def wrapper(*a, _real=real, _what=what, **k):
                counts[_what] += 1
                return _real(*a, **k)

            monkeypatch.setattr(module, name, wrapper)
    return counts


def _loop(tiers: tmc.TierConfig):
    model = Net(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    cfg = tmc.CheckpointConfig(window=tmc.SparseConfig(window=3, policy="sparse"), router_top_k=TOP_K, tiers=tiers)
    return tmc.Checkpointer(model, opt, forward_backward(model), None, cfg)


@pytest.mark.parametrize("recovers", [False, True], ids=["new run", "recovered run"])
def test_each_piece_of_start_up_work_runs_once(recovers, tmp_path, monkeypatch):
    tiers = tmc.TierConfig(root=str(tmp_path), run_id="once")
    if recovers:  # a first attempt that commits windows 1-3 and 4-6
        with _loop(tiers) as ck:
            ck.resume()
            for step in range(1, 8):
                ck.step(batch_for(step))
    counts = _counting(monkeypatch)
    with _loop(tiers) as ck:
        start = ck.resume()
        ck.step(batch_for(start + 1))
    assert (start == 6) == recovers and ck.resumed is not None
    assert (ck.resumed.recovered_step is not None) == recovers
    assert dict(counts) == {what: 1 for what in COUNTED}, dict(counts)


def test_a_second_optimizer_on_the_same_operators_is_attached_again():
    """The attachment is remembered per optimizer: another optimizer over the same model sets the operators' state
    anew (its layout may differ), and the same one again does no work."""
    model = Net(0)
    ops = tmc.discover_operators(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    adamw = torch.optim.AdamW(model.parameters(), lr=0.1)
    optim_state.attach_optimizer_state(model, ops, sgd)
    keys_sgd = {s.key for o in ops for pieces in (o.state or {}).values() for s in pieces}
    optim_state.attach_optimizer_state(model, ops, adamw)
    keys_adamw = {s.key for o in ops for pieces in (o.state or {}).values() for s in pieces}
    assert keys_sgd == {"momentum_buffer"} and keys_adamw == {"step", "exp_avg", "exp_avg_sq"}
    before = [o.state for o in ops]
    optim_state.attach_optimizer_state(model, ops, adamw)
    assert all(a is o.state for a, o in zip(before, ops))  # remembered: not rebuilt


def test_a_refused_start_leaves_no_thread_running(tmp_path):
    """build_parts starts the copy and persist threads, then refuses a host_memory_limit no window fits in: every
    thread it started is told to stop before the refusal reaches the caller, and ends."""
    import threading

    before = set(threading.enumerate())
    model = Net(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    window = tmc.SparseConfig(window=3, policy="sparse", host_memory_limit="64 KiB")
    cfg = tmc.CheckpointConfig(
        window=window, router_top_k=TOP_K, tiers=tmc.TierConfig(root=str(tmp_path), run_id="refused")
    )
    ck = tmc.Checkpointer(model, opt, lambda tokens: model(tokens).sum(), None, cfg)
    with pytest.raises(tmc.HostMemoryLimitError):
        ck.resume()
    ck.close()
    started = set(threading.enumerate()) - before
    assert {t.name for t in started} <= {"tmoe-snapshot", "tmoe-host-tier"}  # (the threads build_parts starts)
    for t in started:  # told to stop, not waited for (stop() after an error): they end on their own
        t.join(10.0)
    assert not [t.name for t in started if t.is_alive()]
