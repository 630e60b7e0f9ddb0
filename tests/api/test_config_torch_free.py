"""`torchmoe_ckpt.config` imports no torch: a launcher (TorchTitan's `[sparse_checkpoint]` section) builds and checks
every config before torch loads. Checked in a fresh interpreter, where nothing imported torch before."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECK = """
import sys
import torchmoe_ckpt as tmc
import torchmoe_ckpt.config as c
import titan_integration.sparse_config as s
cfg = c.CheckpointConfig(tiers={"run_id": "r", "object_store": {"uri": "memory://x"}}, window={"window": 3})
sec = s.SparseCheckpointSection.from_table({"enable": True, "window": 3, "object_store": {"uri": "memory://x"}})
sec.core_config(), sec.checkpoint_config()
assert tmc.CheckpointConfig is c.CheckpointConfig
print("torch" in sys.modules)
assert tmc.ReplayPolicy is c.ReplayPolicy and tmc.OperatorSpec is c.OperatorSpec  # the public names, unchanged
"""


def test_config_imports_no_torch():
    proc = subprocess.run(
        [sys.executable, "-c", CHECK],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False", "torchmoe_ckpt.config (or the [sparse_checkpoint] section) imported torch"
