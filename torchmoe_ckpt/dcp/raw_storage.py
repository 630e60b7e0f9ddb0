"""Raw-bytes DCP StorageWriter / StorageReader: no per-item serialization.

A slot's items are laid out once in one data file per rank (`__{rank}_0.distcp`), each tensor's bytes
copied as they are (one pwritev per file on a local or /dev/shm path, so the kernel's copy is the only one;
one put per file on an fsspec store), with a CRC32 per item computed on the way. `Metadata.storage_data`
maps each item to a `RawItem` (file, offset, length, checksum); the pickled `.metadata` is written last
(tmp + rename where the filesystem has it), so a checkpoint without it is half-written and invisible. The
reader checks every item's checksum before copying it anywhere, and still reads checkpoints of DCP's own
torch.save format (FileSystemWriter).

Both follow DCP's contract, so `dcp.save` / `dcp.async_save` / `dcp.load` drive them, with or without a
process group (`no_dist=True`: each rank writes its own self-contained checkpoint).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ..errors import TorchmoeError
from ..storage import checksums
from ..storage.checksums import BLOCK, SUM64, UnknownChecksum, digest_blocks
from ..storage.manifest import crc32_combine

PLANNER_KEY = "torchmoe_ckpt"  # = planner.PLANNER_KEY (planner.py builds on this module, not the reverse)
METADATA = ".metadata"
ALIGN = 64  # item start alignment in a data file (cache line; lets readers view items in place)
IOV_BATCH = 512  # buffers per pwritev (below IOV_MAX)


def checksum_matches(data, want: str) -> bool:
    try:
        return checksums.matches(data, want)
    except UnknownChecksum as exc:
        raise CorruptItemError(str(exc)) from None


def checksum_name(fqn: str, offset) -> str:
    """How an item is named in the planner's checksum table (`planner._checksum_name`)."""
    return f"{fqn}@{','.join(str(o) for o in (offset or ()))}"


@dataclass
class RawItem:
    """Where one item's raw bytes sit (Metadata.storage_data value). `length` and `offset` as in DCP's own
    _StorageInfo, so tools that read those keep working."""

    relative_path: str
    offset: int
    length: int
    checksum: str | None = None


def done(value=None) -> Future:
    """A Future that already holds `value`: these writers and readers finish their I/O before returning."""
    fut: Future = Future()
    fut.set_result(value)
    return fut


class CorruptItemError(TorchmoeError, RuntimeError):
    """An item's bytes do not match the checksum recorded when it was written: never loaded."""


# ---- where the files go: a local directory or any fsspec URI --------------------------------------
class _Local:
    def __init__(self, root: str):
        self.root = root

    def makedirs(self) -> None:
        os.makedirs(self.root, exist_ok=True)

    def write_data(self, rel: str, size: int, chunks: list) -> None:
        """Write `chunks` (bytes-like, back to back) as file `rel` of `size` bytes: one pwritev per batch, the
        kernel's copy is the only one. No O_TRUNC: a recycled file (HostTier reuses the files of collected
        windows) keeps its shared-memory pages, so no page is allocated and zeroed again."""
        fd = os.open(os.path.join(self.root, rel), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, size)
            pos = 0
            for i in range(0, len(chunks), IOV_BATCH):
                batch = chunks[i : i + IOV_BATCH]
                want = sum(len(c) for c in batch)
                done = os.pwritev(fd, batch, pos)
                if done != want:  # short write (tmpfs full): finish it byte-exactly or fail
                    flat = b"".join(bytes(c) for c in batch)
                    while done < want:
                        n = os.pwrite(fd, flat[done:], pos + done)
                        if n <= 0:
                            raise OSError(f"short write to {rel}")
                        done += n
                pos += want
        finally:
            os.close(fd)

    def put_last(self, rel: str, data: bytes) -> None:
        path = os.path.join(self.root, rel)
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # atomic: the metadata, written last, is the commit

    def read(self, rel: str) -> bytearray:
        path = os.path.join(self.root, rel)
        buf = bytearray(os.path.getsize(path))
        with open(path, "rb", buffering=0) as f:
            f.readinto(buf)
        return buf

    def exists(self, rel: str) -> bool:
        return os.path.exists(os.path.join(self.root, rel))

    def copy_from(self, rel: str, src: str) -> None:
        with open(src, "rb") as fi, open(os.path.join(self.root, rel), "wb") as fo:
            os.sendfile(fo.fileno(), fi.fileno(), 0, os.fstat(fi.fileno()).st_size)


class _Fsspec:
    def __init__(self, uri: str, storage_options: dict | None):
        import fsspec  # optional extra (s3/azure); only imported for a store URI

        self.fs, self.root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))

    def makedirs(self) -> None:
        if self.local:  # on object stores makedirs of a prefix is a no-op (or would create a bucket)
            self.fs.makedirs(self.root, exist_ok=True)

    def write_data(self, rel: str, size: int, chunks: list) -> None:
        self.fs.pipe_file(f"{self.root}/{rel}", b"".join(chunks))  # one put per data file

    def put_last(self, rel: str, data: bytes) -> None:
        self.fs.pipe_file(f"{self.root}/{rel}", data)  # after every data file: the commit
        if hasattr(self.fs, "invalidate_cache"):
            self.fs.invalidate_cache()

    def read(self, rel: str) -> bytearray:
        return bytearray(self.fs.cat_file(f"{self.root}/{rel}"))

    def exists(self, rel: str) -> bool:
        return self.fs.exists(f"{self.root}/{rel}")

    def copy_from(self, rel: str, src: str) -> None:
        if self.local:
            self.fs.makedirs(self.root, exist_ok=True)
        self.fs.put_file(src, f"{self.root}/{rel}")


def open_files(path: str | os.PathLike, storage_options: dict | None = None):
    """A plain path: local files (pwritev). Any URI (file:// too): fsspec with `storage_options`."""
    p = str(path)
    return _Fsspec(p, storage_options) if "://" in p else _Local(p)


def has_checkpoint(path: str | os.PathLike, storage_options: dict | None = None) -> bool:
    """Whether `path` holds a committed checkpoint (its `.metadata`, written last, is there)."""
    return open_files(path, storage_options).exists(METADATA)


# ---- writer ----------------------------------------------------------------------------------------------
class RawWriter(StorageWriter):
    def __init__(
        self,
        path: str | os.PathLike = "",
        storage_options: dict | None = None,
        item_checksums: bool = True,
        checksum_algo: str = "crc32",
        planner_checksums: bool = False,
        mapped=None,
    ):
        """`checksum_algo="crc32"` also gives each data file's CRC32 (`file_crc32`), combined from the item CRCs
        without a second pass; `planner_checksums` copies the item checksums into the planner's metadata info
        (where SlotSavePlanner would otherwise compute them in a pass of its own). `mapped` (a
        mapped_files.MappedFiles, local paths only) writes each data file through a kept shared mapping with
        sum64b512 checksums (items BLOCK-aligned): one memcpy plus one summing pass; `file_checksum` then
        holds each file's (algo, digest)."""
        super().__init__()
        self.path, self.storage_options, self.item_checksums = str(path), storage_options, item_checksums
        self.algo, self.planner_checksums = checksum_algo, planner_checksums
        self.rank, self.use_collectives, self.is_coordinator = 0, True, True
        self.save_id = uuid.uuid4().hex
        self.written: dict[str, int] = {}  # data file -> bytes (this rank), for callers that list files
        self.file_crc32: dict[str, int] = {}  # data file -> CRC32 (checksum_algo "crc32" only)
        self.mapped = mapped
        self.file_checksum: dict[str, tuple[str, int]] = {}  # data file -> (algo, 32-bit digest)

    def files(self):
        return open_files(self.path, self.storage_options)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = str(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self.written = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank", 0)
        self.use_collectives = kwargs.get("use_collectives", True)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.files().makedirs()
        if not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=f"__{self.rank}_")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=f"__{i}_") for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rel = f"{plan.storage_data or '__0_'}0.distcp"
        files = self.files()
        mapped = self.mapped is not None and isinstance(files, _Local)
        if mapped and (hit := self.mapped.layouts.get(id(plan.items))) is not None and hit[0] is plan.items:
            # the same planned items as an earlier save (planners cache them): offsets laid out then
            layout = [(wi, planner.resolve_data(wi), off, n) for wi, off, n in hit[1]]
            return self._write_mapped(files, rel, layout, hit[2], plan.items, hit[3])
        align = BLOCK if mapped else ALIGN
        layout, pos = [], 0
        for wi in plan.items:  # laid out once: offsets from the plan, before any byte moves
            data = planner.resolve_data(wi)
            n = len(data.getbuffer()) if wi.type == WriteItemType.BYTE_IO else data.numel() * data.element_size()
            layout.append((wi, data, pos, n))
            pos = (pos + n + align - 1) // align * align
        if mapped:
            if len(self.mapped.layouts) > 64:
                self.mapped.layouts.clear()
            # per item, computed once per layout: its block range, length bytes, checksum-table name
            spans = [
                (
                    off // BLOCK * 8,
                    (off + n + BLOCK - 1) // BLOCK * 8,
                    n.to_bytes(8, "little"),
                    checksum_name(wi.index.fqn, wi.index.offset),
                )
                for wi, _, off, n in layout
            ]
            self.mapped.layouts[id(plan.items)] = (plan.items, [(wi, off, n) for wi, _, off, n in layout], pos, spans)
            return self._write_mapped(files, rel, layout, pos, plan.items, spans)
        results: list[WriteResult] = []
        chunks: list = []
        crc = 0  # the file's CRC32, combined from the item CRCs (crc32 only)
        for k, (wi, data, off, n) in enumerate(layout):
            if wi.type == WriteItemType.BYTE_IO:
                src = data.getbuffer()
            else:
                t = data.detach()
                t = (t if t.device.type == "cpu" else t.cpu()).contiguous()
                src = t.reshape(-1).view(torch.uint8).numpy() if n else b""
            end = layout[k + 1][2] if k + 1 < len(layout) else pos
            pad = bytes(end - off - n)  # alignment padding, written as zeros (a recycled file holds old bytes)
            chunks += [src, pad] if pad else [src]
            ck = checksums.checksum(src, self.algo) if self.item_checksums or self.algo == "crc32" else None
            if ck is not None and self.algo == "crc32":
                crc = zlib.crc32(pad, crc32_combine(crc, checksums.parse(ck)[1], n)) & 0xFFFFFFFF
            keep = ck if self.item_checksums or self.planner_checksums else None
            results.append(WriteResult(index=wi.index, size_in_bytes=n, storage_data=RawItem(rel, off, n, keep)))
        files.write_data(rel, pos, chunks)
        self.written[rel] = pos
        if self.algo == "crc32":
            self.file_crc32[rel] = crc
        return done(results)

    def _write_mapped(self, files: _Local, rel: str, layout: list, pos: int, key, spans) -> Future[list[WriteResult]]:
        """One copy_ per item into the kept mapping, then one summing pass: every item's sum64b512 and the
        file's come from the same block sums (items BLOCK-aligned, zero padding between them)."""
        items = [
            (off, n, data.getbuffer() if wi.type == WriteItemType.BYTE_IO else data.detach())
            for wi, data, off, n in layout
        ]
        sums = memoryview(self.mapped.write(os.path.join(files.root, rel), pos, items, key)).cast("B")
        results, crc32 = [], zlib.crc32
        for (wi, _, off, n), (a, b, nle, _) in zip(layout, spans):  # = digest_blocks(sums[a:b], n), inlined
            ck = f"{SUM64}:{crc32(nle, crc32(sums[a:b])):08x}"
            results.append(WriteResult(index=wi.index, size_in_bytes=n, storage_data=RawItem(rel, off, n, ck)))
        self._names = (results, [sp[3] for sp in spans])  # finish() names the checksums without re-deriving
        self.written[rel] = pos
        self.file_checksum[rel] = (SUM64, digest_blocks(sums, pos))
        return done(results)

    def metadata_name(self) -> str:
        return METADATA if self.use_collectives else f"__{self.rank}{METADATA}"

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        info = (metadata.planner_data or {}).get(PLANNER_KEY) if isinstance(metadata.planner_data, dict) else None
        cached = getattr(self, "_names", None)
        if (
            self.planner_checksums
            and isinstance(info, dict)
            and cached
            and len(results) == 1
            and results[0] is cached[0]
        ):
            info["checksums"] = {name: r.storage_data.checksum for name, r in zip(cached[1], cached[0])}
        elif self.planner_checksums and isinstance(info, dict):
            # CRC32s as ints (what planner.verify_items always read), other algorithms as named strings
            info["checksums"] = {
                checksum_name(i.fqn, i.offset): checksums.parse(d.checksum)[1]
                if d.checksum.startswith("crc32:")
                else d.checksum
                for i, d in metadata.storage_data.items()
                if isinstance(d, RawItem) and d.checksum
            }
        metadata.storage_meta = self.storage_meta()
        metadata.version = "1.0.0"
        self.metadata_bytes = pickle.dumps(metadata)
        self.files().put_last(self.metadata_name(), self.metadata_bytes)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return bool(str(checkpoint_id))


# ---- reader ----------------------------------------------------------------------------------------------
class RawReader(StorageReader):
    def __init__(self, path: str | os.PathLike = "", storage_options: dict | None = None, verify: bool = True):
        super().__init__()
        self.path, self.storage_options, self.verify = str(path), storage_options, verify
        self.storage_data: dict = {}
        self.load_id = uuid.uuid4().hex

    def files(self):
        return open_files(self.path, self.storage_options)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = str(checkpoint_id)
        self.storage_data, self.load_id = {}, uuid.uuid4().hex

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        md = pickle.loads(bytes(self.files().read(METADATA if rank is None else f"__{rank}{METADATA}")))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.metadata, self.storage_data = metadata, metadata.storage_data
        self._sizes = {
            (fqn, tuple(c.offsets)): tuple(c.sizes)
            for fqn, tm in metadata.state_dict_metadata.items()
            for c in getattr(tm, "chunks", ())
        }

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for rel, reqs in per_file.items():
            raw = self.read_file(rel)
            for req in reqs:
                self._read_item(raw, rel, req, planner)
        return done()

    def read_file(self, rel: str) -> bytearray:
        """The bytes of data file `rel` (PeerReader reads them from wherever a copy is held)."""
        return self.files().read(rel)

    def _read_item(self, raw: bytearray, rel: str, req, planner: LoadPlanner) -> None:
        info = self.storage_data[req.storage_index]
        view = memoryview(raw)[info.offset : info.offset + info.length]
        if len(view) != info.length:
            raise CorruptItemError(f"{self.path}/{rel}: item {req.storage_index.fqn} is cut short (torn file)")
        if isinstance(info, RawItem) and self.verify and info.checksum and not checksum_matches(view, info.checksum):
            raise CorruptItemError(
                f"{self.path}/{rel}: item checksums do not match for {req.storage_index.fqn} at "
                f"{tuple(req.storage_index.offset or ())} (corrupt)"
            )
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(bytes(view)))
            return
        if isinstance(info, _StorageInfo):  # DCP's own torch.save format (FileSystemWriter)
            tensor = torch.load(io.BytesIO(bytes(view)), map_location="cpu", weights_only=True)
        else:
            fqn = req.storage_index.fqn
            dtype = self.metadata.state_dict_metadata[fqn].properties.dtype
            shape = self._sizes[(fqn, tuple(req.storage_index.offset or ()))]
            tensor = (torch.frombuffer(view, dtype=dtype) if len(view) else torch.empty(0, dtype=dtype)).reshape(shape)
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise CorruptItemError(
                f"{req.storage_index.fqn}: stored {tuple(tensor.size())}, wanted {tuple(target.size())}"
            )
        target.copy_(tensor)
        planner.commit_tensor(req, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return bool(str(checkpoint_id))


def read_slot_metadata(path: str | Path, storage_options: dict | None = None) -> Metadata:
    """The pickled DCP metadata of a slot checkpoint (either format)."""
    return RawReader(path, storage_options).read_metadata()
