"""`torchmoe-ckpt selftest --model hf:<type>`: transformers MoE families built tiny from code, FSDP2 on 2 ranks,
trained through the own-loop Checkpointer, one rank killed with kill -9 and recovered: every entry of the
model, optimizer and scheduler state dicts and every later loss torch.equal to a run that never failed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from torchmoe_harness.selftest_hf import selftest_hf

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast

CLI = [sys.executable, "-m", "torchmoe_ckpt.ops.cli"]


def check(res: dict, layers: int) -> None:
    assert res["bit_exact"], res["mismatches"]
    assert res["compared_tensors"] > 100 and res["compared_losses"] >= 6
    assert len(res["experts_per_moe_layer"]) == layers and all(n == 4 for n in res["experts_per_moe_layer"])
    assert res["replayed_iterations"] == 2 and res["recovery_source"] == "host"


def test_mixtral_fp32_from_the_command_line(tmp_path):
    out = subprocess.run(
        CLI
        + [
            "selftest",
            "--model",
            "hf:mixtral",
            "--nproc",
            "2",
            "--steps",
            "10",
            "--fail-at",
            "7",
            "--out",
            str(tmp_path),
            "--json",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=58,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    check(json.loads(out.stdout), layers=2)


def test_deepseek_v3_bf16_router_bias_buffer(tmp_path):
    # DeepSeek-V3 keeps its router's e_score_correction_bias as a persistent buffer; its first layer is dense.
    check(selftest_hf("deepseek_v3", dtype="bf16", steps=10, fail_at=7, out_dir=str(tmp_path), verbose=False), layers=1)


@pytest.mark.matrix
@pytest.mark.parametrize(
    "model_type,dtype,layers",
    [
        ("mixtral", "bf16", 2),
        ("deepseek_v3", "fp32", 1),
        ("qwen2_moe", "fp32", 2),
        ("olmoe", "bf16", 2),
        ("gpt_oss", "fp32", 2),
        ("deepseek_v4", "fp32", 2),
        ("afmoe", "fp32", 1),
    ],
)
def test_more_families(tmp_path, model_type, dtype, layers):
    check(selftest_hf(model_type, dtype=dtype, steps=10, fail_at=7, out_dir=str(tmp_path), verbose=False), layers)


def test_non_moe_model_type_is_one_line():
    out = subprocess.run(CLI + ["selftest", "--model", "hf:llama"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "not a Mixture-of-Experts model type" in out.stderr
