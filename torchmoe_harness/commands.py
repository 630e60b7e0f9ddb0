"""The harness's `torchmoe-ckpt` subcommands (selftest, bench, simulate, gpu-check, cluster), registered through the
entry-point group `torchmoe_ckpt.commands` (pyproject.toml), so the library's CLI lists them without importing the
harness.

Each `register_*` adds one subparser and sets `fn` (called with the parsed arguments, returns the exit code).
The work is imported only when the command runs: `torchmoe-ckpt --help` and `inspect` stay fast.
"""

from __future__ import annotations

import argparse
import json
import os

from torchmoe_ckpt.ops.cli import bounded

_positive = bounded(int, 1)
RANK_MEMORY_BYTES = 512 << 20  # what one harness rank needs at least (torch, the model, its slot buffers)


def max_ranks() -> int:
    """The most local ranks this machine runs: 4 per CPU core, and RANK_MEMORY_BYTES of memory each."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 1 << 40
    return max(1, min(4 * (os.cpu_count() or 1), memory // RANK_MEMORY_BYTES))


def _ranks(text: str) -> int:
    """--nproc: a count of local ranks this machine can run (an absurd number would start torchrun with it)."""
    n = _positive(text)
    if n > max_ranks():
        raise argparse.ArgumentTypeError(
            f"{text} is out of range: this machine runs at most {max_ranks()} local ranks "
            f"(4 per CPU core, {RANK_MEMORY_BYTES >> 20} MiB of memory each)"
        )
    return n


def _window(text: str):
    return None if text == "auto" else bounded(int, 1)(text)


def _selftest(a) -> int:
    if not 1 <= a.fail_at <= a.steps:
        raise ValueError(f"--fail-at {a.fail_at} must be in [1, --steps {a.steps}] (the iteration that fails)")
    if a.nproc % a.hsdp:
        raise ValueError(f"--hsdp {a.hsdp} must divide --nproc {a.nproc} (replicas x shards = ranks)")
    if a.model.startswith("hf:"):
        from torchmoe_harness.selftest_hf import selftest_hf

        if a.hsdp != 1 or a.phase != "update":
            raise ValueError(
                "--model hf:... runs FSDP2 with a real kill -9: --hsdp and --phase apply to the harness model"
            )
        res = selftest_hf(
            a.model[3:],
            a.nproc,
            a.experts,
            a.layers,
            a.steps,
            a.fail_at,
            a.dtype,
            a.window,
            a.seed,
            a.out,
            verbose=not a.quiet,
        )
    elif a.model == "harness":
        from torchmoe_harness.selftest import selftest

        res = selftest(
            a.nproc,
            a.experts,
            a.layers,
            a.steps,
            a.fail_at,
            a.hsdp,
            a.dtype,
            a.window,
            a.seed,
            a.phase,
            a.out,
            verbose=not a.quiet,
        )
    else:
        raise ValueError(
            f"--model {a.model!r}: use 'harness' (the built-in test model) or hf:<model_type>, e.g. "
            "hf:mixtral, hf:deepseek_v3"
        )
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        found = f" experts_per_moe_layer={res['experts_per_moe_layer']}" if "experts_per_moe_layer" in res else ""
        print(
            f"bit_exact={res['bit_exact']} compared_tensors={res['compared_tensors']} window={res['window']}{found} "
            f"replayed_iterations={res['replayed_iterations']} recovered_from_step={res['recovered_from_step']}"
        )
    return 0 if res["bit_exact"] else 1


def _bench(a) -> int:
    from torchmoe_harness.bench import report_markdown, run_bench, run_sections

    if a.sections:
        res = run_sections(a.out, a.sections.split(","), verbose=not a.quiet)
    else:
        res = run_bench(a.out, tuple(a.models.split(",")), a.nproc, a.overlap, verbose=not a.quiet)
    print(json.dumps(res, indent=1) if a.json else report_markdown(res))
    return 0


def _simulate(a) -> int:
    from torchmoe_harness.ettr import run_simulate

    res, text = run_simulate(a.out, a.failures, a.seeds, a.hours, a.bench)
    print(json.dumps(res, indent=1) if a.json else text)
    return 0


def register_selftest(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("selftest", help="reference run vs a run that fails and recovers; compares with torch.equal")
    s.add_argument(
        "--model",
        default="harness",
        help="'harness' (default), or hf:<model_type>: any transformers MoE model type built tiny, e.g. "
        "hf:mixtral, hf:deepseek_v3 (trained through the own-loop Checkpointer, killed with kill -9)",
    )
    s.add_argument("--nproc", type=_ranks, default=2)
    s.add_argument("--experts", type=_positive, default=4)
    s.add_argument("--layers", type=_positive, default=2)
    s.add_argument("--steps", type=_positive, default=12)
    s.add_argument("--fail-at", type=_positive, default=8)
    s.add_argument(
        "--phase",
        choices=("update", "copy"),
        default="update",
        help="fail before the optimizer step, or tear that iteration's snapshot copy",
    )
    s.add_argument("--hsdp", type=_positive, default=1, help="replicate degree (HSDP); 1 = FSDP2")
    s.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    s.add_argument("--window", type=_window, default=3, help="W, or 'auto'")
    s.add_argument("--seed", type=bounded(int, 0), default=0)
    s.add_argument("--out", default=None, help="keep run outputs here")
    s.add_argument("--json", action="store_true")
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(fn=_selftest)


def register_bench(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="measure slot bytes, training-thread wait and recovery cost")
    b.add_argument("--out", default="benchmarks/results")
    b.add_argument("--models", default="tiny")  # cpu-large: superseded by the MoE-regime section (bench_moe)
    b.add_argument("--nproc", type=_ranks, default=2)
    b.add_argument(
        "--overlap",
        type=bounded(float, 0.0, 1.0, low_open=True),
        default=0.05,
        help="share of an iteration one slot copy may take, in (0, 1]",
    )
    b.add_argument(
        "--sections",
        default=None,
        help="only these report sections (comma-separated: moe_regime, ettr, tiers, restart, peer_tier, families, "
        "policy_sweep), "
        "merged into OUT/bench.json and bench.md beside the results already there",
    )
    b.add_argument("--json", action="store_true")
    b.add_argument("--quiet", action="store_true")
    b.set_defaults(fn=_bench)


def register_simulate(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("simulate", help="ETTR simulator: MoEvement Table 3's shape (DeepSeek-MoE), measured systems")
    m.add_argument("--out", default="benchmarks/results/simulate.json")
    m.add_argument("--failures", choices=("poisson", "periodic"), default="poisson")
    m.add_argument("--seeds", type=_positive, default=20, help="Poisson runs averaged per cell")
    m.add_argument("--hours", type=bounded(float, 0.0, low_open=True), default=12.0)
    m.add_argument("--bench", default=None, help="bench.json: also the ETTR of its measured systems")
    m.add_argument("--json", action="store_true")
    m.set_defaults(fn=_simulate)


def register_gpu_check(sub: argparse._SubParsersAction) -> None:
    from torchmoe_harness.gpu_check import add_arguments, from_args

    g = sub.add_parser("gpu-check", help="the GPU check: exact recovery, replay check, benchmark (docs/gpu.md)")
    add_arguments(g)
    g.set_defaults(fn=from_args)


def register_cluster(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser(
        "cluster",
        help="real nodes on one machine (namespaces, a bridge, tc tbf) to rehearse node loss, blackholes and "
        "slow links with your own training script (docs/failure-recovery.md)",
    )
    from torchmoe_harness.cluster import register_subcommands

    register_subcommands(c.add_subparsers(dest="cluster_cmd", required=True))
