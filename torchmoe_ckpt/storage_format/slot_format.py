"""The on-disk slot format: one writer's piece of a slot as a self-contained raw-bytes DCP checkpoint
(`slot-SS/<writer>/__0_0.distcp`, items at 512-byte-aligned offsets with zero padding; `.metadata` written last),
read by every tier, the DCP adapters and `inspect`/`verify`. What DCP derives from a set of slot buffers is computed
once per layout (`SlotLayout`); a save adds only its ids and one digest per item.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from array import array
from dataclasses import dataclass

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..core.errors import TorchmoeError
from ..core.rejection import Rejection
from ..core.slot import Slot, SlotItem
from . import checksums
from .checksums import BLOCK, CRC32, SUM64, UnknownChecksum, crc32_bytes
from .layout import DATA_FILE, METADATA

PLANNER_KEY = "torchmoe_ckpt"  # our entry in Metadata.planner_data: window, slot, step, run, plan, checksums
INFO_KEYS = ("window", "slot", "step", "plan")  # what every writer of one slot save must agree on


class CorruptCopyError(TorchmoeError, RuntimeError):
    """A copy is torn or corrupt (an item or file does not match its recorded checksum, a file is cut short or
    missing, a window's files do not verify): never loaded; the reader moves on to the next tier or window.
    `rejection`: the check's typed reason, when a check found it (recovery decides by its kind)."""

    def __init__(self, *args: object, rejection: Rejection | None = None):
        super().__init__(*args)
        self.rejection = rejection  # an attribute, not an argument: it survives a pickle (BaseException's state)


@dataclass
class RawItem:
    """Where one item's raw bytes sit (a Metadata.storage_data value; fields named as DCP's _StorageInfo's)."""

    relative_path: str
    offset: int
    length: int
    checksum: str | None = None


def checksum_name(fqn: str, offset) -> str:
    """How an item is named in the planner info's checksum table."""
    return f"{fqn}@{','.join(str(o) for o in (offset or ()))}"


_WRITE_ITEMS: dict[tuple, WriteItem] = {}  # a slot item's DCP WriteItem, shared by the slots of every plan


def write_item(it: SlotItem) -> WriteItem:
    """`it.write_item()`, built once per (key, region, dtype): a new plan (a reorder, another W) re-plans its
    slots from the same pieces, and building ~200 WriteItems costs milliseconds each time."""
    pc, b = it.piece, it.buffer
    key = (it.key, it.role, pc.global_offset, pc.shape, pc.global_shape, b.dtype, b.requires_grad, b.is_pinned())
    wi = _WRITE_ITEMS.get(key)
    if wi is None:
        if len(_WRITE_ITEMS) > 65536:  # bounded: pieces of models this process no longer trains
            _WRITE_ITEMS.clear()
        wi = _WRITE_ITEMS[key] = it.write_item()
    return wi


def nbytes_of(wi: WriteItem, data) -> int:
    if wi.type == WriteItemType.BYTE_IO:
        return len(data.getbuffer()) if isinstance(data, io.BytesIO) else len(memoryview(data))
    return data.numel() * data.element_size()


def _round_up(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK * BLOCK


def rebuild_metadata(
    static: bytes, info: dict, algo: str, digests: bytes, checkpoint_id: str, save_id: str
) -> Metadata:
    """Unpickling a slot's `.metadata` calls this: the full DCP Metadata, per-save values filled in."""
    md = pickle.loads(static)
    sums, ds = {}, array("I")
    ds.frombytes(digests)
    for (idx, item), d in zip(md.storage_data.items(), ds):
        item.checksum = ck = f"{algo}:{d:08x}"
        sums[checksum_name(idx.fqn, idx.offset)] = ck
    md.planner_data = {PLANNER_KEY: dict(info, checksums=sums)}
    md.storage_meta = StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id)
    return md


class _SaveRecord:
    """Pickles as a call to `rebuild_metadata`: the static part goes in as bytes (a memcpy, not a re-pickle)."""

    __slots__ = ("args",)

    def __init__(self, *args):
        self.args = args

    def __reduce__(self):
        return rebuild_metadata, self.args


class SlotLayout:
    """Offsets, file size, block ranges and the static DCP metadata of one writer's slot items, computed once.

    `items`: (DCP WriteItem, bytes) in save order. `offsets`: where each item sits (a slot whose buffers are
    views of one mapped file keeps their offsets, `size` is that file's); None: back to back, 512-aligned."""

    def __init__(self, items: list[tuple[WriteItem, int]], offsets: list[int] | None = None, size: int | None = None):
        sd, storage, pos, self.offsets = {}, {}, 0, []
        for k, (wi, n) in enumerate(items):
            off = offsets[k] if offsets is not None else pos
            pos = max(pos, _round_up(off + n))
            self.offsets.append(off)
            if wi.type == WriteItemType.BYTE_IO:
                sd[wi.index.fqn] = BytesStorageMetadata()
            else:
                td = wi.tensor_data
                assert td is not None  # a tensor write item carries its tensor data
                sd.setdefault(wi.index.fqn, TensorStorageMetadata(td.properties, td.size, [])).chunks.append(td.chunk)
            storage[wi.index] = RawItem(DATA_FILE, off, n, None)
        self.size = pos if size is None else size
        self.lengths = [n for _, n in items]
        self.indexes = [wi.index for wi, _ in items]
        self.nbytes = sum(self.lengths)
        # per item: its range in the file's block sums (int64 each) and its length, as sum64b512 digests it
        self.spans = [
            (off // BLOCK * 8, _round_up(off + n) // BLOCK * 8, n.to_bytes(8, "little"))
            for off, n in zip(self.offsets, self.lengths)
        ]
        md = Metadata(sd, planner_data={PLANNER_KEY: {}}, storage_data=storage)
        md.version = "1.0.0"
        self.static = pickle.dumps(md)

    @staticmethod
    def key(items: list[tuple[WriteItem, int]], offsets=None, size=None) -> tuple:
        """What a layout depends on, compared by value (a DCP planner builds new WriteItems every save)."""
        sig = []
        for wi, n in items:
            td = wi.tensor_data
            p = None if td is None else td.properties
            shape = None if td is None else (tuple(td.chunk.sizes), tuple(td.size))
            props = None if p is None else (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory)
            sig.append((wi.index.fqn, tuple(wi.index.offset or ()), n, shape, props))
        return tuple(sig), tuple(offsets or ()), size

    def record(self, info: dict, checkpoint_id: str, save_id: str = "", sums=None, data=None, algo: str = SUM64):
        """(`.metadata` bytes, the data file's digest, the items' checksum strings) of one save: from the data
        file's block sums (sum64b512; a bytes-like of little-endian int64, one per BLOCK), or, for CRC32, from
        the data file's bytes."""
        if algo == SUM64:
            assert sums is not None, "sum64b512 digests from the block sums"
            mv = memoryview(sums).cast("B")
            ds = array("I", [crc32_bytes(nle, crc32_bytes(mv[a:b])) for a, b, nle in self.spans])
            file_digest = crc32_bytes(self.size.to_bytes(8, "little"), crc32_bytes(mv))
        elif algo == CRC32:
            assert data is not None, "CRC32 digests from the data file's bytes"
            mv = memoryview(data).cast("B")
            ds = array("I", [crc32_bytes(mv[o : o + n]) for o, n in zip(self.offsets, self.lengths)])
            file_digest = crc32_bytes(mv)
        else:
            raise UnknownChecksum(f"unknown checksum algorithm {algo!r}")
        meta = pickle.dumps(_SaveRecord(self.static, info, algo, ds.tobytes(), checkpoint_id, save_id))
        return meta, file_digest, [f"{algo}:{d:08x}" for d in ds]

    def results(self, rel: str, digests: list[str]) -> list[WriteResult]:
        """DCP's WriteResults of a save: each item at its place in data file `rel`, with its checksum."""
        return [
            WriteResult(index=i, size_in_bytes=n, storage_data=RawItem(rel, off, n, d))
            for i, off, n, d in zip(self.indexes, self.offsets, self.lengths, digests)
        ]


def slot_items(slot: Slot, base: torch.Tensor | None = None) -> tuple[list, list[int] | None]:
    """A slot's (WriteItem, bytes) in save order, and the offsets of its buffers in `base` (the uint8 view of the
    mapped file they are views of; None: laid out back to back)."""
    items = [(write_item(it), it.nbytes) for it in slot.items]
    if base is None:
        return items, None
    offsets = [it.buffer.data_ptr() - base.data_ptr() if it.nbytes else 0 for it in slot.items]
    assert all(o % BLOCK == 0 and 0 <= o and o + n <= base.numel() for o, (_, n) in zip(offsets, items)), offsets
    return items, offsets


def pack(layout: SlotLayout, sources: list) -> torch.Tensor:
    """The data file of one save as a uint8 tensor (items at their offsets, zero padding)."""
    out = torch.zeros(layout.size, dtype=torch.uint8)
    for off, n, src in zip(layout.offsets, layout.lengths, map(as_source, sources)):
        if n and isinstance(src, torch.Tensor):
            out[off : off + n].view(src.dtype).view(src.shape).copy_(src)
        elif n:
            out[off : off + n].copy_(torch.frombuffer(bytearray(src), dtype=torch.uint8))
    return out


def as_source(d):
    """An item's data as the copy loops take it: a tensor (detached) or a bytes-like (a BytesIO's buffer)."""
    return d.getbuffer() if isinstance(d, io.BytesIO) else d.detach() if isinstance(d, torch.Tensor) else d


# ---- reading -------------------------------------------------------------------------------------------------
def planner_info(md) -> dict:
    """Our planner info (window, slot, step, run, plan, checksums) of a DCP `Metadata` ({} when it has none)."""
    return (getattr(md, "planner_data", None) or {}).get(PLANNER_KEY) or {}


def load_metadata(raw: bytes, where: str) -> Metadata:
    try:
        md = pickle.loads(raw)
    except Exception as exc:  # a torn or foreign file
        raise CorruptCopyError(f"{where}: metadata unreadable ({type(exc).__name__}: {exc})") from None
    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = StorageMeta()
    return md


def merge_metadata(pieces: dict[str, Metadata], where: str) -> Metadata:
    """One checkpoint's metadata from its writers' (`{writer: Metadata}`): chunks and storage entries united,
    each writer's files under its own directory. Writers of different saves (another window, slot or plan)
    are refused."""
    sd, storage, sums = {}, {}, {}
    infos = {w: planner_info(md) for w, md in pieces.items()}
    first = next(iter(infos.values()))
    for w, info in infos.items():
        if any(info.get(k) != first.get(k) for k in INFO_KEYS):
            raise CorruptCopyError(f"{where}: writer {w}'s piece was written for {info}, another's for {first}")
    for w, md in pieces.items():
        for fqn, tm in md.state_dict_metadata.items():
            if isinstance(tm, TensorStorageMetadata):
                have = sd.setdefault(fqn, TensorStorageMetadata(tm.properties, tm.size, []))
                seen = {tuple(c.offsets) for c in have.chunks}
                have.chunks.extend(c for c in tm.chunks if tuple(c.offsets) not in seen)
            else:
                sd.setdefault(fqn, tm)
        for idx, item in md.storage_data.items():
            storage[idx] = dataclasses.replace(item, relative_path=f"{w}/{item.relative_path}")
        sums.update(infos[w].get("checksums") or {})
    out = Metadata(sd, planner_data={PLANNER_KEY: dict(first, checksums=sums)}, storage_data=storage)
    out.storage_meta, out.version = StorageMeta(), "1.0.0"
    return out


def read_slot_metadata(files, rel: str = "") -> Metadata:
    """The metadata of a slot directory (`rel` under `files`): its own `.metadata` (one writer's piece, or a
    plain DCP checkpoint) when it has one, else every writer's piece in it, merged."""
    where = _join(files.where, rel)
    if files.exists(_join(rel, METADATA)):
        return load_metadata(bytes(files.read(_join(rel, METADATA))), where)
    pieces = {}
    for w in sorted(files.listdir(rel)):
        path = _join(rel, w, METADATA)
        if not w.startswith(".") and files.exists(path):
            pieces[w] = load_metadata(bytes(files.read(path)), f"{where}/{w}")
    if not pieces:
        raise FileNotFoundError(f"{where}: no committed checkpoint (no {METADATA})")
    return merge_metadata(pieces, where)


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


def chunk_sizes(md: Metadata) -> dict[tuple, tuple]:
    return {
        (fqn, tuple(c.offsets)): tuple(c.sizes)
        for fqn, tm in md.state_dict_metadata.items()
        for c in getattr(tm, "chunks", ())
    }


@dataclass(frozen=True)
class ItemSource:
    """What the item reads of one checkpoint share (a DCP reader's `read_data`)."""

    md: Metadata  # its DCP metadata
    sizes: dict  # chunk_sizes(md)
    verify: bool  # check each item against its checksum
    where: str  # the checkpoint's location, named in errors


def load_item(raw, rel: str, req, planner, source: ItemSource) -> None:
    """Check one item of data file `rel` (its bytes `raw`) against its checksum and hand it to `planner`."""
    md, sizes, verify, where = source.md, source.sizes, source.verify, source.where
    info = md.storage_data[req.storage_index]
    view = memoryview(raw)[info.offset : info.offset + info.length]
    if len(view) != info.length:
        raise CorruptCopyError(f"{where}/{rel}: item {req.storage_index.fqn} is cut short (torn file)")
    if isinstance(info, RawItem) and verify and info.checksum and not checksum_matches(view, info.checksum):
        raise CorruptCopyError(
            f"{where}/{rel}: item checksums do not match for {req.storage_index.fqn} at "
            f"{tuple(req.storage_index.offset or ())} (corrupt)"
        )
    if req.type == LoadItemType.BYTE_IO:
        planner.load_bytes(req, io.BytesIO(bytes(view)))
        return
    if isinstance(info, _StorageInfo):  # DCP's own torch.save format (FileSystemWriter)
        tensor = torch.load(io.BytesIO(bytes(view)), map_location="cpu", weights_only=True)
    else:
        fqn = req.storage_index.fqn
        tm = md.state_dict_metadata[fqn]
        assert isinstance(tm, TensorStorageMetadata)  # a tensor item (BYTE_IO returned above)
        dtype = tm.properties.dtype
        shape = sizes[(fqn, tuple(req.storage_index.offset or ()))]
        tensor = (torch.frombuffer(view, dtype=dtype) if len(view) else torch.empty(0, dtype=dtype)).reshape(shape)
    tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
    target = planner.resolve_tensor(req).detach()
    if target.size() != tensor.size():
        raise CorruptCopyError(f"{req.storage_index.fqn}: stored {tuple(tensor.size())}, wanted {tuple(target.size())}")
    target.copy_(tensor)
    planner.commit_tensor(req, target)


def read_slot(files, rel: str, slot: Slot, md: Metadata | None = None) -> dict:
    """Fill `slot`'s buffers from the writer's piece at `rel` (the piece the same plan wrote: every item at the key
    and offsets it was saved under), each item checked against its checksum before it is copied; returns the
    planner info (window, slot, step, run, plan, checksums). The host tier's own read: no DCP planning per load."""
    where = f"{files.where}/{rel}"
    md = md if md is not None else read_slot_metadata(files, rel)
    raw = memoryview(files.read(_join(rel, DATA_FILE)))
    for it in slot.items:
        wi = write_item(it)
        info = md.storage_data.get(wi.index)
        if not isinstance(info, RawItem) or info.length != it.nbytes:
            raise CorruptCopyError(
                f"{where}: no item {wi.index.fqn} at {tuple(wi.index.offset or ())} of {it.nbytes} bytes: written for "
                "another model or plan"
            )
        view = raw[info.offset : info.offset + info.length]
        if len(view) != info.length or not checksum_matches(view, info.checksum):
            raise CorruptCopyError(f"{where}: item checksums do not match for {wi.index.fqn} (torn or corrupt)")
        if info.length:
            it.buffer.view(-1).view(torch.uint8).copy_(torch.frombuffer(view, dtype=torch.uint8))
    return planner_info(md)


def checksum_matches(data, want) -> bool:
    try:
        return checksums.matches(data, want)
    except UnknownChecksum as exc:
        raise CorruptCopyError(str(exc)) from None
