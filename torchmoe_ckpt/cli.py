"""The `torchmoe-ckpt` command."""
from __future__ import annotations

import argparse
import json
import logging
import sys


def _selftest(a) -> int:
    from .selftest import selftest
    res = selftest(a.nproc, a.experts, a.layers, a.steps, a.fail_at, a.hsdp, a.dtype, a.window, a.seed, a.phase,
                   a.out, verbose=not a.quiet)
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        print(f"bit_exact={res['bit_exact']} compared_tensors={res['compared_tensors']} window={res['window']} "
              f"replayed_iterations={res['replayed_iterations']} recovered_from_step={res['recovered_from_step']}")
    return 0 if res["bit_exact"] else 1


def _bench(a) -> int:
    from .bench import report_markdown, run_bench
    res = run_bench(a.out, tuple(a.models.split(",")), a.nproc, a.overlap, verbose=not a.quiet)
    print(json.dumps(res, indent=1) if a.json else report_markdown(res))
    return 0


def _simulate(a) -> int:
    from .ettr import run_simulate
    res, text = run_simulate(a.out, a.failures, a.seeds, a.hours, a.bench)
    print(json.dumps(res, indent=1) if a.json else text)
    return 0


def _json_arg(text: str) -> dict:
    try:
        value = json.loads(open(text[1:]).read() if text.startswith("@") else text)
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"not a JSON object or @file.json: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"key\": \"...\"}'")
    return value


def _inspect(a) -> int:
    from .inspect import format_inspect, inspect_location, main_json
    info = inspect_location(a.location, a.storage_options)
    print(main_json(info) if a.json else format_inspect(info))
    return 0


def _verify(a) -> int:
    from .inspect import format_inspect, main_json, verify_location
    ok, info = verify_location(a.location, a.storage_options)
    print(main_json(info) if a.json else format_inspect(info))
    print("verify: OK, every file matches its manifest" if ok else "verify: FAILED (see problems above)",
          file=sys.stderr)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="torchmoe-ckpt", description="Sparse per-iteration checkpointing for MoE training")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("selftest", help="reference run vs a run that fails and recovers; compares with torch.equal")
    s.add_argument("--nproc", type=int, default=2)
    s.add_argument("--experts", type=int, default=4)
    s.add_argument("--layers", type=int, default=2)
    s.add_argument("--steps", type=int, default=12)
    s.add_argument("--fail-at", type=int, default=8)
    s.add_argument("--phase", choices=("update", "copy"), default="update",
                   help="fail before the optimizer step, or tear that iteration's snapshot copy")
    s.add_argument("--hsdp", type=int, default=1, help="replicate degree (HSDP); 1 = FSDP2")
    s.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    s.add_argument("--window", type=lambda v: None if v == "auto" else int(v), default=3, help="W, or 'auto'")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", default=None, help="keep run outputs here")
    s.add_argument("--json", action="store_true")
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(fn=_selftest)
    b = sub.add_parser("bench", help="measure slot bytes, training-thread wait and recovery cost")
    b.add_argument("--out", default="benchmarks/results")
    b.add_argument("--models", default="tiny,cpu-large")
    b.add_argument("--nproc", type=int, default=2)
    b.add_argument("--overlap", type=float, default=0.05, help="share of an iteration one slot copy may take")
    b.add_argument("--json", action="store_true")
    b.add_argument("--quiet", action="store_true")
    b.set_defaults(fn=_bench)
    m = sub.add_parser("simulate", help="ETTR simulator: MoEvement Table 3's shape (DeepSeek-MoE), measured systems")
    m.add_argument("--out", default="benchmarks/results/simulate.json")
    m.add_argument("--failures", choices=("poisson", "periodic"), default="poisson")
    m.add_argument("--seeds", type=int, default=20, help="Poisson runs averaged per cell")
    m.add_argument("--hours", type=float, default=12.0)
    m.add_argument("--bench", default=None, help="bench.json: also the ETTR of its measured systems")
    m.add_argument("--json", action="store_true")
    m.set_defaults(fn=_simulate)
    for name, fn, text in (("inspect", _inspect, "windows, slots, operators, sizes and checksum status"),
                           ("verify", _verify, "exit 0 only if every file of every committed window verifies")):
        c = sub.add_parser(name, help=text)
        c.add_argument("location", help="host-tier run directory (e.g. /dev/shm/torchmoe-ckpt/node-0/<run>) or "
                                        "object-store URI (s3://bucket/prefix, az://container/prefix, file://...)")
        c.add_argument("--storage-options", type=_json_arg, default=None,
                       help="fsspec options as JSON, or @file.json (e.g. endpoint_url, key/secret, connection_string)")
        c.add_argument("--json", action="store_true")
        c.set_defaults(fn=fn)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return a.fn(a)
    except (ValueError, RuntimeError) as exc:
        print(f"torchmoe-ckpt {a.cmd}: error: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc}",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
