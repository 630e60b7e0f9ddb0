"""Peer tier: every window a writer commits on its host tier also reaches r peers on other nodes (placement.py),
and comes back from them when its node lost it.

An HSDP *replica* peer already holds bit-identical slot data, so it is sent only the manifest, the replay records
and the `.metadata` files, and verifies by digest that its own data equals the sender's (a DCP user's save dedups
replicated items, so its PeerWriter sends the data: `replicas_hold_data`). Push and pull run over a gloo group,
rank pairs in one global order (no deadlock). A copy lives under `.peers/<receiver>/from-<sender>/` in the common
layout, its manifest last. Files travel in messages of at most CHUNK bytes through two reused buffers
(peer_transport.py: the byte transport), written over a collected copy's spare files; no checksum pass (a copy is
verified when used: `holdings`)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.errors import PeerTimeoutError
from ..runtime import faults
from ..storage_format import usage
from ..storage_format.files import LocalFiles
from ..storage_format.layout import (
    REPLICA_VERIFIED,
    held_copies_dir,
    is_data_file,
    manifest_name,
    parse_manifest_name,
    parse_peer_copy_name,
    peer_copy_dir,
    rank_of_writer,
    window_dirname,
    writer_name,
)
from ..storage_format.manifest import WindowManifest
from ..storage_format.spare_files import place_new_file, pwrite_all
from .peer_lag import LinkStats
from .peer_transport import CHUNK, GlooTransport
from .window_tier import FilesWindowTier

if TYPE_CHECKING:
    from .contracts import PeerTransport
    from .host_tier import HostTier

log = logging.getLogger("torchmoe_ckpt.peer_tier")
__all__ = ["CHUNK", "REPLICA_VERIFIED", "PeerTier"]  # CHUNK: each transfer buffer's bound (host_memory.py)


class PeerTier:
    """The peer policy: which windows go to which peers, where received copies live, which copies are usable
    (contracts.py: the `PeerTier` steps of a save and a recovery). The bytes travel through a `PeerTransport`."""

    def __init__(
        self,
        tier: HostTier,
        placement=None,
        group=None,
        replicas_hold_data: bool = True,
        *,
        timeout_s: float | None = None,
        transport: Callable[[float | None], PeerTransport] = GlooTransport,
    ):
        """Args:
        tier: this writer's HostTier (what it pushes; where held copies live).
        placement: where pushes go (placement.py; None: pull only, a DCP user's reader).
        group: the gloo group the transfers run over (None: the default group).
        replicas_hold_data: replica peers hold the sender's slot data (see the module docstring).
        timeout_s: the longest one message waits for its partner (TierConfig.peer_timeout_s; None: the group's).
        transport: makes a byte transport from `timeout_s` (contracts.PeerTransport; GlooTransport by default,
            a test's or another wire's otherwise): one receives, one sends, and a pull makes its own.
        """
        self.tier, self.placement, self.group = tier, placement, group
        self.timeout_s, self._transport = timeout_s, transport
        # Why the peer tier stopped (a partner rank that did not answer in time: gloo closed the pair), or None.
        # Once set, pushes do nothing for the rest of the process: the pair order cannot be resumed on this group.
        self.stopped: str | None = None
        # (sender, receiver, whether the receiver is an HSDP replica holding the data) in one global order
        self.pairs: list[tuple[int, int, bool]] = []
        if placement is not None:
            self.pairs = [
                (src, dst, replicas_hold_data and dst in placement.replica_peers[src])
                for src in range(tier.world_size)
                for dst in placement.peers[src]
            ]
        self.bytes_sent = 0  # all bytes this rank sent to peers
        self.data_bytes_sent = 0  # of which slot data (0 when every peer is an HSDP replica)
        self.own_data_bytes = 0  # slot data of the windows this rank pushed (sent r times without replicas)
        self.replica_verified = self.replica_mismatch = 0
        self.inbox: PeerTransport = transport(timeout_s)  # receives (push and pull)
        self.outbox: PeerTransport = transport(timeout_s)  # sends (push)
        self._window_files: dict[int, int] = {}  # sender -> data files of its newest copy held here
        self._received = 0  # bytes of the transfer being received (its link's rate)
        self.links: dict[tuple[str, int], LinkStats] = {}  # (direction, peer) -> what crossed that link, how fast

    def _link(self, direction: str, peer: int) -> LinkStats:
        return self.links.setdefault((direction, peer), LinkStats(peer, direction))

    def held(self, src: int) -> FilesWindowTier:
        """The copies of `src`'s windows this writer holds, as a tier of their own (list, verify, read)."""
        held = FilesWindowTier(LocalFiles(self.tier.dir / peer_copy_dir(self.tier.writer, writer_name(src))), src, 0)
        # collected copies' data files are written over by the next ones: the host tier's `spare_windows` of them
        held.max_spares = self._spare_limit(src)
        return held

    def trim_spares(self) -> int:
        """Delete the spare data files of every copy held here (memory pressure); returns their bytes."""
        return sum(self.held(src).trim_spares() for src in self.sources())

    def _spare_limit(self, src: int) -> int:
        return self.tier.spare_windows * self._window_files.get(src, 0)

    def host_bytes(self) -> dict[str, int]:
        """What this writer holds for others (copies, their spares: the file system) and its two transfer buffers."""
        root, seen = self.tier.dir / held_copies_dir(self.tier.writer), set()
        spare = sum(usage.tree_bytes(d, seen) for d in root.glob("from-*/.spare"))
        return {
            "peer_copies": usage.tree_bytes(root, seen),
            "peer_spares": spare,
            "peer_buffers": self.inbox.buffer_bytes() + self.outbox.buffer_bytes(),
        }

    def push(self, window_id: int, manifest: WindowManifest | None, superseded_by: int | None = None) -> None:
        """Send this writer's committed window to its peers and store what peers send (collective; `manifest`
        None: nothing committed to send). `superseded_by`: a newer window is already committed here, so only the
        header travels (the pair order stays the same on every rank) and the peers keep their older copy.
        A partner that does not answer within `timeout_s` stops the peer tier (`stopped`, one warning); a stopped
        tier's push returns at once (its partners then time out too, and stop)."""
        if self.stopped is not None:
            return
        try:
            self._push(window_id, manifest, superseded_by)
        except PeerTimeoutError as exc:
            self.stopped = str(exc)
            log.warning("%s", exc)

    def _push(self, window_id: int, manifest: WindowManifest | None, superseded_by: int | None) -> None:
        me = self.tier.rank
        files = {} if manifest is None or superseded_by is not None else manifest.files
        data_bytes = sum(f.bytes for r, f in files.items() if is_data_file(r))
        self.own_data_bytes += data_bytes
        for src, dst, replica in self.pairs:
            if me == src:
                wdir = self.tier.window_dir(window_id)
                send = [(rel, wdir / rel) for rel in sorted(files) if not (replica and is_data_file(rel))]
                meta = {"manifest": None if not files else manifest.to_json(), "superseded_by": superseded_by}  # pyright: ignore[reportOptionalMemberAccess]  (files is empty without a manifest)
                faults.point("replication")
                t0 = time.perf_counter()
                n = self.outbox.send(send, dst, self.group, meta)
                if send:  # a header alone says nothing about the link's rate
                    self._link("to", dst).add(n, time.perf_counter() - t0)
                self.bytes_sent += n
                self.data_bytes_sent += 0 if replica else data_bytes
            elif me == dst:
                held = self.held(src)
                t0, self._received = time.perf_counter(), 0
                theirs = self._receive(src, held, window_id)  # collective with the sender's send
                if theirs is None:  # nothing sent (superseded, or nothing committed): the older copies stay
                    continue
                self._link("from", src).add(self._received, time.perf_counter() - t0)
                self._window_files[src] = sum(map(is_data_file, theirs.files))
                held.max_spares = self._spare_limit(src)
                if replica:
                    self._verify_replica(window_id, theirs, held)
                complete = held.window_ids()  # the two newest complete copies stay; data files kept as spares
                keep_from = complete[-2] if len(complete) > 1 else window_id
                for wid in held.window_ids(require_manifest=False):
                    if wid < keep_from:
                        held.remove_window(wid)

    def link_stats(self) -> list[dict]:
        """Every peer link of this rank that carried a copy: bytes, seconds, bytes/s (mean and newest)."""
        return [self.links[k].to_dict() for k in sorted(self.links)]

    def _verify_replica(self, window_id: int, theirs: WindowManifest, held: FilesWindowTier) -> None:
        mine = self.tier.manifest(window_id)
        ours = {r.replace(self.tier.writer, held.writer): f.crc32 for r, f in mine.files.items() if is_data_file(r)}
        same = all(ours.get(r) == f.crc32 for r, f in theirs.files.items() if is_data_file(r))
        if same:
            self.replica_verified += 1
            held.files.write(f"{window_dirname(window_id)}/{REPLICA_VERIFIED}", str(self.tier.rank).encode())
        else:  # not bit-identical after all: this copy cannot stand in for the sender's
            self.replica_mismatch += 1
            log.warning(
                "rank %d's window %d differs from replica rank %d's: not counted as a copy",
                held.rank,
                window_id,
                self.tier.rank,
            )

    def _receive(self, holder: int, dest: FilesWindowTier, window_id: int) -> WindowManifest | None:
        """One window copy of `dest.writer` from `holder` into `dest`, data files over `dest`'s spares; the manifest
        last (a torn copy has none). None: the sender had none."""
        w = window_dirname(window_id)
        dest.files.remove([f"{w}/{manifest_name(dest.writer)}"])  # incomplete until the manifest is back

        def write(rel: str, size: int, chunks) -> None:  # over a collected copy's file: its pages are reused
            self._received += size
            path = dest.files.path(f"{w}/{rel}")
            # a file already at `path` (maybe a link to live slot buffers) is replaced
            place_new_file(path, dest.take_spare(size) if is_data_file(rel) and dest is not self.tier else None)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                for off, view in chunks:
                    pwrite_all(fd, view, off)
                os.ftruncate(fd, size)
            finally:
                os.close(fd)

        meta = self.inbox.recv(holder, self.group, write)  # collective with the holder's send
        text = meta["manifest"]
        if text is None:
            return None
        man = WindowManifest.from_json(text)
        if dest is self.tier and self.tier.node_ranks:  # now this node's own window: the ranks that write here
            man.extra["node_ranks"] = self.tier.node_ranks
        dest.files.write_last(f"{w}/{manifest_name(dest.writer)}", man.to_json().encode())  # the copy is complete
        return man

    def sources(self) -> list[int]:
        """The writers this writer holds copies of."""
        names = [parse_peer_copy_name(n) for n in self.tier.files.listdir(held_copies_dir(self.tier.writer))]
        return sorted(rank_of_writer(n) for n in names if n is not None)

    def copies(self, window_id: int) -> dict[int, Path]:
        """Rank -> the directory holding that writer's committed copy of a window here (own node's, or held)."""
        w = window_dirname(window_id)
        names = map(parse_manifest_name, self.tier.files.listdir(w))
        out = {rank_of_writer(n): self.tier.window_dir(window_id) for n in names if n}
        for src in self.sources():
            if src in out:
                continue
            held = self.held(src)
            if held.files.exists(f"{w}/{manifest_name(held.writer)}"):
                out[src] = Path(held.files.path(w))
        return out

    def holdings(self) -> dict[int, list[int]]:
        """src rank -> windows this writer can provide for it (a full copy, or a verified replica copy)."""
        held = {src: self.held(src) for src in self.sources()}
        ok = {src: [w for w in h.window_ids() if self._usable(h, w)] for src, h in held.items()}
        return {src: wids for src, wids in ok.items() if wids}

    def _usable(self, held: FilesWindowTier, wid: int) -> bool:
        if held.files.exists(f"{window_dirname(wid)}/{REPLICA_VERIFIED}"):  # its data files are this writer's own
            return self.tier.verify(wid) == [] and not [p for p in held.verify(wid) if not is_data_file(p.file)]
        return not held.verify(wid)

    def _source(self, window_id: int, src: int):
        """(manifest, rel -> path) of the copy of `src`'s window this writer sends: its host directory's, else
        an orphan's or a held copy, whose slot data may be this writer's own verified-identical replica files."""
        w = window_dirname(window_id)
        if self.tier.files.exists(f"{w}/{manifest_name(writer_name(src))}"):
            man, wdir = self.tier.manifest(window_id, src), self.tier.window_dir(window_id)
            return man, lambda rel: wdir / rel
        held = self.held(src)
        orphans = self.tier.orphans  # copies of an older node numbering (orphans.py)
        if orphans is not None and not held.files.exists(f"{w}/{manifest_name(held.writer)}"):
            got = orphans.source(window_id, src)
            if got is not None:
                return got
        wdir, own = held.files.path(w), self.tier.window_dir(window_id)
        replica = (wdir / REPLICA_VERIFIED).exists()

        def path(rel: str) -> Path:
            return own / rel.replace(held.writer, self.tier.writer) if replica and is_data_file(rel) else wdir / rel

        return held.manifest(window_id), path

    def pull(self, window_id: int, transfers: list[tuple[int, int, int]]) -> None:
        """Each (holder, needer, src) sends src's copy of `window_id` from holder to needer, kept as its own
        window when src is the needer, else as a held copy. Collective: every rank passes the same transfers."""
        me = self.tier.rank
        for holder, needer, src in sorted(transfers):
            if me == holder:
                man, path = self._source(window_id, src)
                files = [(rel, path(rel)) for rel in sorted(man.files)]
                self._transport(self.timeout_s).send(files, needer, self.group, {"manifest": man.to_json()})
            elif me == needer:
                self._receive(holder, self.tier if src == me else self.held(src), window_id)
