"""The window manifest: the file that makes a window visible.

A window is stored as a directory (on any tier) of plain files:

    window-000042/
        slot-00/.metadata, slot-00/__0_0.distcp, ...   one standard DCP checkpoint per slot
        slot-01/...
        replay/rank-00000.pt, ...                      per-rank replay records
        MANIFEST.json                                  written last, after every other file
                                                       (per rank on a host tier: MANIFEST.rank-RRRRR.json)

MANIFEST.json lists every other file with its size and CRC32 (as reported by the write that produced it,
never re-read from disk), the run identity of the writer (identity.py), the window/slot/step each slot file
was written for, and a SHA-256 of its own canonical content: an edited manifest (a start step changed by one
bit, a plan edited) no longer matches its checksum and is refused. Readers treat a window without a
manifest as invisible (half-written), and verify each file against the manifest before using it: a torn or
corrupt file makes the window unusable on that tier, and the reader moves on to the next tier.
"""
from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

FORMAT = "torchmoe-ckpt/window/2"  # 2: identity, slot records and a self-checksum
MANIFEST_NAME = "MANIFEST.json"


def window_dirname(window_id: int) -> str:
    return f"window-{window_id:06d}"


def parse_window_dirname(name: str) -> int | None:
    if name.startswith("window-") and name[7:].isdigit():
        return int(name[7:])
    return None


def rank_manifest_name(rank: int) -> str:
    """A rank's manifest of a window on a host tier (each rank commits its own files)."""
    return f"MANIFEST.rank-{rank:05d}.json"


def slot_rank_dir(window_dir: Path, slot: int, rank: int) -> Path:
    """Where one rank's DCP checkpoint of one slot lives inside a window directory on a host tier."""
    return window_dir / f"slot-{slot:02d}" / f"rank-{rank:05d}"


def crc32_bytes(data: bytes | memoryview, crc: int = 0) -> int:
    return zlib.crc32(data, crc) & 0xFFFFFFFF


def crc32_stream(chunks: Iterable[bytes]) -> tuple[int, int]:
    """(crc32, size) of a stream of byte chunks."""
    crc, size = 0, 0
    for c in chunks:
        crc = zlib.crc32(c, crc)
        size += len(c)
    return crc & 0xFFFFFFFF, size


@dataclass
class FileEntry:
    bytes: int
    crc32: int


def file_entry(path: Path) -> FileEntry:
    """Size and CRC32 of a file on disk, read in 4 MiB chunks."""
    with open(path, "rb") as f:
        crc, size = crc32_stream(iter(lambda: f.read(1 << 22), b""))
    return FileEntry(size, crc)


class ManifestError(ValueError):
    """A manifest that is not ours, or whose content does not match its own checksum (edited or damaged)."""


@dataclass
class WindowManifest:
    window_id: int
    start_step: int              # slot 0 holds the state after this iteration
    window: int                  # W
    world_size: int
    plan: dict                   # WindowPlan.to_dict()
    files: dict[str, FileEntry] = field(default_factory=dict)   # path relative to the window dir
    extra: dict = field(default_factory=dict)                   # dtype, rank, counters, ...
    format: str = FORMAT
    identity: dict = field(default_factory=dict)   # RunIdentity.to_dict() of the run that wrote the window
    slots: list = field(default_factory=list)      # per slot: {"slot", "window", "step", ...} as it was written

    def to_dict(self) -> dict:
        d = {"format": self.format, "window_id": self.window_id, "start_step": self.start_step,
             "window": self.window, "world_size": self.world_size, "plan": self.plan,
             "files": {k: {"bytes": v.bytes, "crc32": v.crc32} for k, v in sorted(self.files.items())},
             "extra": self.extra, "identity": self.identity, "slots": self.slots}
        d["checksum"] = content_checksum(d)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "WindowManifest":
        try:
            d = json.loads(text)
        except ValueError as exc:
            raise ManifestError(f"manifest is not JSON ({exc})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            fmt = d.get("format") if isinstance(d, dict) else None
            raise ManifestError(f"not a torchmoe-ckpt window manifest (format {fmt!r}, expected {FORMAT!r})")
        if d.get("checksum") != content_checksum(d):
            raise ManifestError("manifest checksum does not match its content (edited or damaged)")
        return WindowManifest.from_dict(d)

    @staticmethod
    def from_dict(d: dict) -> "WindowManifest":
        """Fields of a manifest dict, unchecked (the tensorstore tier rebuilds a manifest with new files)."""
        try:
            files = {k: FileEntry(int(v["bytes"]), int(v["crc32"])) for k, v in d["files"].items()}
            return WindowManifest(int(d["window_id"]), int(d["start_step"]), int(d["window"]), int(d["world_size"]),
                                  d["plan"], files, d.get("extra", {}), d["format"], d.get("identity") or {},
                                  list(d.get("slots") or []))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ManifestError(f"manifest is missing or has a bad field ({type(exc).__name__}: {exc})") from None

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())


def content_checksum(d: dict) -> str:
    """SHA-256 of a manifest dict's canonical JSON without its "checksum" field."""
    body = json.dumps({k: v for k, v in d.items() if k != "checksum"}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def plan_digest(plan: dict) -> str:
    """Short digest of a window plan, written into every slot's DCP metadata: a slot written under another
    plan (or a manifest whose plan was edited) is recognised when loading."""
    return hashlib.sha256(json.dumps(plan, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def slot_record(info: dict) -> dict:
    """What a slot file was written for (kept per slot in the manifest, compared with its DCP metadata)."""
    return {k: info.get(k) for k in ("window", "slot", "step", "start_step", "run", "plan")}


def check_window(man: WindowManifest, window_id: int, rank: int, world_size: int | None = None,
                 slot_info=None) -> list[str]:
    """Problems with where a manifest and its slot files sit: the window id of its directory, the rank, the
    world size, the plan, and the window/slot/step/run/plan each slot's DCP metadata was written for
    (`slot_info(rel)` returns that metadata's planner info). A window directory or a slot file copied from
    another window or run is refused here even when every CRC matches. Empty list = consistent."""
    out = []
    if man.window_id != window_id:
        out.append(f"manifest is of window {man.window_id}, found in the directory of window {window_id}")
    if man.extra.get("rank", rank) != rank:
        out.append(f"manifest is rank {man.extra.get('rank')}'s, found as rank {rank}'s")
    if world_size is not None and man.world_size != world_size:
        out.append(f"world size {man.world_size} != {world_size}")
    if not man.slots and not man.identity:
        return out  # written by a tool, not a checkpointer: nothing recorded to compare (recovery refuses it)
    slots = man.plan.get("slots") if isinstance(man.plan, dict) else None
    if not isinstance(slots, list) or len(slots) != man.window or man.plan.get("window", man.window) != man.window:
        return out + [f"plan does not describe {man.window} slots (edited or damaged)"]
    if len(man.slots) != man.window:
        return out + [f"manifest records {len(man.slots)} slot files for W={man.window}"]
    digest = plan_digest(man.plan)
    run = (man.identity or {}).get("fingerprint")
    for i, rec in enumerate(man.slots):
        # A writer that gave no plan digest (a tool, not the checkpointer) records None for it.
        want = {"window": man.window_id, "slot": i, "step": man.start_step + i, "start_step": man.start_step,
                "run": run, "plan": digest if rec.get("plan") is not None else None}
        bad = [k for k, v in want.items() if rec.get(k) != v]
        if bad:
            out.append(f"slot {i}: manifest records {', '.join(f'{k} {rec.get(k)!r}' for k in bad)}, expected "
                       f"{', '.join(f'{want[k]!r}' for k in bad)}")
            continue
        if slot_info is None:
            continue
        rel = next((r for r in sorted(man.files) if r.startswith(f"slot-{i:02d}/") and r.endswith(".metadata")), None)
        if rel is None:
            out.append(f"slot {i}: no DCP metadata file listed")
            continue
        try:
            info = slot_info(rel) or {}
        except Exception as exc:  # unreadable metadata: a damaged or foreign file
            out.append(f"slot {i}: metadata unreadable ({type(exc).__name__}: {exc})")
            continue
        bad = [k for k, v in want.items() if info.get(k) != v]
        if bad:
            out.append(f"{rel}: written for {', '.join(f'{k} {info.get(k)!r}' for k in bad)}, but sits at "
                       f"{', '.join(f'{k} {want[k]!r}' for k in bad)} (a slot file of another window or run)")
    return out
