"""Per-slot timing of our copy path in the GPU check's benchmark (phase 3): for every slot copied in a measured
window, the update's stall on the copy's end event, the delay from `ready` (the optimizer step's event) to the
copy's start on the side stream, the copy's duration, and its bytes (the leading and the longest uninterrupted
same-dtype block included: the length the copy engine runs without yielding, docs/gpu.md).

The library's counters keep one copy time per slot (`Slot.copy_seconds`) and no event for `ready` or for the
stall, so this is a harness hook, opt-in, installed on one `SnapshotEngine` for the measured steps only
(`SlotTimer.install`). It adds timing-enabled CUDA events next to the library's own (never in place of them: the
library's ordering is untouched) and reads them only after the window, once the device is synchronised: no host
sync on the training thread. On a CPU the same records are kept from host clocks (the copy runs on the copy thread,
the update waits on the host), so the code path and the table exist there too."""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import torch


@dataclass
class SlotRecord:
    """One slot copy: where it sits in its window, what it moved, and its events (CUDA) or clock readings (CPU)."""

    index: int
    window: int | None
    step: int
    bytes: int = 0
    lead_bytes: int = 0  # the same-dtype memcpys at the head of the copy, back to back
    longest_bytes: int = 0  # the longest such run anywhere in the copy
    ready: object = None
    start: object = None
    end: object = None
    ends: list = field(default_factory=list)  # every end event the copy recorded: a staged copy's `staged` first
    stall: tuple | None = None  # (event before, event after) the training stream's wait on `end`
    host_wait_s: float | None = None  # the training thread's wait in engine.wait() for this copy
    lists: tuple | None = None  # the copy's (sources, destinations): its blocks are counted after the window
    job: object = None  # the library's copy job: its lists and bytes are resolved on the copy thread, read after

    def timings(self, cuda: bool) -> dict:
        """Seconds, read after the device is synchronised (None: not measured for this copy)."""

        def span(a, b):
            if a is None or b is None:
                return None
            return a.elapsed_time(b) / 1e3 if cuda else b - a

        if self.job is not None:  # the copy thread filled it in when it issued the copy
            self.bytes, self.lists = int(self.job.host_bytes), (self.job.srcs, self.job.dsts)
            self.job = None
        if self.lists is not None:  # counted here, not on the training thread during the window
            self.lead_bytes, self.longest_bytes = same_dtype_blocks(*self.lists)
            self.lists = None
        stall = span(*self.stall) if self.stall else None
        if stall is None and not cuda:
            stall = self.host_wait_s  # a CPU update waits on the host: that is its stall
        return {
            "index": self.index,
            "window": self.window,
            "step": self.step,
            "bytes": self.bytes,
            "lead_bytes": self.lead_bytes,
            "longest_bytes": self.longest_bytes,
            "ready_to_start_s": span(self.ready, self.start),
            "copy_s": span(self.start, self.end),
            "stall_s": stall,
            "host_wait_s": self.host_wait_s,
        }


def same_dtype_blocks(srcs: list, dsts: list) -> tuple[int, int]:
    """(leading, longest) bytes of back-to-back same-dtype copies: a cast (or a chunked copy's spacer) ends a run."""
    lead = longest = run = 0
    leading = True
    for s, d in zip(srcs, dsts):
        if s.dtype == d.dtype:
            run += d.numel() * d.element_size()
            continue
        longest = max(longest, run)
        if leading:
            lead, leading = run, False
        run = 0
    longest = max(longest, run)
    return (run if leading else lead), longest


class _TimedCopier:
    """The engine's CopyStream with timing events recorded beside its own; everything else delegated."""

    def __init__(self, inner, timer: SlotTimer):
        self._inner, self._timer = inner, timer

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _event(self):
        ev = torch.cuda.Event(enable_timing=True)  # CUDA only
        ev.record(torch.cuda.current_stream(self._inner.device))  # CUDA only
        return ev

    def mark_ready(self):
        ready = self._inner.mark_ready()
        self._timer.ready_mark = self._event() if self._inner.cuda else time.perf_counter()
        return ready

    def begin(self, ready):
        start = self._inner.begin(ready)
        rec = self._timer.waiting.popleft() if self._timer.waiting else None
        if rec is not None:
            rec.start = start
        self._timer.copying = rec
        return start

    def end(self):
        end = self._inner.end()
        if self._timer.copying is not None:
            self._timer.copying.end = end
            self._timer.copying.ends.append(end)
        return end

    def order_after(self, end) -> None:
        if not self._inner.cuda or end is None or not self._timer.stalls:
            return self._inner.order_after(end)
        before = self._event()
        self._inner.order_after(end)
        rec = self._timer.record_for(end)
        if rec is not None:
            rec.stall = (before, self._event())


class SlotTimer:
    """Records every slot copy of one engine between `install` and `uninstall` (see the module's docstring)."""

    def __init__(self, engine, window_of):
        self.engine, self.window_of = engine, window_of
        self.records: list[SlotRecord] = []
        self.by_job: dict[int, SlotRecord] = {}
        self.waiting: deque[SlotRecord] = deque()  # captured, not yet begun on the copy thread (FIFO: one thread)
        self.copying: SlotRecord | None = None
        self.ready_mark: object = None
        self.cuda = bool(engine.use_cuda)
        self.stalls = True  # False: waits are no update's (the turn's last copy finished), not recorded

    @classmethod
    def install(cls, engine, window_of=lambda: None) -> SlotTimer:
        t = cls(engine, window_of)
        inner_capture, inner_wait = engine.capture, engine.wait

        def capture(slot, step):
            inner_capture(slot, step)
            job = engine._last
            rec = SlotRecord(slot.index, t.window_of(), step, ready=t.ready_mark)
            if job is not None:
                rec.job = job  # its bytes and lists exist once the copy thread has issued it
                t.by_job[id(job)] = rec
            t.records.append(rec)
            t.waiting.append(rec)

        def wait():
            job = engine.inflight if t.stalls else None
            t0 = time.perf_counter()
            try:
                return inner_wait()
            finally:
                rec = t.by_job.get(id(job)) if job is not None else None
                if rec is not None and rec.host_wait_s is None:
                    rec.host_wait_s = time.perf_counter() - t0

        engine.capture, engine.wait = capture, wait  # instance attributes shadow the methods
        t._copier = engine.copier
        engine.copier = _TimedCopier(engine.copier, t)
        return t

    def record_for(self, end) -> SlotRecord | None:
        """The copy whose end event `end` is: the update waits on `end` or, staged, on `staged` (the device copy's
        end, recorded before the host copy's), so every end a copy recorded counts, not only its last."""
        return next((r for r in reversed(self.records) if any(e is end for e in r.ends)), None)

    def uninstall(self) -> None:
        """Stop recording (the library's own methods back); the records stay for `collect`."""
        for name in ("capture", "wait"):
            self.engine.__dict__.pop(name, None)
        self.engine.copier = self._copier

    def collect(self) -> list[dict]:
        """Every record's timings; call once the copies are done and the device synchronised."""
        return [r.timings(self.cuda) for r in self.records]


def _spread(xs: list[float]) -> list[float] | None:
    xs = [x for x in xs if x is not None]
    return [min(xs), statistics.median(xs), max(xs)] if xs else None


def per_slot(turns: list[dict]) -> dict[int, dict]:
    """Per slot index, over every measured copy of a system's turns: count, [min, median, max] of the stall,
    the ready-to-start delay and the copy (seconds), and the median bytes, leading and longest block."""
    by: dict[int, list[dict]] = {}
    for t in turns:
        for r in t.get("slots") or []:
            by.setdefault(r["index"], []).append(r)
    out = {}
    for idx in sorted(by):
        rs = by[idx]
        out[idx] = {
            "copies": len(rs),
            "windows": sorted({r["window"] for r in rs if r["window"] is not None}),
            "stall_s": _spread([r["stall_s"] for r in rs]),
            "ready_to_start_s": _spread([r["ready_to_start_s"] for r in rs]),
            "copy_s": _spread([r["copy_s"] for r in rs]),
            "bytes": statistics.median(r["bytes"] for r in rs),
            "lead_bytes": statistics.median(r["lead_bytes"] for r in rs),
            "longest_bytes": statistics.median(r["longest_bytes"] for r in rs),
        }
    return out


def markdown(slots: dict[str, dict]) -> list[str]:
    """The per-slot table of every system that has one (ms as min / median / max over repetitions)."""
    if not slots:
        return []

    def ms(s):
        return "-" if not s else " / ".join(f"{x * 1e3:.2f}" for x in s)

    lines = [
        "Per slot index (ms as min / median / max over every measured copy of the turns): the update's stall on "
        "the copy's end event, ready (after the optimizer step) to the copy's start, the copy; bytes per copy, the "
        "leading and the longest run of back-to-back same-dtype memcpys (what the copy engine runs without yielding):",
        "",
        "| system | slot | W | copies | stall | ready -> start | copy | MB | lead MB | longest MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in slots.items():
        for idx, r in rows.items():
            ws = ",".join(map(str, r["windows"])) or "-"
            lines.append(
                f"| {name} | {idx} | {ws} | {r['copies']} | {ms(r['stall_s'])} | {ms(r['ready_to_start_s'])} | "
                f"{ms(r['copy_s'])} | {r['bytes'] / 1e6:.1f} | {r['lead_bytes'] / 1e6:.1f} | "
                f"{r['longest_bytes'] / 1e6:.1f} |"
            )
    return lines + [""]
