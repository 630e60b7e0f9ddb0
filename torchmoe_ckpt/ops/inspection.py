"""`torchmoe-ckpt inspect` and `verify`: what a checkpoint location holds, and whether every byte verifies.

A location is a run directory in the tiers' layout (storage_format/layout.py), a directory above several runs, or an
object store in the tensorstore format, read through fsspec; each writer's copy is checked by the tiers' own
code (tiers/window_tier.py). Dense exports (`step-N` directories with DCP's `.metadata`) are listed too."""

from __future__ import annotations

import re

from ..storage_format.files import StoreFiles
from ..storage_format.layout import METADATA, is_internal, parse_manifest_name, parse_window_dirname, writer_rank
from ..storage_format.manifest import WindowManifest, slot_metadata_file, written_world_size
from ..storage_format.store_open import explain, open_store
from ..tiers.window_tier import FilesWindowTier

_STEP_DIR = re.compile(r"^step-(\d+)$")


GIVE = "give a run directory (e.g. /dev/shm/torchmoe-ckpt/node-0/<run>) or the object-store URI of the run"


def _open(location: str, storage_options: dict | None):
    if not isinstance(location, str) or not location.strip():
        raise ValueError(f"the location is empty: {GIVE}")
    fs, root = open_store(location, storage_options, probe=False)
    root = root.rstrip("/")
    try:  # a dead endpoint or missing credentials surface here: one line naming the fix, not a traceback
        exists, is_dir = fs.exists(root), fs.isdir(root)
    except Exception as exc:
        raise ValueError(explain(location, exc)) from None
    if not exists or not is_dir:
        raise ValueError(f"{location}: {'is a file, not a' if exists else 'no such'} checkpoint location ({GIVE})")
    return fs, root


def _run_of(rel_parts: list[str]) -> str:
    """The run a window belongs to, from its path below the location (the parts before `window-N`, without
    the tensorstore format's `<writer>`): "" when the location itself is the run."""
    if rel_parts and writer_rank(rel_parts[-1]) is not None:
        rel_parts = rel_parts[:-1]
    return "/".join(rel_parts)


def _window_part(parts: list[str]) -> tuple[int, int] | None:
    """(index of the `window-N` part, N) of a path below the location, None when it is not a window's file or
    lies in an internal directory (slot buffers, spares, peer copies)."""
    for j, p in enumerate(parts[:-1]):
        if is_internal(p):
            return None
        wid = parse_window_dirname(p)
        if wid is not None:
            return j, wid
    return None


def _exports(files: list[str]) -> list[tuple[int, str]]:
    """(step, directory) of every dense export: a `step-N` directory with DCP's `.metadata`."""
    return sorted(
        {
            (int(m.group(1)), f.rsplit("/", 1)[0])
            for f in files
            if f.endswith(f"/{METADATA}") and (m := _STEP_DIR.match(f.rsplit("/", 2)[-2]))
        }
    )


def _runs(files: list[str], root: str) -> set[str]:
    runs = set()
    for f in files:
        parts = f[len(root) :].strip("/").split("/")
        found = _window_part(parts)
        if found is not None:
            runs.add(_run_of(parts[: found[0]]))
    return runs


def _writer_of(name: str) -> int | None:
    """The writer (rank) a window file's path part names: its slot directory, replay file or manifest."""
    writer = parse_manifest_name(name) or (name[:-3] if name.endswith(".pt") else name)
    return writer_rank(writer)


def _slots(man: WindowManifest, infos: list[dict]) -> list[dict]:
    return [
        {
            "slot": i,
            "step": info.get("step"),
            "active": sp["active"],
            "frozen_count": len(sp["frozen"]),
            "planned_bytes": sp["bytes"],
            "items_with_checksum": len(info.get("checksums", {})),
        }
        for i, (sp, info) in enumerate(zip(man.plan["slots"], infos))
    ]


def _dcp_copy(tier: FilesWindowTier, window_id: int):
    """(manifest, problems, per slot planner info, bytes) of one writer's copy in the DCP layout."""
    man = tier.manifest(window_id)
    # Recovery's own checks (window_tier.py). No job to compare the world size with: the one the writing run recorded
    # in its identity (none recorded, a DCP user's window: the manifest's own, nothing to compare)
    world = written_world_size(man) or man.world_size
    problems = tier.check(window_id, world_size=world) or tier.record_problems(window_id, man)
    rels = [slot_metadata_file(man, i) for i in range(len(man.plan["slots"]))] if not problems else []
    return man, problems, [tier.slot_info(window_id, r) if r else {} for r in rels], man.total_bytes


def inspect_location(location: str, storage_options: dict | None = None) -> dict:
    """What one run holds: its windows (each writer's copy read and checked), their slots and the dense exports.

    Args:
        location: a host-tier run directory (e.g. /dev/shm/torchmoe-ckpt/node-0/<run>) or an object-store URI.
        storage_options: fsspec options for an object store (credentials, endpoint_url, ...).

    Returns:
        `{"location", "windows": [...], "dense_exports": [...]}`; a location with several runs gives
        `{"location", "runs": [one such entry per run, with "run"]}`. `format_inspect` prints it.

    Raises:
        ValueError: the location cannot be listed, or holds no window and no dense export.
    """
    fs, root = _open(location, storage_options)
    try:
        files = [f.rstrip("/") for f in fs.find(root)]
    except Exception as exc:
        raise ValueError(explain(location, exc)) from None
    runs = _runs(files, root)
    if not runs and not _exports(files):
        raise ValueError(
            f"{location}: not a checkpoint run (no window-N directories and no dense exports below it); {GIVE}"
        )
    if len(runs) > 1:
        return {
            "location": location,
            "runs": [
                dict(inspect_location(f"{location.rstrip('/')}/{r}", storage_options), run=r) for r in sorted(runs)
            ],
        }
    return _inspect_run(location, storage_options, fs, root, files)


def _inspect_run(location: str, storage_options: dict | None, fs, root: str, files: list[str]) -> dict:
    """One run: every window directory (with or without a manifest), each committed copy read and checked."""
    windows, copies = _find_copies(location, storage_options, fs, root, files)
    for wid, rank, fmt, read in sorted(copies, key=lambda c: c[:2]):
        _read_copy(windows[wid], rank, fmt, read)
    for entry in windows.values():
        entry["paths"] = sorted(entry["paths"])
        entry["ranks_with_files"] = sorted(entry["ranks_with_files"])
        entry["status"] = "corrupt" if entry["problems"] else "verified"
        if not entry["committed_ranks"]:
            entry["status"] = "uncommitted (no manifest: never used)"
    return {
        "location": location,
        "windows": [windows[k] for k in sorted(windows)],
        "dense_exports": [{"step": s, "path": p} for s, p in _exports(files)],
    }


def _find_copies(location: str, storage_options: dict | None, fs, root: str, files: list[str]):
    """(window id -> its entry, [(window, writer rank, format, read)]): `read()` gives (manifest, problems, slot
    infos, bytes), or None for a torn tensorstore commit."""
    windows: dict[int, dict] = {}
    copies = []
    for f in files:  # every window directory, with or without a manifest
        parts = f[len(root) :].strip("/").split("/")
        found = _window_part(parts)
        if found is None:
            continue
        j, wid = found
        new = dict(
            window_id=wid, paths=set(), committed_ranks=[], problems={}, slots=[], bytes=0, ranks_with_files=set()
        )
        entry = windows.setdefault(wid, new)
        entry["paths"].add("/".join([root, *parts[: j + 1]]))
        entry["ranks_with_files"].update(r for q in parts[max(j - 1, 0) :] if (r := _writer_of(q)) is not None)
        writer = parse_manifest_name(parts[-1]) if len(parts) == j + 2 else None
        if writer is not None:  # the DCP layout
            rank = writer_rank(writer)
            tier = FilesWindowTier(StoreFiles(fs, "/".join([root, *parts[:j]]), location), rank, 0)  # pyright: ignore[reportArgumentType]  (a manifest's writer has a rank)
            copies.append((wid, tier.rank, "dcp", lambda t=tier, w=wid: _dcp_copy(t, w)))
        elif parts[-1] == "manifest.ocdbt" and len(parts) == j + 2 and j >= 1:  # tensorstore: <run>/<writer>/window-N
            from ..tiers.tensorstore_tier import TensorstoreTier

            ts = TensorstoreTier(location, _run_of(parts[:j]), writer_rank(parts[j - 1]), storage_options, probe=False)
            copies.append((wid, ts.rank, "tensorstore", lambda t=ts, w=wid: t.inspect(w)))
    return windows, copies


def _read_copy(entry: dict, rank: int, fmt: str, read) -> None:
    """One writer's copy of a window read into the window's entry: committed, its problems, sizes and slots."""
    entry["format"] = fmt
    try:
        got = read()
    except Exception as exc:  # unreadable: bad JSON, edited (checksum), a damaged database
        entry["problems"][rank] = [f"bad manifest: {' '.join(str(exc).split())[:300]}"]
        return
    if got is None:
        return  # a torn tensorstore commit: invisible
    man, problems, infos, nbytes = got
    entry["committed_ranks"].append(rank)
    if problems:
        entry["problems"][rank] = [str(p) for p in problems]  # the JSON edge: `inspect`/`verify` print these
    ident = man.identity or {}
    entry.update(
        start_step=man.start_step,
        window=man.window,
        world_size=man.world_size,
        bytes=entry["bytes"] + nbytes,
        run_id=ident.get("run_id"),
        fingerprint=ident.get("fingerprint"),
        merged_experts=(ident.get("parts") or {}).get("merged_experts") or {},
        node_ranks=sorted(set(entry.get("node_ranks", [])) | set(man.extra.get("node_ranks") or [])),
    )
    if not entry["slots"] and not problems:
        entry["slots"] = _slots(man, infos)


def format_inspect(info: dict) -> str:
    if "runs" in info:  # several runs under one location: each listed on its own
        head = (
            f"{info['location']}: {len(info['runs'])} runs (listed separately; give one run's path to inspect it alone)"
        )
        return "\n".join([head] + [f"run {r['run']}:\n" + format_inspect(r) for r in info["runs"]])
    lines = [f"{info['location']}: {len(info['windows'])} window(s), {len(info['dense_exports'])} dense export(s)"]
    for w in info["windows"]:
        if not w["committed_ranks"]:
            lines.append(f"  window {w['window_id']}: {w['status']}")
            continue
        lines.append(
            f"  window {w['window_id']}: {w['status']}; steps {w.get('start_step')}.."
            f"{(w.get('start_step') or 0) + (w.get('window') or 1) - 1}, W={w.get('window')}, "
            f"ranks {w['committed_ranks']}/{w.get('world_size')}, {w.get('bytes', 0)} bytes"
            + (f", run {w['run_id']!r}" if w.get("run_id") else "")
        )
        for name, why in sorted((w.get("merged_experts") or {}).items()):
            lines.append(f"    operator {name}: all of its layer's experts as one operator, because {why}")
        for s in w["slots"]:
            lines.append(
                f"    slot {s['slot']} (after iteration {s['step']}): full state of {', '.join(s['active'])};"
                f" compute weights of {s['frozen_count']} later operator(s); {s['planned_bytes']} bytes "
                f"(largest rank); {s['items_with_checksum']} checksummed items"
            )
        for rank, probs in w["problems"].items():
            for p in probs:
                lines.append(f"    rank {rank}: {p}" if isinstance(rank, int) else f"    {p}")
    for e in info["dense_exports"]:
        lines.append(f"  dense export at step {e['step']}: {e['path']} (complete: DCP .metadata present)")
    return "\n".join(lines)


def verify_location(location: str, storage_options: dict | None = None) -> tuple[bool, dict]:
    """OK only if there is a committed window, every committed copy verifies and every committed window was
    committed by every rank of the run.

    Args:
        location: as for `inspect_location`.
        storage_options: as for `inspect_location`.

    Returns:
        (ok, info): `inspect_location`'s info, with every problem found listed in `info["problems"]`.

    Raises:
        ValueError: as `inspect_location`.
    """
    info = inspect_location(location, storage_options)
    runs = info["runs"] if "runs" in info else [info]
    problems = []
    for run in runs:
        prefix = f"run {run['run']}: " if "run" in run else ""
        # A window whose manifest is unreadable (bad checksum: edited) is reported too, not taken as uncommitted.
        committed = [w for w in run["windows"] if w["committed_ranks"] or w["problems"]]
        if not committed:
            problems.append(f"{prefix}no committed window")
        name = run.get("run") or str(run.get("location", location)).rstrip("/").rsplit("/", 1)[-1]
        problems += [prefix + p for p in _foreign_windows(committed, name)]
        for w in committed:
            w["problems"].update(_missing_ranks(w, run["windows"]))
            for rank, probs in sorted(w["problems"].items(), key=lambda kv: str(kv[0])):
                problems += [f"{prefix}window {w['window_id']} rank {rank}: {p}" for p in probs]
            if w["problems"]:
                w["status"] = "corrupt" if any(isinstance(r, int) for r in w["problems"]) else "incomplete"
    info["problems"] = problems
    return not problems, info


def _foreign_windows(windows: list[dict], run_name: str | None = None) -> list[str]:
    """Windows of one run directory written by different runs (recovery refuses all but the job's own). The run's
    identity: the one whose run id names the directory, else the one most windows carry, else none is blamed."""
    groups: dict[tuple, list[int]] = {}
    for w in windows:
        if w.get("fingerprint"):
            groups.setdefault((w.get("run_id"), w.get("fingerprint")), []).append(w["window_id"])
    if len(groups) < 2:
        return []
    named = [k for k in groups if k[0] == run_name]
    counts = sorted((len(v) for v in groups.values()), reverse=True)
    own = named[0] if len(named) == 1 else None
    if own is None and counts[0] > counts[1]:
        own = max(groups, key=lambda k: len(groups[k]))
    say = lambda k: f"run {k[0]!r} (identity {str(k[1])[:12]})"  # noqa: E731
    if own is None:
        listed = "; ".join(f"window(s) {groups[k]} by {say(k)}" for k in groups)
        return [
            f"windows here were written by different runs: {listed}; recovery loads only the windows of the "
            f"job's own identity: remove the ones that do not belong here"
        ]
    return [
        f"window {wid}: written by {say(k)}, not by this run's {say(own)}: recovery refuses it; remove the "
        f"window that does not belong here"
        for k, ids in groups.items()
        if k != own
        for wid in ids
    ]


def _missing_ranks(window: dict, windows: list[dict]) -> dict[str, list[str]]:
    """A window is usable only when every rank committed it. Expected: every rank of the world size when all are
    in this location, else every rank seen here (one node's directory), plus the manifests' `node_ranks`."""
    seen = {r for w in windows for r in w["committed_ranks"]} | set(window["ranks_with_files"])
    seen |= {r for w in windows for r in w.get("node_ranks") or []}
    world = window.get("world_size") or 0
    expected = set(range(world)) if seen >= set(range(world)) else seen
    missing = sorted(expected - set(window["committed_ranks"]))
    if not missing:
        return {}
    return {
        "all": [
            f"not committed by rank(s) {missing} (committed by {sorted(window['committed_ranks'])} of "
            f"{world}): unusable, recovery skips it"
        ]
    }
