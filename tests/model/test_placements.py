"""DTensor placements at start (issue 44): Shard and Replicate on any mesh are captured, a strided shard or a
pending reduction on a mesh dimension wider than 1 is one line naming the fix from operator discovery, before any
step (on a 1-wide one it is the whole tensor: TorchTitan's TP alone keeps a 1-wide FSDP dimension with a strided
shard); and the per-step reads
take a DTensor (the loss under TorchTitan's tensor parallelism) as this rank's local tensor, on both read paths
(the first iteration under TP 2 died in `_foreach_copy_` with mixed Tensor and DTensor before)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from torchmoe_ckpt.model.identity import mesh_replicate
from torchmoe_ckpt.model.operators import discover_operators
from torchmoe_ckpt.runtime.deferred_reads import HostReads
from torchmoe_ckpt.runtime.device_copy import CopyStream
from torchmoe_harness.launch import torchrun

PROBE = Path(__file__).with_name("placements_probe.py")


@pytest.fixture
def mesh(one_rank_group):
    return init_device_mesh("cpu", (1, 1), mesh_dim_names=("fsdp", "tp"))


def _model(mesh, placements, buffer=None) -> nn.Module:
    m = nn.Linear(4, 4, bias=False)
    m.weight = nn.Parameter(DTensor.from_local(torch.randn(4, 4), mesh, placements, run_check=False))
    if buffer is not None:
        m.register_buffer("stat", DTensor.from_local(torch.zeros(4), mesh, buffer, run_check=False))
    return m


def test_shard_and_replicate_on_a_2d_mesh_are_captured(mesh):
    """FSDP x TP as TorchTitan lays it out when the two shard different dimensions, a TP-replicated buffer."""
    ops = discover_operators(_model(mesh, (Shard(0), Shard(1)), buffer=(Shard(0), Replicate())))
    assert sorted(p.fqn for op in ops for p in op.pieces) == ["stat", "weight"]
    assert mesh_replicate(_model(mesh, (Shard(0), Shard(1)))) == 1  # the FSDP dimension is no HSDP replica


@pytest.mark.torchrun
def test_an_unhandled_placement_is_one_line_at_discovery(tmp_path):
    """2 ranks: a strided shard or a Partial refused on the 2-wide mesh dimension only."""
    log = torchrun(2, [str(PROBE)], tmp_path / "torchrun.log", 55.0)
    got = dict(re.findall(r"placement=(\S+) result=(.*)", log))
    assert got.keys() == {
        "shard-shard",
        "strided-on-1-wide",
        "strided-on-2-wide",
        "partial-on-1-wide",
        "partial-on-2-wide",
    }, log[-3000:]
    assert got["shard-shard"] == got["strided-on-1-wide"] == got["partial-on-1-wide"] == "ok replicate=1", got
    for case, why, fix in [
        ("strided-on-2-wide", "a strided shard", "shard each tensor dimension on one mesh dimension only"),
        ("partial-on-2-wide", "a pending reduction", "reduce it before training"),
    ]:
        msg = got[case]
        assert msg.startswith("weight: DTensor placement") and "mesh dimension 'fsdp'" in msg and why in msg, msg
        assert f"fix: {fix}" in msg, msg


@pytest.mark.parametrize("on_copy_stream", [True, False], ids=["copy-stream", "training-stream"])
def test_a_dtensor_loss_is_read_as_its_local_tensor(mesh, on_copy_stream):
    loss = DTensor.from_local(torch.tensor(2.5), mesh["tp"], (Replicate(),), run_check=False)
    tokens, norm = torch.arange(6).reshape(2, 3), torch.tensor(0.75)
    got = HostReads(CopyStream("cpu"), on_copy_stream).copy((tokens, norm, loss, None))
    assert not any(isinstance(x, DTensor) for x in got[:3])
    assert torch.equal(got[0], tokens) and torch.equal(got[1], norm) and torch.equal(got[2], loss.to_local())
