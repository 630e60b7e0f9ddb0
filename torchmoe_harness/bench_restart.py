"""`make bench` section: where a TorchTitan restart's time goes, from the kill to the first trained iteration.

One job (TorchTitan's DeepSeek-V3 tiny, 2 CPU ranks under ``torchrun --max-restarts 1``, the job-file path,
sparse window W=3) in which rank 1 is killed with SIGKILL before the backward of iteration 5; the restarted
workers recover from host memory and train on. Each worker logs its own marks
(titan_integration/restart_timing.py); the kill's time is the fault injection's. Phases, in seconds, the
median over the ranks:

  agent_restart   kill -> the new worker process started (torchrun noticed, stopped the other rank, spawned)
  imports         process start -> TorchTitan's main() (Python, torch, TorchTitan, our launcher's checks)
  process_group   TorchTitan's config parse, init_process_group, device meshes
  model_build     model, parallelisation, optimizer, LR schedulers, data loader
  recovery        tiers, run identity, newest window found, loaded and replayed (W-1 iterations)
  first_step      the first iteration trained after the recovery
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import time
from pathlib import Path

from titan_integration import recovery_demo
from titan_integration.restart_timing import PHASES

STEPS, WINDOW, KILL_STEP = 8, 3, 5
FAULT = f"kill:point=backward:rank=1:step={KILL_STEP}"
WHAT = {
    "agent_restart": "torchrun: failure noticed, other rank stopped, new workers spawned",
    "imports": "Python, torch, TorchTitan, our launcher's checks",
    "process_group": "TorchTitan config parse, init_process_group, device meshes",
    "model_build": "model, FSDP, optimizer, LR schedulers, data loader",
    "recovery": f"window found, loaded, {WINDOW - 1} iterations replayed",
    "first_step": "first iteration trained after recovery",
}


def _rank_phases(timing: dict, kill: float) -> dict[str, float]:
    """One rank's phases, with agent_restart and total from the fault's kill time (every rank has the marks)."""
    marks = timing["marks"]
    out = {p: timing[p] for p in PHASES if p != "agent_restart"}
    out["agent_restart"] = round(marks["process_start"] - kill, 3)
    out["total"] = round(marks["first_step"] - kill, 3)
    return out


def run(out: Path, say) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    d = out / "restart"
    shutil.rmtree(d, ignore_errors=True)
    say(f"restart: TorchTitan, 2 ranks, kill -9 of rank 1 in iteration {KILL_STEP}, time from the kill to training")
    job = recovery_demo.write_job(d, steps=STEPS, window=WINDOW, host_dir=d / "host")
    t0 = time.perf_counter()
    rc, log = recovery_demo.torchrun(d, recovery_demo.child_env(), job, nproc=2, fault=FAULT, timeout=280)
    wall = time.perf_counter() - t0
    (d / "torchrun.log").write_text(log)
    if rc != 0:
        raise RuntimeError(f"restart bench: torchrun exited {rc} (log: {d / 'torchrun.log'})")
    kill = float(re.search(r"event=fault_injected .* time=([0-9.]+)", log).group(1))
    per_rank = []
    for rank in range(2):
        _, run_rec = recovery_demo.load_rank(d, rank)
        timing = json.loads((d / "export" / f"restart-timing-rank-{rank}-attempt-1.json").read_text())
        per_rank.append(_rank_phases(timing, kill))
    phases = {p: statistics.median(r[p] for r in per_rank) for p in (*PHASES, "total")}
    rec = run_rec["recovery"]
    res = {
        "phases_s": phases,
        "per_rank": per_rank,
        "wall_s": wall,
        "ranks": 2,
        "kill": FAULT,
        "recovered_step": rec["recovered_step"],
        "replayed_iterations": rec["replayed_iterations"],
        "ours_s": phases["recovery"],
        "imports_share": phases["imports"] / phases["total"],
    }
    shutil.rmtree(d / "host", ignore_errors=True)
    return res


def markdown(res: dict) -> list[str]:
    ph = res["phases_s"]
    lines = [
        "## Restart of a TorchTitan job after kill -9 (2 CPU ranks, deepseek_v3 tiny)",
        "",
        f"From the kill (`{res['kill']}`) to the first iteration trained after recovery, median over ranks; "
        f"recovered iteration {res['recovered_step']} by replaying {res['replayed_iterations']}.",
        "",
        "| phase | seconds | share | what |",
        "|---|---|---|---|",
    ]
    for p in PHASES:
        lines.append(f"| {p} | {ph[p]:.2f} | {ph[p] / ph['total'] * 100:.0f}% | {WHAT[p]} |")
    lines += [f"| **total** | **{ph['total']:.2f}** | 100% | |", ""]
    return lines
