"""Object-store tier in the DCP format: any fsspec URI (file://, s3://, az://, abfs://, memory://) in the layout of
every other tier, each writer's manifest put last as its commit (no rename: on Azure a rename is a non-atomic
copy). The uploader copies committed host windows here off the training path; a DCP user's StoreWriter writes
slots here directly. Storage options go to fsspec explicitly, and every store call retries (retry.py).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..core.config_values import check_uri
from ..core.errors import StoreConfigError
from ..core.rejection import Rejection, RejectionKind
from ..runtime import faults
from ..storage_format import usage
from ..storage_format.checksums import CHUNK, Digester, FileEntry
from ..storage_format.files import StoreFiles
from ..storage_format.layout import METADATA, is_data_file, manifest_name, window_dirname
from ..storage_format.manifest import WindowManifest
from ..storage_format.spare_files import place_new_file, pwrite_all
from ..storage_format.store_open import open_store, quiet_third_party_loggers
from ..storage_format.tensorstore_spec import NoTensorstoreDriver
from .contracts import ObjectStore, StoreTier
from .tensorstore_tier import TensorstoreTier
from .window_tier import FilesWindowTier

log = logging.getLogger("torchmoe_ckpt.object_tier")
FORMATS = ("dcp", "tensorstore")


def make_store(
    uri: str,
    run_id: str,
    rank: int,
    storage_options: dict | None = None,
    keep_windows: int = 2,
    format: str = "dcp",
    **kw,
):
    """The object-store tier for one URI in the format "dcp" (ObjectTier) or "tensorstore" (TensorstoreTier; with no
    driver for az:// and abfs://, those stores say so once and keep the DCP format)."""
    if format not in FORMATS:
        raise StoreConfigError(f"unknown object-store format {format!r}: use one of {', '.join(FORMATS)}")
    check_uri(uri)
    quiet_third_party_loggers()
    if format == "tensorstore":
        try:
            return TensorstoreTier(uri, run_id, rank, storage_options, keep_windows=keep_windows, **kw)
        except NoTensorstoreDriver as exc:
            if rank == 0:
                log.warning("%s: using the DCP/fsspec format for this store instead", exc)
    return ObjectTier(uri, run_id, rank, storage_options, keep_windows=keep_windows, **kw)


class ObjectTier(FilesWindowTier, StoreTier, ObjectStore):
    format = "dcp"

    def __init__(self, *args, world_size: int = 1, **kw):
        """StoreTier's arguments. `world_size`: recorded in the manifests this tier commits itself (a DCP user's)."""
        StoreTier.__init__(self, *args, **kw)
        self.fs, root = open_store(self.uri, self.storage_options, self.probe)
        run = self.run_id.strip("/")
        self.base = f"{root.rstrip('/')}/{run}" if run else root.rstrip("/")
        where = f"{self.uri.rstrip('/')}/{run}" if run else self.uri
        FilesWindowTier.__init__(self, StoreFiles(self.fs, self.base, where), self.rank, world_size)
        self.spare_windows = 1  # a local store keeps deleted windows' data files (the host tier's setting)
        self._buf = bytearray(CHUNK)  # the upload thread's one chunk buffer (a local store streams through it)

    @property
    def max_spares(self) -> int:
        """A local store keeps `spare_windows` deleted windows' data files, to be written over."""
        return self.spare_windows * self.window_data_files if self.files.local else 0

    def in_memory(self) -> bool:
        """A local store on a memory file system (tmpfs): its files are host memory."""
        if self._in_memory is None:
            self._in_memory = self.files.local and usage.in_memory(self.files.path(""))
        return self._in_memory

    _in_memory: bool | None = None

    def host_bytes(self) -> dict[str, int]:
        """The upload thread's chunk buffer, and this writer's files when the store is in memory (tmpfs)."""
        out = {"store_buffers": len(self._buf)}
        if self.in_memory():
            root, seen = Path(self.files.path("")), set()
            spare = usage.tree_bytes(self.spare_path(), seen)
            out["store_files"] = sum(usage.window_bytes(root, self.writer, seen).values()) + spare
        return out

    def upload(self, tier: FilesWindowTier, window_id: int, entries: dict | None = None, commit: bool = True) -> int:
        """Upload this writer's copy of a committed window of `tier`: every file its manifest lists (or `entries`),
        each checked against its entry; `commit`: then the manifest, once every file is in the store. Returns bytes."""
        man = tier.manifest(window_id) if commit else None
        self.spare_windows = getattr(tier, "spare_windows", self.spare_windows)
        if man is not None:
            self.window_data_files = sum(map(is_data_file, man.files))
        w = window_dirname(window_id)
        if entries is None:  # a whole window: invisible here until its manifest is back
            self._retry("delete", self.files.remove, [f"{w}/{manifest_name(self.writer)}"])
        if entries is None:
            assert man is not None, "a whole window is uploaded with its commit"
            files = man.files
        else:
            files = entries
        nbytes = 0
        for rel in sorted(files, key=lambda r: r.endswith(METADATA)):  # a slot's `.metadata` after its data
            entry = files[rel]
            if self.files.local:  # one pass: each chunk is copied, checksummed and written while in cache
                self._retry("upload", self._stream, tier.files.path(f"{w}/{rel}"), self.files.path(f"{w}/{rel}"), entry)
            else:
                data = tier.files.read(f"{w}/{rel}")
                if not entry.matches(data):  # size and digest (CRC32, or the algorithm the entry names)
                    raise RuntimeError(f"local copy of window {window_id} changed under the uploader: {rel}")
                self._retry("upload", self._put, self.files.path(f"{w}/{rel}"), bytes(data))
            nbytes += entry.bytes
        if man is not None:  # commit
            faults.point("upload")
            self._check_complete(w, man, window_id)
            self._retry(
                "commit", self._put, self.files.path(f"{w}/{manifest_name(self.writer)}"), man.to_json().encode()
            )
            self.files.invalidate()
        return nbytes

    def _check_complete(self, w: str, man: WindowManifest, window_id: int) -> None:
        """Before the manifest: every file is in the store at its size (a store that restarted during the upload lost
        files). Raises, so the uploader uploads the whole window again."""
        self.files.invalidate()
        sizes = self._retry("list", self.files.sizes, w)
        torn = [rel for rel, e in man.files.items() if sizes.get(rel) != e.bytes]
        if torn:
            raise RuntimeError(
                f"window {window_id} is torn in the store ({len(torn)} of {len(man.files)} file(s) "
                f"missing or short, e.g. {torn[0]}; did the store restart?): uploading it again"
            )

    def _stream(self, src, path: str, entry: FileEntry) -> None:
        """Copy a host-tier file to a local store through one reused buffer, checksumming exactly the bytes written
        (a mismatch raises); a data file is written over a spare, reusing its pages."""
        place_new_file(Path(path), self.take_spare(entry.bytes) if is_data_file(path) else None)
        d, mv = Digester(entry.algo), memoryview(self._buf)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            with open(src, "rb", buffering=0) as f:
                pos = 0
                while n := f.readinto(self._buf):
                    d.update(mv[:n])
                    pwrite_all(fd, mv[:n], pos)
                    pos += n
            os.ftruncate(fd, pos)  # a longer spare's tail
        finally:
            os.close(fd)
        if d.entry() != entry:  # size and digest (CRC32, or the algorithm the entry names)
            raise RuntimeError(f"local copy changed under the uploader: {src}")

    def _put(self, path: str, data: bytes) -> None:
        if self.files.local:
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        self.fs.pipe_file(path, data)

    def window_ids(self, require_manifest: bool = True, rank: int | None = None) -> list[int]:
        """Windows whose manifest is in the store (a window without one is half-uploaded: invisible)."""
        self.files.invalidate()
        return super().window_ids(require_manifest, rank)

    def download(self, window_id: int, tier: FilesWindowTier) -> list[Rejection]:
        """Fetch this writer's copy into `tier` (the host tier), every file verified, the manifest last; returns
        problems (empty = ok)."""
        w = window_dirname(window_id)
        try:
            man = self.manifest(window_id)
        except Exception as exc:
            return [Rejection(RejectionKind.DOWNLOAD_FAILED, f"manifest unreadable: {exc}")]
        tier.files.remove([f"{w}/{manifest_name(tier.writer)}"])
        problems = []
        for rel, entry in man.files.items():
            try:
                data = self._retry("download", self.files.read, f"{w}/{rel}")
            except Exception as exc:
                problems.append(Rejection(RejectionKind.DOWNLOAD_FAILED, f"{rel}: {exc}", file=rel))
                continue
            if not entry.matches(data):
                why = f"{rel}: does not match the manifest (torn or corrupt)"
                problems.append(Rejection(RejectionKind.CORRUPT, why, file=rel))
                continue
            tier.files.write(f"{w}/{rel}", data)  # a new file, never written into (it may link live slot buffers)
        if not problems:
            tier.files.write_last(f"{w}/{manifest_name(tier.writer)}", man.to_json().encode())
        return problems

    def collect(self, keep_from: int | None = None) -> list[int]:
        """Keep this writer's newest `keep_windows` windows (or those from `keep_from` on); returns deleted ids."""
        ids = self.window_ids()
        if keep_from is not None:
            gone = [w for w in ids if w < keep_from]
        else:
            gone = ids[: -self.keep] if self.keep > 0 else []
        for wid in gone:
            self._retry("delete", self.remove_window, wid)
        kept = [w for w in ids if w not in gone]
        for wid in self.window_ids(require_manifest=False):
            # uploads cut off by an outage or an exit: invisible to recovery, but they take space
            if kept and wid < min(kept) and wid not in ids:
                self._retry("delete", self.remove_window, wid)
        return gone
