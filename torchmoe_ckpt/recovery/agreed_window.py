"""Find and fetch the window to recover from, across the tiers: the newest window every rank can get (its own
checked host copy, a peer's, else the object store's), agreed by all ranks, loaded, and handed to the replay;
any failure on any rank excludes that window everywhere and the next newest is tried. Collective."""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

import torch

from ..core.rejection import Rejection, RejectionKind
from ..core.window import Window
from ..model.identity import RunIdentity
from ..persist.build_tiers import Tiers
from ..runtime.agreement import all_gather_objects, failure_reason, run_everywhere
from ..storage_format.slot_format import CorruptCopyError
from ..tiers.host_tier import HostTier
from .replay_check import ReplayDivergence

log = logging.getLogger("torchmoe_ckpt.tiers")

__all__ = ["SearchResult", "TierOutcome", "recover_from_tiers"]


class SearchResult(StrEnum):
    """What the search over the tiers came to. A str, so that `outcome == "recovered"` keeps working; the report
    says `.value`."""

    RECOVERED = "recovered"
    NO_WINDOW = "no window"
    NO_USABLE_WINDOW = "no usable window"  # some existed, all rejected


@dataclass
class TierOutcome:
    """What the search over the tiers found, typed (its JSON form, `to_dict()`, is part of the recovery report)."""

    outcome: SearchResult = SearchResult.NO_WINDOW
    source: str | None = None  # "host", "peer N" or "object store"; None: nothing recovered
    source_peer: int | None = None  # source "peer N": N, the rank whose host memory held this rank's copy
    unusable_copies: dict[int, Rejection] = field(default_factory=dict)  # this rank's damaged copies: window -> why
    rejected: dict[int, dict[int, Rejection]] = field(default_factory=dict)  # window -> {rank: why}, agreed
    unusable_by_rank: dict[int, dict[int, Rejection]] = field(default_factory=dict)  # every rank's damaged copies
    pulled_from_peers: dict[int, int] | None = None  # rank -> the peer it pulled its part from (host/peer tier)
    orphans_removed: list[str] | None = None  # run dirs of an older node numbering, retired after the recovery
    store_unreachable: str | None = None  # why the object store could not be listed
    failed_downloads: dict[int, Rejection | None] | None = None  # window -> the first rank's reason

    def to_dict(self) -> dict:
        """The report's keys, reasons as their text and ranks of `rejected`/`pulled_from_peers` as strings (the
        JSON edge); optional ones only when set."""
        out: dict = {
            "unusable_copies": _texts(self.unusable_copies),
            "rejected": {w: {str(r): str(why) for r, why in per_rank.items()} for w, per_rank in self.rejected.items()},
            "unusable_by_rank": {r: _texts(copies) for r, copies in self.unusable_by_rank.items()},
            "source": self.source,
            "source_peer": self.source_peer,
            "outcome": self.outcome.value,
        }
        optional = {
            "pulled_from_peers": _rank_keys(self.pulled_from_peers),
            "orphans_removed": self.orphans_removed,
            "store_unreachable": self.store_unreachable,
            "failed_downloads": _texts(self.failed_downloads),
        }
        out.update((k, v) for k, v in optional.items() if v is not None)
        return out

    def settle(self) -> TierOutcome:
        """Set `outcome` from what was found (after the last change)."""
        damaged = self.rejected or self.unusable_by_rank or self.unusable_copies
        if self.source:
            self.outcome = SearchResult.RECOVERED
        elif damaged:
            self.outcome = SearchResult.NO_USABLE_WINDOW
        else:
            self.outcome = SearchResult.NO_WINDOW
        return self


def _texts(whys: Mapping[int, Rejection | None] | None) -> dict[int, str | None] | None:
    return None if whys is None else {w: None if why is None else str(why) for w, why in whys.items()}


def _rank_keys(by_rank: Mapping[int, int] | None) -> dict[str, int] | None:
    return None if by_rank is None else {str(r): v for r, v in by_rank.items()}


class RankView(NamedTuple):
    """One rank's view in a round of the host/peer search (gathered from every rank)."""

    local: list[int]  # windows of its own it can load (host tier, or its host's older numbering)
    held: dict[int, list[int]]  # rank -> windows this rank can send it (peer tier, orphans)
    unusable: dict[int, Rejection] | None  # its damaged copies (first round only)
    # rank -> windows of it on this host's orphans that no peer tier can send (replicas = 0): they still exist, so
    # the run is refused rather than started over (first round only)
    stranded: dict[int, list[int]] | None = None


@dataclass(frozen=True)
class _Load:
    """Loads window `wid` of this rank from its host tier: the operators, the dtype and the identity to check."""

    tier: HostTier
    ops: dict
    compute_dtype: torch.dtype
    identity: RunIdentity | None

    def __call__(self, wid: int):
        return self.tier.load_window(wid, self.ops, self.compute_dtype, self.identity)


def recover_from_tiers(
    tiers: Tiers,
    ops: dict,
    compute_dtype: torch.dtype,
    identity: RunIdentity | None = None,
    use: Callable[[Window], object] | None = None,
) -> tuple[Window | None, TierOutcome]:
    """Agree on the newest window every rank can get (its own checked copy, or a peer's), pull the missing copies,
    load this rank's and hand it to `use(window)` (the replay). Collective.

    Any failure on any rank (every exception but a process exit or a failed collective) excludes that window
    everywhere and the next newest is tried, host and peers first, then the object store.

    Args:
        tiers: this rank's tiers: its host tier, the peer tier (or None) and the object store (or None).
        ops: operators by name.
        compute_dtype: the dtype the slots were captured in.
        identity: windows of another run are rejected (None: no check).
        use: called with the loaded window (the replay); its failure on any rank rejects the window.

    Returns:
        (the Window, or None, and a `TierOutcome`).
    """
    tier, peers = tiers.host, tiers.peers
    load = _Load(tier, ops, compute_dtype, identity)
    found = TierOutcome(unusable_copies=_check_host_copies(tier, identity))
    excluded: set[int] = set()
    orphans = tier.orphans  # copies under an older node numbering (orphans.py): this rank's own part, others'
    adopted = orphans.holdings() if orphans is not None else {}
    seen: list[set[int]] = []  # per rank: every window it could get in the first round (host, peers)
    stranded: dict[int, dict[int, int]] = {}  # rank -> {window: the rank whose host holds it, unsendable}
    for i in itertools.count():
        views = _gather_views(tier, peers, adopted, excluded, found.unusable_copies, first=i == 0)
        avail = _available(views, excluded)
        if i == 0:
            found.unusable_by_rank = {r: v.unusable for r, v in enumerate(views) if v.unusable}
            seen = [set(a) for a in avail]
            stranded = _stranded(views)
        common = set.intersection(*avail)
        if not common:
            break
        wid = max(common)
        needers = _needers(views, wid)
        fetch = functools.partial(_pull_and_load, load, peers, wid, needers)
        window = _attempt(wid, found, fetch, use)
        if window is not None:
            found.source_peer = needers.get(tier.rank)
            found.source = "host" if found.source_peer is None else f"peer {found.source_peer}"
            found.pulled_from_peers = dict(needers)
            _retire(orphans, found)
            return window, found.settle()
        excluded.add(wid)
    window, listed = _from_store(load, tiers.store, found, use, excluded)
    if window is None:
        _not_every_rank(found, seen, listed, stranded)
    else:
        _retire(orphans, found)
    return window, found.settle()


def _check_host_copies(tier: HostTier, identity: RunIdentity | None) -> dict[int, Rejection]:
    """This rank's damaged host copies: window -> the first problem. Every rank says its own (rank 0 alone would
    hide a damaged copy on another rank)."""
    unusable: dict[int, Rejection] = {}
    for w in tier.window_ids():
        problems = tier.check(w, identity)
        if not problems:
            continue
        unusable[w] = problems[0]
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        log.warning(
            "event=unusable_copy rank=%d window=%d dir=%s: %s%s; this copy is skipped",
            tier.rank,
            w,
            tier.window_dir(w),
            problems[0],
            more,
        )
    return unusable


def _gather_views(tier: HostTier, peers, adopted: dict, excluded: set[int], unusable: dict, first: bool):
    """Every rank's `RankView` of this round. Collective."""
    own = set(tier.window_ids()) | set(adopted.get(tier.rank, ()))
    local = [w for w in sorted(own) if w not in excluded and w not in unusable]
    held = peers.holdings() if peers is not None else {}
    if peers is not None:  # others' parts can be sent from the orphans over the peer tier
        held.update({s: sorted({*held.get(s, ()), *ws}) for s, ws in adopted.items() if s != tier.rank})
    # Without a peer tier others' parts on the orphans cannot be sent; said, so a renumbered survivor whose only
    # copies are another rank's part refuses like its mirror instead of finding "no window" (issue 44).
    stranded = {s: ws for s, ws in adopted.items() if s != tier.rank} if peers is None and first else None
    return all_gather_objects(RankView(local, held, unusable if first else None, stranded or None))


def _stranded(views: list[RankView]) -> dict[int, dict[int, int]]:
    """rank -> {window: the lowest rank whose host holds its part but cannot send it}."""
    out: dict[int, dict[int, int]] = {}
    for holder, v in enumerate(views):
        for r, ws in (v.stranded or {}).items():
            for w in ws:
                out.setdefault(r, {}).setdefault(w, holder)
    return out


def _available(views: list[RankView], excluded: set[int]) -> list[set[int]]:
    """Per rank: the windows it can get, its own or from any rank holding them for it."""
    world = len(views)
    return [
        set(views[r].local).union(*(views[h].held.get(r, ()) for h in range(world))) - excluded for r in range(world)
    ]


def _needers(views: list[RankView], wid: int) -> dict[int, int]:
    """rank -> the lowest rank that can send it `wid`, for each rank without a copy of its own."""
    world = len(views)
    return {
        r: min(h for h in range(world) if wid in views[h].held.get(r, ()))
        for r in range(world)
        if wid not in views[r].local
    }


def _retire(orphans, found: TierOutcome) -> None:
    """After a successful recovery the copies of an older node numbering go (orphans.py says why)."""
    if orphans is not None:
        found.orphans_removed = [str(d) for d in orphans.run_dirs]
        orphans.retire()


def _not_every_rank(
    found: TierOutcome, seen: list[set[int]], listed: list[set[int]] | None, stranded: dict[int, dict[int, int]]
) -> None:
    """Windows some rank can get but another cannot, from any tier, or that sit on a host under an older node
    numbering with no peer tier to send them: never "no window" (a new run would overwrite the copies left). Each
    is rejected with the ranks that have no copy they can get (recovery refuses unless the user opted into
    restarts); the same on every rank (`seen`, `stranded` and the store listing are gathered)."""
    have = [a | b for a, b in zip(seen, listed or [set()] * len(seen))]  # seen: every rank's, from the first round
    exists = set().union(*have, *(set(ws) for ws in stranded.values()))
    for wid in sorted(exists - set(found.rejected), reverse=True):
        found.rejected[wid] = {r: _no_copy(r, wid, stranded) for r, h in enumerate(have) if wid not in h}


def _no_copy(rank: int, wid: int, stranded: dict[int, dict[int, int]]) -> Rejection:
    holder = stranded.get(rank, {}).get(wid)
    if holder is not None:
        return Rejection(
            RejectionKind.STRANDED,
            f"no copy: rank {rank}'s part of window {wid} is only on the host of rank {holder} (under an older node "
            "numbering) and no peer tier (replicas = 0) can send it",
        )
    return Rejection(
        RejectionKind.NO_COPY,
        f"no copy: rank {rank}'s part of window {wid} is on no tier (its host copy is gone and no peer or object "
        "store holds it)",
    )


def _pull_and_load(load: _Load, peers, wid: int, needers: dict):
    """The missing parts of `wid` pulled from the peers that hold them, then this rank's part loaded."""
    tier = load.tier
    if needers:
        peers.pull(wid, [(holder, dst, dst) for dst, holder in needers.items()])
    if wid not in tier.window_ids() and tier.orphans is not None and tier.orphans.copy_of(wid, tier.rank):
        tier.orphans.copy_into(wid, tier.rank, tier)  # this rank's part, from its host's older numbering
    return load(wid)


def _attempt(wid: int, found: TierOutcome, fetch, use):
    """Fetch + load `wid` on this rank, agree, then `use` it, agree again: the window, or None when any rank
    failed (the reasons are in found.rejected[wid], per rank). Collective: two agreements.

    A collective that failed inside (a peer frozen or gone past the process group's timeout) is no verdict on the
    window: agreeing on it would wait once more for the same peer, so it ends the recovery (runtime/agreement.py).
    """
    window, failures = run_everywhere(fetch, reason=_load_failed)
    if failures:
        _reject(wid, failures, found)
        return None
    if use is not None:
        _, failures = run_everywhere(use, window, reason=_replay_failed)
        if failures:
            _reject(wid, failures, found)
            return None
    return window


def _load_failed(exc: BaseException) -> Rejection:
    return _failed("load", exc, RejectionKind.LOAD_FAILED)


def _replay_failed(exc: BaseException) -> Rejection:
    return _failed("replay", exc, RejectionKind.REPLAY_FAILED)


def _failed(phase: str, exc: BaseException, otherwise: RejectionKind) -> Rejection:
    """A rank's failure in `phase`, said as "phase: TypeName: message"; its kind is the check's that raised it (a
    CorruptCopyError of a foreign copy is FOREIGN), a divergence's, or `otherwise`."""
    text = f"{phase}: {failure_reason(exc)}"
    found = getattr(exc, "rejection", None)
    if isinstance(found, Rejection):
        return found.reworded(text)
    return Rejection(RejectionKind.REPLAY_DIVERGENCE if isinstance(exc, ReplayDivergence) else otherwise, text)


MAX_RANKS_LISTED = 4  # ranks whose reason a window_rejected line quotes (all are in the report)


def _reject(wid: int, failures: dict[int, Rejection], found: TierOutcome) -> None:
    bad = dict(failures)
    found.rejected.setdefault(wid, {}).update(bad)
    shown = list(bad.items())[:MAX_RANKS_LISTED]  # the ranks are bounded, each reason is said whole
    more = f" (+{len(bad) - len(shown)} more rank(s))" if len(bad) > len(shown) else ""
    log.warning(
        "event=window_rejected window=%d %s%s: trying the next newest window",
        wid,
        " ".join(f"rank{r}={str(w)!r}" for r, w in shown),
        more,
    )


def _from_store(load: _Load, store, found: TierOutcome, use, excluded: set[int]):
    """Last tier: the newest window every rank has in the object store, downloaded and checked. Returns (the
    window or None, every rank's store listing or None without a store)."""
    if store is None:
        return None, None
    try:
        mine, why = store.window_ids(), None
    except Exception as exc:  # a store that cannot be listed is a tier without windows, said in the report
        mine, why = [], failure_reason(exc)
    listed = [set(x) for x in all_gather_objects(mine)]
    if why is not None:
        found.store_unreachable = why
    candidates = sorted(set.intersection(*listed) - set(excluded), reverse=True)
    for wid in candidates:

        def fetch(wid=wid):
            problems = store.download(wid, load.tier)
            if problems:
                raise CorruptCopyError(f"object store copy of window {wid}: {problems[0]}", rejection=problems[0])
            return load(wid)

        window = _attempt(wid, found, fetch, use)
        if window is not None:
            found.source = "object store"
            return window, listed
        failed = found.failed_downloads = found.failed_downloads or {}
        failed[wid] = next(iter(found.rejected.get(wid, {}).values()), None)
    return None, listed
