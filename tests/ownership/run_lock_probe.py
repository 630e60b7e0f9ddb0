"""torchrun worker for tests/ownership/test_run_lock.py: build this rank's tiers (which takes the run's lock), say so,
hold the run for a while, optionally die on the first attempt so torchrun restarts the same job.

    torchrun --nproc_per_node 2 tests/ownership/run_lock_probe.py ROOT RUN_ID HOLD_S [die]
"""

from __future__ import annotations

import logging
import os
import sys
import time

from torchmoe_ckpt.config import TierConfig
from torchmoe_ckpt.persist.build_tiers import build_tiers


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    root, run_id, hold_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    tiers = build_tiers(TierConfig(root=root, run_id=run_id), rank, world)  # RunLockedError: refused at start
    print(f"event=holding rank={rank} attempt={attempt} run_dir={tiers.host.dir}", flush=True)
    if "die" in sys.argv[4:] and attempt == 0 and rank == 0:
        os._exit(1)  # a crash: torchrun restarts the same job, which must take its own lock over
    time.sleep(hold_s)


if __name__ == "__main__":
    main()
