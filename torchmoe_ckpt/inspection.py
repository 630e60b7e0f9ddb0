"""`torchmoe-ckpt inspect` and `verify`: what a checkpoint location holds, and whether every byte verifies.

A location is a host-tier directory (`<root>/node-N/<run>`, windows with `MANIFEST.rank-R.json` per rank) or
an object-store URI (`s3://bucket/prefix`, `az://container/prefix`, `file://...`: `<run>/rank-R/window-N/`
with `MANIFEST.json`; or, in the tensorstore format, `<run>/rank-R/window-N/` OCDBT databases), read through
fsspec (and tensorstore) with the storage options given. Dense exports (`step-N`
directories with DCP's `.metadata`) found under the location are listed too."""

from __future__ import annotations

import json
import re

from .dcp.checksums import digest
from .dcp.manifest import MANIFEST_NAME, WindowManifest, check_window, parse_window_dirname
from .dcp.planner import PLANNER_KEY, slot_info

_HOST_MANIFEST = re.compile(r"^MANIFEST\.rank-(\d+)\.json$")
_RANK_DIR = re.compile(r"^rank-(\d+)$")
_STEP_DIR = re.compile(r"^step-(\d+)$")
_RANK_FILE = re.compile(r"^(?:MANIFEST\.)?rank-(\d+)(?:\.pt|\.json)?$")  # a rank's files in either layout
_SLOT_METADATA = re.compile(r"/window-\d+/slot-\d+/\.metadata$")  # a DCP user's slot: dcp.save, no manifest


def _open(location: str, storage_options: dict | None):
    from .dcp.object_tier import open_store
    from .dcp.store_errors import explain

    if not isinstance(location, str) or not location.strip():
        raise ValueError(
            "the location is empty: give a host-tier run directory, e.g. "
            "/dev/shm/torchmoe-ckpt/node-0/<run>, or the object-store URI of the run"
        )
    fs, root = open_store(location, storage_options, probe=False)
    root = root.rstrip("/")
    try:  # a dead endpoint or missing credentials surface here: one line naming the fix, not a traceback
        exists, is_dir = fs.exists(root), fs.isdir(root)
    except Exception as exc:
        raise ValueError(explain(location, exc)) from None
    if not exists:
        raise ValueError(
            f"{location}: no such checkpoint location (give a host-tier run directory, e.g. "
            f"/dev/shm/torchmoe-ckpt/node-0/<run>, or the object-store URI of the run)"
        )
    if not is_dir:
        raise ValueError(
            f"{location}: is a file, not a checkpoint location (give a host-tier run directory, "
            f"e.g. /dev/shm/torchmoe-ckpt/node-0/<run>, or the object-store URI of the run)"
        )
    return fs, root


def _run_of(rel_parts: list[str]) -> str:
    """The run a window belongs to, from its path below the location (the parts before `window-N`, without
    the object store's `rank-R`): "" when the location itself is the run."""
    if rel_parts and _RANK_DIR.match(rel_parts[-1]):
        rel_parts = rel_parts[:-1]
    return "/".join(rel_parts)


def _runs(files: list[str], root: str) -> set[str]:
    runs = set()
    for f in files:
        parts = f[len(root) :].strip("/").split("/")
        for j, p in enumerate(parts[:-1]):
            if parse_window_dirname(p) is not None:
                runs.add(_run_of(parts[:j]))
                break
    return runs


def _sub_location(location: str, run: str) -> str:
    return f"{location.rstrip('/')}/{run}"


def _manifests(files: list[str]) -> dict[tuple[str, int], str]:
    """(window dir, rank) -> manifest path, for both layouts."""
    out = {}
    for f in files:
        d, name = f.rsplit("/", 1)
        m = _HOST_MANIFEST.match(name)
        if m and parse_window_dirname(d.rsplit("/", 1)[-1]) is not None:
            out[(d, int(m.group(1)))] = f
        elif name == MANIFEST_NAME and parse_window_dirname(d.rsplit("/", 1)[-1]) is not None:
            rank = _RANK_DIR.match(d.rsplit("/", 2)[-2])
            out[(d, int(rank.group(1)) if rank else 0)] = f
    return out


def _verify_files(fs, wdir: str, man: WindowManifest) -> list[str]:
    problems = []
    for rel, want in man.files.items():
        try:
            data = fs.cat_file(f"{wdir}/{rel}")
        except FileNotFoundError:
            problems.append(f"{rel}: missing")
            continue
        if len(data) != want.bytes:
            problems.append(f"{rel}: {len(data)} bytes, manifest says {want.bytes} (torn)")
        elif not want.matches(data):  # CRC32, or the digest algorithm the entry names
            problems.append(f"{rel}: {want.algo} {digest(data, want.algo):08x} != {want.crc32:08x} (corrupt)")
    return problems


def _slots(fs, wdir: str, man: WindowManifest) -> list[dict]:
    import pickle

    out = []
    for i, sp in enumerate(man.plan["slots"]):
        rel = next((r for r in man.files if r.startswith(f"slot-{i:02d}/") and r.endswith(".metadata")), None)
        info = {}
        if rel is not None:
            with fs.open(f"{wdir}/{rel}", "rb") as f:
                info = (pickle.load(f).planner_data or {}).get(PLANNER_KEY, {})
        out.append(
            {
                "slot": i,
                "step": info.get("step"),
                "active": sp["active"],
                "frozen_count": len(sp["frozen"]),
                "planned_bytes": sp["bytes"],
                "items_with_checksum": len(info.get("checksums", {})),
            }
        )
    return out


def inspect_location(location: str, storage_options: dict | None = None) -> dict:
    """What one run holds; a location that holds several runs (a host root, an object-store prefix) gives
    `{"location", "runs": [one entry per run, with "run"]}`: windows of different runs are never merged."""
    fs, root = _open(location, storage_options)
    try:
        files = [f.rstrip("/") for f in fs.find(root)]
    except Exception as exc:
        from .dcp.store_errors import explain

        raise ValueError(explain(location, exc)) from None
    runs = _runs(files, root)
    exports_here = any(f.endswith("/.metadata") and _STEP_DIR.match(f.rsplit("/", 2)[-2]) for f in files)
    if not runs and not exports_here:
        raise ValueError(
            f"{location}: not a checkpoint run (no window-N directories and no dense exports "
            f"below it); give a host-tier run directory, e.g. /dev/shm/torchmoe-ckpt/node-0/<run>, "
            f"or the object-store URI of the run"
        )
    if len(runs) > 1:
        return {
            "location": location,
            "runs": [dict(inspect_location(_sub_location(location, r), storage_options), run=r) for r in sorted(runs)],
        }
    return _inspect_run(location, storage_options, fs, root, files)


def _inspect_run(location: str, storage_options: dict | None, fs, root: str, files: list[str]) -> dict:
    manifests = _manifests(files)
    windows: dict[int, dict] = {}
    root_parts = root.split("/")
    for f in files:  # every window directory, with or without a manifest
        parts = f.split("/")
        for j, p in enumerate(parts):
            wid = parse_window_dirname(p)
            if wid is not None:
                entry = windows.setdefault(
                    wid,
                    {
                        "window_id": wid,
                        "paths": set(),
                        "committed_ranks": [],
                        "problems": {},
                        "slots": [],
                        "bytes": 0,
                        "ranks_with_files": set(),
                    },
                )
                entry["paths"].add("/".join(parts[: j + 1]))
                entry["ranks_with_files"].update(
                    int(m.group(1)) for q in parts[len(root_parts) :] if (m := _RANK_FILE.match(q))
                )
                break
    for (wdir, rank), mpath in sorted(manifests.items()):
        entry = windows[parse_window_dirname(wdir.rsplit("/", 1)[-1])]
        try:
            man = WindowManifest.from_json(fs.cat_file(mpath).decode())
        except Exception as exc:
            entry["problems"][rank] = [f"bad manifest: {exc}"]
            continue
        entry["committed_ranks"].append(rank)
        problems = _verify_files(fs, wdir, man) or check_window(  # where each file sits (window/slot/step/run)
            man,
            entry["window_id"],
            rank,
            None,
            lambda rel: slot_info(fs.cat_file(f"{wdir}/{rel}")),  # noqa: B023
        )
        if problems:
            entry["problems"][rank] = problems
        ident = man.identity or {}
        entry.update(
            start_step=man.start_step,
            window=man.window,
            world_size=man.world_size,
            bytes=entry["bytes"] + man.total_bytes,
            run_id=ident.get("run_id"),
            fingerprint=ident.get("fingerprint"),
        )
        if not entry["slots"] and not problems:
            entry["slots"] = _slots(fs, wdir, man)
    if any(f.endswith("/manifest.ocdbt") for f in files):  # tensorstore-format windows (OCDBT databases)
        from .dcp.tensorstore_format import inspect_windows

        for wid, got in inspect_windows(location, storage_options, root, files).items():
            entry = windows[wid]
            entry["committed_ranks"] += got.pop("committed_ranks")
            entry["problems"].update(got.pop("problems"))
            entry["bytes"] += got.pop("bytes")
            entry["slots"] = entry["slots"] or got.pop("slots")
            entry.update({k: v for k, v in got.items() if k != "slots"})
    for entry in windows.values():
        entry["paths"] = sorted(entry["paths"])
        entry["ranks_with_files"] = sorted(entry["ranks_with_files"])
        entry["status"] = (
            "uncommitted (no manifest: never used)"
            if not entry["committed_ranks"]
            else "corrupt"
            if entry["problems"]
            else "verified"
        )
    exports = sorted(
        {
            (int(m.group(1)), f.rsplit("/", 1)[0])
            for f in files
            if f.endswith("/.metadata") and (m := _STEP_DIR.match(f.rsplit("/", 2)[-2]))
        }
    )
    out = {
        "location": location,
        "windows": [windows[k] for k in sorted(windows)],
        "dense_exports": [{"step": s, "path": p} for s, p in exports],
    }
    slots = sum(1 for f in files if _SLOT_METADATA.search(f))
    if slots and not any(w["committed_ranks"] or w["problems"] for w in windows.values()):
        out["layout"] = "dcp-user"  # windows of `dcp.save(planner=SparseSavePlanner)`: no manifests to check
        out["note"] = (
            f"{location}: {len(windows)} window(s), {slots} slot(s) written by dcp.save with "
            "SparseSavePlanner (the DCP-user layout: no window manifests, so inspect/verify cannot check "
            "them); check a window by loading it: tmc.load_sparse_window verifies every item's checksum "
            "(CorruptItemError names a bad one: fall back to the previous window), see docs/dcp-user.md"
        )
    return out


def format_inspect(info: dict) -> str:
    if "runs" in info:  # several runs under one location: each listed on its own
        head = (
            f"{info['location']}: {len(info['runs'])} runs (listed separately; give one run's path to inspect it alone)"
        )
        return "\n".join([head] + [f"run {r['run']}:\n" + format_inspect(r) for r in info["runs"]])
    if info.get("layout") == "dcp-user":
        return info["note"]
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
    """OK only if there is at least one committed window, every committed copy verifies and every committed
    window was committed by every rank of the run. Every problem found is listed in `info["problems"]`."""
    info = inspect_location(location, storage_options)
    runs = info["runs"] if "runs" in info else [info]
    problems = []
    for run in runs:
        prefix = f"run {run['run']}: " if "run" in run else ""
        # A window whose manifest is unreadable (bad checksum: edited) is reported too, not taken as uncommitted.
        committed = [w for w in run["windows"] if w["committed_ranks"] or w["problems"]]
        if run.get("layout") == "dcp-user":
            problems.append(f"{prefix}not verifiable here: {run['note']}")
        elif not committed:
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
    """Windows of one run directory written by different runs (a copied-in window, a reused run id with another
    model or seed): recovery refuses all but the job's own (IdentityMismatch), so verify names them. Which
    identity is the run's: the one whose run id names the directory (`run_name`), else the one most windows
    carry; with no such answer (one window each) every group is named and none is blamed."""
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
    """A window is usable only when every rank committed it. The ranks expected: every rank of the world
    size the manifests record when they are all in this location, else every rank seen committing here
    (a host directory of one node holds that node's ranks only)."""
    seen = {r for w in windows for r in w["committed_ranks"]} | set(window["ranks_with_files"])
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


def main_json(info: dict) -> str:
    return json.dumps(info, indent=1, default=str)
