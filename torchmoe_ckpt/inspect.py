"""`torchmoe-ckpt inspect` and `verify`: what a checkpoint location holds, and whether every byte verifies.

Understands the host-tier layout (`<root>/<run>/window-NNNNNN/...` with per-rank manifests)."""
from __future__ import annotations

import json
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader

from .dcp.host_tier import slot_rank_dir
from .dcp.manifest import WindowManifest, parse_window_dirname
from .dcp.planner import PLANNER_KEY


def _windows(root: Path) -> list[Path]:
    if parse_window_dirname(root.name) is not None:
        return [root]
    wins = sorted(p for p in root.glob("window-*") if parse_window_dirname(p.name) is not None)
    if not wins and root.is_dir():
        wins = sorted(p for p in root.glob("*/window-*") if parse_window_dirname(p.name) is not None)
    return wins


def inspect_location(path: str) -> dict:
    root = Path(path.removeprefix("file://"))
    if not root.exists():
        raise ValueError(f"{path}: no such checkpoint location (give the host-tier run directory, "
                         f"e.g. /dev/shm/torchmoe-ckpt/<run>)")
    from .dcp.host_tier import HostTier
    out = {"location": str(root), "windows": []}
    for wdir in _windows(root):
        wid = parse_window_dirname(wdir.name)
        manifests = sorted(wdir.glob("MANIFEST.rank-*.json"))
        entry: dict = {"window_id": wid, "path": str(wdir), "committed_ranks": [], "problems": {}, "slots": []}
        for mf in manifests:
            rank = int(mf.name.split("-")[1].split(".")[0])
            man = WindowManifest.from_json(mf.read_text())
            tier = HostTier.__new__(HostTier)
            tier.dir, tier.rank = wdir.parent, rank
            problems = tier.verify(wid, rank)
            entry["committed_ranks"].append(rank)
            if problems:
                entry["problems"][rank] = problems
            entry.update(start_step=man.start_step, window=man.window, world_size=man.world_size,
                         bytes=entry.get("bytes", 0) + man.total_bytes)
            if not entry["slots"]:
                for i, sp in enumerate(man.plan["slots"]):
                    md = FileSystemReader(slot_rank_dir(wdir, i, rank)).read_metadata()
                    info = (md.planner_data or {}).get(PLANNER_KEY, {})
                    entry["slots"].append({"slot": i, "step": info.get("step"), "active": sp["active"],
                                           "frozen_count": len(sp["frozen"]), "planned_bytes": sp["bytes"],
                                           "items_with_checksum": len(info.get("checksums", {}))})
        entry["status"] = ("uncommitted (no manifest: never used)" if not manifests else
                           "corrupt" if entry["problems"] else "verified")
        out["windows"].append(entry)
    return out


def format_inspect(info: dict) -> str:
    lines = [f"{info['location']}: {len(info['windows'])} window(s)"]
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
    return "\n".join(lines)


def verify_location(path: str) -> tuple[bool, dict]:
    info = inspect_location(path)
    ok = bool(info["windows"]) and all(w["status"] != "corrupt" for w in info["windows"]) and any(
        w["status"] == "verified" for w in info["windows"])
    return ok, info


def main_json(info: dict) -> str:
    return json.dumps(info, indent=1)
