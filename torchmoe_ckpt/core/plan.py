"""A window plan: per slot, the operators whose full state it copies (active) and those whose compute weights it
copies (frozen), as `planning.schedule` (Algorithm 1) chooses them; saved with every window."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SlotPlan:
    active: tuple[str, ...]  # full state (master + optimizer) copied in this slot
    frozen: tuple[str, ...]  # operators after `active`: only compute weights copied
    bytes: int


@dataclass(frozen=True)
class WindowPlan:
    slots: tuple[SlotPlan, ...]
    budget_bytes: float
    fits: bool
    order: tuple[str, ...]
    sliding: bool = False  # every slot carries the compute weights of every operator not active in it

    @property
    def window(self) -> int:
        return len(self.slots)

    @property
    def worst_slot_bytes(self) -> int:
        return max(s.bytes for s in self.slots)

    def slot_of(self, op: str) -> int:
        for i, s in enumerate(self.slots):
            if op in s.active:
                return i
        raise KeyError(f"operator {op!r} is not in this plan")

    def to_dict(self) -> dict:
        return {
            "budget_bytes": self.budget_bytes if math.isfinite(self.budget_bytes) else None,
            "fits": self.fits,
            "order": list(self.order),
            "slots": [{"active": list(s.active), "frozen": list(s.frozen), "bytes": s.bytes} for s in self.slots],
            "sliding": self.sliding,
        }

    @staticmethod
    def from_dict(d: dict) -> WindowPlan:
        return WindowPlan(
            tuple(SlotPlan(tuple(s["active"]), tuple(s["frozen"]), int(s["bytes"])) for s in d["slots"]),
            float("inf") if d["budget_bytes"] is None else float(d["budget_bytes"]),
            bool(d["fits"]),
            tuple(d["order"]),
            bool(d.get("sliding", False)),
        )
