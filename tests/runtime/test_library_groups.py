"""The library's own collectives never touch the default process group (on a GPU job an NCCL group, which refuses
CPU tensors): the own loop trains, checkpoints, is killed and recovers bit-exactly under a default group that
really refuses every CPU collective (cuda_only_default_probe.py), and the library's gloo group is one, cached,
and made again for a new default group."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.events import find

from torchmoe_harness.launch import torchrun

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "tests" / "runtime" / "cuda_only_default_probe.py"


def run_probe(out: Path, run_id: str, fault: str | None = None, max_restarts: int = 0) -> tuple[list[dict], str]:
    out.mkdir(parents=True, exist_ok=True)
    env = {"OWN_LOOP_OUT": str(out), "TORCHMOE_FAULT": fault or ""}
    args = ["--steps", "10", "--run-id", run_id, "--host-dir", str(out / "shm"), "--window", "3"]
    log = torchrun(2, [str(PROBE), *args], out / "torchrun.log", 55.0, env, max_restarts)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)], log


def test_own_loop_and_recovery_never_use_a_default_group_that_refuses_cpu_tensors(tmp_path):
    ref, _ = run_probe(tmp_path / "ref", "ref")
    got, log = run_probe(tmp_path / "kill", "kill", fault="kill:point=optimizer:rank=1:step=8", max_restarts=1)
    assert find(log, "fault_injected") and find(log, "recovered", exact="true"), log[-3000:]
    for r in range(2):
        assert all(got[r]["checks"].values()), got[r]["checks"]  # incl.: the default group did refuse CPU tensors
        a, b = ref[r]["state"], got[r]["state"]
        assert a.keys() == b.keys() and any(k.startswith("['optim']['state']") for k in a)
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"rank {r}: {k} differs"
        after = sorted(got[r]["losses"])
        assert after and after[0] <= 8 and after[-1] == 10
        for s in after:
            assert torch.equal(ref[r]["losses"][s], got[r]["losses"][s]), f"rank {r}: loss at step {s}"


NEW_DEFAULT = """
import torch.distributed as dist
from torchmoe_ckpt.runtime.distributed import init_process_group, library_group
init_process_group("gloo")
first = library_group()
assert first is library_group() and first is not dist.group.WORLD and dist.get_backend(first) == "gloo"
dist.destroy_process_group()
assert library_group() is None
init_process_group("gloo")
second = library_group()
assert second is not first and second is library_group() and dist.get_backend(second) == "gloo"
print("ok")
"""


def test_library_group_is_made_once_per_default_group():
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", NEW_DEFAULT], capture_output=True, text=True, env=env, timeout=50)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
