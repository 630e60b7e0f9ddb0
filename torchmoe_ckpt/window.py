"""A window: W consecutive slots that together hold every operator's full state once, plus the replay
records of the iterations between them. Shared by the checkpointer (which fills windows) and the storage
tiers (which persist and load them), so it sits below both."""

from __future__ import annotations

from dataclasses import dataclass, field

from .replay_log import ReplayLog
from .schedule import WindowPlan
from .snapshot import Slot


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
