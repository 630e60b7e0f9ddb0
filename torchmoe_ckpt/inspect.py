"""`torchmoe-ckpt inspect` and `verify`: what a checkpoint location holds, and whether every byte verifies.

A location is a host-tier directory (`<root>/node-N/<run>`, windows with `MANIFEST.rank-R.json` per rank) or
an object-store URI (`s3://bucket/prefix`, `az://container/prefix`, `file://...`: `<run>/rank-R/window-N/`
with `MANIFEST.json`; or, in the tensorstore format, `<run>/rank-R/window-N/` OCDBT databases), read through
fsspec (and tensorstore) with the storage options given. Dense exports (`step-N`
directories with DCP's `.metadata`) found under the location are listed too."""
from __future__ import annotations

import json
import re

from .dcp.manifest import MANIFEST_NAME, WindowManifest, crc32_bytes, parse_window_dirname
from .dcp.planner import PLANNER_KEY

_HOST_MANIFEST = re.compile(r"^MANIFEST\.rank-(\d+)\.json$")
_RANK_DIR = re.compile(r"^rank-(\d+)$")
_STEP_DIR = re.compile(r"^step-(\d+)$")


def _open(location: str, storage_options: dict | None):
    from .dcp.object_tier import open_store
    fs, root = open_store(location, storage_options, probe=False)
    root = root.rstrip("/")
    if not fs.exists(root):
        raise ValueError(f"{location}: no such checkpoint location (give a host-tier run directory, e.g. "
                         f"/dev/shm/torchmoe-ckpt/node-0/<run>, or the object-store URI of the run)")
    return fs, root


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
        elif crc32_bytes(data) != want.crc32:
            problems.append(f"{rel}: CRC32 {crc32_bytes(data):08x} != {want.crc32:08x} (corrupt)")
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
        out.append({"slot": i, "step": info.get("step"), "active": sp["active"], "frozen_count": len(sp["frozen"]),
                    "planned_bytes": sp["bytes"], "items_with_checksum": len(info.get("checksums", {}))})
    return out


def inspect_location(location: str, storage_options: dict | None = None) -> dict:
    fs, root = _open(location, storage_options)
    files = [f.rstrip("/") for f in fs.find(root)]
    manifests = _manifests(files)
    windows: dict[int, dict] = {}
    for f in files:  # every window directory, with or without a manifest
        parts = f.split("/")
        for j, p in enumerate(parts):
            wid = parse_window_dirname(p)
            if wid is not None:
                windows.setdefault(wid, {"window_id": wid, "paths": set(), "committed_ranks": [], "problems": {},
                                         "slots": [], "bytes": 0})["paths"].add("/".join(parts[: j + 1]))
                break
    for (wdir, rank), mpath in sorted(manifests.items()):
        entry = windows[parse_window_dirname(wdir.rsplit("/", 1)[-1])]
        try:
            man = WindowManifest.from_json(fs.cat_file(mpath).decode())
        except Exception as exc:
            entry["problems"][rank] = [f"bad manifest: {exc}"]
            continue
        entry["committed_ranks"].append(rank)
        problems = _verify_files(fs, wdir, man)
        if problems:
            entry["problems"][rank] = problems
        entry.update(start_step=man.start_step, window=man.window, world_size=man.world_size,
                     bytes=entry["bytes"] + man.total_bytes)
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
        entry["status"] = ("uncommitted (no manifest: never used)" if not entry["committed_ranks"] else
                           "corrupt" if entry["problems"] else "verified")
    exports = sorted({(int(m.group(1)), f.rsplit("/", 1)[0]) for f in files
                      if f.endswith("/.metadata") and (m := _STEP_DIR.match(f.rsplit("/", 2)[-2]))})
    return {"location": location, "windows": [windows[k] for k in sorted(windows)],
            "dense_exports": [{"step": s, "path": p} for s, p in exports]}


def format_inspect(info: dict) -> str:
    lines = [f"{info['location']}: {len(info['windows'])} window(s), {len(info['dense_exports'])} dense export(s)"]
    for w in info["windows"]:
        if not w["committed_ranks"]:
            lines.append(f"  window {w['window_id']}: {w['status']}")
            continue
        lines.append(f"  window {w['window_id']}: {w['status']}; steps {w.get('start_step')}.."
                     f"{(w.get('start_step') or 0) + (w.get('window') or 1) - 1}, W={w.get('window')}, "
                     f"ranks {w['committed_ranks']}/{w.get('world_size')}, {w.get('bytes', 0)} bytes")
        for s in w["slots"]:
            lines.append(f"    slot {s['slot']} (after iteration {s['step']}): full state of {', '.join(s['active'])};"
                         f" compute weights of {s['frozen_count']} later operator(s); {s['planned_bytes']} bytes "
                         f"(largest rank); {s['items_with_checksum']} checksummed items")
        for rank, probs in w["problems"].items():
            for p in probs:
                lines.append(f"    rank {rank}: {p}")
    for e in info["dense_exports"]:
        lines.append(f"  dense export at step {e['step']}: {e['path']} (complete: DCP .metadata present)")
    return "\n".join(lines)


def verify_location(location: str, storage_options: dict | None = None) -> tuple[bool, dict]:
    """OK only if there is at least one committed window and every committed copy verifies."""
    info = inspect_location(location, storage_options)
    committed = [w for w in info["windows"] if w["committed_ranks"]]
    ok = bool(committed) and all(not w["problems"] for w in committed)
    return ok, info


def main_json(info: dict) -> str:
    return json.dumps(info, indent=1, default=str)

