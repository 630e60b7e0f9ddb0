"""torchrun entry for tests/api/test_own_loop.py: runs examples/own_loop.py unchanged, then writes every
tensor of this rank's final training state (model, optimizer and scheduler state dicts, local shards) and its losses."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from torchmoe_harness.hf_worker import flat_state

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from own_loop import main

if __name__ == "__main__":
    model, optimizer, scheduler, losses = main(sys.argv[1:])
    state = flat_state({"model": model.state_dict(), "optim": optimizer.state_dict(), "sched": scheduler.state_dict()})
    rank = int(os.environ.get("RANK", "0"))
    torch.save({"state": state, "losses": losses}, Path(os.environ["OWN_LOOP_OUT"]) / f"rank{rank}.pt")
    sys.stdout.flush()
    os._exit(0)  # skip gloo teardown (its threads occasionally abort at exit after the results are written)
