"""torchrun probe of runtime.agreement.LaggedMin on 2 gloo ranks: each call returns the previous call's MIN over
the ranks, never waits for the one it starts, and runs off the default group. Prints one JSON line per rank."""

from __future__ import annotations

import json
import os

import torch.distributed as dist

from torchmoe_ckpt.runtime.agreement import LaggedMin
from torchmoe_ckpt.runtime.distributed import init_process_group

init_process_group("gloo")
rank = dist.get_rank()
lag = LaggedMin()
got = [lag.exchange(10.0 + rank, first=-1.0)]  # nothing agreed yet: `first`
got.append(lag.exchange(20.0 + 5 * rank, first=-1.0))  # the first call's MIN
got.append(lag.exchange(3.0 - rank, first=-1.0))  # the second's
got.append(lag.settle())  # the third's, waited for
got.append(lag.settle())  # none in flight
lag.exchange(1.0, first=-1.0)
lag.drop()  # given up: nothing waited (every rank started it, so gloo finishes it alone)
dist.barrier()
print(json.dumps({"rank": rank, "got": got}), flush=True)
os._exit(0)  # as the harness leaves: gloo's threads occasionally abort a process tearing its groups down
