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

Then the same job with a pre-imported standby per rank (TORCHMOE_STANDBY=1, titan_integration/standby.py): the
restarted workers hand themselves over to it instead of importing torch and TorchTitan again.
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


def _one(d: Path, env: dict) -> dict:
    """One job with the kill; every rank's phases and the median over ranks."""
    shutil.rmtree(d, ignore_errors=True)
    job = recovery_demo.write_job(d, steps=STEPS, window=WINDOW, host_dir=d / "host")
    t0 = time.perf_counter()
    rc, log = recovery_demo.torchrun(d, env, job, nproc=2, fault=FAULT, timeout=280)
    wall = time.perf_counter() - t0
    (d / "torchrun.log").write_text(log)
    if rc != 0:
        raise RuntimeError(f"restart bench: torchrun exited {rc} (log: {d / 'torchrun.log'})")
    kill = float(re.search(r"event=fault_injected .* time=([0-9.]+)", log).group(1))
    per_rank, in_standby = [], []
    for rank in range(2):
        _, run_rec = recovery_demo.load_rank(d, rank)
        timing = json.loads((d / "export" / f"restart-timing-rank-{rank}-attempt-1.json").read_text())
        per_rank.append(_rank_phases(timing, kill))
        in_standby.append(bool((timing.get("standby") or {}).get("in_standby")))
    phases = {p: statistics.median(r[p] for r in per_rank) for p in (*PHASES, "total")}
    rec = run_rec["recovery"]
    shutil.rmtree(d / "host", ignore_errors=True)
    return {
        "phases_s": phases,
        "per_rank": per_rank,
        "wall_s": wall,
        "in_standby": all(in_standby),
        "recovered_step": rec["recovered_step"],
        "replayed_iterations": rec["replayed_iterations"],
        "recovery_phases_s": rec.get("phases"),
        "imports_share": phases["imports"] / phases["total"],
    }


def run(out: Path, say) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    say(f"restart: TorchTitan, 2 ranks, kill -9 of rank 1 in iteration {KILL_STEP}, time from the kill to training")
    env = recovery_demo.child_env()
    cold = _one(out / "restart", env)
    say("restart: the same with a pre-imported standby per rank (TORCHMOE_STANDBY=1)")
    warm = _one(out / "restart-standby", dict(env, TORCHMOE_STANDBY="1"))
    return dict(
        cold,
        ranks=2,
        kill=FAULT,
        ours_s=cold["phases_s"]["recovery"],
        standby=warm,
        speedup=cold["phases_s"]["total"] / warm["phases_s"]["total"],
    )


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
    sb = res.get("standby")
    if sb:
        lines[-2] = "| phase | seconds | share | with a standby (TORCHMOE_STANDBY=1) | what |"
        lines[-1] = "|---|---|---|---|---|"
    for p in PHASES:
        extra = f" {sb['phases_s'][p]:.2f} |" if sb else ""
        lines.append(f"| {p} | {ph[p]:.2f} | {ph[p] / ph['total'] * 100:.0f}% |{extra} {WHAT[p]} |")
    extra = f" **{sb['phases_s']['total']:.2f}** |" if sb else ""
    lines += [f"| **total** | **{ph['total']:.2f}** | 100% |{extra} |", ""]
    if sb:
        lines += [
            f"With a standby the restarted workers {'ran' if sb['in_standby'] else 'did NOT run'} in their rank's "
            f"pre-imported standby: kill to training {ph['total']:.2f} s -> {sb['phases_s']['total']:.2f} s "
            f"({res['speedup']:.1f}x); what was cut: the imports phase ({ph['imports']:.2f} s -> "
            f"{sb['phases_s']['imports']:.2f} s). Recovery itself: "
            + ", ".join(f"{k} {v:.2f} s" for k, v in (res.get("recovery_phases_s") or {}).items())
            + ".",
            "",
        ]
    return lines


def main() -> None:
    """The restart section alone: `python -m torchmoe_harness.bench_restart [OUT]`."""
    import sys

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tmoe-bench-restart")
    res = run(out, lambda m: print(f"[bench] {m}", flush=True))
    (out / "restart.json").write_text(json.dumps(res, indent=1))
    print("\n".join(markdown(res)))


if __name__ == "__main__":
    main()
