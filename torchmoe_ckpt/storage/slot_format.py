"""A slot's raw-bytes DCP checkpoint laid out once per slot layout: the host tier's persist without re-planning.

A slot object's items never change (its buffers are allocated once per window plan and reused), so everything
DCP derives from them -- the save plan, the global plan and `Metadata` (tensor chunks, properties), the
`RawItem` storage entries (file, offset, length) and the sum64b512 block ranges of each item -- is computed
and pickled once, in `RawLayout(slot)`, through our SlotSavePlanner. A save then only adds what changes:
window/slot/step/run ids and one 32-bit digest per item.

The `.metadata` file a save writes is a pickle whose top object rebuilds the full DCP `Metadata` when
unpickled (`rebuild_metadata`: the once-pickled static part, with the per-save info and digests filled
in), so every reader -- our RawReader under stock `dcp.load`, `read_slot_metadata`, peers, inspect -- sees the
same `Metadata` (RawItem checksums, planner info with per-item checksums) a RawWriter save writes.

Offsets: a slot whose buffers are views of one mapped data file (slot_files.py) keeps the offsets its buffers
have in that file; any other slot is laid out back to back, BLOCK-aligned (the padding reads as zeros).
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from array import array

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..dcp.raw_storage import PLANNER_KEY, RawItem, checksum_name
from ..snapshot import Slot
from .checksums import BLOCK, SUM64
from .manifest import crc32_bytes
from .slot_planner import SlotSavePlanner

DATA_FILE = "__0_0.distcp"  # the data file of a one-rank save (RawWriter's name)


def rebuild_metadata(
    static: bytes, info: dict, algo: str, digests: bytes, checkpoint_id: str, save_id: str
) -> Metadata:
    """Unpickling a layout save's `.metadata` calls this: the full DCP Metadata, per-save values filled in."""
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


class RawLayout:
    """Offsets, file size, block ranges and the static DCP metadata of one slot object, computed once."""

    def __init__(self, slot: Slot, base: torch.Tensor | None = None, rel: str = DATA_FILE):
        """`base`: the uint8 tensor of the mapped file the slot's buffers are views of (their offsets are
        kept); None: items laid out back to back, BLOCK-aligned."""
        planner = SlotSavePlanner(slot, {}, checksums=False)
        planner.set_up_planner({}, None, True)
        local = planner.create_local_plan()
        plans, md = planner.create_global_plan([local])
        storage, items, pos = {}, [], 0
        where = {id(it.buffer): k for k, it in enumerate(slot.items)}
        self.index = []  # per item: its position in slot.items (for_slot maps another slot's buffers with it)
        for wi in plans[0].items:
            buf = planner.resolve_data(wi)
            self.index.append(where[id(buf)])
            n = buf.numel() * buf.element_size()
            if base is not None:
                off = buf.data_ptr() - base.data_ptr() if n else 0
                assert off % BLOCK == 0 and 0 <= off and off + n <= base.numel(), (wi.index.fqn, off, n)
            else:
                off = pos
                pos = (pos + n + BLOCK - 1) // BLOCK * BLOCK
            storage[wi.index] = RawItem(rel, off, n, None)
            items.append((off, n, buf.detach()))
        self.size = base.numel() if base is not None else pos
        self.items = items  # [(offset, nbytes, buffer)] in metadata order: what MappedFiles.write copies
        # per item: its range in the file's block sums (int64 each) and its length, as sum64b512 digests it
        self.spans = [
            (off // BLOCK * 8, (off + n + BLOCK - 1) // BLOCK * 8, n.to_bytes(8, "little")) for off, n, _ in items
        ]
        self.nbytes = sum(n for _, n, _ in items)
        self.static = pickle.dumps(
            dataclasses.replace(
                md, storage_data=storage, planner_data={PLANNER_KEY: {}}, storage_meta=None, version="1.0.0"
            )
        )
        self.rel = rel

    def template(self) -> RawLayout:
        """This layout without buffers (what a cache keeps: no reference to a slot's memory)."""
        lay = copy.copy(self)
        lay.items = [(off, n, None) for off, n, _ in self.items]
        return lay

    def for_slot(self, slot: Slot) -> RawLayout:
        """This layout for another slot object with the same `layout_key` (its own buffers, nothing re-planned)."""
        lay = copy.copy(self)
        lay.items = [(off, n, slot.items[k].buffer.detach()) for (off, n, _), k in zip(self.items, self.index)]
        return lay

    def save_record(self, sums, info: dict, checkpoint_id: str, save_id: str = "") -> tuple[bytes, int]:
        """(`.metadata` bytes, the data file's sum64b512 digest) of one save, from the data file's block sums
        (a bytes-like of little-endian int64, one per BLOCK)."""
        mv = memoryview(sums).cast("B")
        ds = array("I", [crc32_bytes(nle, crc32_bytes(mv[a:b])) for a, b, nle in self.spans])
        file_digest = crc32_bytes(self.size.to_bytes(8, "little"), crc32_bytes(mv))
        meta = pickle.dumps(_SaveRecord(self.static, info, SUM64, ds.tobytes(), checkpoint_id, save_id))
        return meta, file_digest


def layout_key(slot: Slot, base: torch.Tensor | None = None) -> tuple:
    """What a slot's layout depends on: its items (key, role, global offset and size, dtype, shape) and, for a slot
    backed by a mapped file, where each buffer sits in it. Slot objects of the same plan share it."""
    b = 0 if base is None else base.data_ptr()
    return tuple(
        (
            it.key,
            it.role,
            tuple(it.piece.global_offset),
            tuple(it.piece.global_shape),
            it.buffer.dtype,
            tuple(it.buffer.shape),
            it.buffer.data_ptr() - b if base is not None else 0,
        )
        for it in slot.items
    ) + (None if base is None else base.numel(),)
