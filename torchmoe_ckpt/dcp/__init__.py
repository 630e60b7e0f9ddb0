"""DCP only: the sparse planners a DCP user passes to `dcp.save` / `dcp.load` on a standard state dict, the thin
StorageWriter/StorageReader adapters over the storage tiers (torchmoe_ckpt.storage), and the dense export."""

from ..storage_format.slot_format import CorruptCopyError
from .peer_storage import PeerReader, PeerWriter, held_copies
from .raw_storage import RawReader, RawWriter, committed_windows, has_checkpoint
from .sparse_planner import SparseLoadPlanner, SparseSavePlanner, SparseSchedule, load_sparse_window
from .tier_storage import HostReader, HostWriter, StoreReader, StoreWriter, TieredReader, TieredWriter

CorruptItemError = CorruptCopyError  # the name DCP users know: the same error type

__all__ = [  # also exported by torchmoe_ckpt itself
    "SparseSchedule",
    "SparseSavePlanner",
    "SparseLoadPlanner",
    "load_sparse_window",
    "HostWriter",
    "HostReader",
    "StoreWriter",
    "StoreReader",
    "PeerWriter",
    "PeerReader",
    "TieredWriter",
    "TieredReader",
    "RawWriter",
    "RawReader",
    "has_checkpoint",
    "committed_windows",
    "held_copies",
    "CorruptCopyError",
    "CorruptItemError",
]
