"""ArenaSlotPool (the arena allocator): slots assembled from per-operator groups of one arena per slot set hold
exactly the items build_slot makes, and a reorder or a window-size change reuses the released set's buffers
instead of allocating."""

import random

import torch

from torchmoe_ckpt.operators import discover_operators
from torchmoe_ckpt.schedule import plan_window
from torchmoe_ckpt.slot_pool import ArenaSlotPool
from torchmoe_ckpt.snapshot import build_slot
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
