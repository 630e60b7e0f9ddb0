"""Operator discovery, slot contents and the snapshot engine, in one process (1-rank gloo group)."""

import pytest
import torch

from torchmoe_ckpt.capture.snapshot import SimulatedCopyFault, SnapshotEngine, StateAccess, restore_slot
from torchmoe_ckpt.core.slot import build_slot
from torchmoe_ckpt.model.operators import discover_operators
from torchmoe_ckpt.recovery.sparse_to_dense import init_optimizer_state
from torchmoe_harness.trainer import RunConfig, Trainer


@pytest.fixture(scope="module")
def trainer(one_rank_group):
    t = Trainer(RunConfig(steps=3))
    t.train_step()
    return t


def test_every_parameter_element_belongs_to_exactly_one_operator(trainer):
    ops = discover_operators(trainer.model)
    cfg = trainer.cfg.model
    kinds = [o.kind for o in ops]
    assert kinds.count("expert") == cfg.n_layers * cfg.num_experts
    assert kinds.count("router") == cfg.n_layers
    covered: dict[str, int] = {}
    for o in ops:
        for p in o.pieces:
            if p.is_param:
                covered[p.fqn] = covered.get(p.fqn, 0) + p.numel
    for name, p in trainer.model.named_parameters():
        assert covered.pop(name) == p.numel(), name
    assert not covered
    routers = [o for o in ops if o.kind == "router"]
    assert all(any(p.fqn.endswith("expert_bias_E") for p in o.pieces) for o in routers)


def test_expert_pieces_have_global_offsets(trainer):
    ops = {o.name: o for o in discover_operators(trainer.model)}
    e2 = ops["layers.1.moe.experts.2"]
    assert {p.fqn.rsplit(".", 1)[-1] for p in e2.pieces} == {"w1_EFD", "w2_EDF", "w3_EFD"}
    for p in e2.pieces:
        assert p.global_offset[0] == 2 and p.shape[0] == 1
    assert e2.full_bytes() > 6 * e2.compute_bytes(2)  # 12 B/param (+step) vs 2 B/param


def test_slot_round_trip_and_write_items(trainer):
    ops = discover_operators(trainer.model)
    by_name = {o.name: o for o in ops}
    active = tuple(o.name for o in ops[:3])
    frozen = tuple(o.name for o in ops[3:])
    slot = build_slot(0, active, frozen, by_name, torch.bfloat16)
    access = StateAccess(trainer.model, trainer.optimizer)
    engine = SnapshotEngine(access)
    engine.capture(slot, trainer.step)
    engine.wait()
    assert slot.complete and slot.step == trainer.step
    compute = [i for i in slot.items if i.role == "compute"]
    assert compute and all(i.buffer.dtype == torch.bfloat16 for i in compute)
    full_roles = {i.role for i in slot.items if i.op in active}
    assert {"master", "exp_avg", "exp_avg_sq", "step"} <= full_roles
    items = slot.write_items()
    assert len(items) == len(slot.items)
    assert items[0].tensor_data.chunk.offsets == torch.Size(slot.items[0].piece.global_offset)
    # Restoring into a fresh trainer reproduces exactly the active operators' master and optimizer state.
    before = {k: v.clone() for k, v in trainer.export_state().items()}
    fresh = Trainer(RunConfig(steps=3), init_seed=123)
    init_optimizer_state(fresh.optimizer)
    restore_slot(slot, StateAccess(fresh.model, fresh.optimizer), roles=("master", "exp_avg", "exp_avg_sq", "step"))
    after = fresh.export_state()
    w1 = "layers.0.moe.routed_experts.inner_experts.w1_EFD"
    for key in (f"param/{w1}", f"optim/{w1}/exp_avg", f"optim/{w1}/exp_avg_sq"):
        assert torch.equal(after[key][:1], before[key][:1])  # expert 0 was active
    assert not torch.equal(after[f"param/{w1}"][3:], before[f"param/{w1}"][3:])  # expert 3 was not
    engine.shutdown()


def test_torn_copy_is_reported_not_committed(trainer):
    ops = discover_operators(trainer.model)
    slot = build_slot(0, tuple(o.name for o in ops), (), {o.name: o for o in ops}, torch.float32)
    engine = SnapshotEngine(StateAccess(trainer.model, trainer.optimizer))

    def tear(s, n):
        raise SimulatedCopyFault("torn")

    engine.fault_hook = tear
    engine.capture(slot, trainer.step)
    with pytest.raises(SimulatedCopyFault):
        engine.wait()
    assert not slot.complete
    engine.shutdown()


def test_empty_shard_keeps_its_step_counter():
    """Uneven FSDP2 sharding can leave a rank no rows of a small parameter (e.g. [1, D] on 2 ranks); its
    optimizer state still has a step counter, which a slot must hold (seen on DeepSeek-V4 / HY-V4 before)."""
    from torchmoe_ckpt.core.operator import Operator, Piece

    empty = Piece("gate.weight", True, (1, 4), (1, 0), (slice(0, 0), slice(0, 4)), (0, 4))
    full = Piece("norm.weight", True, (4,), (0,), (slice(0, 4),), (4,))
    ops = {"a": Operator("a", "dense", 0, pieces=[empty, full])}
    slot = build_slot(0, ("a",), (), ops, torch.bfloat16)
    assert [(i.key, i.role) for i in slot.items if i.piece is empty] == [("optim.gate.weight.step", "step")]
    frozen = build_slot(0, (), ("a",), ops, torch.bfloat16)
    assert [i.piece for i in frozen.items] == [full]
