"""Copies a host still holds under node directories none of its ranks write any more: after torchrun numbered the
hosts anew, a surviving host's ranks write `<root>/node-M/<run>` while their copies (and peer copies held for
others) sit in `<root>/node-N/<run>`. They are found by writer names, not by today's rank or node number.

A node directory is an orphan of this agent when no rank of the agent maps to it and its run lock is this job's
own or stale (another live agent's is never touched). Its local rank 0 reads them; recovery
(recovery/agreed_window.py) counts their verified copies like peer copies. After a successful recovery they are
removed: a newer leftover must never be mixed with the windows the new numbering writes under the same ids."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from ..ownership import run_lock
from ..storage_format.files import LocalFiles
from ..storage_format.layout import (
    PEERS_DIR,
    REPLICA_VERIFIED,  # the marker of a data-less replica copy (not usable alone)
    manifest_name,
    node_dirname,
    parse_manifest_name,
    parse_peer_copy_name,
    parse_window_dirname,
    rank_of_writer,
    window_dirname,
)
from .window_tier import FilesWindowTier

log = logging.getLogger("torchmoe_ckpt.tiers")


def agent_nodes(rank: int, ranks_per_node: int) -> set[int]:
    """The node indices of every rank of this torchrun agent (contiguous: LOCAL_RANK, LOCAL_WORLD_SIZE)."""
    local, size = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    first = rank - local
    return {r // ranks_per_node for r in range(first, first + size)}


class OrphanCopies:
    """Every complete window copy in this host's orphan node directories of one run, by writer."""

    def __init__(self, run_dirs: list[Path]):
        self.run_dirs = run_dirs
        self._copies: list[FilesWindowTier] = []  # one per (directory, writer): its windows of that writer
        for d in run_dirs:
            windows = [d / name for name in _listdir(d) if parse_window_dirname(name) is not None]
            writers = {w for wd in windows for n in _listdir(wd) if (w := parse_manifest_name(n)) is not None}
            self._copies += [FilesWindowTier(LocalFiles(d), rank_of_writer(w), 0) for w in sorted(writers)]
            for p in sorted(d.glob(f"{PEERS_DIR}/*/*")):  # <holder>/from-<src>
                if (src := parse_peer_copy_name(p.name)) is not None:
                    self._copies.append(FilesWindowTier(LocalFiles(p), rank_of_writer(src), 0))

    @staticmethod
    def find(root: Path, run_id: str, rank: int, ranks_per_node: int, world: int) -> OrphanCopies | None:
        """This agent's orphans under `root` (only its local rank 0 reads them; None elsewhere or when none)."""
        if int(os.environ.get("LOCAL_RANK", "0")) != 0:
            return None
        mine, me = {node_dirname(n) for n in agent_nodes(rank, ranks_per_node)}, run_lock.this_job(world)
        runs = [node_dir / run_id for node_dir in sorted(Path(root).glob("node-*")) if node_dir.name not in mine]
        # one locked by a live agent of this host is never touched
        dirs = [d for d in runs if d.is_dir() and not run_lock.held_by_another_job(d, me)]
        return OrphanCopies(dirs) if dirs else None

    def _usable(self, copy: FilesWindowTier, wid: int) -> bool:
        if copy.files.exists(f"{window_dirname(wid)}/{REPLICA_VERIFIED}"):
            return False  # its data files are the old holder's own: not a copy that stands alone
        return not copy.verify(wid)

    def holdings(self) -> dict[int, list[int]]:
        """writer rank -> windows of it that verify here."""
        out: dict[int, set[int]] = {}
        for c in self._copies:
            out.setdefault(c.rank, set()).update(w for w in c.window_ids() if self._usable(c, w))
        return {r: sorted(ws) for r, ws in out.items() if ws}

    def copy_of(self, wid: int, src: int) -> FilesWindowTier | None:
        return next((c for c in self._copies if c.rank == src and wid in c.window_ids() and self._usable(c, wid)), None)

    def source(self, wid: int, src: int):
        """(manifest, rel -> path) of writer `src`'s copy of window `wid` (what the peer tier sends), or None."""
        c = self.copy_of(wid, src)
        if c is None:
            return None
        wdir = Path(c.files.path(window_dirname(wid)))
        return c.manifest(wid), lambda rel: wdir / rel

    def copy_into(self, wid: int, src: int, tier) -> None:
        """Writer `src`'s copy of `wid` into `tier` (this rank's own window now), every file, the manifest last."""
        got = self.source(wid, src)
        if got is None:  # callers ask `copy_of` first
            raise FileNotFoundError(f"no usable copy of writer {src}'s window {wid} among this host's orphans")
        man, path = got
        w = window_dirname(wid)
        for rel in sorted(man.files):
            dest = tier.files.path(f"{w}/{rel}")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path(rel), dest)  # a copy, not a link: the tier later writes over collected files
        if tier.node_ranks:  # now a window of the node this rank writes today
            man.extra["node_ranks"] = tier.node_ranks
        tier.files.write_last(f"{w}/{manifest_name(tier.writer)}", man.to_json().encode())

    def retire(self) -> None:
        """Remove the orphan directories (after a successful recovery: see the module docstring)."""
        for d in self.run_dirs:
            shutil.rmtree(d, ignore_errors=True)
        log.info("event=orphans_removed dirs=%s: copies of the old node numbering, no longer needed", self.run_dirs)


def _listdir(d: Path) -> list[str]:
    try:
        return sorted(os.listdir(d))
    except OSError:
        return []
