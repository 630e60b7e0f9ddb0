"""Run under torchrun by tests/titan_glue/test_titan_sparse.py: build TorchTitan's *stock* Trainer from the
given flags, call its stock CheckpointManager.load() (which follows --checkpoint.initial_load_path), and save each
rank's model parameters as loaded (local shards) to $PROBE_OUT/loaded-rank-R.pt. No training step runs, so what
is saved is exactly what TorchTitan read."""

import os
import sys

import torch

from titan_integration.cpu_mode import enable_cpu_mode

enable_cpu_mode()
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.tools.logging import init_logger  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

init_logger()

config = ConfigManager().parse_args(sys.argv[1:])
trainer = config.build()
assert type(trainer) is Trainer, type(trainer)
assert type(trainer.checkpointer).__name__ == "CheckpointManager", type(trainer.checkpointer)
loaded = trainer.checkpointer.load(step=-1)
rank = torch.distributed.get_rank()
out = {"loaded": torch.tensor(bool(loaded))}
for name, p in trainer.model_parts[0].named_parameters():
    out[f"param/{name}"] = (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
torch.save(out, os.path.join(os.environ["PROBE_OUT"], f"loaded-rank-{rank}.pt"))
torch.distributed.barrier()
os._exit(0)  # skip interpreter teardown (gloo threads), as titan_integration.train does
