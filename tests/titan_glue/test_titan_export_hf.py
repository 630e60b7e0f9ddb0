"""`export-hf` of TorchTitan runs (issue 47): a 2-rank FSDP run of a family's tiny flavour with sparse checkpointing
(3 steps, W = 2: window 0 = steps 1-2, committed during step 3), window 0 exported with TorchTitan's own state-dict
adapter (`to_hf`, titan_integration/hf_export.py) into the transformers model of the same family:

* `from_pretrained` loads it with no missing, unexpected or mismatched keys;
* read back and mapped through the adapter's `from_hf`, every tensor is `torch.equal` to the TorchTitan model's
  parameter after step 1, the window's first step (a 1-step twin of the same job: its final state, the ranks'
  FSDP shards concatenated);
* transformers' logits on a fixed batch agree with TorchTitan's (the same exported weights in TorchTitan's tiny
  model, one process, fp32) within `LOGIT_BOUND` of the logits' scale (TorchTitan's bf16 expert GEMMs), and within
  `FP32_BOUND` with the routed experts zeroed in both (docs/torchtitan.md "Export to Hugging Face").

gpt_oss is refused in one line (TorchTitan 0.3.0's adapter drops every expert tensor), kimi_k2_7 and qwen3_5 too
(their `to_hf` fuses several tensors at once). qwen3 is the default case; deepseek_v3 is `matrix`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

from titan_integration import recovery_demo

pytestmark = pytest.mark.titan

REPO = Path(__file__).resolve().parents[2]

# max |HF logits - TorchTitan logits| / max |TorchTitan logits|, fp32 (docs/torchtitan.md "Export to Hugging Face").
# TorchTitan's routed experts multiply in bf16 whatever the parameters' dtype: bf16's unit roundoff is 2^-9 ~ 2e-3,
# and the routed experts' share of the logits is below their scale. Measured 4.2e-4 (qwen3), 8.3e-4 (deepseek_v3).
LOGIT_BOUND = {"qwen3": 2e-3, "deepseek_v3": 2e-3}
# The same with the routed experts zeroed in both: fp32 rounding only. Measured 2.7e-7 (qwen3), 6.0e-6 (deepseek_v3:
# MLA with YaRN RoPE, each library computing its frequencies and mscale in its own order).
FP32_BOUND = {"qwen3": 1e-5, "deepseek_v3": 3e-5}

COMPARE = r"""
import json, sys, torch
from titan_integration.cpu_mode import enable_cpu_mode; enable_cpu_mode()
from titan_integration import families, hf_export
from transformers import AutoModelForCausalLM
from safetensors import safe_open
from pathlib import Path

fam, hf_dir, ref_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
model, info = AutoModelForCausalLM.from_pretrained(
    str(hf_dir), output_loading_info=True, dtype=torch.float32, attn_implementation="eager"
)
hf = {}
for f in sorted(hf_dir.glob("*.safetensors")):
    with safe_open(str(f), framework="pt") as g:
        hf.update({k: g.get_tensor(k) for k in g.keys()})
adapter = hf_export.titan_adapter(fam)
titan_sd = adapter.from_hf(dict(hf))
shards = [torch.load(ref_dir / f"state-rank-{r}.pt", weights_only=True) for r in range(2)]
want = {k.removeprefix("param/"): torch.cat([s[k] for s in shards]) for k in shards[0] if k.startswith("param/")}
spec = families.model_spec(fam, "tiny", cpu=True)
with torch.device("meta"):
    titan = spec.model.build()
titan.to_empty(device="cpu")
with torch.no_grad():
    titan.init_weights(buffer_device=None)  # (its RoPE cache)
persistent = {k for k in titan.state_dict() if k not in titan_sd}  # buffers: expert_bias (rank 0's, replicated)
unexpected = sorted(set(titan_sd) - set(titan.state_dict()))
titan.load_state_dict(dict(titan_sd, **{k: shards[0]["buffer/" + k] for k in persistent}))  # merges wq/wk/wv
got = dict(titan.named_parameters())
missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want)) + unexpected
differ = sorted(k for k in want if k in got and not torch.equal(got[k].detach(), want[k]))
titan.eval()
batch = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(123))
pos = torch.arange(batch.shape[1]).expand_as(batch)
def titan_logits():
    return titan(batch, positions=pos, attention_masks=titan.get_attention_masks(positions=pos))

with torch.no_grad():
    b = model.eval()(batch).logits
    a_bias = titan_logits()  # with the run's expert_bias (TorchTitan's load balancing: top-k selection only)
    bias = {k: v for k, v in titan.named_buffers() if k.endswith("expert_bias_E")}
    hf_bias = {k: v for k, v in model.named_buffers() if k.endswith("e_score_correction_bias")}
    bias_max = max(v.abs().max().item() for v in bias.values())
    if not hf_bias:  # the HF model has no such bias (Qwen3-MoE): compare TorchTitan's routing without it
        for v in bias.values():
            v.zero_()
    a = titan_logits()
    # TorchTitan's grouped experts compute in bf16 whatever the parameters' dtype (common/moe.py: x.bfloat16() @
    # w.bfloat16()); without the routed experts (zeroed in both) everything else must agree to fp32 rounding
    for k, v in titan.named_parameters():
        if "routed_experts" in k:
            v.zero_()
    for k, v in model.named_parameters():
        if ".mlp.experts." in k:
            v.zero_()
    a0, b0 = titan_logits(), model(batch).logits
print("RESULT " + json.dumps({
    "info": {k: sorted(map(str, v)) for k, v in info.items()},
    "missing": missing, "extra": extra, "differ": differ, "tensors": len(want),
    "max_abs": (a - b).abs().max().item(), "scale": a.abs().max().item(),
    "max_abs_with_run_bias": (a_bias - b).abs().max().item(), "bias_dropped": not hf_bias,
    "bias_max": bias_max, "max_abs_no_routed": (a0 - b0).abs().max().item(), "scale_no_routed": a0.abs().max().item(),
    "argmax_agree": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
}))
"""


def _script(code: str, env: dict, *args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=55
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def _titan_run(d: Path, env: dict, fam: str, steps: int) -> Path:
    job = recovery_demo.write_job(d, steps=steps, window=2, host_dir=d / "host", family=fam)
    rc, out = recovery_demo.torchrun(d, env, job, nproc=2, timeout=55)
    assert rc == 0, out[-6000:]
    return d


def _export_cli(run: Path, out: Path, fam: str) -> subprocess.CompletedProcess:
    from titan_integration import hf_export

    cfg = out.parent / f"{fam}-config.json"
    hf_export.tiny_hf_config(fam).to_json_file(str(cfg))
    cmd = [sys.executable, "-m", "torchmoe_ckpt.ops.cli", "export-hf", str(run / "host" / "node-0" / "demo")]
    cmd += [str(out), "--model-config", str(cfg), "--titan-family", fam, "--window", "0"]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=55)


@pytest.mark.parametrize("fam", ["qwen3", pytest.param("deepseek_v3", marks=pytest.mark.matrix)])
def test_a_titan_window_exports_to_its_transformers_model(tmp_path, env, fam):
    run = _titan_run(tmp_path / "run", env, fam, steps=3)
    twin = _titan_run(tmp_path / "twin", env, fam, steps=1)  # the weights after step 1: window 0's first step
    proc = _export_cli(run, tmp_path / "hf", fam)
    assert proc.returncode == 0 and "exported window 0 (step 1, W=2)" in proc.stdout, proc.stderr[-3000:]
    got = _script(COMPARE, env, fam, str(tmp_path / "hf"), str(twin / "export"))
    print(f"\n{fam}: {proc.stdout.strip()}\n{fam}: {json.dumps(got)}")
    info = got["info"]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not got["missing"] and not got["extra"] and got["tensors"] > 20, got
    assert not got["differ"], f"differ from TorchTitan's parameters after step 1: {got['differ'][:5]}"
    assert got["max_abs"] <= LOGIT_BOUND[fam] * got["scale"], got
    assert got["max_abs_no_routed"] <= FP32_BOUND[fam] * got["scale_no_routed"], got


def test_gpt_oss_adapter_drops_every_expert_and_the_export_is_refused_in_one_line(tmp_path, env):
    """TorchTitan 0.3.0's gpt-oss `to_hf` maps no expert tensor (PR #4475's bug): the completeness check names
    the missing expert tensors in one line, and no folder is left."""
    run = _titan_run(tmp_path / "run", env, "gpt_oss", steps=3)
    proc = _export_cli(run, tmp_path / "hf", "gpt_oss")
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-3000:]
    assert "would miss 8 of its" in err[0] and "mlp.experts." in err[0], err[0]
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.partial-*"))


FUSING = r"""
import json, torch
from titan_integration.cpu_mode import enable_cpu_mode; enable_cpu_mode()
from titan_integration import families, hf_export
from torchmoe_ckpt.core.errors import ConfigError

out = {}
for fam in ("kimi_k2_7", "qwen3_5"):
    nm = hf_export.titan_name_map_for(fam)
    with torch.device("meta"):
        sd = families.model_spec(fam, "tiny", cpu=True).model.build().state_dict()
    try:
        for k, v in sd.items():
            nm(k, v)
        out[fam] = None
    except ConfigError as e:
        out[fam] = str(e)
print("RESULT " + json.dumps(out))
"""


def test_adapters_that_fuse_tensors_are_refused_in_one_line(env):
    """Kimi K2.5's and Qwen3.5's `to_hf` need several tensors at once (the vision q/k/v; in_proj q/k/v and the
    experts' w1/w3): the per-tensor name map says so in one line (no run needed: the meta model's names)."""
    got = _script(FUSING, env)
    for fam in ("kimi_k2_7", "qwen3_5"):
        assert got[fam] and "\n" not in got[fam] and "fuses several tensors" in got[fam], got


def test_an_unknown_titan_family_is_one_line(tmp_path, capsys):
    from torchmoe_ckpt.ops.cli import main

    rc = main(["export-hf", str(tmp_path), str(tmp_path / "hf"), "--model-config", "qwen3_moe", "--titan-family", "x"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "'x' is not a TorchTitan MoE family; fix: use one of" in err, err
    assert not (tmp_path / "hf").exists()
