"""Fault injection (faults.py): with TORCHMOE_FAULT_STATE naming a folder that does not exist yet, the fault
still fires (the folder is created for its marker), and only once per job."""

import os
import signal
import subprocess
import sys

import pytest
from support.events import find

pytestmark = pytest.mark.torchrun  # starts torchrun/gloo processes or servers: not in make test-fast

PROGRAM = (
    "from torchmoe_ckpt.runtime import faults\n"
    "faults.set_iteration(3)\n"
    "faults.point('forward')\n"
    "print('survived', flush=True)\n"
)


def _run(state):
    env = dict(os.environ, TORCHMOE_FAULT="kill:point=forward:rank=0:step=2", TORCHMOE_FAULT_STATE=str(state), RANK="0")
    return subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=50)


def test_fault_state_folder_that_does_not_exist_is_created_and_the_fault_fires_once(tmp_path):
    state = tmp_path / "not" / "there"
    first = _run(state)
    assert first.returncode == -signal.SIGKILL, (first.returncode, first.stdout, first.stderr)
    assert find(first.stderr, "fault_injected", action="kill", point="forward", rank=0, iteration=3), first.stderr
    assert (state / "fault-0").exists()
    second = _run(state)  # the next attempt of the same job: already fired
    assert second.returncode == 0 and "survived" in second.stdout, (second.returncode, second.stderr)
