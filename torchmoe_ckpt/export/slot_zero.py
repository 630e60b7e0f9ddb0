"""Slot 0 of one committed window, read across every writer of the run: the weights of every operator at the
window's first step, with no replay (slot 0 holds the compute weights of every operator, and the full state,
master weights included, of its first active set).

A window is chosen from a run directory or object-store URI in the tiers' layout (storage_format/layout.py): the
newest one every rank of the run committed, or one by id, or the one whose first step is given. Each writer's
manifest is read (its own checksum), where it and its slot files sit is checked (`check_window`, as recovery and
`verify` do), slot 0's files are checked against the manifest's sizes (and its `.metadata` against its digest), and
every item read is checked against its recorded checksum before it is used. Items are read one at a time, by byte
range, so the host memory held is one item plus the tensor it lands in.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..core.errors import TorchmoeError
from ..core.rejection import Rejection, RejectionKind
from ..storage_format.checksums import crc32_bytes
from ..storage_format.files import LocalFiles, open_files
from ..storage_format.layout import (
    METADATA,
    is_internal,
    parse_manifest_name,
    parse_window_dirname,
    slot_name,
    slot_of,
    window_dirname,
    writer_name,
    writer_rank,
)
from ..storage_format.manifest import WindowManifest, check_window, written_world_size
from ..storage_format.slot_format import (
    CorruptCopyError,
    RawItem,
    checksum_matches,
    chunk_sizes,
    planner_info,
    read_slot_metadata,
)

GIVE = "give a run directory (e.g. /dev/shm/torchmoe-ckpt/node-0/<run>) or the object-store URI of the run"
SOURCES = ("model", "compute")  # slot keys holding weights: master (or buffer) values, compute weights


class WindowChoiceError(TorchmoeError, ValueError):
    """No committed window matches what was asked (an id or a step that no window has, no window at all)."""


@dataclass(frozen=True)
class Piece:
    """One stored chunk of a tensor in slot 0."""

    source: str  # "model": master weights (or a buffer's value); "compute": compute weights
    dtype: torch.dtype
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    item: RawItem  # where its bytes sit (relative to the slot directory) and their checksum

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass
class StoredTensor:
    """A training tensor (parameter or persistent buffer) of slot 0: its global shape and its pieces."""

    fqn: str  # the training model's name (the slot key without "model."/"compute.")
    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def coverage_problem(self) -> str | None:
        """Why the pieces do not cover the tensor exactly once (None: they do)."""
        got = sum(p.numel for p in self.pieces)
        regions = {(p.offsets, p.sizes) for p in self.pieces}
        if got != self.numel or len(regions) != len(self.pieces):
            return f"{self.fqn}: slot 0 holds {got} of its {self.numel} elements"
        return None


def committed_windows(files) -> dict[int, dict[int, WindowManifest]]:
    """window id -> {writer rank: its manifest} for every window directory with at least one manifest."""
    out: dict[int, dict[int, WindowManifest]] = {}
    for name in sorted(files.listdir("")):
        wid = parse_window_dirname(name)
        if wid is None:
            continue
        for f in files.listdir(name):
            writer = parse_manifest_name(f)
            rank = writer_rank(writer) if writer is not None else None
            if rank is None:
                continue
            try:
                out.setdefault(wid, {})[rank] = WindowManifest.from_json(bytes(files.read(f"{name}/{f}")))
            except ValueError as exc:  # an edited or damaged manifest: this copy is unusable, the window too
                raise CorruptCopyError(f"window {wid} rank {rank}: bad manifest ({exc})") from None
    return out


def _world(man: WindowManifest) -> int:
    return written_world_size(man) or man.world_size


def complete(mans: dict[int, WindowManifest]) -> bool:
    """Whether every rank of the run that wrote the window committed it here."""
    first = next(iter(mans.values()))
    return set(range(_world(first))) <= set(mans)


class SlotZero:
    """Slot 0 of one committed window of a run, all writers' pieces merged (`read_slot_metadata`)."""

    def __init__(
        self,
        location: str,
        storage_options: dict | None = None,
        window: int | None = None,
        step: int | None = None,
    ):
        """Choose the window: `window` (an id), `step` (the window whose first step it is), else the newest one
        every rank committed. Raises WindowChoiceError (none matches), CorruptCopyError (a copy does not verify),
        ValueError (not a run location)."""
        if window is not None and step is not None:
            raise WindowChoiceError("give a window id or a step, not both")
        self.location = str(location)
        self.files = open_files(self.location, storage_options)
        if not self.files.exists(""):
            raise ValueError(f"{self.location}: no such checkpoint location ({GIVE})")
        wins = committed_windows(self.files)
        if not wins:
            runs = [n for n in self.files.listdir("") if not is_internal(n) and committed_windows_below(self.files, n)]
            more = f"; it holds the runs {sorted(runs)}: give one of them" if runs else ""
            raise WindowChoiceError(f"{self.location}: no committed window here{more} ({GIVE})")
        usable = {w: m for w, m in wins.items() if complete(m)}
        self.window_id = self._choose(usable, wins, window, step)
        self.manifests = usable[self.window_id]
        man = self.manifests[min(self.manifests)]
        self.start_step, self.window, self.world_size = man.start_step, man.window, _world(man)
        self.compute_dtype = str(man.extra.get("dtype") or (man.identity.get("parts") or {}).get("compute_dtype"))
        self.policy = "dense snapshot (W = 1)" if man.window == 1 else f"sparse window (W = {man.window})"
        self._check()
        self.rel = slot_name(self.window_id, 0)
        self.md = read_slot_metadata(self.files, self.rel)
        info = planner_info(self.md)
        if (info.get("window"), info.get("slot"), info.get("step")) != (self.window_id, 0, self.start_step):
            raise CorruptCopyError(
                f"{self.rel}: written for {info.get('window')}/{info.get('slot')}/{info.get('step')}"
            )
        self.tensors = self._tensors()

    def _choose(self, usable: dict, wins: dict, window: int | None, step: int | None) -> int:
        def listing() -> str:
            ws = sorted(usable)
            return ", ".join(f"{w} (step {usable[w][min(usable[w])].start_step})" for w in ws) or "none"

        if window is not None:
            if window not in usable:
                why = "not committed by every rank of the run" if window in wins else "no such window"
                raise WindowChoiceError(f"window {window}: {why}; committed windows here: {listing()}")
            return window
        if step is not None:
            found = [w for w in usable if usable[w][min(usable[w])].start_step == step]
            if not found:
                raise WindowChoiceError(
                    f"step {step} is no committed window's first step (a window holds the weights of its first "
                    f"step only); committed windows here: {listing()}"
                )
            return max(found)
        if not usable:
            raise WindowChoiceError(
                f"{self.location}: no window committed by every rank of the run (windows {sorted(wins)}: some ranks' "
                "manifests are missing here); give the object-store URI, or a directory that holds every rank"
            )
        return max(usable)

    def _check(self) -> None:
        """Each writer's copy: where its manifest and slot files sit (as recovery checks), slot 0's files present
        at their sizes, its `.metadata` at its digest. Items are checked when they are read."""
        w = window_dirname(self.window_id)
        for rank, man in sorted(self.manifests.items()):
            tier_info = lambda rel: planner_info(_load_md(self.files, f"{w}/{rel}"))  # noqa: E731
            problems = check_window(man, self.window_id, rank, self.world_size, tier_info)
            for rel, want in sorted(man.files.items()):
                if slot_of(rel) != 0:
                    continue
                size = _size(self.files, f"{w}/{rel}")
                if size is None:
                    problems.append(Rejection(RejectionKind.MISSING_FILE, f"{rel}: missing", file=rel))
                elif size != want.bytes:
                    problems.append(
                        Rejection(
                            RejectionKind.TORN, f"{rel}: {size} bytes, manifest says {want.bytes} (torn)", file=rel
                        )
                    )
                elif rel.endswith(METADATA) and crc32_bytes(bytes(self.files.read(f"{w}/{rel}"))) != want.crc32:
                    problems.append(
                        Rejection(
                            RejectionKind.CORRUPT, f"{rel}: digest differs from the manifest's (corrupt)", file=rel
                        )
                    )
            if problems:
                more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
                raise CorruptCopyError(
                    f"window {self.window_id} rank {rank} ({writer_name(rank)}): {problems[0]}{more}; "
                    "export an older window (--window) or another copy"
                )

    def _tensors(self) -> dict[str, StoredTensor]:
        sizes = chunk_sizes(self.md)
        out: dict[str, StoredTensor] = {}
        for idx, item in self.md.storage_data.items():
            source, _, fqn = idx.fqn.partition(".")
            tm = self.md.state_dict_metadata.get(idx.fqn)
            if source not in SOURCES or not isinstance(tm, TensorStorageMetadata) or not isinstance(item, RawItem):
                continue  # optimizer state, replay records of a DCP user's window, ...
            offsets = tuple(idx.offset or ())
            st = out.setdefault(fqn, StoredTensor(fqn, tuple(tm.size)))
            st.pieces.append(Piece(source, tm.properties.dtype, offsets, sizes[(idx.fqn, offsets)], item))
        return out

    def read(self, fqn: str, dtype: torch.dtype | None, held=None) -> torch.Tensor:
        """The whole tensor `fqn` in `dtype` (None: its stored dtype), assembled from its pieces, each checked
        against its checksum. `held(nbytes)`, if given, is told the bytes held while an item is read."""
        st = self.tensors[fqn]
        want = dtype if dtype is not None else st.pieces[0].dtype
        out = torch.empty(st.shape, dtype=want)
        for p in st.pieces:
            raw = _read_range(self.files, f"{self.rel}/{p.item.relative_path}", p.item.offset, p.item.length)
            if held is not None:
                held(len(raw))
            if p.item.checksum and not checksum_matches(memoryview(raw), p.item.checksum):
                raise CorruptCopyError(
                    f"{self.location}/{self.rel}: item checksums do not match for {p.source}.{fqn} at {p.offsets} "
                    "(corrupt); export an older window (--window)"
                )
            src = (torch.frombuffer(raw, dtype=p.dtype) if len(raw) else torch.empty(0, dtype=p.dtype)).view(p.sizes)
            out[tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes))].copy_(src)
            del src, raw
        return out


def committed_windows_below(files, name: str) -> bool:
    """Whether directory `name` of `files` looks like a run: it holds a window directory."""
    return any(parse_window_dirname(n) is not None for n in files.listdir(name))


def _load_md(files, rel: str):
    import pickle

    return pickle.loads(bytes(files.read(rel)))


def _size(files, rel: str) -> int | None:
    if isinstance(files, LocalFiles):
        try:
            return os.path.getsize(files.path(rel))
        except FileNotFoundError:
            return None
    try:
        return int(files.fs.size(files.path(rel)))
    except FileNotFoundError:
        return None


def _read_range(files, rel: str, offset: int, length: int) -> bytearray:
    """`length` bytes of file `rel` from `offset` (a local read into one buffer, or a ranged GET)."""
    if isinstance(files, LocalFiles):
        buf = bytearray(length)
        with open(files.path(rel), "rb", buffering=0) as f:
            f.seek(offset)
            got = f.readinto(buf)
        if got != length:
            raise CorruptCopyError(f"{files.where}/{rel}: cut short at {offset + (got or 0)} bytes (torn)")
        return buf
    data = files.fs.cat_file(files.path(rel), start=offset, end=offset + length)
    if len(data) != length:
        raise CorruptCopyError(f"{files.where}/{rel}: cut short (torn)")
    return bytearray(data)
