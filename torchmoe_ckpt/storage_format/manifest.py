"""The window manifest, `MANIFEST.<writer>.json`, written last: the file that makes a writer's copy of a window
visible. It lists every other file of the writer with its size and digest (as the write reported it), the run
identity, what each slot file was written for, and a SHA-256 of its own content (an edited manifest is refused).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

from ..core.errors import TorchmoeError
from ..core.records import SlotInfo
from ..core.rejection import Rejection, RejectionKind
from .checksums import CRC32, FileEntry
from .layout import METADATA, slot_of

FORMAT = "torchmoe-ckpt/window/2"  # 2: identity, slot records and a self-checksum


def _entry_dict(v: FileEntry) -> dict:
    # "algo" only when not CRC32: manifests of CRC32 files stay byte-identical to earlier versions
    return {"bytes": v.bytes, "crc32": v.crc32, **({} if v.algo == CRC32 else {"algo": v.algo})}


class ManifestError(TorchmoeError, ValueError):
    """A manifest that is not ours, or whose content does not match its own checksum (edited or damaged)."""


@dataclass
class WindowManifest:
    window_id: int
    start_step: int  # slot 0 holds the state after this iteration
    window: int  # W
    world_size: int
    plan: dict  # WindowPlan.to_dict()
    files: dict[str, FileEntry] = field(default_factory=dict)  # path relative to the window dir
    extra: dict = field(default_factory=dict)  # dtype, rank, counters, ...
    format: str = FORMAT
    identity: dict = field(default_factory=dict)  # RunIdentity.to_dict() of the run that wrote the window
    slots: list = field(default_factory=list)  # per slot: {"slot", "window", "step", ...} as it was written

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["files"] = {k: _entry_dict(v) for k, v in sorted(self.files.items())}
        d["checksum"] = content_checksum(d)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @staticmethod
    def from_json(text: str | bytes) -> WindowManifest:
        try:
            d = json.loads(text)
        except ValueError as exc:
            raise ManifestError(f"manifest is not JSON ({exc})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            fmt = d.get("format") if isinstance(d, dict) else None
            raise ManifestError(f"not a torchmoe-ckpt window manifest (format {fmt!r}, expected {FORMAT!r})")
        if d.get("checksum") != content_checksum(d):
            raise ManifestError("manifest checksum does not match its content (edited or damaged)")
        return WindowManifest.from_dict(d)

    @staticmethod
    def from_dict(d: dict) -> WindowManifest:
        """Fields of a manifest dict, unchecked (the tensorstore tier rebuilds a manifest with new files)."""
        try:
            files = {
                k: FileEntry(int(v["bytes"]), int(v["crc32"]), str(v.get("algo", CRC32))) for k, v in d["files"].items()
            }
            window_id, start_step, window, world_size = (
                int(d[k]) for k in ("window_id", "start_step", "window", "world_size")
            )
            extra, identity, slots = d.get("extra", {}), d.get("identity") or {}, list(d.get("slots") or [])
            return WindowManifest(
                window_id, start_step, window, world_size, d["plan"], files, extra, d["format"], identity, slots
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ManifestError(f"manifest is missing or has a bad field ({type(exc).__name__}: {exc})") from None

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())


def content_checksum(d: dict) -> str:
    """SHA-256 of a manifest dict's canonical JSON without its "checksum" field."""
    body = json.dumps({k: v for k, v in d.items() if k != "checksum"}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def plan_digest(plan: dict) -> str:
    """Short digest of a window plan, in every slot's DCP metadata (a slot of another plan is recognised)."""
    return hashlib.sha256(json.dumps(plan, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def record_digest(record: dict) -> str:
    """Digest of one replay record (`IterationRecord.to_dict()`: tensors' dtype, shape, bytes, other values, in key
    order). Slot i's DCP metadata holds its iteration's, so a record edited later no longer matches its slot."""
    import torch
    from torch.utils._pytree import tree_flatten

    h = hashlib.sha256()
    for key in sorted(record):
        leaves, spec = tree_flatten(record[key])
        h.update(f"{key}={spec}".encode())
        for x in leaves:
            if torch.is_tensor(x):
                t = x.detach().cpu().contiguous()
                h.update(f"{t.dtype}{tuple(t.shape)}".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            else:
                h.update(repr(x).encode())
    return h.hexdigest()[:32]


def slot_record(info: SlotInfo) -> dict:
    """What a slot file was written for, as the manifest keeps it per slot (JSON), compared with its DCP metadata."""
    return {k: getattr(info, k) for k in ("window", "slot", "step", "start_step", "run", "plan")}


def check_window(
    man: WindowManifest, window_id: int, rank: int, world_size: int | None = None, slot_info=None
) -> list[Rejection]:
    """Problems with where a manifest and its slot files sit (window, rank, world size, plan, and what each slot's
    DCP metadata, `slot_info(rel)`, was written for): a copy from another window or run is refused even when every
    checksum matches. Empty list = consistent."""
    out = _placement_problems(man, window_id, rank, world_size)
    if not man.slots and not man.identity:
        return out  # written by a tool, not a checkpointer: nothing recorded to compare (recovery refuses it)
    slots = man.plan.get("slots") if isinstance(man.plan, dict) else None
    if not isinstance(slots, list) or len(slots) != man.window or man.plan.get("window", man.window) != man.window:
        return out + [_layout(f"plan does not describe {man.window} slots (edited or damaged)")]
    if len(man.slots) != man.window:
        return out + [_layout(f"manifest records {len(man.slots)} slot files for W={man.window}")]
    digest = plan_digest(man.plan)
    run = (man.identity or {}).get("fingerprint") or None  # a DCP user's window names no run
    for i, rec in enumerate(man.slots):
        # A writer that gave no plan digest (a tool, not the checkpointer) records None for it.
        want = dict(window=man.window_id, slot=i, step=man.start_step + i, start_step=man.start_step, run=run)
        want["plan"] = digest if rec.get("plan") is not None else None
        bad = _differs(rec, want)
        if bad:
            out.append(
                _layout(
                    f"slot {i}: manifest records {', '.join(f'{k} {rec.get(k)!r}' for k in bad)}, expected "
                    f"{', '.join(f'{want[k]!r}' for k in bad)}"
                )
            )
        elif slot_info is not None:
            problem = _slot_file_problem(man, i, want, slot_info)
            if problem is not None:
                out.append(problem)
    return out


def _layout(message: str, file: str = "") -> Rejection:
    return Rejection(RejectionKind.LAYOUT, message, file=file)


def _placement_problems(man: WindowManifest, window_id: int, rank: int, world_size: int | None) -> list[Rejection]:
    """Whether the manifest is of the window, writer and world size where it was found."""
    out = []
    if man.window_id != window_id:
        out.append(_layout(f"manifest is of window {man.window_id}, found in the directory of window {window_id}"))
    if man.extra.get("rank", rank) != rank:
        out.append(_layout(f"manifest is rank {man.extra.get('rank')}'s, found as rank {rank}'s"))
    if world_size is not None and man.world_size != world_size:
        out.append(_layout(f"world size {man.world_size} != {world_size}"))
    return out


def _slot_file_problem(man: WindowManifest, i: int, want: dict, slot_info) -> Rejection | None:
    """Whether slot `i`'s DCP metadata (`slot_info(rel)`) was written for where it sits (`want`); None: it was."""
    rel = slot_metadata_file(man, i)
    if rel is None:
        return _layout(f"slot {i}: no DCP metadata file listed")
    try:
        info = slot_info(rel) or {}
    except Exception as exc:  # unreadable metadata: a damaged or foreign file
        why = f"slot {i}: metadata unreadable ({type(exc).__name__}: {exc})"
        return Rejection(RejectionKind.UNREADABLE, why, file=rel)
    bad = _differs(info, want)
    if bad:
        return _layout(
            f"{rel}: written for {', '.join(f'{k} {info.get(k)!r}' for k in bad)}, but sits at "
            f"{', '.join(f'{k} {want[k]!r}' for k in bad)} (a slot file of another window or run)",
            rel,
        )
    return None


def _differs(got: dict, want: dict) -> list[str]:
    """The keys whose recorded value is not the expected one (a run recorded as "" is no run)."""
    return [k for k, v in want.items() if ((got.get(k) or None) if k == "run" else got.get(k)) != v]


def written_world_size(man: WindowManifest) -> int | None:
    """The world size of the run that wrote `man`, from its run identity (None: it records none, e.g. a DCP user's
    window). `verify` has no job to compare a copy with: it checks the manifest's `world_size` against this."""
    ws = ((man.identity or {}).get("parts") or {}).get("world_size")
    return ws if isinstance(ws, int) and not isinstance(ws, bool) else None


def slot_metadata_file(man: WindowManifest, slot: int) -> str | None:
    """The DCP metadata file of one slot among a manifest's files."""
    return next((r for r in sorted(man.files) if slot_of(r) == slot and r.endswith(f"/{METADATA}")), None)
