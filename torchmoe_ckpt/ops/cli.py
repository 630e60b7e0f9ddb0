"""The `torchmoe-ckpt` command: `inspect`, `verify` and `export-hf`; further subcommands come from installed packages
through the entry-point group `torchmoe_ckpt.commands` (each names a `register(subparsers)` that adds one subparser with
`fn(args) -> exit code`), so the library never imports what sits on top of it."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from importlib.metadata import entry_points

COMMANDS_GROUP = "torchmoe_ckpt.commands"
# Name maps for export-hf that live above the library (TorchTitan's adapters: titan_integration/hf_export.py), found
# by entry point so that the library never imports what sits on top of it.
NAME_MAPS_GROUP = "torchmoe_ckpt.hf_name_maps"


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (`torchmoe-ckpt verify: error: ...`) and exit 2, like every other
    error of the command. Subparsers inherit the class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def bounded(kind, low=None, high=None, low_open: bool = False):
    """An argparse `type=` that converts with `kind` and checks low <= value <= high (low < value: `low_open`)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}") from None
        too_low = low is not None and (value <= low if low_open else value < low)
        if value != value or too_low or (high is not None and value > high):
            want = f"> {low}" if low_open else f">= {low}"
            if high is not None:
                want = f"in {'(' if low_open else '['}{low}, {high}]"
            raise argparse.ArgumentTypeError(f"{text} is out of range: must be {want}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _json_arg(text: str) -> dict:
    try:
        value = json.loads(open(text[1:]).read() if text.startswith("@") else text)
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"not a JSON object or @file.json: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError('must be a JSON object, e.g. \'{"key": "..."}\'')
    return value


def _inspect(a) -> int:
    """`inspect`, and `verify` (the same listing, then every problem and the verdict on stderr)."""
    from .inspection import format_inspect, inspect_location, verify_location

    where = (a.location, a.storage_options)
    ok, info = verify_location(*where) if a.cmd == "verify" else (True, inspect_location(*where))
    print(json.dumps(info, indent=1, default=str) if a.json else format_inspect(info))
    if a.cmd != "verify":
        return 0
    for problem in info["problems"]:
        print(f"verify: problem: {problem}", file=sys.stderr)
    verdict = f"FAILED ({len(info['problems'])} problem(s) listed above)"
    if ok:
        verdict = "OK, every committed window is complete and every file matches its manifest"
    print(f"verify: {verdict}", file=sys.stderr)
    return 0 if ok else 1


def _export_hf(a) -> int:
    """`export-hf`: a Hugging Face model folder from slot 0 of a committed window (export/hf_folder.py)."""
    from ..export.hf_folder import HFExportOptions, export_hf

    name_map = None
    if a.titan_family:  # TorchTitan's own state-dict adapter of that family (titan_integration/hf_export.py)
        name_map = _name_map_plugin("titan")(a.titan_family, a.titan_flavor)
    opts = HFExportOptions(
        name_map=name_map,
        window=a.window,
        step=a.step,
        dtype=a.dtype,
        max_shard_bytes=a.max_shard_size,
        storage_options=a.storage_options,
        overwrite=a.overwrite,
    )
    report = export_hf(a.location, a.out, a.model_config, opts)
    print(json.dumps(report.to_dict(), indent=1) if a.json else report.line())
    return 0


def _name_map_plugin(name: str):
    """The `torchmoe_ckpt.hf_name_maps` entry point `name`: (family, flavour) -> a name map for export_hf."""
    found = {ep.name: ep for ep in entry_points(group=NAME_MAPS_GROUP)}
    if name not in found:
        raise ValueError(
            f"--titan-family needs the {name!r} name map of the titan_integration package (entry point group "
            f"{NAME_MAPS_GROUP}): install this project with its TorchTitan extra (pip install -e '.[titan]')"
        )
    try:
        return found[name].load()
    except ImportError as exc:
        raise ValueError(f"--titan-family needs titan_integration and torchtitan ({exc})") from None


def _add_export_hf(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("export-hf", help="Hugging Face safetensors (shards, index, config.json) of a committed window")
    c.add_argument("location", help="the run's directory in any tier, or its object-store URI")
    c.add_argument("out", help="the folder to write (local; must not exist, or be empty, unless --overwrite)")
    c.add_argument(
        "--model-config",
        required=True,
        help="the transformers config.json the run's model was built from (or its folder, or a model type)",
    )
    which = c.add_mutually_exclusive_group()
    which.add_argument("--window", type=bounded(int, 0), default=None, help="a committed window's id (default: newest)")
    which.add_argument("--step", type=bounded(int, 0), default=None, help="the window whose first step this is")
    c.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="fp32: master weights (refused where slot 0 has only bf16 compute weights); bf16: compute weights",
    )
    c.add_argument(
        "--titan-family",
        default=None,
        help="a TorchTitan run: map names with that family's state-dict adapter (to_hf), e.g. qwen3, deepseek_v3",
    )
    c.add_argument("--titan-flavor", default="tiny", help="the TorchTitan flavour the run trained (default: tiny)")
    c.add_argument("--max-shard-size", default="1 GiB", help="the largest shard, e.g. '1 GiB' (default)")
    c.add_argument("--storage-options", type=_json_arg, default=None, help="fsspec options as JSON, or @file.json")
    c.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.set_defaults(fn=_export_hf)


def register_plugins(sub: argparse._SubParsersAction) -> list[str]:
    """Add the subcommands of every installed `torchmoe_ckpt.commands` entry point (sorted by name); one that
    fails to load is reported on stderr and left out. Returns the names."""
    added = []
    for ep in sorted({ep.name: ep for ep in entry_points(group=COMMANDS_GROUP)}.values(), key=lambda e: e.name):
        if ep.name in sub.choices:
            continue
        try:
            ep.load()(sub)
        except Exception as exc:  # a broken plugin must not take the built-in commands down with it
            print(
                f"torchmoe-ckpt: command {ep.name!r} ({ep.value}) is unavailable: {type(exc).__name__}: {exc}",
                file=sys.stderr,
            )
            continue
        added.append(ep.name)
    return added


def main(argv: list[str] | None = None) -> int:
    """The `torchmoe-ckpt` command: `inspect` and `verify` a location, `export-hf` a window, plus the subcommands
    other packages register (entry points; the harness adds its own).

    Args:
        argv: the arguments after the program name (None: sys.argv[1:]).

    Returns:
        The exit status: 0 (done; `verify`: everything verified), 1 (`verify`: a problem found), 2 (an error,
        said in one line on stderr).

    Raises:
        SystemExit: bad arguments (one line on stderr, status 2) or --help (status 0), from argparse.
    """
    ap = OneLineParser(prog="torchmoe-ckpt", description="Sparse per-iteration checkpointing for MoE training")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, fn, text in (
        ("inspect", _inspect, "windows, slots, operators, sizes and checksum status"),
        ("verify", _inspect, "exit 0 only if every file of every committed window verifies"),
    ):
        c = sub.add_parser(name, help=text)
        c.add_argument(
            "location",
            help="host-tier run directory (e.g. /dev/shm/torchmoe-ckpt/node-0/<run>) or "
            "object-store URI (s3://bucket/prefix, az://container/prefix, file://...)",
        )
        c.add_argument(
            "--storage-options",
            type=_json_arg,
            default=None,
            help="fsspec options as JSON, or @file.json (e.g. endpoint_url, key/secret, connection_string)",
        )
        c.add_argument("--json", action="store_true")
        c.set_defaults(fn=fn)
    _add_export_hf(sub)
    register_plugins(sub)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return a.fn(a)
    except Exception as exc:  # every error is one line and exit 2; a traceback is for our bugs, not user input
        text = " ".join(str(exc).split())
        kind = "" if isinstance(exc, (ValueError, RuntimeError, OSError)) else f"{type(exc).__name__}: "
        print(f"torchmoe-ckpt {a.cmd}: error: {kind}{text or type(exc).__name__}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
