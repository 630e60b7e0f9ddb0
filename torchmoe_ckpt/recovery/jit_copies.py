"""The just-in-time copies on disk and in the store (jit.py writes and resumes from them): each rank's copy of one
step is a state file and its marker (`JitMarker`, JSON, written last: the commit). Here: the marker, the copies a
rank can see (`list_copies`), the step every shard has (`choose`), and reading one copy back, checked against its
marker (`read_copy`). JSON only in `JitMarker.to_json` / `from_json`."""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass, fields
from fnmatch import fnmatch
from pathlib import Path
from typing import Literal

import torch

from ..storage_format.checksums import crc32_bytes
from ..storage_format.files import StoreFiles

__all__ = ["MARKER", "STATE", "JitCopy", "JitMarker", "JitSaved", "choose", "list_copies", "read_copy"]

MARKER = "COMPLETE.json"
STATE = "state.pt"
FORMAT = "torchmoe-ckpt/jit/1"


@dataclass(frozen=True)
class JitMarker:
    """What one rank's copy is: written after its state file, so a copy without one is incomplete."""

    step: int  # the state is the one after this iteration
    rank: int
    shard: str  # the shard key (jit.shard_layout): ranks with the same key hold the same state
    begun: int  # the newest iteration this rank had started (replayed after the restart)
    lr: float  # the LR at `step`: the restarted schedule must give the same
    bytes: int  # the state file's size
    crc32: int  # and its CRC32
    reason: str  # what triggered the save: the watchdog's event, or "sigterm"
    op: str | None  # the region the failure was detected in
    world: int
    attempt: int  # torchrun's restart count of the process that saved it
    format: str = FORMAT

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @staticmethod
    def from_json(text: str | bytes) -> JitMarker:
        """Raises ValueError for a marker that does not parse or lacks a field (a torn or foreign file)."""
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError("a JIT marker is a JSON object")
        missing = [f.name for f in fields(JitMarker) if f.name not in d and f.name != "format"]
        if missing:
            raise ValueError(f"JIT marker without {', '.join(missing)}")
        return JitMarker(**{f.name: d[f.name] for f in fields(JitMarker) if f.name in d})


@dataclass(frozen=True)
class JitCopy:
    """A complete copy a rank can see: its marker and where its files are."""

    marker: JitMarker
    where: Literal["host", "store"]
    path: str  # its directory: a host path, or a path under the store's JIT prefix


@dataclass(frozen=True)
class JitSaved:
    """What this process's save did (once per process): the copy written, or why there is none."""

    marker: JitMarker | None = None  # the copy written (None: skipped or failed)
    host_seconds: float = 0.0  # the host copy's part of `seconds`
    seconds: float = 0.0
    store: bool | str | None = None  # True: in the store too; a string: why not; None: no store
    skipped: str | None = None  # e.g. "no update yet": the initial state is the state, a restart cold-starts
    error: str | None = None  # the save failed: its exception


def list_copies(jit_dir: Path, store: StoreFiles | None) -> list[JitCopy]:
    """Complete copies this rank can see: a marker that parses and a state file of its size (CRC: at load)."""
    out: list[JitCopy] = []
    for m in sorted(Path(jit_dir).glob(f"step-*/rank-*/{MARKER}")):
        try:
            marker = JitMarker.from_json(m.read_text())
            if (m.parent / STATE).stat().st_size == marker.bytes:
                out.append(JitCopy(marker, "host", str(m.parent)))
        except (OSError, ValueError, TypeError):
            continue  # torn marker or missing state file: not a copy
    if store is not None:
        store.invalidate()
        for rel in [r for r in store.find() if r.count("/") == 2 and fnmatch(r, f"step-*/rank-*/{MARKER}")]:
            try:
                out.append(JitCopy(JitMarker.from_json(store.read(rel)), "store", rel.rsplit("/", 1)[0]))
            except Exception:
                continue
    return out


def choose(everyone: list[tuple[str, list[JitCopy]]]) -> tuple[int | None, dict[str, list[JitCopy]]]:
    """The newest step at which every shard has a complete copy, and {shard: copies at that step}."""
    need = {key for key, _ in everyone}
    by_step: dict[int, dict[str, list[JitCopy]]] = {}
    seen = set()
    for _, copies in everyone:
        for c in copies:
            if (c.where, c.path) not in seen:  # ranks on one node list the same files
                seen.add((c.where, c.path))
                by_step.setdefault(c.marker.step, {}).setdefault(c.marker.shard, []).append(c)
    ok = [s for s, shards in by_step.items() if need <= set(shards)]
    if not ok:
        return None, {}
    step = max(ok)
    return step, by_step[step]


def read_copy(copy: JitCopy, store: StoreFiles | None) -> dict:
    """The copy's state blob (torch.load of its state file), refused unless it matches its marker."""
    m = copy.marker
    if copy.where == "host":
        data = (Path(copy.path) / STATE).read_bytes()
    else:
        data = _store_of(store).read(f"{copy.path}/{STATE}")
    if len(data) != m.bytes or crc32_bytes(data) != m.crc32:
        raise ValueError(
            f"JIT copy {copy.where}:{copy.path} does not match its marker "
            f"({len(data)} bytes, CRC32 {crc32_bytes(data):08x}; marker {m.bytes}, {m.crc32:08x})"
        )
    blob = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")  # copied into place by apply_state
    if blob["shard"] != m.shard or blob["step"] != m.step:
        raise ValueError(f"JIT copy {copy.path} holds {blob['shard']} step {blob['step']}, marker says otherwise")
    return blob


def _store_of(store: StoreFiles | None) -> StoreFiles:
    if store is None:  # list_copies lists store copies only with a store
        raise ValueError("a JIT copy in the object store, but no object store is configured")
    return store
