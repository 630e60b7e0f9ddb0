"""Lock-race probe for tests/ownership/test_run_lock.py: N racer processes (forked here, synchronised by a
barrier per trial) take over the same stale run lock at once, trial after trial; prints, as JSON, how many
racers won each trial (returned from run_lock.acquire instead of being refused).

    python lock_race_probe.py ROOT TRIALS RACERS
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import socket
import subprocess
import sys
from pathlib import Path

from torchmoe_ckpt.ownership import run_lock


def racer(root: Path, trials: int, barrier, wins) -> None:
    for t in range(trials):
        barrier.wait()
        try:
            run_lock.acquire(root / f"trial-{t:03d}", leader=True, wait_s=5)
            with wins.get_lock():
                wins[t] += 1
        except run_lock.RunLockedError:
            pass
    barrier.wait()  # every racer stays alive (a live holder) until every trial is judged


def main() -> None:
    root, trials, n = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    logging.getLogger("torchmoe_ckpt").setLevel(logging.ERROR)  # one takeover line per trial otherwise
    dead = subprocess.Popen(["true"])
    dead.wait()  # a holder whose process is gone: its lock is stale
    host = socket.gethostname()
    for t in range(trials):
        d = root / f"trial-{t:03d}"
        d.mkdir(parents=True)
        (d / run_lock.LOCK_NAME).write_text(
            json.dumps({"job": f"gone@{host}:{dead.pid}", "host": host, "pid": dead.pid})
        )
    ctx = mp.get_context("fork")  # this process imports nothing that runs threads
    barrier, wins = ctx.Barrier(n), ctx.Array("i", trials)
    procs = [ctx.Process(target=racer, args=(root, trials, barrier, wins)) for _ in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    print(json.dumps({"wins": list(wins), "exit_codes": [p.exitcode for p in procs], "pid": os.getpid()}))


if __name__ == "__main__":
    main()
