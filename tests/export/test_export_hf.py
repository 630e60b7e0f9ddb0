"""`export_hf` / `torchmoe-ckpt export-hf`: tiny transformers MoE models trained in the own loop (one process), a
committed window that is not the newest exported to a Hugging Face folder, read back with `from_pretrained`: no
missing or unexpected keys, every tensor `torch.equal` to the training model's at that window's first step (fp32),
the logits on a fixed batch `torch.equal` too. A name map that drops an expert tensor, fp32 from bf16 compute
weights and a window no one committed are refused in one line, leaving no folder."""

from __future__ import annotations

import json
import shutil
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import torchmoe_ckpt as tmc
from torchmoe_ckpt.ops.cli import main
from torchmoe_harness.hf_models import build_hf_model

STEPS = 7  # W = 3: windows 0 (steps 1..3) and 1 (4..6) committed, 2 in flight
BATCH = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(123))  # the fixed batch of the logits
# three structures: Mixtral (grouped experts), Qwen2-MoE (a shared expert and its gate, attention biases),
# DeepSeek-V3 (MLA attention, a dense first layer, shared experts, the router's e_score_correction_bias buffer)
MODELS = {"mixtral": {}, "qwen2_moe": {}, "deepseek_v3": {"layers": 3}}


@dataclass
class Trained:
    model: torch.nn.Module
    run: Path  # the host tier's run directory
    states: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # step -> state dict after it
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # step -> the training model's logits on BATCH


def train(root: Path, model_type: str, run_id: str, sparse: tmc.SparseConfig, compute_dtype=None, **sizes) -> Trained:
    torch.manual_seed(0)
    model = build_hf_model(model_type, seed=0, **sizes)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def forward_backward(tokens: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(tokens[:, :-1]).logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss

    tiers = tmc.TierConfig(root=str(root), run_id=run_id)
    cfg = tmc.CheckpointConfig(tiers=tiers, window=sparse, max_grad_norm=1.0, compute_dtype=compute_dtype)
    out = Trained(model, root / "node-0" / run_id)
    with tmc.Checkpointer(model, opt, forward_backward, None, cfg) as ck:
        for step in range(ck.resume() + 1, STEPS + 1):
            ck.step(torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(step)))
            out.states[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            model.eval()  # (eval forwards are not counted by the router hooks)
            with torch.no_grad():
                out.logits[step] = model(BATCH).logits.clone()
            model.train()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Trained]:
    root = tmp_path_factory.mktemp("shm")
    return {t: train(root, t, t, tmc.SparseConfig(window=3), **sizes) for t, sizes in MODELS.items()}


def loaded(out: Path, dtype=torch.float32):
    model, info = AutoModelForCausalLM.from_pretrained(
        str(out), output_loading_info=True, dtype=dtype, attn_implementation="eager"
    )
    return model.eval(), info


def assert_equal_to_step(model, trained: Trained, step: int, dtype=torch.float32) -> None:
    want = trained.states[step]
    got = model.state_dict()
    assert got.keys() == want.keys()
    bad = [k for k in want if not (got[k].dtype == dtype and torch.equal(got[k], want[k].to(dtype)))]
    assert not bad, f"differ from the training model at step {step}: {bad[:5]}"


@pytest.mark.parametrize("model_type", list(MODELS))
def test_an_older_window_exports_to_a_folder_transformers_loads_exactly(runs, model_type, tmp_path):
    trained = runs[model_type]
    newest = max(int(p.parent.name.split("-")[1]) for p in trained.run.glob("window-*/MANIFEST.*"))
    assert newest == 1
    t0 = time.perf_counter()
    tracemalloc.start()
    report = tmc.export_hf(
        trained.run, tmp_path / "hf", trained.model.config, tmc.HFExportOptions(window=0, max_shard_bytes="64 KiB")
    )
    _, traced = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"\n{model_type}: {report.line()}; Python allocations (tracemalloc) peak {traced} B")
    assert (report.window_id, report.start_step, report.window, report.dtype) == (0, 1, 3, "fp32")
    assert report.peak_held_bytes <= report.memory_bound_bytes < report.total_bytes  # streamed: < the whole model
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    shards = [f"model-{i:05d}-of-{report.shards:05d}.safetensors" for i in range(1, report.shards + 1)]
    assert report.shards > 1 and files == sorted(["config.json", "model.safetensors.index.json", *shards])
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["torchmoe_ckpt"]["window"] == 0 and sorted(set(index["weight_map"].values())) == shards
    model, info = loaded(tmp_path / "hf")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert_equal_to_step(model, trained, 1)
    with torch.no_grad():
        assert torch.equal(model(BATCH).logits, trained.logits[1])
    assert not torch.equal(trained.logits[1], trained.logits[4])  # (the windows differ: the test can tell them)
    assert time.perf_counter() - t0 < 30


def test_step_and_newest_choose_the_window_and_the_cli_writes_the_same(runs, tmp_path, capsys):
    trained = runs["mixtral"]
    cfg = tmp_path / "config.json"
    trained.model.config.to_json_file(str(cfg))
    rc = main(["export-hf", str(trained.run), str(tmp_path / "cli"), "--model-config", str(cfg), "--step", "4"])
    out, err = capsys.readouterr()
    assert rc == 0 and "exported window 1 (step 4, W=3)" in out, (out, err)
    assert_equal_to_step(loaded(tmp_path / "cli")[0], trained, 4)
    report = tmc.export_hf(trained.run, tmp_path / "newest", cfg)  # newest by default: window 1 too
    assert (report.window_id, report.start_step) == (1, 4)
    capsys.readouterr()  # (transformers' loading progress)
    rc = main(["export-hf", str(trained.run), str(tmp_path / "x"), "--model-config", str(cfg), "--step", "5"])
    _, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and "step 5 is no committed window's first step" in err, err
    assert "0 (step 1), 1 (step 4)" in err and not (tmp_path / "x").exists()
    rc = main(["export-hf", str(trained.run), str(tmp_path / "x"), "--model-config", str(cfg), "--window", "2"])
    _, err = capsys.readouterr()
    assert rc == 2 and "window 2: not committed by every rank" in err or "window 2: no such window" in err, err


def test_a_name_map_that_drops_an_expert_tensor_is_refused_in_one_line_and_leaves_no_folder(runs, tmp_path):
    trained = runs["qwen2_moe"]
    drop = "model.layers.1.mlp.experts.down_proj"

    def name_map(fqn: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        return {} if fqn == drop else {fqn: t}

    opts = tmc.HFExportOptions(window=0, name_map=name_map)
    with pytest.raises(tmc.IncompleteExportError) as exc:
        tmc.export_hf(trained.run, tmp_path / "hf", trained.model.config, opts)
    msg = str(exc.value)
    assert "\n" not in msg and "would miss 1 of its" in msg and msg.endswith(drop), msg
    assert list(tmp_path.iterdir()) == []  # no folder, no temporary one
    rc = main(["export-hf", str(trained.run), str(tmp_path / "t"), "--model-config", "mixtral"])
    assert rc == 2 and list(tmp_path.iterdir()) == []  # the wrong model: refused too


def test_bf16_compute_weights_export_in_bf16_and_fp32_is_refused(tmp_path):
    """compute_dtype bf16: slot 0 holds fp32 masters of its active operators only, so an fp32 export is refused
    (one line, naming --dtype bf16); the bf16 export equals the training model's weights rounded to bf16."""
    trained = train(tmp_path / "shm", "mixtral", "mp", tmc.SparseConfig(window=3), compute_dtype=torch.bfloat16)
    with pytest.raises(tmc.IncompleteExportError) as exc:
        tmc.export_hf(trained.run, tmp_path / "fp32", trained.model.config, tmc.HFExportOptions(window=0))
    assert "\n" not in str(exc.value) and "--dtype bf16" in str(exc.value) and not (tmp_path / "fp32").exists()
    report = tmc.export_hf(trained.run, tmp_path / "bf16", trained.model.config, tmc.HFExportOptions(dtype="bf16"))
    assert report.dtype == "bf16" and "bfloat16" in report.source, report.source
    model, info = loaded(tmp_path / "bf16", dtype=torch.bfloat16)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert_equal_to_step(model, trained, report.start_step, torch.bfloat16)


def test_a_dense_snapshot_exports_its_master_weights(tmp_path):
    trained = train(tmp_path / "shm", "mixtral", "dense", tmc.SparseConfig(policy="dense", dense_interval=2))
    report = tmc.export_hf(trained.run, tmp_path / "hf", trained.model)  # the model itself names the target
    assert report.window == 1 and report.source.startswith("master weights"), report
    model, info = loaded(tmp_path / "hf")
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert_equal_to_step(model, trained, report.start_step)
    with torch.no_grad():
        assert torch.equal(model(BATCH).logits, trained.logits[report.start_step])


def test_an_object_store_uri_exports_the_same_and_a_flipped_byte_is_refused(runs, tmp_path):
    """The same run read through fsspec (file://: ranged reads, as from s3:// or az://) exports the same tensors;
    a byte flipped in slot 0's data is caught by its item checksum: refused in one line, no folder left."""
    trained = runs["deepseek_v3"]
    store = tmp_path / "store" / "run"
    internal = lambda d, names: [n for n in names if n.startswith(".") and n != ".metadata"]  # noqa: E731
    shutil.copytree(trained.run, store, ignore=internal)  # the windows, as the store holds them
    report = tmc.export_hf(f"file://{store}", tmp_path / "hf", trained.model.config, tmc.HFExportOptions(step=1))
    assert report.window_id == 0
    assert_equal_to_step(loaded(tmp_path / "hf")[0], trained, 1)
    data = store / "window-000000" / "slot-00" / "rank-00000" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(tmc.CorruptCopyError) as exc:
        tmc.export_hf(f"file://{store}", tmp_path / "bad", trained.model.config, tmc.HFExportOptions(window=0))
    msg = str(exc.value)
    assert "\n" not in msg and "(corrupt)" in msg and "older window" in msg, msg
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad.partial-*"))
