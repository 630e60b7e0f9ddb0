"""`make bench`'s report is made from its JSON: the committed report is what the committed results render to, and
one section can be redone and merged beside the others (`torchmoe-ckpt bench --sections NAME`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from torchmoe_harness.bench import SECTIONS, report_markdown, run_sections

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_committed_report_is_what_the_committed_results_render_to():
    """Read back from JSON (integer keys become strings; older results lack newer columns) every section
    renders, and bench.md was not edited by hand or left behind a rerun of one section."""
    full = json.loads((RESULTS / "bench.json").read_text())
    # every section has figures, or the results say why not (a section built after them: `not_measured`)
    missing = set(SECTIONS) - set(full)
    assert missing <= set(full.get("not_measured", {})), sorted(missing)
    assert all(why.strip() for why in full.get("not_measured", {}).values())
    assert report_markdown(full) == (RESULTS / "bench.md").read_text()


def test_one_section_is_rerun_and_merged_beside_the_others(tmp_path):
    out = tmp_path / "results"
    shutil.copytree(RESULTS, out, ignore=shutil.ignore_patterns("gpu", "*.png"))
    before = json.loads((out / "bench.json").read_text())
    before["families"] = {"rows": []}  # as if measured before the section existed
    (out / "bench.json").write_text(json.dumps(before))
    run_sections(str(out), ["families"], verbose=False)
    after = json.loads((out / "bench.json").read_text())
    assert {r["family"] for r in after["families"]["rows"]} == {
        "deepseek_v3",
        "qwen3",
        "gpt_oss",
        "kimi_k2_7",
        "qwen3_5",
    }
    assert {k: v for k, v in after.items() if k not in ("families", "section_seconds")} == {
        k: v for k, v in before.items() if k not in ("families", "section_seconds")
    }
    md = (out / "bench.md").read_text()
    assert md == report_markdown(after) and "## Cost per TorchTitan MoE family" in md and "## Peer tier" in md


def test_an_unknown_section_is_refused_naming_the_choices(tmp_path):
    with pytest.raises(SystemExit, match="choose from .*families.*peer_tier"):
        run_sections(str(tmp_path), ["famillies"], verbose=False)
