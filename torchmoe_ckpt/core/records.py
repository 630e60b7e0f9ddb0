"""The replay record of one iteration (what exact replay needs: batch, gradient norm, LRs and hyper-parameters, RNG
states, loss) and a window's log of them, applied by `recovery.replay_log.Replay`; and `SlotInfo`, what one slot save
was written for."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch.utils._pytree import tree_leaves


@dataclass(frozen=True)
class SlotInfo:
    """What one slot save was written for: its window, slot and steps, the plan and run it belongs to, and the
    digest of its iteration's replay record. Built by the checkpointer (or the DCP planner), completed by the persist
    thread (`step`, `record`), and kept in the slot's DCP `.metadata` (planner data) and, per slot, in the window's
    manifest, which recovery compares. `to_dict` / `from_dict` are those two JSON/DCP edges."""

    window: int
    slot: int
    start_step: int
    window_size: int | None = None  # W of its window
    plan: str | None = None  # the window plan's digest (storage_format.manifest.plan_digest)
    run: str | None = None  # the run identity's fingerprint (None: not checked)
    step: int | None = None  # the iteration whose state the slot holds (set when it is written)
    record: str | None = None  # its replay record's digest (storage_format.manifest.record_digest; None: none)

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> SlotInfo:
        """From a slot's metadata as read (unknown keys, such as the checksums DCP keeps beside it, are left out)."""
        said: dict[str, Any] = {f.name: d.get(f.name) for f in fields(SlotInfo)}
        return SlotInfo(**said)


@dataclass
class IterationRecord:
    step: int
    tokens: object  # the batch this rank trained on: a tensor or any pytree of tensors
    grad_norm: torch.Tensor  # global gradient norm before clipping (fp32 scalar)
    lr: float  # learning rate applied in this step
    loss: torch.Tensor  # this rank's loss, to verify the replay
    rng_state: torch.Tensor  # CPU RNG state at the start of the step
    loss_scale: float = 1.0  # no dynamic loss scaling in fp32/bf16 training; kept for fp16 users
    lrs: tuple[float, ...] | None = None  # every param group's LR in this step (None: all groups used `lr`)
    device_rng: dict | None = None  # device generators' states at the start of the step (rng.capture; None: CPU)
    hyper: tuple[dict, ...] | None = None  # every param group's other hyper-parameters (`group_hyper`)

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in tree_leaves((self.tokens, self.grad_norm, self.loss, self.rng_state, self.device_rng))
            if torch.is_tensor(t)
        )

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["lrs"] = None if self.lrs is None else list(self.lrs)
        d["hyper"] = None if self.hyper is None else list(self.hyper)
        if not self.device_rng:
            del d["device_rng"]  # CPU records stay as they were
        return d

    @staticmethod
    def from_dict(d: dict) -> IterationRecord:
        d = dict(d)
        if d.get("lrs") is not None:
            d["lrs"] = tuple(d["lrs"])
        if d.get("hyper") is not None:
            d["hyper"] = tuple(d["hyper"])
        return IterationRecord(**d)


class ReplayLog:
    """Records of consecutive iterations, owned by one checkpoint window."""

    def __init__(self) -> None:
        self.records: dict[int, IterationRecord] = {}

    def add(self, rec: IterationRecord) -> None:
        self.records[rec.step] = rec

    def get(self, step: int) -> IterationRecord:
        try:
            return self.records[step]
        except KeyError:
            raise KeyError(f"no replay record for iteration {step}; logged: {sorted(self.records)}") from None

    def has(self, steps: range) -> bool:
        return all(s in self.records for s in steps)

    def nbytes(self) -> int:
        return sum(r.nbytes() for r in self.records.values())

    def __len__(self) -> int:
        return len(self.records)
