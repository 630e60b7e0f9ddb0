"""The window manifest: the file that makes a window visible.

A window is stored as a directory (on any tier) of plain files:

    window-000042/
        slot-00/.metadata, slot-00/__0_0.distcp, ...   one standard DCP checkpoint per slot
        slot-01/...
        replay/rank-00000.pt, ...                      per-rank replay records
        MANIFEST.json                                  written last, after every other file
                                                       (per rank on a host tier: MANIFEST.rank-RRRRR.json)

MANIFEST.json lists every other file with its size and CRC32. Readers treat a window without a manifest
as invisible (half-written), and verify each file against the manifest before using it: a torn or
corrupt file makes the window unusable on that tier, and the reader moves on to the next tier.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

FORMAT = "torchmoe-ckpt/window/1"
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


@dataclass
class WindowManifest:
    window_id: int
    start_step: int              # slot 0 holds the state after this iteration
    window: int                  # W
    world_size: int
    plan: dict                   # WindowPlan.to_dict()
    files: dict[str, FileEntry] = field(default_factory=dict)   # path relative to the window dir
    extra: dict = field(default_factory=dict)                   # model fingerprint, dtype, counters, ...
    format: str = FORMAT

    def to_json(self) -> str:
        d = {"format": self.format, "window_id": self.window_id, "start_step": self.start_step,
             "window": self.window, "world_size": self.world_size, "plan": self.plan,
             "files": {k: {"bytes": v.bytes, "crc32": v.crc32} for k, v in sorted(self.files.items())},
             "extra": self.extra}
        return json.dumps(d, indent=1, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "WindowManifest":
        d = json.loads(text)
        if d.get("format") != FORMAT:
            raise ValueError(f"not a torchmoe-ckpt window manifest (format {d.get('format')!r}, expected {FORMAT!r})")
        files = {k: FileEntry(int(v["bytes"]), int(v["crc32"])) for k, v in d["files"].items()}
        return WindowManifest(int(d["window_id"]), int(d["start_step"]), int(d["window"]), int(d["world_size"]),
                              d["plan"], files, d.get("extra", {}), d["format"])

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())
