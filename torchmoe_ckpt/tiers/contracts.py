"""The storage tier contract, written down once: what the tiers implement, the order of a save's and a recovery's
steps, and who calls each (the tiers and where each keeps its copies: docs/architecture.md).

A *window* is W consecutive slots. A *writer* (today a rank, `layout.writer_name`) writes its own piece of every
slot and commits its own copy of the window, visible only through its manifest, written after every file it lists.

The contracts are typed below (Protocols: a tier implements the methods, it does not inherit them); this text is
their call order. The implementations and where each keeps its copies: docs/architecture.md.

WindowTier: a tier slots are written into (window_tier.FilesWindowTier: HostTier; ObjectTier, a DCP user's store)

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

CopyTier / ObjectStore: a tier that holds copies of committed host windows (ObjectTier, TensorstoreTier)

    upload(host, window)                  a committed host window, every file checked, the manifest put last
    window_ids() / verify(window)         committed copies / every file of one read and checked
    download(window, host)                a verified copy into the host tier, manifest last; returns problems
    collect()                             retention: the newest `keep` windows stay

PeerTier is a CopyTier whose steps are collective (one global pair order): push(window, manifest) = upload to
this writer's placed peers and receive theirs; holdings() = what it holds for others; pull(window, transfers).
Its bytes travel through a PeerTransport (peer_transport.GlooTransport): send(files, dst) on one rank of a pair,
recv(src, write) on the other, at the same point of both ranks' pair order.

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
        (sliding plans: HostTier.load_partial(w + 1) too, the newest covering suffix replayed -- recovery/resume.py)
    store.window_ids() -> store.download(w, host) -> HostTier.load_window(w)    the last tier, same agreement

A DCP user's `dcp.load` reads a slot through the same format (dcp/raw_storage.RawReader), merged over its writers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..storage_format.retry import retry

if TYPE_CHECKING:
    from ..core.plan import WindowPlan
    from ..core.records import ReplayLog, SlotInfo
    from ..core.rejection import Rejection
    from ..model.identity import RunIdentity
    from ..storage_format.manifest import WindowManifest


class WindowTier(Protocol):
    """A tier slots are written into and windows committed in, one writer's copy each (window_tier.FilesWindowTier:
    HostTier, and ObjectTier for a DCP user's `dcp.save`).

    Call order (one writer; P: the persist thread for HostTier, the DCP adapters' `write_data` for a DCP user):
        P  write_slot / write_items      once per slot of a window, any order; a failed write leaves no record
        P  write_partial                 (sliding plans, host) after each slot: how far the window got
        P  write_commit                  once, after every slot write of the window succeeded in this process;
                                         raises UncommittableWindow otherwise. The manifest is written last.
        P  collect(keep_from)            after a commit: older windows deleted, each manifest first
        recovery (training thread, before training resumes): window_ids -> check / verify -> load (host)
    """

    rank: int  # the writer
    world_size: int  # recorded in the manifests this tier commits
    writer: str  # the writer's name in the layout (layout.writer_name)

    def write_items(self, window_id: int, slot: int, items: list, info: SlotInfo) -> list:
        """One slot from [(WriteItem, tensor or bytes)]; returns DCP's WriteResults."""
        ...

    def write_partial(self, window_id: int, start_step: int, plan: WindowPlan, records: list, slots: int) -> None:
        """A sliding plan's window before its commit: its first `slots` slots, plan and replay records so far."""
        ...

    def write_commit(
        self, window_id: int, start_step: int, plan: WindowPlan, log: ReplayLog | None, extra: dict
    ) -> WindowManifest:
        """The replay records, then the manifest (the commit); only if every slot write of the window succeeded."""
        ...

    def window_ids(self, require_manifest: bool = True, rank: int | None = None) -> list[int]:
        """Windows this writer (or `rank`) committed; `require_manifest=False`: every window directory."""
        ...

    def manifest(self, window_id: int, rank: int | None = None) -> WindowManifest: ...

    def verify(self, window_id: int, rank: int | None = None) -> list[Rejection]:
        """Every file against the manifest; the problems (empty: it verifies)."""
        ...

    def check(self, window_id: int, identity: RunIdentity | None = None, rank: int | None = None) -> list[Rejection]:
        """`verify`, where every file sits (window/slot/step/run), and whose it is; the problems."""
        ...

    def remove_window(self, window_id: int) -> None: ...

    def collect(self, keep_from: int) -> list[int]:
        """Delete windows older than `keep_from`, each manifest first; returns the deleted ids."""
        ...


class CopyTier(Protocol):
    """A tier that holds copies of committed host windows (ObjectTier, TensorstoreTier; the peer tier's steps
    are the collective form of these).

    Call order: U (the upload thread, uploader.py) calls upload(host, w) for each committed host window, oldest
    first, then collect(); window_ids() lists its committed copies (also at start, for the catch-up). Recovery
    (training thread, every rank) calls window_ids(), then download(w, host) of the newest usable window.
    """

    def upload(self, tier, window_id: int) -> int: ...  # bytes uploaded; the manifest goes last
    def window_ids(self) -> list[int]: ...  # committed copies
    def verify(self, window_id: int) -> list[Rejection]: ...  # problems of the copy (empty: it verifies)
    def download(self, window_id: int, tier) -> list[Rejection]: ...  # into the host tier; problems (empty: usable)
    def collect(self) -> list[int]: ...  # retention: window ids deleted


class ObjectStore(CopyTier, Protocol):
    """An object-store tier (object_tier.make_store: ObjectTier in the DCP format, TensorstoreTier): a CopyTier
    at a URI, retrying every store call (StoreTier). Built by build_tiers; used by the Uploader (U) and recovery."""

    uri: str  # where (named in the status lines)
    run_id: str  # the run's prefix under `uri` ("": the URI is the run directory)
    keep: int  # windows kept by `collect`


# write(rel, size, chunks): store one received file from its (offset, view) chunks (a view is valid until the next)
FileWriter = Callable[[str, int, Iterator[tuple[int, memoryview]]], None]


class PeerTransport(Protocol):
    """The byte transfer under the peer tier (peer_transport.GlooTransport): named files from one rank to another.

    Call order: the persist thread (push) or the training thread at recovery (pull) of both ranks of a pair, in
    the peer tier's one global pair order (no deadlock): `send` on the sender while the receiver runs `recv`.
    One transfer is a header (file names and sizes, the sender's `meta`), then every file's bytes in order.
    A transport bounds every message's wait for its partner (its `timeout_s`, given when the peer tier makes it)
    and raises core.errors.PeerTimeoutError past it; the peer tier then stops (`PeerTier.stopped`).
    """

    def send(self, files: list[tuple[str, Path]], dst: int, group, meta: dict) -> int:
        """Send (name, path) files and `meta` to `dst`; returns the bytes sent."""
        ...

    def recv(self, src: int, group, write: FileWriter) -> dict:
        """Receive one `send` of `src`, each file through `write`; returns the sender's `meta`."""
        ...

    def buffer_bytes(self) -> int:
        """Host memory the transport holds (its reused buffers)."""
        ...


class StoreTier:
    """What both object-store formats share: where, whose copies, how many windows kept, how calls are retried."""

    attempts = 2  # tries per store call (a format may default to more)

    def __init__(  # noqa: PLR0913  (the store's where, whose, retention and retry settings: make_store's kwargs)
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
