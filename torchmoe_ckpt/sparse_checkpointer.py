"""SparseCheckpointer: checkpoint every iteration by spreading the dense state over a window of slots.

Per iteration it captures one slot off the training thread and logs what exact replay needs; plans come from
window_planner.py. Here: the lifecycle, window bookkeeping and the handing of slots to the tiers."""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .capture.device_staging import staging_need
from .checkpointer_parts import PartsInputs, build_parts
from .config import SparseConfig
from .core.errors import ConfigError
from .core.operator import Operator
from .core.records import IterationRecord, SlotInfo
from .core.window import Window, sliding_suffix
from .model.identity import RunIdentity, build_identity
from .model.operators import discover_operators, merged_operators
from .model.optim_state import attach_optimizer_state
from .persist.build_tiers import Tiers
from .planning.calibration import CALIBRATION_STEPS, WARMUP_STEPS, cost_per_byte
from .planning.policy import (
    DEFAULT_RESTART_S,
    PolicyChooser,
    PolicyDecision,
    PolicyInputs,
    PolicyStatus,
    PolicySwitch,
    resolved_mtbf_s,
)
from .recovery import rng
from .recovery.resume import ResumeResult
from .recovery.sparse_to_dense import RecoveryPhases, RecoveryReport, replay_slots, sparse_to_dense
from .runtime.agreement import reduce_float
from .runtime.deferred_reads import HostReads
from .runtime.distributed import library_group
from .storage_format.manifest import plan_digest
from .tiers.host_tier import HostTier
from .tiers.window_tier import PartialWindow

log = logging.getLogger("torchmoe_ckpt")


SAME_GROUP = object()  # agree_group not given: the planning group


@dataclass
class PlanningGroups:
    """The process groups a checkpointer plans and agrees over."""

    group: dist.ProcessGroup | None = None  # the ranks that plan together (None: every rank)
    # Those agreeing on the retention floor and bandwidth (default: `group`; None: every rank; wider under
    # pipeline parallelism).
    agree_group: dist.ProcessGroup | None | object = SAME_GROUP
    sum_counts: bool = False  # routed-token counts are this rank's own: summed over `group` once per window


@dataclass
class RunContext:
    """What the start-up sequence hands a checkpointer (every part optional)."""

    tiers: Tiers | None = None  # where slots and windows are persisted (None: in this process only)
    resumed: ResumeResult | None = None  # the recovered window (the fallback until the next commits), next ids
    identity: RunIdentity | None = None  # written into every manifest and slot (default: built here)
    ops: list[Operator] | None = None  # operators already discovered


@dataclass(frozen=True)
class WindowStarted:
    """A window as it started (`stats()["windows"]`, the newest few)."""

    id: int
    start: int  # its first iteration
    W: int  # its slots (the name stats() has always shown)
    fits: bool  # within the bandwidth budget (Algorithm 1)
    worst_slot_bytes: int
    mean_slot_bytes: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Counters:
    """Whole-run figures (`stats()`); `inherit` continues them after a restart."""

    slots: int = 0
    windows_committed: int = 0
    plans: int = 0
    plan_s_total: float = 0.0
    plan_s_max: float = 0.0
    plan_s_recent: list[float] = field(default_factory=list)  # the last RECENT_PLANS plans' seconds
    slot_bytes: list[int] = field(default_factory=list)
    copy_seconds: list[float] = field(default_factory=list)
    windows: list[WindowStarted] = field(default_factory=list)  # per window started
    recoveries: list[RecoveryReport] = field(default_factory=list)  # per in-memory recovery, with its phases
    policy_switches: list[PolicySwitch] = field(default_factory=list)  # per switch: step, from, to

    def add_plan(self, seconds: float) -> None:
        self.plans += 1
        self.plan_s_total += seconds
        self.plan_s_max = max(self.plan_s_max, seconds)
        self.plan_s_recent = (self.plan_s_recent + [seconds])[-RECENT_PLANS:]

    def inherit(self, old: Counters) -> None:
        self.slots += old.slots
        self.windows_committed += old.windows_committed
        self.plans += old.plans
        self.plan_s_total += old.plan_s_total
        self.plan_s_max = max(self.plan_s_max, old.plan_s_max)
        self.slot_bytes = old.slot_bytes + self.slot_bytes
        self.copy_seconds = old.copy_seconds + self.copy_seconds
        self.windows = old.windows + self.windows
        self.recoveries = old.recoveries + self.recoveries
        self.policy_switches = old.policy_switches + self.policy_switches


@dataclass
class _Redo:
    """After an in-memory recovery: the iteration training must reach again, since when, and the phases to add
    the redo time to (the recovery's report)."""

    until: int
    since: float
    phases: RecoveryPhases


RECENT_PLANS = 64  # plans whose median `stats()` reports
FOLD_EVERY = 16  # dense: iterations between folds of the routed-token counts, between snapshots
DENSE_SETS = 4  # slot sets reserved before the first step where dense snapshots may be taken (_reserve_dense_sets)
REDECIDE_EVERY = 16  # auto: the policy is re-decided at the first window boundary this many iterations after the last


class SparseCheckpointer:
    """Per-iteration sparse checkpointing of one rank: `after_step` after every optimizer step, `close()` at the
    end. Owns the copy thread and, with tiers, the persist and upload threads."""

    _digested: tuple[object, str] = (None, "")  # (plan, its digest): _digest_of

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        compute_dtype: torch.dtype,
        cfg: SparseConfig | None = None,
        run: RunContext | None = None,
        groups: PlanningGroups | None = None,
    ):
        """Validate, then build the copy thread, the persist thread (with tiers), the slot allocator and the
        planner.

        Args:
            model: the model checkpointed.
            optimizer: its optimizer (its state is part of every slot).
            compute_dtype: the dtype slots are captured in.
            cfg: `SparseConfig` (None: defaults).
            run: `RunContext` (tiers, what was resumed, identity, operators).
            groups: `PlanningGroups` (planning and agreement groups, whether counts are summed here).

        Raises:
            ConfigError: `run.tiers.host` is not a HostTier.
            HostMemoryLimitError: no window fits in `cfg.host_memory_limit`.
        """
        run, groups = run or RunContext(), groups or PlanningGroups()
        host_tier = _checked_host_tier(run.tiers)
        committed = run.resumed.window if run.resumed is not None else None
        self.cfg = cfg or SparseConfig()
        self.group = groups.group
        self.agree_group = groups.group if groups.agree_group is SAME_GROUP else groups.agree_group
        self.compute_dtype = compute_dtype
        self.ops: list[Operator] = run.ops if run.ops is not None else discover_operators(model, optimizer=optimizer)
        attach_optimizer_state(model, self.ops, optimizer)  # slot layout and sizes from the real optimizer state
        self.op_by_name = {o.name: o for o in self.ops}
        self.identity = run.identity or _default_identity(model, optimizer, compute_dtype, self.ops, host_tier)
        self._identity_dict = self.identity.to_dict()
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self._level = logging.INFO if self._rank == 0 else logging.DEBUG  # one line per window, not one per rank
        for name, why in merged_operators(self.ops).items():  # why a window has fewer, larger expert operators
            log.log(self._level, f"operator {name}: all of its layer's experts as one operator, because {why}")
        self.current: Window | None = None
        self.committed: Window | None = committed
        self._inherited = committed  # a window handed over after a restart (still the recovery fallback)
        self._next_id = _first_window_id(run.resumed, committed)
        self._closed = False
        self._copies_seen = 0  # copies priced so far (_observe_copy)
        self._cur_slot_bytes: list[int] = []
        self._last_job: dict[int, int] = {}  # window id -> the persist thread's ticket after its commit job
        self.counters = Counters()
        self._inflight_bytes = 0  # the bytes of the slot copy running during the next step (device-loss pricing)
        self._redo: _Redo | None = None  # after an in-memory recovery: until training is back where it was
        self.dense_bytes = sum(o.full_bytes() for o in self.ops)  # what one dense snapshot of this rank copies
        self._policy_setup(run)
        # Threads last: nothing above can leave one running, and build_parts stops its own when it refuses.
        parts = build_parts(
            PartsInputs(
                model,
                optimizer,
                compute_dtype,
                self.cfg,
                self.ops,
                host_tier,
                run.tiers,
                groups.group,
                groups.sum_counts,
                self._rank,
                agree=self._agree,
                windows=lambda: (self.current, self.committed, self._inherited),
            )
        )
        self.parts = parts
        self.access, self.engine, self.trigger, self.persist = parts.access, parts.engine, parts.trigger, parts.persist
        self.slots, self.planner, self.memory = parts.slots, parts.planner, parts.memory
        if self.persist is not None:  # the status line of each committed window says the policy in force
            self.persist.status.policy_text = lambda: None if self.decision is None else self.decision.line()
        try:
            self._reserve_dense_sets()
        except BaseException:  # no thread is left running
            self.stop()
            raise

    def attach(self, trainer) -> SparseCheckpointer:
        trainer.before_update.append(self.before_update)
        return self

    def before_update(self) -> None:
        """The next update overwrites the sources of the in-flight copy: wait for it (measured)."""
        self.engine.wait()
        self._maybe_commit()

    def after_step(self, res) -> None:
        """Capture iteration `res.step`: call right after its optimizer step. Starts a window when the last one is
        full, and commits the window its copy completes (collective then: the retention floor is agreed).

        Args:
            res: the iteration (`checkpointer.StepResult`, the harness's or TorchTitan's): step, seconds, loss,
                gradient norm, LRs, batch, RNG states, routed-token counts and probabilities.
        """
        self.planner.observe_step(res.seconds, res.expert_counts, res.expert_probs, self._inflight_bytes)
        self._observe_policy_step(res.seconds, self._inflight_bytes)
        self._settle(done=False)
        self._inflight_bytes = 0
        t = res.step
        self._end_redo(t)
        calibrating = self.planner.calibrating or self._policy_calibrating
        idle = self.current is None or self.current.captured >= self.current.plan.window
        first_point = False
        if calibrating and idle:
            # Collective under host_memory_limit (once, at the first iteration, on every rank alike): not in the
            # condition above, so that no rank's short-circuit can skip it.
            first_point = self._first_point_due()
            if not first_point:
                return  # the step without copies is being measured
        cur, record = self.current, None
        if cur is not None and cur.start_step < t < cur.start_step + cur.plan.window:
            record = _record(res, self.engine.reads)
            cur.log.add(record)
        if cur is None or cur.captured >= cur.plan.window:
            if first_point:
                cur = self._start_window(t, first_point=True)
            elif not self._boundary(t):  # dense: no snapshot at this iteration
                return
            else:
                cur = self._start_window(t)
            if cur.plan.window == 1:  # a dense snapshot: nothing is replayed, so its RNG comes back from here
                cur.log.add(_resume_record(res))
            if cur.plan.sliding:  # a sliding recovery may start in the window before and replay this one's first
                record = _record(res, self.engine.reads)
                cur.log.add(record)
        slot = cur.slots[t - cur.start_step]
        self.engine.capture(slot, t)
        self._inflight_bytes = self._cur_slot_bytes[t - cur.start_step]
        if self.persist is not None:
            self.persist.slot(
                cur.id,
                slot,
                SlotInfo(
                    cur.id,
                    slot.index,
                    cur.start_step,
                    window_size=cur.plan.window,
                    plan=self._digest_of(cur.plan),
                    run=self._identity_dict["fingerprint"],
                ),
                record,  # the persist thread writes its digest (storage_format.manifest.record_digest)
                # sliding plans: how far the window got, so that a restart can use it before it commits
                PartialWindow(cur.start_step, cur.plan, list(cur.log.records.values())) if cur.plan.sliding else None,
            )
        cur.captured += 1
        self.counters.slots += 1
        self.counters.slot_bytes.append(self._cur_slot_bytes[t - cur.start_step])

    def _end_redo(self, t: int) -> None:
        """After an in-memory recovery: training is back where the failure found it at iteration `t` (the redo's
        seconds go into that recovery's phases)."""
        if self._redo is not None and t >= self._redo.until:
            self._redo.phases.redo = time.perf_counter() - self._redo.since
            self._redo = None

    def flush(self, commit: bool = True) -> None:
        """Finish the copy in flight, commit the window it completes (collective), then wait until the host tier has
        written what is queued (not the uploads). `commit=False` (a peer failed): no commit, no collective."""
        if commit:
            self._settle()
        else:
            self.engine.wait()
        if self.persist is not None:
            self.persist.flush()

    def close(self, upload_timeout_s: float = 30.0) -> dict | None:
        """Flush, wait for pending uploads, stop every thread. Collective (the flush commits). Idempotent.

        Args:
            upload_timeout_s: how long pending uploads may take.

        Returns:
            The exit summary (None without tiers, or when already closed).

        Raises:
            Whatever the flush raises; only the copy thread is stopped then (call `stop()`).
        """
        if self._closed:
            return None
        try:
            self.flush()
        except BaseException:
            self.engine.shutdown()
            raise
        summary = self.persist.finish(upload_timeout_s) if self.persist is not None else None
        self.stop()
        return summary

    def stop(self) -> None:
        """Stop the threads without waiting (after an error: no flush, no collective). Idempotent."""
        if not self._closed:
            self._end(lambda tw: tw.shutdown())

    def abandon(self, upload_wait_s: float = 0.0) -> None:
        """Emulate this process dying: the persist thread drops its queue, nothing more is committed; the object
        store gets up to `upload_wait_s` for windows already handed to it. Unusable afterwards."""
        self._end(lambda tw: tw.abandon(upload_wait_s))

    def wait_abandoned(self, timeout_s: float) -> bool:
        """After `abandon`: wait up to `timeout_s` for the persist thread's job in flight to finish (see
        PersistThread.wait_stopped); whether it ended (True without a persist thread)."""
        return self.persist is None or self.persist.wait_stopped(timeout_s)

    def _end(self, end_writer) -> None:
        self._closed = True
        self.parts.stop(end_writer)

    def abandon_window(self) -> None:
        """Finish the copy in flight, then drop an incomplete window (a loop that pauses checkpointing)."""
        self._settle()
        self._drop_current()

    def _settle(self, done: bool = True) -> None:
        """Wait for the copy in flight (`done`: until it is on the host), price it, commit the window it completes."""
        (self.engine.wait_done if done else self.engine.wait)()
        self._observe_copy()
        self._maybe_commit()

    def _drop_current(self) -> None:
        cur, self.current = self.current, None
        if cur is not None:
            self.slots.release(cur.slots)  # reused once the host tier is done with them

    def recover_in_memory(self, trainer) -> RecoveryReport | None:
        """In-process recovery after a failure that lost the training state but not this process: the dense state
        into `trainer` (a `Replayable` over this checkpointer's model and optimizer), same buffers and threads. With
        sliding plans from the newest W consecutive slots (back to the last iteration captured, that window kept);
        otherwise from the newest committed window, the one being filled dropped. Returns the report (phases;
        redo is added once training is back at the last iteration captured), or None when nothing is committed."""
        t0 = time.perf_counter()
        last = self.current.start_step + self.current.captured - 1 if self.current is not None else None
        self.engine.discard_deferred()  # a copy not issued yet would read the lost state: its slot is torn
        with contextlib.suppress(Exception):  # its error is the failure's, already being handled
            self.engine.wait_done()  # a copy in flight when the state was lost is torn: its slot is not used below
        self._maybe_commit()  # a window whose last copy had finished is the newest recovery point
        suffix = None  # sliding plans: the newest slots covering every operator, torn copies trimmed off
        old, cur = self.committed, self.current
        if old is not None and cur is not None:
            cur.captured = next((k for k in range(cur.captured) if not cur.slots[k].complete), cur.captured)
            suffix = sliding_suffix(old, cur)
        if suffix is None:
            self._drop_current()
        if self.committed is None:
            return None
        find_s = time.perf_counter() - t0
        if suffix is not None and cur is not None:  # (a suffix comes with the window being filled)
            rep = replay_slots(trainer, suffix.seq, suffix.start_step, suffix.record, cur.id, suffix.label)
        else:
            rep = sparse_to_dense(trainer, self.committed)
        rep.phases.find, rep.phases.safety_copy, rep.phases.redo = find_s, 0.0, 0.0
        rep.seconds = time.perf_counter() - t0
        self.counters.recoveries.append(rep)
        if last is not None and last > rep.recovered_step:
            self._redo = _Redo(until=last, since=time.perf_counter(), phases=rep.phases)
        return rep

    def _observe_copy(self) -> None:
        """Feed the copy that just finished (bytes, copy-thread wall time, the wait it caused) to the pricing."""
        n = self.engine.copy_totals["copies"]
        if n != self._copies_seen and self.engine.last_copy is not None:
            self._copies_seen = n
            nbytes, wall, _cpu = self.engine.last_copy
            self.planner.cost.observe_copy(nbytes, wall, self.engine.waits[-1] if self.engine.waits else 0.0)

    def _maybe_commit(self) -> None:
        """Commit the window being filled once its last copy is complete, then release the window it replaces."""
        cur = self.current
        if cur is not None and cur.captured == cur.plan.window:
            # The floor agreement in _commit is a collective: wait for a CUDA copy still running, once per window.
            self.engine.wait_done()
        if cur is None or not cur.committed:
            return
        old, self.committed, self.current = self.committed, cur, None
        self._commit(cur)
        if old is not None:
            self._release(old)

    def _commit(self, cur: Window) -> None:
        """Count and log the window committed in memory, and hand it to the persist thread (collective: the
        retention floor is agreed)."""
        self.counters.windows_committed += 1
        self.counters.copy_seconds.extend(s.copy_seconds for s in cur.slots)
        if log.isEnabledFor(self._level):  # summing every item's bytes costs ~1 ms a window: only when logged
            w = cur.plan.window
            log.log(
                self._level,
                f"window committed id={cur.id} steps={cur.start_step}..{cur.start_step + w - 1} "
                f"W={w} bytes={cur.nbytes()}",
            )
        if self.persist is None:
            return
        # Keep every window from the newest one *all* ranks persisted: the only one they can all recover from.
        mine = max(self.persist.persisted, default=-1)
        mine = self.persist.peer_floor(mine)  # peer_interval k > 1: from the newest window on the peers
        floor = int(self._agree(float(mine), dist.ReduceOp.MIN))
        self.persist.commit(cur, {"dtype": str(self.compute_dtype), "identity": self._identity_dict}, keep_from=floor)
        self._last_job[cur.id] = self.persist.ticket()  # its buffers are read until this job is done

    def _release(self, old: Window) -> None:
        """Let go of the window a commit replaced: its slots go back to the allocator once the persist thread is
        done with them. An inherited window (recovered after a restart) is not the allocator's: let go, its memory
        with it."""
        if old is self._inherited:
            self._inherited = None
        else:
            self.slots.release(old.slots, self._last_job.pop(old.id, None))

    def _agree(self, value: float, op, group: object = SAME_GROUP) -> float:
        """`value` reduced with `op` over `agree_group` (or `group`). Collective."""
        return reduce_float(value, op, self.agree_group if group is SAME_GROUP else group)  # pyright: ignore[reportArgumentType]  (SAME_GROUP is resolved here)

    # ---- the policy (planning/policy.py) --------------------------------------------------------------------
    def _policy_setup(self, run: RunContext) -> None:
        cfg = self.cfg
        fixed, why = cfg.fixed_policy, ""
        if fixed is None and self.agree_group is not self.group:
            # Pipeline stages (agreement wider than planning): localized replay from neighbours' boundary logs is
            # built and tested on windows only; "dense" there is the user's explicit choice.
            fixed, why = "sparse", "pipeline stages: auto keeps windows (localized replay is tested on them)"
        self.chooser = PolicyChooser(fixed, cfg.window, cfg.dense_interval, why)
        self.decision: PolicyDecision | None = None
        self._decided_at: int | None = None  # the iteration of the last decision
        self._next_dense: int | None = None  # dense: the iteration of the next snapshot
        # Auto (or a dense interval to choose) needs the step without copies: the first steps capture nothing.
        self._needs_base = fixed is None or (fixed == "dense" and cfg.dense_interval is None)
        self._steps_seen = 0
        # A recovery point while calibrating (_first_point_due): runs that start from nothing, outside pipelines.
        self._first_point_pending = run.resumed is None and self.agree_group is self.group
        self._base: list[float] = []
        self.base_step_s: float | None = None
        self._samples: list[tuple[float, int]] = []  # (step seconds, bytes copied during it) since the last decision
        self._added_s_per_byte: float | None = None
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.mtbf_s = resolved_mtbf_s(cfg.mtbf, world)  # pyright: ignore[reportArgumentType]  (parsed to seconds)
        # The recovery's own seconds (a restart also re-forms the group and starts the process: a floor)
        measured = _recovery_seconds(run.resumed)
        self.restart_s = float(measured) if isinstance(measured, (int, float)) and measured > 0 else DEFAULT_RESTART_S
        self.restart_measured = measured is not None

    @property
    def _policy_calibrating(self) -> bool:
        return self._needs_base and self.base_step_s is None

    @property
    def policy(self) -> str:
        """The policy in force ("sparse" or "dense"; before the first decision, the one the config fixes)."""
        if self.decision is not None:
            return self.decision.policy
        return self.cfg.fixed_policy or "sparse"

    def _observe_policy_step(self, seconds: float, copy_bytes: int) -> None:
        self._steps_seen += 1
        if self.base_step_s is None and self._needs_base:
            if self._steps_seen > WARMUP_STEPS and copy_bytes == 0 and seconds > 0:
                self._base.append(seconds)
            if len(self._base) >= CALIBRATION_STEPS:
                self.base_step_s = sum(self._base) / len(self._base)
            return
        if seconds > 0 and self.chooser.fixed is None:  # drained at each decision (a fixed policy takes none)
            self._samples.append((seconds, copy_bytes))

    def _boundary(self, t: int) -> bool:
        """A window boundary at iteration `t`: (re-)decide the policy when due, then whether a window or a dense
        snapshot starts here (False: dense, and its next snapshot is later). Collective when deciding (every rank
        reaches the same boundaries at the same iterations)."""
        due = self.decision is None or (
            not self.chooser.fixed and self._decided_at is not None and t - self._decided_at >= REDECIDE_EVERY
        )
        if due and (self.policy != "dense" or self._next_dense is None or t >= self._next_dense):
            self._decide(t)
        if self.policy != "dense":
            return True
        if self._next_dense is not None and t < self._next_dense:
            if t % FOLD_EVERY == 0:  # a long interval: the queued counts into the popularity (bounded memory)
                self.planner.fold_counts()
            return False
        assert self.decision is not None
        self._next_dense = t + self.decision.interval_or_W
        return True

    def _decide(self, t: int) -> None:
        old = self.decision
        d = self.chooser.decide(self._policy_inputs())
        self.decision, self._decided_at = d, t
        if old is not None and old.policy != d.policy:
            self.counters.policy_switches.append(PolicySwitch(t, old.label, d.label))
            self._next_dense = None  # a new dense run starts its snapshots here
        if old is None or old.label != d.label:
            log.log(self._level, f"torchmoe: {d.line()} at iteration {t}")

    def force_policy(self, policy: str, interval: int | None = None) -> None:
        """From the next window boundary on: `policy` ("sparse": windows as the config sizes them; "dense": a
        snapshot every `interval` iterations), kept (a forced switch: tests, the bench). The window being filled
        completes first, and the last committed one stays the recovery point until the first of the new policy
        commits."""
        if policy == "dense" and (interval is None or interval < 1) or policy not in ("sparse", "dense"):
            raise ConfigError(
                f"force_policy takes 'sparse', or 'dense' and an interval >= 1; got {policy!r}, {interval}"
            )
        old = self.decision
        k = interval if policy == "dense" else self.planner.sparse_estimate()[0]
        self.chooser = PolicyChooser(policy, None, interval if policy == "dense" else None)
        self._needs_base = False
        self.decision = PolicyDecision(policy, k, {}, "forced", (), None, forced=True)  # pyright: ignore[reportArgumentType]
        if old is not None and old.policy != policy:
            self.counters.policy_switches.append(PolicySwitch(None, old.label, self.decision.label))
            self._next_dense = None

    def _policy_inputs(self) -> PolicyInputs:
        """This rank's measurements, agreed over the ranks (collective)."""
        self.planner.probe_prior()  # the copy cost's prior (collective the first time)
        base = self.base_step_s or self.planner.t_iter or 1e-3
        c = cost_per_byte(base, self._samples)
        self._samples = []
        if c is not None:
            self._added_s_per_byte = c if self._added_s_per_byte is None else 0.5 * self._added_s_per_byte + 0.5 * c
        w, slot_bytes = self.planner.sparse_estimate()
        x = PolicyInputs(
            step_s=base,
            copy_s_per_byte=1.0 / self.planner.cost.bytes_per_s,
            added_s_per_byte=self._added_s_per_byte or 0.0,
            dense_bytes=self.dense_bytes,
            sparse_window=w,
            sparse_slot_bytes=slot_bytes,
            restart_s=self.restart_s,
            mtbf_s=self.mtbf_s,
            overlap=self.planner.overlap,
        )
        return x.agreed(self._agree_max)

    def _agree_max(self, values: list[float]) -> list[float]:
        if not dist.is_initialized():
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        group = self.agree_group if self.agree_group is not SAME_GROUP else self.group
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=library_group(group))  # pyright: ignore[reportArgumentType]
        return [float(v) for v in t.tolist()]

    def _first_point_due(self) -> bool:
        """During calibration (no copies while the step is measured): one dense snapshot at the first iteration,
        once per run that starts from nothing. Without it a failure in the first ~10 iterations would restart the
        run from scratch, and the first policy decision would price copies by the idle bandwidth probe alone; its
        copy is measured like any other (CopyCost), so that decision is priced by a copy under training. Not after
        a resume (the resumed window is the recovery point), not for pipeline stages (windows only, see
        _policy_setup), not where a dense snapshot would not fit host_memory_limit on some rank. The same answer
        on every rank: configuration, and under a limit one agreement at the first iteration (collective)."""
        if not self._first_point_pending:
            return False
        self._first_point_pending = False
        fits = self.memory.room_for(self.dense_bytes)
        if self.memory.limit is not None and self._agree(float(fits), dist.ReduceOp.MIN) < 1:
            log.log(self._level, "torchmoe: no dense snapshot during calibration: it would not fit host_memory_limit")
            return False
        return True

    def _digest_of(self, plan) -> str:
        """The plan's digest, computed once per plan object (a dense plan is the same object every snapshot; its
        JSON and SHA-256 cost ~1 ms)."""
        if self._digested[0] is not plan:
            self._digested = (plan, plan_digest(plan.to_dict()))
        return self._digested[1]

    def _reserve_dense_sets(self) -> None:
        """Where the policy may take dense snapshots ("auto" takes one while it calibrates, "dense", window = 1),
        their slot sets are built before the first step: a set built at a window start maps its pages on the
        training thread (capture/file_slot_pool.py: FileSlotPool.reserve). DENSE_SETS is what a dense snapshot
        every iteration keeps in use (the one being filled, the committed one, the ones the persist thread still
        links until the retention floor passes them); a switch to windows reuses their files. Within
        host_memory_limit, like every set."""
        if self.chooser.fixed == "sparse" and self.cfg.window != 1:  # (windows of one slot are dense snapshots)
            return  # windows asked for (a forced W >= 2 is one: SparseConfig.fixed_policy)
        plan, _ = self.planner.dense_plan()
        n = self.slots.reserve(plan, DENSE_SETS, self.memory.room_for)
        if n:
            log.debug(f"torchmoe: {n} dense slot sets reserved before the first step ({self.dense_bytes} bytes each)")

    def _start_window(self, t: int, first_point: bool = False) -> Window:
        t0 = time.perf_counter()
        dense = first_point or self.policy == "dense"
        plan, budget = self.planner.dense_plan() if dense else self.planner.plan()
        self.memory.before_window(plan, self._next_id)  # within host_memory_limit, or refused
        slots = self.slots.slots_for(plan)
        # The next window's set, off this thread, if none is left; for the next window's plan when its W grows
        # (a new arena: pinning takes seconds, and the training thread must not do it at the next window start).
        if not first_point:  # (the calibration's one snapshot: the next window's plan is not known yet)
            ahead = self.planner.next_plan(plan) or plan
            self.slots.prepare(ahead, self.memory.room_for)
        win = Window(self._next_id, t, plan, slots)
        self._cur_slot_bytes = self.slots.slot_bytes(slots)
        if self.engine.staging is not None:  # this window staged when its largest slot fits (device_staging.py)
            self.engine.staging.admit(max(staging_need([it.buffer for it in s.items]) for s in slots), self._next_id)
        self._next_id += 1
        self.current = win
        self.counters.add_plan(time.perf_counter() - t0)
        mean = sum(self._cur_slot_bytes) / plan.window
        self.counters.windows.append(WindowStarted(win.id, t, plan.window, plan.fits, plan.worst_slot_bytes, mean))
        if log.isEnabledFor(self._level):
            log.log(
                self._level,
                f"window start id={win.id} t0={t} W={plan.window} fits={plan.fits} "
                f"budget={budget:.3g} worst_slot={plan.worst_slot_bytes}",
            )
        return win

    def inherit_counters(self, old: SparseCheckpointer) -> SparseCheckpointer:
        """Continue the counters of the checkpointer that ran before a restart (for whole-run figures)."""
        self.counters.inherit(old.counters)
        self.engine.waits = old.engine.waits + self.engine.waits
        self.engine.wait_seconds_total += old.engine.wait_seconds_total
        for k, v in old.engine.copy_totals.items():
            self.engine.copy_totals[k] += v
        self.planner.inherit(old.planner)
        if self.base_step_s is None and old.base_step_s is not None:  # the step without copies, measured once
            self.base_step_s = old.base_step_s
        self._added_s_per_byte = self._added_s_per_byte or old._added_s_per_byte
        return self

    def policy_status(self) -> PolicyStatus:
        """The policy in force, each candidate's predicted ETTR, why, and the switches (`stats()["policy"]`)."""
        d = self.decision
        return PolicyStatus(
            policy=self.policy,
            interval_or_W=None if d is None else d.interval_or_W,
            predicted_ettr={} if d is None else dict(d.predicted_ettr),
            reason="not decided yet (calibrating)" if d is None else d.reason,
            forced=self.chooser.fixed is not None,
            mtbf_s=self.mtbf_s,
            restart_s=self.restart_s,
            restart_measured=self.restart_measured,
            base_step_s=self.base_step_s,
            inputs=None if d is None else d.inputs,
            switches=tuple(self.counters.policy_switches),
        )

    def _copy_path_stats(self) -> dict:
        return _copy_path_stats(self)

    def stats(self) -> dict:
        c = self.counters
        waits, sb, cs = self.engine.waits, c.slot_bytes, c.copy_seconds
        tw = self.persist
        return {
            "slots_captured": c.slots,
            "windows_committed": c.windows_committed,
            "reorders": self.planner.reorders,
            "dense_bytes": self.dense_bytes,
            "mean_slot_bytes": sum(sb) / len(sb) if sb else 0,
            "max_slot_bytes": max(sb) if sb else 0,
            "wait_seconds_total": self.engine.wait_seconds_total,
            "wait_seconds_max": max(waits) if waits else 0.0,
            "copy_seconds_mean": sum(cs) / len(cs) if cs else 0.0,
            "t_iter": self.planner.t_iter,
            "bandwidth_bytes_per_s": self.planner.bandwidth,
            "copy": dict(self.engine.copy_totals),
            "priced_bytes_per_s": self.planner.cost.bytes_per_s,
            "priced_t_iter": self.planner.cost.t_iter,
            "auto_window": self.planner.auto_w,
            "copy_path": self._copy_path_stats(),
            "plan_seconds": {
                "plans": c.plans,
                "plan_s_total": c.plan_s_total,
                "plan_s_max": c.plan_s_max,
                "median_recent": statistics.median(c.plan_s_recent or [0.0]),
            },
            "policy": self.policy_status().to_dict(),
            "windows": [w.to_dict() for w in c.windows[-5:]],
            "recoveries": [
                dict(
                    r.phases.to_dict(),
                    recovered_step=r.recovered_step,
                    replayed=r.replayed_iterations,
                    bytes=r.bytes_loaded,
                )
                for r in c.recoveries[-8:]
            ],
            "host_memory": self.memory.account(),  # every host byte held, by part, and the limit
            "host_tier": None if tw is None else tw.stats(),
            "peers": None if tw is None else tw.replication_stats(),
            "object_store": None if tw is None or tw.uploader is None else tw.uploader.stats(),
        }


def _copy_path_stats(ck: SparseCheckpointer) -> dict:
    """The copy path's switches and what they did (docs/gpu.md, "The fix switches")."""
    e, cfg, dl = ck.engine, ck.cfg, ck.planner.device_loss
    return {
        "copy_chunk_bytes": cfg.copy_chunk_bytes,
        "reads_on_copy_stream": cfg.reads_on_copy_stream,
        "reads": e.reads.reads,
        "copy_phase": cfg.copy_phase,
        "issued_by_backward_hook": e.issued_by_hook,
        "device_staging": None if e.staging is None else e.staging.stats(),
        "device_loss": None if dl is None else dl.stats(),
    }


def _checked_host_tier(tiers: Tiers | None) -> HostTier | None:
    host_tier = tiers.host if tiers is not None else None
    if host_tier is not None and not isinstance(host_tier, HostTier):
        raise ConfigError(
            f"tiers.host must be a HostTier, got {type(host_tier).__name__}: build the tiers with "
            "build_tiers(TierConfig(...)), or use torchmoe_ckpt.Checkpointer, which owns them"
        )
    return host_tier


def _default_identity(model, optimizer, compute_dtype, ops, host_tier: HostTier | None) -> RunIdentity:
    """Built from model, optimizer, dtype, world size and the host tier's run id."""
    run_id = host_tier.dir.name if host_tier is not None else None
    world = dist.get_world_size() if dist.is_initialized() else 1
    return build_identity(model, optimizer, compute_dtype, ops, run_id, world)


def _recovery_seconds(resumed: ResumeResult | None) -> float | None:
    """How long the recovery took: its typed outcome's; a recovery without one (pipeline stages, a JIT copy) says
    it in its report."""
    if resumed is None:
        return None
    if resumed.outcome is not None:
        return resumed.outcome.total_seconds
    report = resumed.report
    return report.get("total_seconds", report.get("seconds")) if isinstance(report, dict) else None


def _first_window_id(resumed: ResumeResult | None, committed: Window | None) -> int:
    """Where new window ids start: what the recovery says, else after the recovered window, else 0."""
    if resumed is not None and resumed.next_window_id is not None:
        return resumed.next_window_id
    return committed.id + 1 if committed is not None else 0


def _resume_record(res) -> IterationRecord:
    """A W = 1 window (a dense snapshot) replays nothing, so recovery cannot leave the random state where
    iteration `res.step` left it, as a replay's last iteration does: this record of iteration `res.step` + 1 holds
    the random state now, after the step, where the loop goes on (sparse_to_dense restores it). Nothing else in
    it is used: no batch, norm or loss."""
    cpu, device = rng.capture()
    zero = torch.zeros((), dtype=torch.float32)
    return IterationRecord(res.step + 1, None, zero, float(res.lr), zero, cpu, device_rng=device)


def _record(res, reads: HostReads) -> IterationRecord:
    """Iteration `res.step`'s replay record; host copies queued, not awaited (they land before its slot copy, on
    the stream `reads` puts them on: the slot copy comes after them there, or after the update's event)."""
    tokens, norm, loss, hyper = reads.copy((res.tokens, res.grad_norm, res.loss, getattr(res, "hyper", None) or None))
    return IterationRecord(
        res.step,
        tokens,
        norm,
        res.lr,
        loss,
        res.rng_state,
        lrs=getattr(res, "lrs", None),
        device_rng=getattr(res, "device_rng", None),
        hyper=hyper,
    )
