"""What a dense export needs besides the model and optimizer to be a complete TorchTitan checkpoint.

TorchTitan's CheckpointManager saves, besides the flattened model and ``optimizer``, the Stateful entries
``train_state`` (step, ntokens_seen), ``dataloader`` (``dp_rank_N``: this rank's loader position, and
``world_size``) and ``lr_scheduler`` (``last_epoch``). A full resume
(``--checkpoint.initial_load_path DIR --checkpoint.no-initial_load_model_only``) loads all of them, so an export
without them fails with ``Missing key ... dataloader.dp_rank_0``. The library's DenseExporter writes them when
given this function (``extra=``); TorchTitan's own ``state_dict()`` produces each one, in TorchTitan's format.
"""

from __future__ import annotations

from typing import Any

TITAN_ENTRIES = ("train_state", "dataloader", "lr_scheduler")  # torchtitan.components.checkpoint's keys


def titan_entries(states: dict[str, Any]) -> dict[str, Any]:
    """The entries of TorchTitan's checkpoint ``states`` other than model and optimizer, as TorchTitan saves them."""
    return {k: states[k].state_dict() for k in TITAN_ENTRIES if states.get(k) is not None}
