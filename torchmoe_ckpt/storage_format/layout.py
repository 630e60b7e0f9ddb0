"""Names and paths of everything the storage tiers write, in one place (the tree: docs/architecture.md). Files are
named by *writer* (`writer_name`) and listings return writer names: a stable writer identity would change
`writer_name` only.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

DATA_FILE = "__0_0.distcp"  # a writer's data file of one slot (DCP's name for rank 0 of a one-writer save)
METADATA = ".metadata"  # DCP's metadata file name; in a slot it is the writer's commit of that slot
LOCK_NAME = "LOCK.json"
REPLICA_VERIFIED = "REPLICA_VERIFIED"  # in a replica's peer copy: its slot data is the receiver's own (peer_tier.py)
SLOTS_DIR, SPARE_DIR, PEERS_DIR = ".slots", ".spare", ".peers"
REPLAY_DIR = "replay"
_WINDOW = re.compile(r"^window-(\d+)$")
_SLOT = re.compile(r"^slot-(\d+)$")
_WRITER = re.compile(r"^rank-(\d+)$")
_MANIFEST = re.compile(r"^MANIFEST\.(rank-\d+)\.json$")


def writer_name(rank: int) -> str:
    """The name a writer's files carry (today its rank)."""
    return f"rank-{rank:05d}"


def writer_rank(name: str) -> int | None:
    """The rank of a writer name, None for anything else."""
    m = _WRITER.match(name)
    return int(m.group(1)) if m else None


def node_dirname(node: int) -> str:
    """A node's directory under a host tier's root (`<root>/node-N/<run>`): one failure domain."""
    return f"node-{node}"


def window_dirname(window_id: int) -> str:
    return f"window-{window_id:06d}"


def rank_of_writer(name: str) -> int:
    """The rank of a name already known to be a writer's (parsed from a manifest or a `from-` directory name)."""
    rank = writer_rank(name)
    if rank is None:
        raise ValueError(f"{name!r} is not a writer name")
    return rank


def parse_window_dirname(name: str) -> int | None:
    m = _WINDOW.match(name)
    return int(m.group(1)) if m else None


def slot_dirname(slot: int) -> str:
    return f"slot-{slot:02d}"


def slot_name(window_id: int, slot: int) -> str:
    """A slot directory relative to the run directory: `window-NNNNNN/slot-SS` (where a DCP user saves it)."""
    return f"{window_dirname(window_id)}/{slot_dirname(slot)}"


def parse_slot_path(path: str) -> tuple[str, int, int] | None:
    """(run directory, window id, slot) of a path ending in `window-NNNNNN/slot-SS`; None otherwise."""
    p = PurePosixPath(str(path).rstrip("/"))
    slot, wid = _SLOT.match(p.name), parse_window_dirname(p.parent.name)
    if len(p.parts) < 2 or slot is None or wid is None:
        return None
    run = str(path).rstrip("/")[: -len(f"{p.parent.name}/{p.name}")].rstrip("/")
    return run, wid, int(slot.group(1))


def slot_writer_dir(slot: int, writer: str) -> str:
    """A writer's piece of one slot, relative to the window directory."""
    return f"{slot_dirname(slot)}/{writer}"


def slot_of(rel: str) -> int | None:
    """The slot a window file belongs to (`slot-SS/...`), None for the replay records."""
    m = _SLOT.match(rel.split("/", 1)[0])
    return int(m.group(1)) if m else None


def replay_file(writer: str) -> str:
    return f"{REPLAY_DIR}/{writer}.pt"


def partial_file(writer: str) -> str:
    """A writer's progress through a window not committed yet (sliding plans, host tier)."""
    return f"{REPLAY_DIR}/{writer}.partial.pt"


def manifest_name(writer: str) -> str:
    """A writer's commit of a window (each writer commits its own files)."""
    return f"MANIFEST.{writer}.json"


def parse_manifest_name(name: str) -> str | None:
    """The writer of a manifest file name, None for any other file."""
    m = _MANIFEST.match(name)
    return m.group(1) if m else None


def is_data_file(rel: str) -> bool:
    return rel.endswith(".distcp")


def belongs_to(rel: str, writer: str) -> bool:
    """Whether a window file is `writer`'s: its slot pieces, replay records, manifest (and its temporary name)."""
    return re.search(rf"(^|[/.]){re.escape(writer)}([/.]|$)", rel) is not None


def slots_dir(writer: str) -> str:
    return f"{SLOTS_DIR}/{writer}"


def spare_dir(writer: str) -> str:
    return f"{SPARE_DIR}/{writer}"


def held_copies_dir(holder: str) -> str:
    """Where writer `holder` keeps the copies it holds for other writers (one `from-<writer>` each)."""
    return f"{PEERS_DIR}/{holder}"


def peer_copy_dir(holder: str, src: str) -> str:
    """Where writer `holder` keeps the copies of writer `src`'s windows (a run directory of its own)."""
    return f"{held_copies_dir(holder)}/from-{src}"


def parse_peer_copy_name(name: str) -> str | None:
    """The source writer of a `from-<writer>` directory name."""
    return name[5:] if name.startswith("from-") and writer_rank(name[5:]) is not None else None


def is_internal(name: str) -> bool:
    """A directory that is never a window or a run (slot buffers, spares, peer copies, probes)."""
    return name.startswith(".")


def store_writer_prefix(run_id: str, writer: str) -> str:
    """The tensorstore format's databases of one writer: `<run>/<writer>/window-NNNNNN/` under it."""
    run = run_id.strip("/")
    return f"{run + '/' if run else ''}{writer}/"


def dense_step_dirname(step: int) -> str:
    return f"step-{step}"  # TorchTitan's `{folder}/step-{N}`


def jit_step_dirname(step: int) -> str:
    return f"step-{step:08d}"
