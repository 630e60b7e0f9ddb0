"""TorchTitan's other optimizers on CPU, and why they do not train there: DistMuon (the Kimi K2.x recipe puts the
matrices on it, the rest on AdamW) refuses CPU devices at construction, and AdamW with bf16 states
(implementation = "fused_opt_states_bf16") fails in torch's CPU kernels at its first step. What the integration
adds is checked anyway: DistMuon's update rule (per matrix: an expert cut from a grouped tensor replays exactly, a
cut 2-D matrix is refused) and the bf16 state made up front exactly as TorchTitan's pre-hook makes it. The own-loop
tests (tests/model/test_optimizers_kill9.py) cover Muon + AdamW and bf16 states end to end. One subprocess (the
CPU-mode patches stay out of the test process)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from titan_integration import demo

pytestmark = pytest.mark.titan  # starts TorchTitan: not in make test-fast

CODE = r"""
import torch
from titan_integration.cpu_mode import enable_cpu_mode; enable_cpu_mode()
import torchmoe_ckpt as tmc
tmc.init_process_group("gloo")
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torchtitan.components.optimizer import OptimizersContainer, default_adamw
from torchtitan.distributed.flex_shard.dist_muon import DistMuon, build_dist_muon
from torchtitan.distributed.flex_shard.optimizer_reshard import BucketConfig, ComputeLayout, Owned
import titan_integration.sparse_trainer  # registers DistMuon's update rule
from titan_integration.titan_optimizers import init_titan_optimizer_state
from torchmoe_ckpt.model.optim_state import _check_coupling, rule_of

# 1. DistMuon does not run on CPU: TorchTitan refuses at construction.
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
w = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
try:
    layout = {"w": ComputeLayout({"fsdp": Owned()})}
    groups = [{"params": [w], "param_names": ["w"]}]
    build_dist_muon(groups, compute_sharding_by_fqn=layout, bucket_configs=[BucketConfig(("w",))], lr=0.01)
    raise SystemExit("DistMuon ran on CPU")
except ValueError as e:
    why = str(e)
assert "DistMuon requires one CUDA device per process" in why, why
print("distmuon-cpu:", why)

# 2. Its update rule, registered: per matrix (the last two dims).
rule = rule_of(DistMuon.__new__(DistMuon))
assert rule.coupling == "matrix"
_check_coupling("layers.0.moe.experts.w1", torch.empty(4, 8, 16), [0], DistMuon.__new__(DistMuon), rule, 4)  # ok
try:
    _check_coupling("w", torch.empty(32, 16), [0], DistMuon.__new__(DistMuon), rule, 4)
    raise SystemExit("a cut 2-D matrix was accepted")
except tmc.UncapturedStateError as e:
    assert "DistMuon orthogonalises each matrix (the last two dims) as a whole" in str(e) and "\n" not in str(e), e

# 3. bf16 states: made up front exactly as TorchTitan's pre-hook makes them; torch's CPU AdamW cannot step them.
def container(impl):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    cfg = default_adamw(lr=1e-3)
    cfg.implementation = impl
    return model, OptimizersContainer(cfg, model_parts=[model])

model, ours = container("fused_opt_states_bf16")
init_titan_optimizer_state(ours, "fused_opt_states_bf16")
model2, hooked = container("fused_opt_states_bf16")
for p in model2.parameters():
    p.grad = torch.zeros_like(p)
try:
    hooked.step()  # TorchTitan's pre-hook makes the bf16 state, then torch's CPU fused AdamW refuses it
    raise SystemExit("fp32 params with bf16 states stepped on CPU")
except RuntimeError as e:
    why = str(e)
assert "expected scalar type Float but found BFloat16" in why, why
print("bf16-cpu:", why)
for (p, q) in zip(model.parameters(), model2.parameters()):
    a, b = ours.optimizers[0].state[p], hooked.optimizers[0].state[q]
    assert a.keys() == b.keys() == {"step", "exp_avg", "exp_avg_sq"}, (a.keys(), b.keys())
    for k in a:
        assert (a[k].dtype, a[k].device, a[k].shape) == (b[k].dtype, b[k].device, b[k].shape), k
    assert a["exp_avg"].dtype == torch.bfloat16 and not a["exp_avg"].any() and not a["exp_avg_sq"].any()
model3, plain = container("foreach")
init_titan_optimizer_state(plain, "foreach")
assert plain.optimizers[0].state[next(model3.parameters())]["exp_avg"].dtype == torch.float32
print("ok")
"""


def test_distmuon_and_bf16_states_on_cpu_show_why_and_are_described_right():
    env = demo.child_env()
    proc = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=55)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout.split("\n")
    assert "ok" in out, proc.stdout
    assert any(ln.startswith("distmuon-cpu: DistMuon requires one CUDA device per process") for ln in out)
    assert any(ln.startswith("bf16-cpu:") for ln in out)


GRANULARITY = r"""
import torch
from titan_integration.cpu_mode import enable_cpu_mode; enable_cpu_mode()
from titan_integration.titan_optimizers import register_titan_optimizers; register_titan_optimizers()  # DistMuon's
from torchtitan.distributed.flex_shard.dist_muon import DistMuon
from torchtitan.models.deepseek_v3 import model_registry
from torchmoe_ckpt.model.operators import discover_operators
from torchmoe_ckpt.model.optim_state import attach_optimizer_state
from torchmoe_ckpt.model.update_rules import cut_couples, rule_of

with torch.device("meta"):  # TorchTitan's own debug flavor, sizes only
    model = model_registry("debugmodel").model.build()
params = [p for p in model.parameters()]
mats = [p for n, p in model.named_parameters() if p.dim() >= 2 and "tok_embeddings" not in n and "lm_head" not in n]

# DistMuon: per matrix, each [F, D] of a batch-first 3-D [E, F, D] on its own (its Newton-Schulz runs on the batch):
# an expert cut from dim 0 replays exactly, so every expert stays its own operator; a cut 2-D tensor would couple.
rule = rule_of(DistMuon.__new__(DistMuon))
assert rule.coupling == "matrix" and not cut_couples(rule, 3, (0,)) and cut_couples(rule, 2, (0,))
muon = DistMuon.__new__(DistMuon)  # its constructor refuses CPU tensors: only its class and param groups are read
muon._param_groups_frozen = False
torch.optim.Optimizer.__init__(muon, mats, {"lr": 0.01})
experts = [o.name for o in discover_operators(model, optimizer=muon) if o.kind == "expert"]
assert len(experts) == 5 * 8 and "layers.1.moe.experts.7" in experts, experts

# Adafactor on the same model: each MoE layer's w1/w2/w3 [8, 256, 256] together, one operator per layer.
ada = torch.optim.Adafactor(params)
ops = discover_operators(model, optimizer=ada)
merged = [o for o in ops if o.kind == "expert"]
assert [o.name for o in merged] == [f"layers.{i}.moe.experts" for i in range(1, 6)], [o.name for o in merged]
assert {p.fqn.rsplit(".", 1)[-1] for p in merged[0].pieces} == {"w1_EFD", "w2_EDF", "w3_EFD"}
assert [o.name for o in ops if o.kind == "router"] == [f"layers.{i}.moe.router" for i in range(1, 6)]
attach_optimizer_state(model, ops, ada)
print("ok", len(ops), "operators;", merged[0].merged)
"""


def test_distmuon_keeps_experts_and_adafactor_merges_them_on_the_titan_debug_model():
    """TorchTitan's deepseek_v3 debugmodel (on the meta device): DistMuon's registered rule is per matrix, so its
    grouped [8, 256, 256] experts stay one operator each; Adafactor makes each MoE layer's experts one operator."""
    proc = subprocess.run(
        [sys.executable, "-c", GRANULARITY], env=demo.child_env(), capture_output=True, text=True, timeout=55
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "ok" in proc.stdout and "Adafactor scales each update by the RMS" in proc.stdout, proc.stdout
