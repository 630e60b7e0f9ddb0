"""``TORCHMOE_TITAN_EXPORT=DIR`` (tests, diagnostics): each rank's final state and a JSON record of its run.

``DIR/state-rank-R.pt``: the local model parameters, optimizer state, buffers, LR and step (what the tests compare
with ``torch.equal``); ``DIR/run-rank-R-attempt-A.json``: losses and their bits, LRs, step times, the recovery
report and the checkpointer's counters. Works on any ``SparseTrainer`` (duck-typed: no import of it here).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

EXPORT_ENV = "TORCHMOE_TITAN_EXPORT"
CHECKPOINT_KEYS = (
    "slots_captured",
    "windows_committed",
    "dense_bytes",
    "mean_slot_bytes",
    "max_slot_bytes",
    "wait_seconds_total",
    "wait_seconds_max",
    "copy_seconds_mean",
    "windows",
    "host_tier",
    "copy_path",  # the GPU copy-path switches and what they did (docs/gpu.md)
)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def state_tensors(model: torch.nn.Module, optimizer, step: int) -> dict[str, torch.Tensor]:
    """This rank's local shards: ``param/``, ``optim/<name>/<key>``, ``buffer/``, ``lr``, ``step``. ``optimizer``:
    one torch.optim.Optimizer-like view (``state``, ``param_groups``)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[f"param/{name}"] = _local(p).detach().clone()
        for key, val in optimizer.state.get(p, {}).items():
            out[f"optim/{name}/{key}"] = _local(val).clone() if torch.is_tensor(val) else torch.tensor(val)
    for name, b in model.named_buffers():
        if b is not None:
            out[f"buffer/{name}"] = _local(b).clone()
    out["lr"] = torch.tensor(optimizer.param_groups[0]["lr"], dtype=torch.float64)
    out["step"] = torch.tensor(step)
    return out


def write_export(trainer) -> None:
    """At the end of ``SparseTrainer.train``: write both files when ``$TORCHMOE_TITAN_EXPORT`` is set."""
    d = os.environ.get(EXPORT_ENV)
    if not d:
        return
    rank = torch.distributed.get_rank()
    path = Path(d)
    path.mkdir(parents=True, exist_ok=True)
    torch.save(trainer.export_state(), path / f"state-rank-{rank}.pt")
    st = trainer.sparse.stats() if trainer.sparse is not None else {}
    losses = sorted(trainer._losses.items())
    info = {
        "rank": rank,
        "attempt": trainer._attempt,
        "losses": {str(k): v.item() for k, v in losses},
        "loss_bits": {str(k): v.view(torch.int32).item() for k, v in losses},
        "lrs": {str(k): v for k, v in sorted(trainer._lrs.items())},
        "step_seconds": trainer._step_seconds,
        "recovery": trainer.recovery_report,
        "checkpoint": {k: st.get(k) for k in CHECKPOINT_KEYS},
    }
    (path / f"run-rank-{rank}-attempt-{trainer._attempt}.json").write_text(json.dumps(info, default=str))
