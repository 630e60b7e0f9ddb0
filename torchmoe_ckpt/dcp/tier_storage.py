"""One StorageWriter/StorageReader per tier, composable, for DCP users (`dcp.save` / `dcp.async_save` /
`dcp.load` drive them):

    HostWriter / HostReader      node-local shared memory (a /dev/shm path): raw bytes, one pwritev per file
    PeerWriter / PeerReader      r copies in peers' host memory (peer_storage.py); a later tier of a TieredWriter
    StoreWriter / StoreReader    any fsspec URI (file://, s3://, az://, memory://) with storage options
    TieredWriter / TieredReader  write through several tiers; read from the fastest holding a verified copy

All of them store the raw-bytes layout of `raw_storage.py` (a checksum per item, `.metadata` written last).
The tiered writer writes the first tier (host memory) from the state dict, then hands the *files* it wrote
to the other tiers (a sendfile/put of those bytes, no re-serialization, no second pass over the state), and
commits each tier with its own `.metadata` after its data: a tier that failed half-way has no metadata and
is invisible to readers.
"""

from __future__ import annotations

import logging
import os

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from .raw_storage import CorruptItemError, RawReader, RawWriter, _Local, done

log = logging.getLogger("torchmoe_ckpt.tier_storage")
DEFAULT_HOST_ROOT = "/dev/shm/torchmoe-ckpt"


def _under(base: str, checkpoint_id) -> str | None:
    """A tier's own path for `checkpoint_id` (joined under the tier's base path), None to keep it."""
    return f"{base.rstrip('/')}/{str(checkpoint_id).lstrip('/')}" if checkpoint_id else None


def _local_path(path: str) -> str:
    if path.startswith("file://"):
        return path[len("file://") :]
    if "://" in path:
        raise ValueError(
            f"host tier path {path!r} is a URI: the host tier is a local directory (e.g. under "
            f"/dev/shm); use StoreWriter/StoreReader for {path.split('://')[0]}://"
        )
    return path


class HostWriter(RawWriter):
    """Node-local shared memory: survives a worker restart (torchrun), not a node loss."""

    def __init__(self, path: str | os.PathLike = "", item_checksums: bool = True):
        super().__init__(_local_path(str(path)), None, item_checksums)


class HostReader(RawReader):
    def __init__(self, path: str | os.PathLike = "", verify: bool = True):
        super().__init__(_local_path(str(path)), None, verify)


class StoreWriter(RawWriter):
    """An fsspec object store; `storage_options` go to fsspec (endpoint, credentials), unlike DCP's own
    auto-selection from a checkpoint id, which passes none."""

    def __init__(self, uri: str = "", storage_options: dict | None = None, item_checksums: bool = True):
        super().__init__(uri, storage_options, item_checksums)


class StoreReader(RawReader):
    def __init__(self, uri: str = "", storage_options: dict | None = None, verify: bool = True):
        super().__init__(uri, storage_options, verify)


class TieredWriter(StorageWriter):
    """Write through `writers` (the first one, usually a HostWriter, from the state dict; the others from its
    files). `checkpoint_id` given to `dcp.save` is joined under every tier's own path."""

    def __init__(self, writers: list[RawWriter]):
        super().__init__()
        if not writers:
            raise ValueError("TieredWriter needs at least one tier")
        self.writers = writers
        self.bases = [w.path for w in writers]
        self.bytes_per_tier = [0] * len(writers)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        for w, base in zip(self.writers, self.bases):
            w.reset(_under(base, checkpoint_id))

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        for w in self.writers:
            w.set_up_storage_writer(is_coordinator, *args, **kwargs)

    def storage_meta(self) -> StorageMeta | None:
        return self.writers[0].storage_meta()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        for w in self.writers[1:]:
            w.prepare_local_plan(plan)
        return self.writers[0].prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return self.writers[0].prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        first = self.writers[0]
        results = first.write_data(plan, planner).wait()
        src = first.files()
        for i, w in enumerate(self.writers[1:], 1):
            if hasattr(w, "write_from"):  # a tier with work of its own (PeerWriter: a push to peers, collective)
                self.bytes_per_tier[i] += w.write_from(first, plan, results, planner)
                continue
            dst = w.files()
            for rel, n in first.written.items():
                if isinstance(src, _Local):
                    dst.copy_from(rel, os.path.join(src.root, rel))  # stream the bytes just written
                else:
                    data = src.read(rel)
                    dst.write_data(rel, len(data), [data])
                self.bytes_per_tier[i] += n
        self.bytes_per_tier[0] += sum(first.written.values())
        return done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        failed = []
        for w in self.writers:  # each tier commits after its own data; one failing keeps the others
            try:
                w.finish(metadata, results)
            except Exception as exc:
                failed.append(f"{w.path}: {exc}")
                log.warning("tier %s did not commit: %s", w.path, exc)
        if len(failed) == len(self.writers):
            raise RuntimeError(f"no tier committed the checkpoint: {failed}")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True


class TieredReader(StorageReader):
    """Read from the first of `readers` (fastest first) whose metadata reads and whose items verify; a
    missing, torn or corrupt copy falls through to the next tier."""

    def __init__(self, readers: list[RawReader]):
        super().__init__()
        self.readers = readers
        self.bases = [r.path for r in readers]
        self.source: int | None = None  # index of the tier the last read came from
        self.skipped: list[str] = []

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        for r, base in zip(self.readers, self.bases):
            r.reset(_under(base, checkpoint_id))

    def read_metadata(self, *args, **kwargs) -> Metadata:
        self._mds: list = []
        for r in self.readers:
            try:
                self._mds.append(r.read_metadata(*args, **kwargs))
            except Exception as exc:  # missing or unreadable on this tier
                self._mds.append(None)
                self.skipped.append(f"{r.path}: {type(exc).__name__}: {exc}")
        first = next((m for m in self._mds if m is not None), None)
        if first is None:
            raise FileNotFoundError(f"no tier holds a committed checkpoint: {self.skipped}")
        return first

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        for r, md in zip(self.readers, self._mds):
            if md is not None:
                r.set_up_storage_reader(md, is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        for r, md in zip(self.readers, self._mds):  # the same tiers on every rank (PeerReader fetches here)
            if md is not None:
                plan = r.prepare_local_plan(plan)
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for i, (r, md) in enumerate(zip(self.readers, self._mds)):
            if md is None:
                continue
            try:
                fut = r.read_data(plan, planner)
                fut.wait()
                self.source = i
                return fut
            except (CorruptItemError, OSError) as exc:  # the next tier re-reads every item in place
                self.skipped.append(f"{r.path}: {exc}")
                log.warning("tier %s unusable (%s): reading the next tier", r.path, exc)
        raise CorruptItemError(f"no tier holds a verified copy: {self.skipped}")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True
