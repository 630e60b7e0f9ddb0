"""The recovery story on TorchTitan's MoE: train, kill a rank with ``kill -9``, recover, prove it is exact.

    python -m titan_integration.recovery_demo          # = make demo: 2 ranks, 10 steps, W=3, ~1-2 min
    python -m titan_integration.recovery_demo --nproc 2 --steps 12 --window 4 --kill-step 9 --layout ep2
    python -m titan_integration.recovery_demo --model qwen3     # = make demo DEMO_ARGS="--model qwen3"

Two runs of the same job file (TorchTitan's deepseek_v3 tiny, or ``--model FAMILY``'s CPU flavour: any MoE family
of titan_integration/families.py, under ``torchrun``, CPU/gloo,
``[sparse_checkpoint] enable = true``):

1. a fault-free reference run;
2. the same run where rank 1 is killed with SIGKILL in iteration ``--kill-step`` (the library's fault
   injection, ``TORCHMOE_FAULT``). ``torchrun --max-restarts 1`` restarts every worker; they find the
   newest committed window in host memory (``/dev/shm``), rebuild the dense state by replaying the window
   with frozen operators, and train on. Before recovery every parameter is overwritten with noise, so
   anything recovery forgot would show.

Then every rank's final model, optimizer state (exp_avg, exp_avg_sq, step), buffers (expert bias), LR and
every loss after the recovery are compared with ``torch.equal`` against the reference, and a short report
says which window was used, where the copy came from, how many iterations were replayed, how long recovery
took and whether the result is bit-exact. Exit status 0 only if it is.

The test suite (tests/titan_glue/test_titan_sparse.py) runs the same functions.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from titan_integration.families import FAMILIES, missing  # torch-free: TorchTitan is imported by the runs only

LAYOUTS = {  # name: (ranks, job-file lines)
    "fsdp2": (2, ""),
    "ep2": (2, "[parallelism]\nexpert_parallel_degree = 2"),
    "tp2": (2, "[parallelism]\ntensor_parallel_degree = 2"),  # TP alone (titan_integration/tensor_parallel.py)
    "hsdp2x2": (4, "[parallelism]\ndata_parallel_replicate_degree = 2\ndata_parallel_shard_degree = 2"),
    "pp2": (
        2,
        '[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_schedule = "1F1B"\n'
        "pipeline_parallel_microbatch_size = 2",
    ),
}
DEFAULT_OUT = "outputs/titan-recovery-demo"


def write_job(
    d: Path,
    *,
    steps: int,
    window: int,
    host_dir: Path,
    extra_sparse: str = "",
    extra: str = "",
    seed: int = 7,
    hang_timeout_s: float = 60,
    family: str = "deepseek_v3",
) -> Path:
    """A TorchTitan job file (our TOML loader) with sparse checkpointing on, for one model ``family``
    (titan_integration.families: its CPU flavour)."""
    d.mkdir(parents=True, exist_ok=True)
    model = "" if family == "deepseek_v3" else f'[model]\nname = "{family}"\n'
    text = f"""
dump_folder = "{d / "dump"}"
{model}[training]
steps = {steps}
[debug]
seed = {seed}
deterministic = true
[sparse_checkpoint]
enable = true
window = {window}
root = "{host_dir}"
run_id = "demo"
hang_timeout_s = {hang_timeout_s}
{extra_sparse}
{extra}
"""
    path = d / "job.toml"
    path.write_text(text)
    return path


def child_env() -> dict[str, str]:
    from titan_integration.demo import child_env as env

    e = env()
    e.pop("TORCHMOE_FAULT", None)
    return e


def torchrun(
    d: Path,
    env: dict[str, str],
    job: Path | None,
    *,
    nproc: int,
    fault: str | None = None,
    timeout: float = 280,
    echo: Callable[[str], None] | None = None,
    train_args: list[str] = (),
    script: str | None = None,
    max_restarts: int = 1,
) -> tuple[int, str]:
    """``torchrun --max-restarts 1`` of ``titan_integration.train --config job`` (plus ``train_args``; or of
    ``script``); a SparseTrainer exports each rank's final state and run record into ``d/export``.
    Returns (exit status, combined output)."""
    e = dict(env, TORCHMOE_TITAN_EXPORT=str(d / "export"), TORCHMOE_TITAN_SCRAMBLE="1")
    if fault:
        e["TORCHMOE_FAULT"] = fault
    bin_torchrun = Path(sys.executable).parent / "torchrun"
    launcher = [str(bin_torchrun)] if bin_torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    target = [script] if script else ["-m", "titan_integration.train"] + (["--config", str(job)] if job else [])
    cmd = launcher + [
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        "--tee",
        "3",
        *target,
        *train_args,
    ]
    proc = subprocess.Popen(cmd, cwd=d, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if echo is not None:
            echo(line.rstrip("\n"))
        if time.monotonic() > deadline:
            # SIGTERM, not SIGKILL: torchrun then stops its workers, which lead sessions of their own and would
            # otherwise outlive it (orphans training on, on a shared machine)
            proc.terminate()
            try:
                proc.wait(40)
            except subprocess.TimeoutExpired:
                proc.kill()
            break
    rc = proc.wait()
    return rc, "".join(lines)


def load_rank(d: Path, rank: int) -> tuple[dict, dict]:
    """(final state, newest run record) of one rank, as the trainer exported them."""
    import torch

    state = torch.load(d / "export" / f"state-rank-{rank}.pt", weights_only=True)
    runs = sorted(glob.glob(str(d / "export" / f"run-rank-{rank}-attempt-*.json")))
    return state, json.loads(Path(runs[-1]).read_text())


@dataclass
class RankComparison:
    rank: int
    tensors: int
    differing: list[str]
    losses_compared: list[int]
    losses_equal: bool
    recovery: dict | None
    attempt: int
    checkpoint: dict = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        return not self.differing and self.losses_equal and bool(self.losses_compared)


def compare(reference: Path, run: Path, nproc: int) -> list[RankComparison]:
    """Every rank's final state and every loss after the recovery, ``torch.equal`` against the reference."""
    import torch

    out = []
    for rank in range(nproc):
        want, ref_run = load_rank(reference, rank)
        got, got_run = load_rank(run, rank)
        keys = sorted(set(want) | set(got))
        differing = [k for k in keys if k not in want or k not in got or not torch.equal(want[k], got[k])]
        rec = got_run["recovery"]
        first = (rec or {}).get("recovered_step", 0) + 1
        steps = sorted(int(s) for s in ref_run["loss_bits"] if int(s) >= first)
        equal = all(got_run["loss_bits"].get(str(s)) == ref_run["loss_bits"][str(s)] for s in steps)
        out.append(
            RankComparison(
                rank, len(keys), differing, steps, equal, rec, got_run["attempt"], got_run.get("checkpoint") or {}
            )
        )
    return out


def _pipeline_lines(rec: dict) -> list[str]:
    plan = rec.get("plan") or {}
    lines = [f"plan           {plan.get('mode')}: {plan.get('reason')}"]
    for st in rec["stages"]:
        role = st.get("role", "-")
        what = {
            "healthy": "kept its live state, waited for the others",
            "recovered": "replayed alone from its window and its neighbours' logs",
            "global": "rolled back to the common window, replayed it with every stage",
        }.get(role, role)
        extra = ""
        if role in ("recovered", "global"):
            extra = (
                f"; window {st['window_id']} (from iteration {st['window_start']}) -> iteration "
                f"{st['target_step']} in {st['seconds']:.2f} s"
            )
        lines.append(
            f"stage {st['stage']}        {role}: {what}; recomputed {st['replayed_total']} iterations; "
            f"waited/recovered {st['wait_or_recovery_s']:.2f} s{extra}"
        )
    return lines


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def format_report(
    ranks: list[RankComparison],
    *,
    layout: str,
    fault: str,
    window: int,
    kill_step: int,
    wall_reference: float,
    wall_failure: float,
    family: str = "deepseek_v3",
) -> str:
    r0 = ranks[0]
    rec = r0.recovery or {}
    ck = r0.checkpoint
    exact = all(r.exact for r in ranks)
    lines = [
        "",
        "== recovery report " + "=" * 60,
        f"job            TorchTitan {family} tiny, {len(ranks)} ranks ({layout}), sparse window W={window}",
        f"failure        {fault}; torchrun restarted the workers (attempt {r0.attempt})",
    ]
    if "stages" in rec:  # pipeline parallelism: a plan and one role per stage
        lines += _pipeline_lines(rec)
    elif rec.get("window_id") is not None:
        lines += [
            f"window         {rec['window_id']} (state after iteration {rec['start_step']} + "
            f"{rec['window'] - 1} sparse slots), newest committed",
            f"copy from      {rec.get('source')} tier",
            f"replayed       {rec['replayed_iterations']} iterations with frozen operators -> state after "
            f"iteration {rec['recovered_step']}; training went on from iteration {rec['recovered_step'] + 1}",
            "lost           "
            + (
                f"iterations {rec['recovered_step'] + 1}..{kill_step - 1} ran before the failure and again after it"
                if rec["recovered_step"] + 1 < kill_step
                else "nothing"
            )
            + f"; iteration {kill_step} was the one that failed",
            f"recovery time  {rec['seconds']:.2f} s (load {_mib(rec['bytes_loaded'])} + replay "
            f"{rec['replay_seconds']:.2f} s); restart to trained state {rec.get('restart_seconds', 0.0):.2f} s",
        ]
    else:
        lines.append(f"window         none found: cold start ({rec})")
    if ck.get("dense_bytes"):
        lines.append(
            f"checkpoint     mean slot {_mib(ck['mean_slot_bytes'])} = "
            f"{ck['mean_slot_bytes'] / ck['dense_bytes']:.2f} x dense state ({_mib(ck['dense_bytes'])}) "
            f"per rank per iteration; training thread waited {ck['wait_seconds_total'] * 1e3:.1f} ms in all"
        )
    for r in ranks:
        what = "yes" if r.exact else "NO"
        lines.append(
            f"rank {r.rank}         bit-exact: {what} ({r.tensors} tensors: params, exp_avg, exp_avg_sq, "
            f"step, buffers, LR; losses of iterations {r.losses_compared[0] if r.losses_compared else '-'}.."
            f"{r.losses_compared[-1] if r.losses_compared else '-'} "
            f"{'identical' if r.losses_equal else 'DIFFER'})"
            + ("" if not r.differing else f"; differing: {', '.join(r.differing[:4])}")
        )
    verdict = "BIT-EXACT: the recovered run equals the run that never failed" if exact else "NOT EXACT"
    lines += [
        f"wall time      reference run {wall_reference:.1f} s, run with the failure {wall_failure:.1f} s",
        f"result         {verdict}",
        "=" * 79,
    ]
    return "\n".join(lines)


def _progress(prefix: str) -> Callable[[str], None]:
    """Show what matters from a run: torchmoe events, TorchTitan's step lines of rank 0, torchrun restarts."""
    import re

    ansi = re.compile(r"\x1b\[[0-9;]*m")

    def echo(line: str) -> None:
        line = ansi.sub("", line)
        keep = (
            "event=fault_injected" in line
            or "torchmoe:" in line
            or "will restart worker group" in line
            or "event=pp_" in line
            or ("[default0]" in line and " step:" in line)
        )
        if keep:
            print(f"{prefix} {line.split(']:', 1)[-1].strip()}", flush=True)

    return echo


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m titan_integration.recovery_demo", description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=list(FAMILIES), default="deepseek_v3", help="TorchTitan MoE family")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="fsdp2")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--window", type=int, default=3)
    p.add_argument("--kill-step", type=int, default=7)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--out", default=DEFAULT_OUT, help=f"working folder, wiped first (default {DEFAULT_OUT})")
    p.add_argument("--host-dir", default=None, help="host-memory tier (default /dev/shm/torchmoe-demo-<uid>)")
    args = p.parse_args(argv)
    nproc, extra = LAYOUTS[args.layout]
    if not (1 <= args.kill_step <= args.steps and 0 <= args.kill_rank < nproc and args.window >= 1):
        print(
            f"error: need 1 <= --kill-step <= --steps, 0 <= --kill-rank < {nproc}, --window >= 1; "
            "fix: e.g. --steps 10 --window 3 --kill-step 7 --kill-rank 1",
            file=sys.stderr,
        )
        return 2
    why = missing(args.model)
    if why is not None:
        print(f"error: --model {args.model}: {why}", file=sys.stderr)
        return 2
    out = Path(args.out).absolute()
    host = Path(args.host_dir or f"/dev/shm/torchmoe-demo-{os.getuid()}")
    for d in (out, host):
        shutil.rmtree(d, ignore_errors=True)
    env = child_env()
    fault = f"kill:point=backward:rank={args.kill_rank}:step={args.kill_step}"
    fault_text = f"kill -9 of rank {args.kill_rank} in iteration {args.kill_step} (before its backward pass)"
    print(
        f"[demo] TorchTitan {args.model} tiny, {nproc} ranks ({args.layout}), {args.steps} iterations, "
        f"sparse checkpoint every iteration over a window of {args.window}",
        flush=True,
    )
    runs = {}
    for name, f in (("reference", None), ("failure", fault)):
        d = out / name
        job = write_job(d, steps=args.steps, window=args.window, host_dir=host / name, extra=extra, family=args.model)
        print(f"[demo] {name} run: " + ("no failure" if f is None else fault_text), flush=True)
        t0 = time.perf_counter()
        rc, text = torchrun(d, env, job, nproc=nproc, fault=f, echo=_progress(f"[{name}]"))
        runs[name] = time.perf_counter() - t0
        if rc != 0:
            print(text[-4000:], file=sys.stderr)
            print(f"error: the {name} run failed (torchrun exit status {rc}); its log is above", file=sys.stderr)
            return rc
    ranks = compare(out / "reference", out / "failure", nproc)
    print(
        format_report(
            ranks,
            layout=args.layout,
            fault=fault_text,
            window=args.window,
            kill_step=args.kill_step,
            wall_reference=runs["reference"],
            wall_failure=runs["failure"],
            family=args.model,
        )
    )
    shutil.rmtree(host, ignore_errors=True)
    return 0 if all(r.exact for r in ranks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
