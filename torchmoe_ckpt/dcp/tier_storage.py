"""One StorageWriter/StorageReader per tier for DCP users, each a thin adapter over the checkpointer's tier objects:

    HostWriter / HostReader      node-local shared memory (a /dev/shm path): HostTier
    StoreWriter / StoreReader    any fsspec URI, with storage options: ObjectTier
    PeerWriter / PeerReader      r copies in peers' host memory: PeerTier (peer_storage.py)
    TieredWriter / TieredReader  write through several tiers; read from the fastest holding a verified copy

The tiered writer writes the first tier from the state dict, then hands the files it wrote to the others (each
slot's files, the window manifest last): a tier that failed half-way has no manifest, invisible to readers.
"""

from __future__ import annotations

import logging
import os

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ..storage_format.slot_format import CorruptCopyError
from .raw_storage import NoPlanning, RawReader, RawWriter, done

log = logging.getLogger("torchmoe_ckpt.tier_storage")


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

    _store = False

    def __init__(self, path: str | os.PathLike = ""):
        """Args:
            path: a local directory (e.g. under /dev/shm), or `file://`; a slot path
                (`schedule.slot_path(root, step)`) saves into the run's host tier, committing each window.

        Raises:
            ValueError: `path` is a URI of another scheme (use StoreWriter).
        """
        super().__init__(_local_path(str(path)))


class HostReader(RawReader):
    def __init__(self, path: str | os.PathLike = "", verify: bool = True):
        super().__init__(_local_path(str(path)), None, verify)


class StoreWriter(RawWriter):
    """An fsspec object store; `storage_options` go to fsspec (DCP's own choice from a checkpoint id passes none)."""

    _store = True

    def __init__(self, uri: str = "", storage_options: dict | None = None):
        """Args:
        uri: any fsspec URI (file://, s3://, az://, abfs://, memory://) or a slot path under one.
        storage_options: passed to fsspec as they are (credentials, endpoint).
        """
        super().__init__(uri, storage_options)


class StoreReader(RawReader):
    def __init__(self, uri: str = "", storage_options: dict | None = None, verify: bool = True):
        super().__init__(uri, storage_options, verify)


class _Tiers(NoPlanning):
    """Several tiers as one: a `checkpoint_id` given to DCP is joined under every tier's own path."""

    def __init__(self, tiers: list):
        super().__init__()
        self.tiers, self.bases = tiers, [t.path for t in tiers]

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        for t, base in zip(self.tiers, self.bases):
            t.reset(f"{base.rstrip('/')}/{str(checkpoint_id).lstrip('/')}" if checkpoint_id else None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True


class TieredWriter(_Tiers, StorageWriter):
    """Write through `writers` (the first one, usually a HostWriter, from the state dict; the others from its
    files)."""

    def __init__(self, writers: list[RawWriter]):
        """Args:
            writers: the tiers, fastest first; the first writes from the state dict, the others copy its files
                (a tier that fails is logged and skipped, except a collective PeerWriter, whose failure fails all).

        Raises:
            ValueError: no writer given.
        """
        super().__init__(writers)
        if not writers:
            raise ValueError("TieredWriter needs at least one tier")
        self.writers, self.bytes_per_tier = writers, [0] * len(writers)

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        for w in self.writers:
            w.set_up_storage_writer(is_coordinator, *args, **kwargs)

    def storage_meta(self) -> StorageMeta | None:
        return self.writers[0].storage_meta()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        first = self.writers[0]
        results = first.write_data(plan, planner).wait()
        self.bytes_per_tier[0] += sum(first.written.values())
        for i, w in enumerate(self.writers[1:], 1):
            try:  # each tier commits after its own data; one failing keeps the others
                self.bytes_per_tier[i] += w.write_from(first)
            except Exception as exc:
                log.warning("tier %s did not take the checkpoint: %s", w.path, exc)
                if getattr(w, "collective", False):
                    raise  # a peer push is collective: every rank must fail it together (DCP gathers the error)
        return done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        pass  # every tier committed in write_data


class TieredReader(_Tiers, StorageReader):
    """Read from the first of `readers` (fastest first) whose metadata reads and whose items verify; a
    missing, torn or corrupt copy falls through to the next tier."""

    def __init__(self, readers: list[RawReader]):
        """Args:
        readers: the tiers, fastest first; a missing, torn or corrupt copy falls through to the next.
        """
        super().__init__(readers)
        self.readers = readers
        self.source: int | None = None  # index of the tier the last read came from
        self.skipped: list[str] = []

    def read_metadata(self, *args, **kwargs) -> Metadata:
        self._mds: list = []
        for r in self.readers:
            try:
                self._mds.append(r.read_metadata(*args, **kwargs))
            except Exception as exc:  # missing or unreadable on this tier
                self._mds.append(None)
                self.skipped.append(f"{r.path}: {type(exc).__name__}: {exc}")
        # Planned against the fullest view (a node may hold only its own writers' pieces, a peer or the store all
        # of them); a tier that lacks an item the plan reads falls through to the next in read_data.
        best = max((md for md in self._mds if md is not None), key=lambda md: len(md.storage_data), default=None)
        if best is None:
            raise FileNotFoundError(f"no tier holds a committed checkpoint: {self.skipped}")
        return best

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        for r, md in zip(self.readers, self._mds):
            if md is not None:
                r.set_up_storage_reader(md, is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        for r, md in zip(self.readers, self._mds):  # the same tiers on every rank (PeerReader fetches here)
            if md is not None:
                plan = r.prepare_local_plan(plan)
        return plan

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for i, (r, md) in enumerate(zip(self.readers, self._mds)):
            if md is None:
                continue
            try:
                fut = r.read_data(plan, planner)
                fut.wait()
                self.source = i
                return fut
            except (CorruptCopyError, OSError) as exc:  # the next tier re-reads every item in place
                self.skipped.append(f"{r.path}: {exc}")
                log.warning("tier %s unusable (%s): reading the next tier", r.path, exc)
        raise CorruptCopyError(f"no tier holds a verified copy: {self.skipped}")
