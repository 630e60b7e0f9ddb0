"""Train a few steps with a SparseCheckpointer that is never closed, then exit normally."""

import os
import sys

import torch
import torch.distributed as dist

from torchmoe_harness.baselines.ours import Ours
from torchmoe_harness.trainer import RunConfig, Trainer

os.environ.update(
    MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1"
)
torch.set_num_threads(1)
dist.init_process_group("gloo")
model = {
    "vocab_size": 256,
    "dim": 128,
    "n_layers": 2,
    "n_heads": 4,
    "num_experts": 32,
    "expert_hidden": 512,
    "max_seq_len": 64,
}
trainer = Trainer(RunConfig(model=model, batch_size=1, seq_len=33, steps=100))
ours = Ours(trainer, window=4).attach(trainer)
for _ in range(6):
    ours.after_step(trainer, trainer.train_step())
print("trained", flush=True)
