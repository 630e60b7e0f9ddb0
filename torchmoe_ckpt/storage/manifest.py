"""The window manifest: the file that makes a window visible.

A window is stored as a directory (on any tier) of plain files:

    window-000042/
        slot-00/.metadata, slot-00/__0_0.distcp, ...   one standard DCP checkpoint per slot
        slot-01/...
        replay/rank-00000.pt, ...                      per-rank replay records
        MANIFEST.json                                  written last, after every other file
                                                       (per rank on a host tier: MANIFEST.rank-RRRRR.json)

MANIFEST.json lists every other file with its size and digest (CRC32, or for host-tier data files the
memory-speed sum64b512 of checksums.py, named in the entry; as reported by the write that produced it,
never re-read from disk), the run identity of the writer (identity.py), the window/slot/step each slot file
was written for, and a SHA-256 of its own canonical content: an edited manifest (a start step changed by one
bit, a plan edited) no longer matches its checksum and is refused. Readers treat a window without a
manifest as invisible (half-written), and verify each file against the manifest before using it: a torn or
corrupt file makes the window unusable on that tier, and the reader moves on to the next tier.
"""

from __future__ import annotations

import functools
import hashlib
import json
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import TorchmoeError
from .checksums import BLOCK, CRC32, SUM64, UnknownChecksum, block_sums, digest, digest_blocks

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


def _gf2_times(mat: tuple, vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: tuple) -> tuple:
    return tuple(_gf2_times(mat, mat[n]) for n in range(32))


@functools.lru_cache(maxsize=256)
def _zeros_tables(nbytes: int) -> tuple:
    """`_zeros_operator(nbytes)` as four 256-entry tables (one per CRC byte): applying it is four lookups."""
    rows = _zeros_operator(nbytes)
    tables = []
    for k in range(4):
        t = [0] * 256
        for b in range(1, 256):
            low = (b & -b).bit_length() - 1
            t[b] = t[b & (b - 1)] ^ rows[8 * k + low]
        tables.append(t)
    return tuple(tables)


def _zeros_operator(nbytes: int) -> tuple:
    """The GF(2) matrix that advances a CRC32 over `nbytes` zero bytes (zlib's crc32_combine, composed once
    per length; `_zeros_tables` caches it: a slot's item sizes repeat every window)."""
    odd = (0xEDB88320,) + tuple(1 << n for n in range(31))  # one zero bit
    even = _gf2_square(odd)  # two
    odd = _gf2_square(even)  # four
    op = tuple(1 << n for n in range(32))  # identity
    while nbytes:
        even = _gf2_square(odd)
        if nbytes & 1:
            op = tuple(_gf2_times(even, op[n]) for n in range(32))
        nbytes >>= 1
        if not nbytes:
            break
        odd = _gf2_square(even)
        if nbytes & 1:
            op = tuple(_gf2_times(odd, op[n]) for n in range(32))
        nbytes >>= 1
    return op


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of A+B from crc32(A), crc32(B) and len(B), without reading any byte again."""
    if len2 <= 0:
        return crc1
    t0, t1, t2, t3 = _zeros_tables(len2)
    return (t0[crc1 & 0xFF] ^ t1[(crc1 >> 8) & 0xFF] ^ t2[(crc1 >> 16) & 0xFF] ^ t3[crc1 >> 24] ^ crc2) & 0xFFFFFFFF


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
    crc32: int  # the file's 32-bit digest under `algo` (a CRC32 unless `algo` names another one)
    algo: str = CRC32  # checksums.py: "sum64b512" for host-tier data files (computed at memory speed)

    def matches(self, data) -> bool:
        """Whether `data` (the whole file) has this entry's size and digest."""
        return len(data) == self.bytes and digest(data, self.algo) == self.crc32


class Digester:
    """A file's digest under `algo`, fed chunk by chunk (every chunk but the last a multiple of 512 bytes), so a
    copy loop checksums each chunk while it is in cache instead of in a second pass over the file."""

    def __init__(self, algo: str = CRC32):
        if algo not in (CRC32, SUM64):
            raise UnknownChecksum(f"unknown checksum algorithm {algo!r}")
        self.algo, self.size, self._crc, self._sums = algo, 0, 0, []

    def update(self, chunk) -> None:
        if self.size % BLOCK and self.algo == SUM64:
            raise ValueError("sum64b512 chunks must be multiples of 512 bytes, all but the last")
        if self.algo == CRC32:
            self._crc = zlib.crc32(chunk, self._crc)
        else:
            self._sums.append(block_sums(chunk))
        self.size += len(memoryview(chunk).cast("B"))

    def entry(self) -> FileEntry:
        if self.algo == CRC32:
            return FileEntry(self.size, self._crc & 0xFFFFFFFF)
        sums = np.concatenate(self._sums) if self._sums else np.zeros(0, dtype="<i8")
        return FileEntry(self.size, digest_blocks(sums, self.size), self.algo)


CHUNK = 1 << 20  # bytes per read of a streamed file: one chunk stays in cache between its copy and its checksum


def file_entry(path: Path, algo: str = CRC32) -> FileEntry:
    """Size and digest of a file on disk, read in chunks into one reused buffer."""
    d, buf = Digester(algo), bytearray(CHUNK)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            d.update(memoryview(buf)[:n])
    return d.entry()


def _entry_dict(v: FileEntry) -> dict:
    # "algo" only when not CRC32: manifests of CRC32 files stay byte-identical to earlier versions
    return (
        {"bytes": v.bytes, "crc32": v.crc32}
        if v.algo == CRC32
        else {"bytes": v.bytes, "crc32": v.crc32, "algo": v.algo}
    )


class ManifestError(TorchmoeError, ValueError):
    """A manifest that is not ours, or whose content does not match its own checksum (edited or damaged)."""


@dataclass
class WindowManifest:
    window_id: int
    start_step: int  # slot 0 holds the state after this iteration
    window: int  # W
    world_size: int
    plan: dict  # WindowPlan.to_dict()
    files: dict[str, FileEntry] = field(default_factory=dict)  # path relative to the window dir
    extra: dict = field(default_factory=dict)  # dtype, rank, counters, ...
    format: str = FORMAT
    identity: dict = field(default_factory=dict)  # RunIdentity.to_dict() of the run that wrote the window
    slots: list = field(default_factory=list)  # per slot: {"slot", "window", "step", ...} as it was written

    def to_dict(self) -> dict:
        d = {
            "format": self.format,
            "window_id": self.window_id,
            "start_step": self.start_step,
            "window": self.window,
            "world_size": self.world_size,
            "plan": self.plan,
            "files": {k: _entry_dict(v) for k, v in sorted(self.files.items())},
            "extra": self.extra,
            "identity": self.identity,
            "slots": self.slots,
        }
        d["checksum"] = content_checksum(d)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> WindowManifest:
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
    def from_dict(d: dict) -> WindowManifest:
        """Fields of a manifest dict, unchecked (the tensorstore tier rebuilds a manifest with new files)."""
        try:
            files = {
                k: FileEntry(int(v["bytes"]), int(v["crc32"]), str(v.get("algo", CRC32))) for k, v in d["files"].items()
            }
            return WindowManifest(
                int(d["window_id"]),
                int(d["start_step"]),
                int(d["window"]),
                int(d["world_size"]),
                d["plan"],
                files,
                d.get("extra", {}),
                d["format"],
                d.get("identity") or {},
                list(d.get("slots") or []),
            )
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


def check_window(
    man: WindowManifest, window_id: int, rank: int, world_size: int | None = None, slot_info=None
) -> list[str]:
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
        want = {
            "window": man.window_id,
            "slot": i,
            "step": man.start_step + i,
            "start_step": man.start_step,
            "run": run,
            "plan": digest if rec.get("plan") is not None else None,
        }
        bad = [k for k, v in want.items() if rec.get(k) != v]
        if bad:
            out.append(
                f"slot {i}: manifest records {', '.join(f'{k} {rec.get(k)!r}' for k in bad)}, expected "
                f"{', '.join(f'{want[k]!r}' for k in bad)}"
            )
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
            out.append(
                f"{rel}: written for {', '.join(f'{k} {info.get(k)!r}' for k in bad)}, but sits at "
                f"{', '.join(f'{k} {want[k]!r}' for k in bad)} (a slot file of another window or run)"
            )
    return out
