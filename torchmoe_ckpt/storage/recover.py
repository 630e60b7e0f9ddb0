"""Find and fetch the window to recover from, across the tiers: the newest window every rank can get (its own
checked host copy, a peer's, else the object store's), agreed by all ranks, loaded, and handed to the replay;
any failure on any rank excludes that window everywhere and the next newest is tried. Collective."""

from __future__ import annotations

import functools
import itertools
import logging

import torch
import torch.distributed as dist

from ..core.errors import is_collective_failure
from ..model.identity import RunIdentity
from ..runtime.distributed import library_group
from .host_tier import HostTier
from .slot_format import CorruptCopyError

log = logging.getLogger("torchmoe_ckpt.tiers")


def recover_from_tiers(
    tier: HostTier,
    replicator,
    ops: dict,
    compute_dtype: torch.dtype,
    store=None,
    identity: RunIdentity | None = None,
    use=None,
):
    """Agree on the newest window every rank can get (its own checked copy, or a peer's), pull the missing copies,
    load this rank's and hand it to `use(window)` (the replay). Any failure on any rank (every exception but a
    process exit) excludes that window everywhere and the next newest is tried, host and peers first, then the
    object store. `identity`: windows of another run are rejected. Returns (Window or None, report): "rejected"
    (per window and rank, why), "outcome" ("recovered", "no window" or "no usable window": some existed, all
    rejected), "unusable_copies" (this rank's damaged copies), "unusable_by_rank" (every rank's). Collective."""
    report: dict = {"unusable_copies": {}, "rejected": {}, "unusable_by_rank": {}}
    for w in tier.window_ids():
        if p := tier.check(w, identity):
            report["unusable_copies"][w] = p[0]
            # Every rank says its own (rank 0 alone would hide a damaged copy on another rank).
            log.warning(
                "event=unusable_copy rank=%d window=%d dir=%s: %s%s; this copy is skipped",
                tier.rank,
                w,
                tier.window_dir(w),
                p[0],
                f" (+{len(p) - 1} more)" if len(p) > 1 else "",
            )
    excluded: set[int] = set()
    seen: list[set[int]] = []  # per rank: every window it could get in the first round (host, peers)
    orphans = tier.orphans  # copies under an older node numbering (orphans.py): this rank's own part, others'
    adopted = orphans.holdings() if orphans is not None else {}
    for i in itertools.count():
        own = set(tier.window_ids()) | set(adopted.get(tier.rank, ()))
        local = [w for w in sorted(own) if w not in excluded and w not in report["unusable_copies"]]
        held = replicator.holdings() if replicator is not None else {}
        if replicator is not None:  # others' parts can be sent from the orphans over the peer tier
            held.update({s: sorted({*held.get(s, ()), *ws}) for s, ws in adopted.items() if s != tier.rank})
        everyone = all_gather_objects((local, held, report["unusable_copies"] if i == 0 else None))
        world = len(everyone)
        avail = [
            set(everyone[r][0]).union(*(everyone[h][1].get(r, ()) for h in range(world))) - excluded
            for r in range(world)
        ]
        if i == 0:
            report["unusable_by_rank"] = {r: e[2] for r, e in enumerate(everyone) if e[2]}
            seen = [set(a) for a in avail]
        common = set.intersection(*avail)
        if not common:
            break
        wid = max(common)
        needers = {
            r: min(h for h in range(world) if wid in everyone[h][1].get(r, ()))
            for r in range(world)
            if wid not in everyone[r][0]
        }
        src = f"peer {needers[tier.rank]}" if tier.rank in needers else "host"
        fetch = functools.partial(_pull_and_load, tier, replicator, wid, needers, ops, compute_dtype, identity)
        if (window := _attempt(wid, report, fetch, use)) is not None:
            report.update(source=src, pulled_from_peers={str(k): v for k, v in needers.items()})
            _retire(orphans, report)
            return window, _outcome(report)
        excluded.add(wid)
    window, report = _from_store(tier, store, ops, compute_dtype, report, identity, use, excluded)
    listed = report.pop("store_listed", None)
    if window is None:
        _not_every_rank(report, seen, listed)
    else:
        _retire(orphans, report)
    return window, report


def _retire(orphans, report: dict) -> None:
    """After a successful recovery the copies of an older node numbering go (orphans.py says why)."""
    if orphans is not None:
        report["orphans_removed"] = [str(d) for d in orphans.run_dirs]
        orphans.retire()


def _not_every_rank(report: dict, seen: list[set[int]], listed: list[set[int]] | None) -> None:
    """Windows some rank can get but another cannot, from any tier: never "no window" (a new run would overwrite
    the copies left). Each is rejected with the ranks that have no copy (recovery refuses unless the user opted
    into restarts); the same on every rank (`seen` and the store listing are gathered)."""
    have = [a | b for a, b in zip(seen, listed or [set()] * len(seen))]  # seen: every rank's, from the first round
    for wid in sorted(set().union(*have) - set(report["rejected"]), reverse=True):
        missing = [r for r, h in enumerate(have) if wid not in h]
        report["rejected"][wid] = {
            str(r): f"no copy: rank {r}'s part of window {wid} is on no tier (its host copy is gone and no peer "
            "or object store holds it)"
            for r in missing
        }
    _outcome(report)


def _pull_and_load(tier: HostTier, replicator, wid: int, needers: dict, ops, compute_dtype, identity):
    if needers:
        replicator.pull(wid, [(holder, dst, dst) for dst, holder in needers.items()])
    if wid not in tier.window_ids() and tier.orphans is not None and tier.orphans.copy_of(wid, tier.rank):
        tier.orphans.copy_into(wid, tier.rank, tier)  # this rank's part, from its host's older numbering
    return tier.load_window(wid, ops, compute_dtype, identity)


def _attempt(wid: int, report: dict, fetch, use):
    """Fetch + load `wid` on this rank, agree, then `use` it, agree again: the window, or None when any rank
    failed (the reasons are in report["rejected"][wid], per rank)."""
    window, why = _try(fetch)
    if not _agree(wid, why, report, "load"):
        return None
    if use is not None and not _agree(wid, _try(use, window)[1], report, "replay"):
        return None
    return window


def _try(fn, *args):
    """(fn(*args), None), or (None, why it failed) for every exception but a process exit and a failed collective.
    A collective that failed (a peer frozen or gone past the process group's timeout) is no verdict on the window:
    agreeing on it would wait once more for the same peer, so it ends the recovery (the watchdog exits)."""
    try:
        return fn(*args), None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if is_collective_failure(exc):
            raise
        return None, _reason(exc)


MAX_RANKS_LISTED = 4  # ranks whose reason a window_rejected line quotes (all are in the report)


def _agree(wid: int, why: str | None, report: dict, phase: str) -> bool:
    reasons = all_gather_objects(why)
    bad = {str(r): f"{phase}: {w}" for r, w in enumerate(reasons) if w is not None}
    if bad:
        report["rejected"].setdefault(wid, {}).update(bad)
        shown = list(bad.items())[:MAX_RANKS_LISTED]  # the ranks are bounded, each reason is said whole
        more = f" (+{len(bad) - len(shown)} more rank(s))" if len(bad) > len(shown) else ""
        log.warning(
            "event=window_rejected window=%d %s%s: trying the next newest window",
            wid,
            " ".join(f"rank{r}={w!r}" for r, w in shown),
            more,
        )
    return not bad


def _reason(exc: BaseException) -> str:
    # Never cut: its end is often its point (ReplayDivergence's likely causes); recovery.py bounds the lists.
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


def _outcome(report: dict) -> dict:
    damaged = report["rejected"] or report.get("unusable_by_rank") or report["unusable_copies"]
    report["outcome"] = "recovered" if report.get("source") else "no usable window" if damaged else "no window"
    return report


def _from_store(tier: HostTier, store, ops: dict, compute_dtype: torch.dtype, report: dict, identity, use, excluded):
    """Last tier: the newest window every rank has in the object store, downloaded and checked."""
    if store is None:
        return None, _outcome(dict(report, source=None))
    try:
        mine, why = store.window_ids(), None
    except Exception as exc:  # a store that cannot be listed is a tier without windows, said in the report
        mine, why = [], _reason(exc)
    listed = all_gather_objects(mine)
    report["store_listed"] = [set(x) for x in listed]
    if why is not None:
        report["store_unreachable"] = why
    candidates = sorted(set.intersection(*map(set, listed)) - set(excluded), reverse=True)
    for wid in candidates:

        def fetch(wid=wid):
            if problems := store.download(wid, tier):
                raise CorruptCopyError(f"object store copy of window {wid}: {problems[0]}")
            return tier.load_window(wid, ops, compute_dtype, identity)

        if (window := _attempt(wid, report, fetch, use)) is not None:
            return window, _outcome(dict(report, source="object store"))
        report.setdefault("failed_downloads", {})[wid] = next(iter(report["rejected"].get(wid, {}).values()), None)
    return None, _outcome(dict(report, source=None))


def all_gather_objects(obj) -> list:
    """Every rank's `obj` (a one-element list without a process group), on the library's gloo group."""
    if not dist.is_initialized():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=library_group())
    return out
