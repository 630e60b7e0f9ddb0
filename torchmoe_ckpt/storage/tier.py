"""The storage tier contract, written down once: what the tiers implement, in which order the steps of a save and
of a recovery run, and who calls each step.

    tier                  class                               where                               kind
    host memory           host_tier.HostTier                  node-local directory (/dev/shm)     WindowTier
    object store (DCP)    object_tier.ObjectTier              any fsspec URI, the same layout      WindowTier, CopyTier
    object store (zarr3)  tensorstore_tier.TensorstoreTier    one OCDBT database per window        CopyTier
    peers                 peer_tier.PeerTier                  other nodes' host memory, over gloo  collective copies

A *window* is W consecutive slots. A *writer* (today: a rank, `layout.writer_name`) writes its own piece of
every slot and commits its own copy of the window: a copy becomes visible only through the writer's manifest,
written after every file it lists (manifest.py). Every item and every file carries a checksum (checksums.py);
where every file sits is layout.py; the files go through files.py (a local directory or any fsspec store).

WindowTier: a tier slots are written into (host memory; a DCP user's object store)

    write_slot(window, slot, info)        the checkpointer's captured slot: data file, then its `.metadata`
    write_items(window, slot, items, info)  the same from DCP write items (the DCP adapters)
    write_commit(window, start, plan, log, extra)  only if every slot write of the window succeeded in this
                                          process: the replay records, then the manifest (the commit)
    window_ids()                          windows this writer committed
    verify(window) / check(window, identity)  every file against the manifest / and where it sits, whose it is
    load_window(window, ops, dtype, identity)  (host) the checked copy into fresh slot buffers
    collect(keep_from)                    older windows deleted, each manifest first

CopyTier: a tier that holds copies of committed host windows (object stores)

    upload(host, window)                  this writer's committed window copied from the host tier, every file
                                          checked against the host manifest, the manifest put last
    window_ids()                          committed copies in the store
    verify(window)                        every file (piece) of the copy read and checked
    download(window, host)                a verified copy back into the host tier, its manifest last; returns the
                                          problems (empty: usable)
    collect()                             retention: the newest `keep` windows stay

PeerTier is a CopyTier whose steps are collective (every rank calls them in the same order, point-to-point in
one global pair order): push(window, manifest) = upload to this writer's placed peers and receive theirs;
holdings() = what this writer holds for others; pull(window, transfers) = download.

Call order of a save, the checkpointer (who: the training thread T, the persist thread P, the upload thread U)

    T  SparseCheckpointer.after_step(i)   capture slot i into its buffers (copy engine), PersistThread.slot()
    P  HostTier.write_slot(w, slot)       once the slot's copy finished (with slot files on CPU: a link + one
                                          summing pass, slot_files.py)
    T  window complete                    PersistThread.commit(w, keep_from = newest window every rank persisted)
    P  HostTier.write_commit(w, ...)      the window is committed on the host tier
    P  PeerTier.push(w, manifest)         collective
    P  Uploader.submit(w)  ->  U: ObjectTier.upload(host, w), ObjectTier.collect()
    P  HostTier.collect(keep_from)        keeping what the store still has to take (a bounded backlog)

A DCP user's `dcp.save(planner=SparseSavePlanner, storage_writer=...)` runs the same steps through the thin
adapters of dcp/ in StorageWriter.write_data (every rank): write_items into the first tier, write_commit on a
window's last slot, then each later tier takes the files (ObjectTier.upload of the slot's files, the manifest
at the commit; PeerTier.push at the commit).

Call order of a recovery (recover.recover_from_tiers, collective)

    HostTier.check(w, identity)           every local window; damaged copies are reported and skipped
    PeerTier.holdings()                   what this rank holds for others
    all-gather                            the newest window every rank can get (own copy or a peer's)
    PeerTier.pull(w, transfers)           ranks without a usable copy get theirs from a holder
    HostTier.load_window(w)  -> agree  -> replay -> agree    a failure on any rank excludes w; the next newest
    store.window_ids() -> store.download(w, host) -> HostTier.load_window(w)    the last tier, same agreement

A DCP user's `dcp.load(storage_reader=...)` reads a slot through the same slot format (dcp/raw_storage.RawReader),
merged over the writers of the slot; PeerReader pulls what its node lost first (PeerTier.pull).
"""

from __future__ import annotations

from typing import Protocol

from .retry import retry


class CopyTier(Protocol):
    """A tier that holds copies of committed host windows (see the module docstring)."""

    def upload(self, tier, window_id: int) -> int: ...  # bytes uploaded; the manifest goes last
    def window_ids(self) -> list[int]: ...  # committed copies
    def verify(self, window_id: int) -> list[str]: ...  # problems of the copy (empty: it verifies)
    def download(self, window_id: int, tier) -> list[str]: ...  # into the host tier; problems (empty: usable)
    def collect(self) -> list[int]: ...  # retention: window ids deleted


class StoreTier:
    """What both object-store formats share: where the store is, whose copies, how many windows it keeps, and
    how its calls are retried (retry.py)."""

    attempts = 2  # tries per store call (a format may default to more)

    def __init__(
        self,
        uri: str,
        run_id: str,
        rank: int,
        storage_options: dict | None = None,
        keep_windows: int = 2,
        attempts: int | None = None,
        backoff_s: float = 0.2,
        probe: bool = True,
    ):
        """`run_id` "": the URI is the run directory itself. `probe`: check at once that the store can be written
        (a wrong scheme, a missing bucket or bad credentials fail here, with the fix)."""
        self.uri, self.run_id, self.rank, self.storage_options = uri, run_id, rank, storage_options
        self.keep, self.backoff, self.probe = keep_windows, backoff_s, probe
        self.attempts = self.attempts if attempts is None else attempts

    def _retry(self, what: str, fn, *args):
        return retry(what, fn, *args, attempts=self.attempts, backoff_s=self.backoff)
