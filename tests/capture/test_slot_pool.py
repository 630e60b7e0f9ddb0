"""ArenaSlotPool (the arena allocator): slots assembled from per-operator groups of one arena per slot set hold
exactly the items build_slot makes, and a reorder or a window-size change reuses the released set's buffers
instead of allocating."""

import random

import torch

from torchmoe_ckpt.capture.slot_pool import ArenaSlotPool
from torchmoe_ckpt.core.slot import build_slot
from torchmoe_ckpt.model.operators import discover_operators
from torchmoe_ckpt.planning.schedule import plan_window
from torchmoe_harness.model import TinyMoE, TinyMoEConfig

CFG = TinyMoEConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, num_experts=4, expert_hidden=8, max_seq_len=8)


def _setup():
    ops = discover_operators(TinyMoE(CFG))
    by = {o.name: o for o in ops}
    full = {o.name: o.full_bytes() for o in ops}
    comp = {o.name: o.compute_bytes(2) for o in ops}
    return ops, by, full, comp


def _items(slot):
    return sorted(
        (
            it.key,
            it.role,
            tuple(it.piece.global_offset) if it.role != "step" else (),
            tuple(it.buffer.shape),
            it.buffer.dtype,
            it.op,
        )
        for it in slot.items
    )


def test_same_items_as_build_slot_and_reuse_across_reorders():
    ops, by, full, comp = _setup()
    names = [o.name for o in ops]
    pool = ArenaSlotPool(by, torch.bfloat16)
    rnd = random.Random(0)
    live = []
    for window, w in enumerate((4, 4, 4, 4, 6, 2)):
        order = names[:]
        rnd.shuffle(order)  # a popularity reorder
        plan = plan_window(order, full, comp, float("inf"), forced_window=w, warn=False)
        before, arenas = pool.new_memory_groups, pool.allocations
        slots = pool.slots_for(plan)
        for sl, sp, n in zip(slots, plan.slots, pool.slot_bytes(slots)):
            ref = build_slot(sl.index, sp.active, sp.frozen, by, torch.bfloat16)
            assert _items(sl) == _items(ref)
            assert n == sl.nbytes == ref.nbytes
            assert len({it.buffer.data_ptr() for it in sl.items if it.buffer.numel()}) == len(
                [it for it in sl.items if it.buffer.numel()]
            )  # no buffer shared within a slot
        ptrs = [{it.buffer.data_ptr() for it in sl.items if it.buffer.numel()} for sl in slots]
        for other in live:  # nor with a window still alive (the committed one)
            for sl in other:
                assert not any(it.buffer.data_ptr() in set().union(*ptrs) for it in sl.items if it.buffer.numel())
        if window == 3:  # after a window of the same W came back, a reorder reuses (nearly) every buffer
            used = sum(len(sp.active) + len(sp.frozen) for sp in plan.slots)  # groups, besides step counters
            assert pool.new_memory_groups - before <= 0.05 * used, (pool.new_memory_groups - before, used)
            assert pool.allocations == arenas  # and allocates nothing: the released set's arena is re-assembled
        live.append(slots)
        if len(live) > 1:  # the committed window retires when the next one commits
            pool.release(live.pop(0))


def test_shrinking_window_lets_buffers_go():
    ops, by, full, comp = _setup()
    names = [o.name for o in ops]
    pool = ArenaSlotPool(by, torch.float32)
    big = pool.slots_for(plan_window(names, full, comp, float("inf"), forced_window=6, warn=False))
    pool.release(big)
    small = plan_window(names, full, comp, float("inf"), forced_window=2, warn=False)
    pool.slots_for(small)
    kept = pool.host_bytes()["slot_sets"]
    assert len(pool.sets) == 1 and kept <= 2 * pool.set_bytes(small)  # at most one more window's worth


def test_next_set_is_allocated_off_the_training_thread():
    """A window start that leaves no second set asks `prepare`: the next set is allocated on the pool's helper
    thread (pinning 8 GiB took 3 s on an H200 host, inside a training step, before this), counted as held from the
    start; the next window start allocates nothing. A larger W prepares again."""
    ops, by, full, comp = _setup()
    names = [o.name for o in ops]
    pool = ArenaSlotPool(by, torch.float32)
    threads = []
    real = pool._alloc

    def alloc(need, thread="training_thread"):
        threads.append(__import__("threading").current_thread().name)
        return real(need, thread)

    pool._alloc = alloc
    plan = plan_window(names, full, comp, float("inf"), forced_window=3, warn=False)
    first = pool.slots_for(plan)
    assert pool.prepare(plan) and pool.host_bytes()["slot_sets"] == 2 * pool.set_bytes(plan)
    assert not pool.prepare(plan)  # one at a time
    pool._join_spare()
    assert not pool.preparing
    assert threads == ["MainThread", "tmoe-slot-alloc"] and pool.prepared == 1
    assert not pool.prepare(plan)  # a second set exists: nothing to do
    pool.release(first)
    pool.slots_for(plan)  # the released set (or the prepared one): no allocation
    assert pool.allocations == 2
    bigger = plan_window(names, full, comp, float("inf"), forced_window=len(names), warn=False)
    if pool.set_need(bigger) > max(s.arena.capacity for s in pool.sets):
        assert pool.prepare(bigger, room=lambda n: False) is False  # over the memory limit: not ahead of time
        assert pool.prepare(bigger)
        pool.close()
        assert threads[-1] == "tmoe-slot-alloc" and pool.allocations == 3


def test_pinned_sets_are_kept_when_w_shrinks(monkeypatch):
    """A pinned set larger than a new plan needs is reused (re-pinning would cost the training thread seconds and
    freeing synchronises the device); a plain one more than twice too large is replaced. CPU stand-in: the pool
    believes its arenas are pinned (capacities of pinned blocks), they are plain (this machine has no pinned
    allocator)."""
    ops, by, full, comp = _setup()
    real_empty = torch.empty
    names = [o.name for o in ops]
    big = plan_window(names, full, comp, float("inf"), forced_window=len(names), warn=False)
    small = plan_window(names, full, comp, float("inf"), forced_window=1, warn=False)
    for pinned in (False, True):
        pool = ArenaSlotPool(by, torch.float32)
        pool.pin_memory = pinned
        monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **kw: real_empty(*a, **kw))
        pool.release(pool.slots_for(big))
        assert pool.set_need(small) * 2 < pool.sets[0].arena.capacity  # more than twice too large
        pool.slots_for(small)
        assert pool.allocations == (1 if pinned else 2), pinned
        monkeypatch.undo()
