"""`export-hf` of a window written by a 2-rank FSDP2 run (torchrun, gloo): the pieces of both ranks merged, read in
one process; loaded with `from_pretrained`, its tensors and logits `torch.equal` to the training model's (gathered)
at the window's first step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from torchmoe_ckpt.ops.cli import main
from torchmoe_harness.launch import torchrun

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes: not in make test-fast

PROBE = Path(__file__).with_name("export_probe.py")


def test_a_window_of_a_2_rank_fsdp2_run_exports_exactly(tmp_path, capsys):
    host, out = tmp_path / "shm", tmp_path / "out"
    out.mkdir()
    torchrun(2, [str(PROBE), "--host-dir", str(host), "--out", str(out)], out / "torchrun.log", 55.0)
    ref = torch.load(out / "reference.pt", weights_only=True)
    run = host / "node-0" / "ranks"
    assert sorted(p.name for p in (run / "window-000000").glob("MANIFEST.*")) == [
        "MANIFEST.rank-00000.json",
        "MANIFEST.rank-00001.json",
    ]
    cfg = str(out / "config.json")
    rc = main(["export-hf", str(run), str(tmp_path / "hf"), "--model-config", cfg, "--window", "0"])
    printed, err = capsys.readouterr()
    assert rc == 0 and "exported window 0 (step 1, W=3)" in printed, (printed, err)
    model, info = AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), output_loading_info=True, dtype=torch.float32, attn_implementation="eager"
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    got, want = model.state_dict(), ref["states"][1]
    assert got.keys() == want.keys()
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, bad[:5]
    with torch.no_grad():
        assert torch.equal(model.eval()(ref["batch"]).logits, ref["logits"][1])
