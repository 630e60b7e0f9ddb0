"""Demo: train the tiny DeepSeek-V3 MoE with TorchTitan's real trainer on 2 CPU ranks, then summarise.

    python -m titan_integration.demo                 # 6 steps, 2 ranks, ~30 s on 2 cores
    python -m titan_integration.demo --steps 20 --nproc 2 -- --checkpoint.enable --checkpoint.interval 5

It runs ``torchrun --standalone --nproc_per_node N -m titan_integration.train ...`` (offline:
HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled), streams rank 0's log, and prints a
table of loss and step time per step parsed from it. Extra arguments (after ``--`` or any
unrecognised ``--section.option``) go to TorchTitan unchanged. Exit status: 0 on success, the
child's status otherwise (1 if training ran but logged a non-finite loss).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

DEFAULT_DUMP = "outputs/titan-demo"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RANK_PREFIX = re.compile(r"^\[(?:default|rank)(\d+)\]:")
_TS = r"(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"
_STEP_LINE = re.compile(_TS + r".*?step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+)\s+grad_norm:\s*(?P<gn>\S+)")
_START_LINE = re.compile(_TS + r".*Training starts at step")


@dataclass
class StepRecord:
    step: int
    loss: float
    grad_norm: float
    seconds: float | None  # wall time since the previous step's log line (rank 0)


def _ts(s: str) -> float:
    return datetime.strptime(s, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def parse_steps(lines: list[str]) -> list[StepRecord]:
    """Parse TorchTitan's per-step metric lines (rank 0, ANSI colours stripped) into records."""
    records: list[StepRecord] = []
    last_ts: float | None = None
    for raw in lines:
        line = _ANSI.sub("", raw)
        m = _START_LINE.search(line)
        if m:
            last_ts = _ts(m["ts"])
            continue
        m = _STEP_LINE.search(line)
        if not m:
            continue
        ts = _ts(m["ts"])
        records.append(
            StepRecord(
                step=int(m["step"]),
                loss=float(m["loss"]),
                grad_norm=float(m["gn"]),
                seconds=None if last_ts is None else ts - last_ts,
            )
        )
        last_ts = ts
    return records


def format_summary(records: list[StepRecord]) -> str:
    out = ["", "step      loss  grad_norm  step_time(s)", "----  --------  ---------  ------------"]
    for r in records:
        secs = f"{r.seconds:12.3f}" if r.seconds is not None else f"{'-':>12}"
        out.append(f"{r.step:4d}  {r.loss:8.4f}  {r.grad_norm:9.4f}  {secs}")
    steady = [r.seconds for r in records[1:] if r.seconds is not None]
    if steady:
        out.append(f"median step time (steps 2..{records[-1].step}): {statistics.median(steady):.3f} s")
    if len(records) >= 2:
        out.append(f"loss {records[0].loss:.4f} -> {records[-1].loss:.4f}")
    return "\n".join(out)


def build_command(args: argparse.Namespace, extra: list[str]) -> list[str]:
    bin_dir = Path(sys.executable).parent
    torchrun = bin_dir / "torchrun"
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    cmd = launcher + [
        "--standalone",
        "--nproc_per_node",
        str(args.nproc),
        "--tee",
        "3",
        "--local-ranks-filter",
        "0",
        "-m",
        "titan_integration.train",
        # A job file (--config job.toml) names its own model; --module only goes with a config function.
        *([] if args.config.endswith(".toml") else ["--module", args.module]),
        "--config",
        args.config,
        "--training.steps",
        str(args.steps),
        "--dump_folder",
        str(Path(args.dump_folder).absolute()),
    ]
    return cmd + extra


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        WANDB_MODE="disabled",
        PYTHONUNBUFFERED="1",
    )
    env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun would pick; also silences its banner
    # torch 2.13: a fresh rendezvous store per round, so a replacement host can join (docs/torchtitan.md)
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # Make `-m titan_integration.train` importable from any CWD without an installed package.
    repo_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH")) if p)
    return env


def run(cmd: list[str], env: dict[str, str], echo: bool = True) -> tuple[int, list[str], list[str], str | None]:
    """Run torchrun; stream rank 0's lines. Returns (rc, rank0_lines, launcher_lines, error_line)."""
    rank0: list[str] = []
    launcher: list[str] = []
    error_line: str | None = None
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.rstrip("\n")
        m = _RANK_PREFIX.match(line)
        if m:
            line = line[m.end() :]
            rank0.append(line)
            if line.startswith("error: ") and error_line is None:
                error_line = line
                continue  # printed once at the end, without torchrun's failure report
            if echo:
                print(line, flush=True)
        else:
            launcher.append(line)  # torchrun's own output: only shown if the run fails
    return proc.wait(), rank0, launcher, error_line


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(prog="python -m titan_integration.demo", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6, help="training steps (default 6)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--module", default="titan_integration.config_registry")
    p.add_argument(
        "--config",
        default="deepseek_v3_tiny",
        help="config function name, or a TOML job file (job.toml, see docs/torchtitan.md)",
    )
    p.add_argument(
        "--dump-folder",
        default=None,
        help=f"TorchTitan dump folder (default {DEFAULT_DUMP}, which is wiped first unless --keep; "
        "a folder you name is never wiped)",
    )
    p.add_argument("--keep", action="store_true", help=f"do not wipe {DEFAULT_DUMP} first")
    p.add_argument("--quiet", action="store_true", help="do not stream the training log")
    args, unknown = p.parse_known_args(argv)
    extra = unknown + extra

    if args.dump_folder is None:
        args.dump_folder = DEFAULT_DUMP
        if Path(DEFAULT_DUMP).exists() and not args.keep:
            shutil.rmtree(DEFAULT_DUMP)  # a stale checkpoint there would make TorchTitan resume

    cmd = build_command(args, extra)
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    rc, rank0, launcher, error_line = run(cmd, child_env(), echo=not args.quiet)
    wall = time.perf_counter() - t0

    if error_line is not None:
        print(error_line, file=sys.stderr)
        return rc or 2
    if rc != 0:
        print("\n".join(launcher), file=sys.stderr)
        print(f"error: training failed (torchrun exit status {rc}) after {wall:.1f} s", file=sys.stderr)
        return rc

    records = parse_steps(rank0)
    print(format_summary(records))
    print(f"wall time: {wall:.1f} s ({args.nproc} ranks, {len(records)} steps)")
    if not records:
        print("error: no step lines found in the training log", file=sys.stderr)
        return 1
    if not all(math.isfinite(r.loss) for r in records):
        print("error: non-finite loss", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
