"""The storage tier contract, written down once: what the tiers implement, the order of a save's and a recovery's
steps, and who calls each (the tiers and where each keeps its copies: docs/architecture.md).

A *window* is W consecutive slots. A *writer* (today a rank, `layout.writer_name`) writes its own piece of every
slot and commits its own copy of the window, visible only through its manifest, written after every file it lists.

WindowTier: a tier slots are written into (HostTier; ObjectTier, a DCP user's object store)

    write_slot(window, slot, info[, partial])  the checkpointer's slot: data file, then `.metadata`; then, for
                                          sliding plans, the window's progress (write_partial)
    write_partial(window, start, plan, records, slots)  (host) how far a window not committed yet got
    write_items(window, slot, items, info)  the same from DCP write items (the DCP adapters)
    write_commit(window, start, plan, log, extra)  only if every slot write of the window succeeded in this
                                          process: the replay records, then the manifest (the commit)
    window_ids()                          windows this writer committed
    verify(window) / check(window, identity)  every file against the manifest / and where it sits, whose it is
    load_window(window, ops, dtype, identity)  (host) the checked copy into fresh slot buffers
    load_partial(window, start, ops, dtype, run)  (host) the slots written of a window not committed (sliding)
    collect(keep_from)                    older windows deleted, each manifest first

CopyTier: a tier that holds copies of committed host windows (ObjectTier, TensorstoreTier)

    upload(host, window)                  a committed host window, every file checked, the manifest put last
    window_ids() / verify(window)         committed copies / every file of one read and checked
    download(window, host)                a verified copy into the host tier, manifest last; returns problems
    collect()                             retention: the newest `keep` windows stay

PeerTier is a CopyTier whose steps are collective (one global pair order): push(window, manifest) = upload to
this writer's placed peers and receive theirs; holdings() = what it holds for others; pull(window, transfers).

A save (T: training thread, P: persist thread, U: upload thread)

    T  SparseCheckpointer.after_step(i)   capture slot i (copy engine), PersistThread.slot()
    P  HostTier.write_slot(w, slot)       once the copy finished (slot files on CPU: a link + one summing pass)
    T  window complete                    PersistThread.commit(w, keep_from = newest window every rank persisted)
    P  HostTier.write_commit(w, ...)      then PeerTier.push(w, manifest), collective
    P  Uploader.submit(w)  ->  U: ObjectTier.upload(host, w), ObjectTier.collect()
    P  HostTier.collect(keep_from)        keeping what the store still has to take (a bounded backlog)

A DCP user's `dcp.save` runs the same steps in the dcp/ adapters' write_data (write_items, write_commit).

A recovery (recover.recover_from_tiers, collective)

    HostTier.check(w, identity)           every local window; damaged copies are reported and skipped
    PeerTier.holdings(), all-gather       the newest window every rank can get (own copy or a peer's)
    PeerTier.pull(w, transfers)           ranks without a usable copy get theirs from a holder
    HostTier.load_window(w) -> agree -> replay -> agree    a failure on any rank excludes w; the next newest
        (sliding plans: HostTier.load_partial(w + 1) too, the newest covering suffix replayed -- recovery/recover.py)
    store.window_ids() -> store.download(w, host) -> HostTier.load_window(w)    the last tier, same agreement

A DCP user's `dcp.load` reads a slot through the same format (dcp/raw_storage.RawReader), merged over its writers.
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
    """What both object-store formats share: where, whose copies, how many windows kept, how calls are retried."""

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
