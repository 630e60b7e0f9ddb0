"""A window: W consecutive slots holding every operator's full state once, and the replay records between them
(below both the checkpointer, which fills windows, and the tiers, which persist and load them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .plan import WindowPlan
from .records import ReplayLog
from .slot import Slot


@dataclass
class Window:
    id: int
    start_step: int  # slot 0 holds the state after this iteration
    plan: WindowPlan
    slots: list[Slot]
    log: ReplayLog = field(default_factory=ReplayLog)
    captured: int = 0  # slots handed to the copy engine

    @property
    def committed(self) -> bool:
        w = self.plan.window
        return (
            self.captured == w
            and all(s.complete for s in self.slots)
            and self.log.has(range(self.start_step + 1, self.start_step + w))
        )

    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)


@dataclass
class SlidingSuffix:
    """The newest consecutive slots of a committed window and the next that activate every operator (sliding
    plans): what `sparse_to_dense.replay_slots` converts to the dense state."""

    seq: list  # [(Slot, SlotPlan)], oldest first
    start_step: int  # the first slot holds the state after this iteration
    records: dict  # step -> IterationRecord, the replay records of both windows
    label: str

    def record(self, step: int):
        try:
            return self.records[step]
        except KeyError:
            raise KeyError(f"{self.label}: no replay record for iteration {step}") from None


def sliding_suffix(old: Window, new: Window) -> SlidingSuffix | None:
    """The newest covering suffix of `old` (committed) then `new`'s first `new.captured` slots; None when not both
    sliding, not consecutive, nothing captured, or no suffix covers every operator."""
    k = new.captured
    if not (old.plan.sliding and new.plan.sliding) or k == 0 or new.start_step != old.start_step + old.plan.window:
        return None
    chain = [(sl, sp, old.start_step + i) for i, (sl, sp) in enumerate(zip(old.slots, old.plan.slots))]
    chain += [(sl, sp, new.start_step + i) for i, (sl, sp) in enumerate(zip(new.slots[:k], new.plan.slots))]
    everyone, seen = set(new.plan.order), set()
    for first in range(len(chain) - 1, -1, -1):
        seen |= set(chain[first][1].active)
        if seen >= everyone:
            break
    else:
        return None
    return SlidingSuffix(
        [(sl, sp) for sl, sp, _ in chain[first:]],
        chain[first][2],
        {**old.log.records, **new.log.records},
        f"slots of windows {old.id} and {new.id} from iteration {chain[first][2]} (sliding)",
    )
