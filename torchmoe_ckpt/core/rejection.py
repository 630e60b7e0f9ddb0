"""Why a copy of a window is not used: a kind, which code decides by, and a message, which people read.

Every check that refuses a copy (the tiers' `check`/`verify`/`record_problems`, a load or a replay that failed, a
rank's part that no tier holds) says it as a `Rejection`; recovery and `torchmoe-ckpt verify` decide by its `kind`,
never by its text. The text is rendered only at the edges (logs, the recovery report's JSON, error messages), as
DCP's planner keeps its `WriteItem`s typed and renders them only in its metadata. Rejections pickle (they are
gathered across ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

__all__ = ["Rejection", "RejectionKind"]


class RejectionKind(Enum):
    """What is wrong with a copy (the values are names for people; code compares members)."""

    NOT_COMMITTED = "not committed"  # no manifest: the copy was never committed on this tier
    BAD_MANIFEST = "bad manifest"  # the manifest cannot be read
    MISSING_FILE = "missing file"  # a file the manifest lists is not there
    TORN = "torn"  # a file's size is not the one the manifest records
    CORRUPT = "corrupt"  # a checksum does not match
    UNREADABLE = "unreadable"  # a file that verifies but cannot be parsed (slot metadata, replay records)
    LAYOUT = "layout"  # not of the window, rank, world size, slot, step or plan where it was found
    FOREIGN = "foreign"  # written by another run (its identity differs)
    FORGED_RECORD = "forged record"  # a replay record is not the one its slot was written with
    LOAD_FAILED = "load failed"  # its load raised
    REPLAY_DIVERGENCE = "replay divergence"  # its replay did not reproduce the logged values
    REPLAY_FAILED = "replay failed"  # its replay raised otherwise
    DOWNLOAD_FAILED = "download failed"  # the object store's copy could not be fetched or does not verify
    NO_COPY = "no copy"  # a rank's part is on no tier
    STRANDED = "stranded"  # a rank's part is only on another host, under an older node numbering, and cannot be sent


@dataclass(frozen=True)
class Rejection:
    """One reason a copy is refused. `str()` is `message`, the text shown to users and in the report."""

    kind: RejectionKind
    message: str
    # FOREIGN: what differs from this run's identity (the refusal quotes it); "" for every other kind
    detail: str = ""
    file: str = ""  # the file it is about, relative to the window directory ("": the copy as a whole)

    def __str__(self) -> str:
        return self.message

    def reworded(self, message: str) -> Rejection:
        """The same reason said where it was met (e.g. "load: CorruptCopyError: ..."): kind and detail kept."""
        return replace(self, message=message)
