"""Cost per TorchTitan MoE family: slot bytes over dense bytes and the auto W of each family's debug flavour and
tiny flavour (titan_integration/family_costs.py). Sizes from the meta-device model, not timings: a few seconds,
most of it importing TorchTitan, in a child process (CPU mode's patches stay out of the bench process).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from titan_integration import recovery_demo
from titan_integration.family_costs import FamilyCost
from titan_integration.family_costs import markdown as cost_rows


def run(out: Path, say) -> dict:
    say("families: slot bytes / dense bytes and auto W per TorchTitan MoE family (meta device)")
    proc = subprocess.run(
        [sys.executable, "-m", "titan_integration.family_costs", "--json"],
        env=recovery_demo.child_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return {"rows": [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]}


def markdown(res: dict) -> list[str]:
    rows = [FamilyCost(**dict(r, forced={int(w): v for w, v in r["forced"].items()})) for r in res["rows"]]
    return [
        "## Cost per TorchTitan MoE family (AdamW state, bf16 compute weights for frozen operators)",
        "",
        "Mean slot bytes / dense snapshot bytes at a forced W, and the auto W for a copy budget of 0.3 x the dense "
        "snapshot (in brackets: its mean slot ratio). Debug flavours at TorchTitan's sizes; tiny: ours.",
        "",
        *cost_rows(rows),
        "",
    ]
