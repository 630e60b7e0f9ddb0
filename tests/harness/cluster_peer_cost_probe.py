"""By hand, not a test: the per-iteration cost of the peer tier on two cluster nodes at given link rates.

    sudo PYTHONPATH=. python tests/harness/cluster_peer_cost_probe.py 40 40mbit 4mbit

For each rate, the same fault-free job (the harness model, 2 nodes x 1 rank, W=3, host tier on each node's
/dev/shm) with replicas = 0 and replicas = 1; prints the median and mean step time (the first 3 steps left out)
and what the peer tier sent. One run each: a data point, not a benchmark (that is issue #39's `make bench` part).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import test_cluster as cl  # the tests' spec and program helpers

from torchmoe_harness.cluster import Cluster


def main(steps: int, rates: list[str]) -> None:
    root = Path(tempfile.mkdtemp(prefix="tmoe-peer-cost-"))
    for rate in rates:
        for replicas in (0, 1):
            out = root / f"{rate}-r{replicas}"
            out.mkdir(parents=True)
            spec = cl._spec(replicas)
            spec["run"] = {"steps": steps, "dtype": "fp32"}
            with Cluster(nodes=2, link_rate=rate, out=out / "cluster") as c:
                for n in c.nodes:
                    c.start(n, cl._program(out, "job", spec))
                codes = c.wait(600)
            assert codes == [0, 0], f"exit codes {codes}; logs in {out / 'cluster'}"
            report = json.loads((out / "report.json").read_text())
            s = report["step_seconds"][3:]
            peers = report["checkpoint"].get("peers") or {}
            print(
                f"{rate} replicas={replicas}: median step {statistics.median(s) * 1e3:.1f} ms, mean "
                f"{statistics.mean(s) * 1e3:.1f} ms over {len(s)} steps; peer bytes sent {peers.get('bytes_sent', 0)}, "
                f"replication lag max {peers.get('replication_lag_s_max', 0):.2f} s",
                flush=True,
            )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40, sys.argv[2:] or ["40mbit", "4mbit"])
