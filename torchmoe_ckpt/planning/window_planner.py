"""WindowPlanner: what the next window holds, the same on every rank of the planning group.

It orders the operators (experts by popularity, re-sorted when the reorder rule fires, then routers and dense),
prices a slot's copy budget from what copies cost under training, picks W (Algorithm 1, or forced; agreed in the
background during the window before) and returns the slot plan; and caps W by the host-memory limit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..core.operator import Operator
from ..core.plan import WindowPlan
from ..core.sparse_config import CUDA_OVERLAP, SparseConfig
from ..model.operators import agreed_sizes, expert_grid
from ..runtime.deferred_reads import HostReads
from ..runtime.device_copy import host_copy
from ..runtime.distributed import library_group
from .calibration import DeviceLoss
from .popularity import PopularityTracker, order_experts, reorder_needed
from .schedule import CopyCost, choose_window, copy_budget, measure_copy_bandwidth, plan_window

log = logging.getLogger("torchmoe_ckpt")

_PROBED: dict[str, float] = {}  # the idle copy bandwidth, measured once per process (agreed across ranks)


def _default_overlap(cuda: bool) -> float:
    """SparseConfig.overlap's default: on a CPU copies run beside the step (a whole iteration); on CUDA the prior
    until the device's loss is measured (calibration.py): a side-stream copy slows the step it overlaps."""
    if cuda:
        return CUDA_OVERLAP
    return 1.0


@dataclass
class _Split:
    """A split of `order` into W slots (`plan`), kept to be reused while the order and W stay (_same_split)."""

    order: list[str]  # the operator order it split: the same list object while no reorder happened
    window: int | None  # W
    plan: WindowPlan


class WindowPlanner:
    """Plans the windows of one rank. `agree(value, op)`: a collective over the checkpointer's agree group;
    `group`: the ranks that plan together; `sum_counts`: counts are this rank's own; `cuda`: the default overlap and
    pricing; `reads`: where the routed-token counts are copied to the host (None: the training stream);
    `device_loss`: price auto W by the measured device loss (calibration.py; None: on CUDA with `overlap` None)."""

    def __init__(  # noqa: PLR0913  (the planner's inputs, built in one place: SparseCheckpointer)
        self,
        cfg: SparseConfig,
        ops: list[Operator],
        compute_dtype: torch.dtype,
        group: dist.ProcessGroup | None,
        agree,
        sum_counts: bool,
        rank: int,
        cuda: bool = False,
        reads: HostReads | None = None,
        device_loss: bool | None = None,
    ):
        self.cfg, self.ops, self.compute_dtype, self.group = cfg, ops, compute_dtype, group
        self.overlap = _default_overlap(cuda) if cfg.overlap is None else cfg.overlap
        self.reads = reads
        measured = (cuda and cfg.overlap is None) if device_loss is None else device_loss
        # Auto W only: a forced W has nothing to price.
        self.device_loss = DeviceLoss(cfg.max_step_overhead) if measured and cfg.window is None else None
        self._agree, self.sum_counts, self._rank = agree, sum_counts, rank
        self.op_by_name = {o.name: o for o in ops}
        self.grid = expert_grid(ops)
        n_layers = max((layer + 1 for layer, _ in self.grid), default=1)
        n_experts = max((expert + 1 for _, expert in self.grid), default=1)
        cap = None if cfg.expert_capacity is None else torch.tensor(cfg.expert_capacity, dtype=torch.float64)
        self.tracker = PopularityTracker(n_layers, n_experts, policy=cfg.popularity, decay=cfg.decay, capacity=cap)
        self.pending_counts: list[tuple[torch.Tensor, torch.Tensor]] = []
        # The last window's counts on their way to the host, applied at the next window start (lagging one window).
        self._counts_in_flight: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        self.reorders = 0
        self._order: list[str] | None = None
        self._order_freq: torch.Tensor | None = None
        self._sizes: tuple[dict[str, int], dict[str, int]] | None = None
        # The copy bandwidth: given, or probed once per process when first needed; the prior until copies are seen.
        self.bandwidth: float | None = cfg.bandwidth_bytes_per_s
        self.cost = CopyCost(self.bandwidth or _PROBED.get("bytes_per_s") or 1e9)
        self._prior_known = self.bandwidth is not None or "bytes_per_s" in _PROBED
        self.t_iter: float | None = None
        self.auto_w: int | None = None
        self.next_w: int | None = None  # this rank's proposal for the next window's W (`_agreed_w`, `next_plan`)
        self._w_pending: tuple | None = None  # (async all-reduce, tensor): the next window's agreed W
        self.w_cap: int | None = None  # the largest W under the host-memory limit (None: no limit, or W forced)
        self._warned_unfit = False  # an impossible copy budget is reported once, not every window
        self._last_split: _Split | None = None  # the last split, reused while the order and W stay (_same_split)
        self._w1_order: list[str] | None = None  # a W = 1 plan's operator order (_fixed_order)

    def observe_step(self, seconds: float, counts: torch.Tensor, probs: torch.Tensor, copy_bytes: int = 0) -> None:
        """One iteration: its seconds, routed-token counts and probabilities, and the bytes of the slot copy that
        ran during it (0: none; the device-loss pricing's sample)."""
        self.t_iter = seconds if self.t_iter is None else 0.7 * self.t_iter + 0.3 * seconds
        self.pending_counts.append((counts, probs))  # read at the next window start
        self.cost.observe_step(seconds)
        if self.device_loss is not None:
            self.device_loss.observe(seconds, copy_bytes)

    @property
    def calibrating(self) -> bool:
        """The device-loss pricing still measures the step without copies: capture nothing yet (calibration.py)."""
        return self.device_loss is not None and self.device_loss.calibrating

    def plan(self) -> tuple[WindowPlan, float]:
        """The next window's plan and the copy budget per slot it was priced with (bytes; inf when W is forced).
        Collective over the agree group on every rank's first auto-W plan of a process (`_probe_prior`)."""
        order = self.operator_order()
        full, comp = self.op_sizes()
        self._probe_prior()
        budget, auto_w = float("inf"), None
        if self.cfg.window is None:
            budget = self._copy_budget()
            proposal = choose_window(order, full, comp, budget, self.auto_w, sliding=self.cfg.sliding)
            auto_w = self._agreed_w(min(proposal, self.w_cap or len(order)))
        w = self.cfg.window if auto_w is None else auto_w
        if w == 1:
            order = self._fixed_order(order)
        warn = not self._warned_unfit and self._rank == 0
        plan = self._same_split(order, w, budget)
        if plan is None or (warn and not plan.fits):  # a new order or W (or a warning to give): split anew
            plan = plan_window(
                order,
                full,
                comp,
                budget,
                forced_window=self.cfg.window,
                auto_window=auto_w,
                warn=warn,
                sliding=self.cfg.sliding,
            )
            self._last_split = _Split(order, w, plan)
        self._warned_unfit = self._warned_unfit or not plan.fits
        return plan, budget

    def dense_plan(self) -> tuple[WindowPlan, float]:
        """A dense snapshot's plan: one slot holding the full state of every operator (a W = 1 window). The
        popularity keeps being folded in (the counts of the iterations between snapshots), so that a switch back
        to windows orders them as if windows had run."""
        order = self._fixed_order(self.operator_order())
        full, comp = self.op_sizes()
        if self.device_loss is not None:  # fold the steps since into the cost per byte (bounded, still learned)
            self.device_loss.budget()
        plan = self._same_split(order, 1, float("inf"))
        if plan is None:
            plan = plan_window(order, full, comp, float("inf"), forced_window=1, warn=False)
            self._last_split = _Split(order, 1, plan)
        return plan, float("inf")

    def fold_counts(self) -> None:
        """Between dense snapshots: the routed-token counts queued so far into the popularity (bounded memory over
        a long interval). Collective with `sum_counts`: call at the same iteration on every rank."""
        self._update_popularity()

    def sparse_estimate(self) -> tuple[int, float]:
        """(W, mean slot bytes) the next auto window would take, from what is known now, without side effects (no
        collective, no samples folded): the policy's input. A forced W: that W."""
        order = self._order or [o.name for o in self.ops]
        full, comp = self.op_sizes()
        w = self.cfg.window or self.auto_w
        if w is None:
            budget = self.cost.budget_bytes(self.overlap) if self.cost.t_iter else float("inf")
            w = choose_window(order, full, comp, budget, sliding=self.cfg.sliding)
        w = min(w, len(order), self.w_cap or len(order))
        plan = plan_window(order, full, comp, float("inf"), forced_window=w, warn=False, sliding=self.cfg.sliding)
        return w, sum(sl.bytes for sl in plan.slots) / plan.window

    def probe_prior(self) -> None:
        """The idle copy bandwidth as the copy cost's prior (`_probe_prior`); collective the first time."""
        self._probe_prior()

    def _probe_prior(self) -> None:
        """Measure the idle copy bandwidth, the copy cost's prior until copies under training are seen, once per
        process: the probe copies real bytes and takes a while, and a restart in the same process (a new
        checkpointer after a recovery) prices with what the first one measured. Agreed to the slowest rank's
        figure, so that every rank prices the same W. Only for an auto W priced by what copies cost (no
        `window`, no `bandwidth_bytes_per_s`); collective (agree group) the first time, on every rank alike."""
        if self._prior_known or self.cfg.window is not None or self.cfg.bandwidth_bytes_per_s is not None:
            return
        if "bytes_per_s" not in _PROBED:
            _PROBED["bytes_per_s"] = self._agree(measure_copy_bandwidth(), dist.ReduceOp.MIN)
        self.bandwidth = _PROBED["bytes_per_s"]
        self.cost.prior_s_per_byte = 1.0 / self.bandwidth
        self._prior_known = True

    def _copy_budget(self) -> float:
        """Bytes one slot may copy: priced by what copies cost under training, or by the given bandwidth."""
        if self.device_loss is not None:  # what the device loses, measured (calibration.py)
            measured = self.device_loss.budget()
            bound = (
                self.cost.budget_bytes(1.0)
                if self.cfg.bandwidth_bytes_per_s is None
                else copy_budget(self.t_iter, self.cfg.bandwidth_bytes_per_s, 1.0)  # pyright: ignore[reportArgumentType]
            )  # a copy longer than the step would make the update wait, whatever the rule says
            if measured is None:  # no copy measured yet: the prior share of the step
                return bound * self.overlap
            return min(measured, bound)
        if self.cfg.bandwidth_bytes_per_s is None:
            return self.cost.budget_bytes(self.overlap)
        return copy_budget(self.t_iter, self.cfg.bandwidth_bytes_per_s, self.overlap)  # pyright: ignore[reportArgumentType]  (after_step observes a step before any plan)

    def _fixed_order(self, order: list[str]) -> list[str]:
        """A W = 1 plan's order: the operators as the model declares them, the same list while the set is the same.
        Its one slot holds every operator's full state, so the popularity order changes nothing in it; a fixed
        order keeps its plan, slot files, their mapping and layout window after window (a reorder would rebuild
        them: the W = 1 snapshot then cost ~2x a plain dense snapshot, bench policy_sweep)."""
        names = set(order)
        if self._w1_order is None or set(self._w1_order) != names:
            rank = {o.name: i for i, o in enumerate(self.ops)}
            self._w1_order = sorted(order, key=lambda n: rank.get(n, len(rank)))
        return self._w1_order

    def _same_split(self, order: list[str], w: int | None, budget: float) -> WindowPlan | None:
        """The last plan again when the order (the same list object) and W are unchanged, re-priced for `budget`
        (only `fits` depends on it): splitting anew costs ~1 ms per window start. None: split anew."""
        last = self._last_split
        if last is None or last.order is not order or last.window != w:
            return None
        return replace(last.plan, budget_bytes=float(budget), fits=all(s.bytes <= budget for s in last.plan.slots))

    def _agreed_w(self, proposal: int) -> int:
        """The largest W any rank proposed, agreed asynchronously during the window before (no rank waits here)."""
        if self._w_pending is None:
            auto_w = int(self._agree(float(proposal), dist.ReduceOp.MAX, self.group))
        else:
            work, agreed = self._w_pending
            if work is not None:
                work.wait()
            auto_w = int(agreed.item())
        nxt = torch.tensor([float(proposal)], dtype=torch.float64)
        work = (
            dist.all_reduce(nxt, op=dist.ReduceOp.MAX, group=library_group(self.group), async_op=True)
            if dist.is_initialized()
            else None
        )
        self._w_pending = (work, nxt)
        self.auto_w = auto_w
        self.next_w = proposal
        return auto_w

    def next_plan(self, plan: WindowPlan) -> WindowPlan | None:
        """The plan the next window will likely take when its W grows past `plan`'s: the same order and budget,
        split with the W this rank just proposed for it (`_agreed_w`: agreed as the MAX over ranks, so at least
        this one; on one rank exactly it). None: W forced, or not growing. What the slot allocator pins ahead, a
        window early and off the training thread (slot_pool.prepare), instead of at the next window start."""
        if self.cfg.window is not None or self.next_w is None or self.next_w <= plan.window:
            return None
        full, comp = self.op_sizes()
        return plan_window(
            list(plan.order),
            full,
            comp,
            plan.budget_bytes,
            auto_window=self.next_w,
            warn=False,
            sliding=self.cfg.sliding,
        )

    def _update_popularity(self) -> None:
        """Queue the last window's counts for the host (no sync) and apply the ones queued a window ago (summed over
        the group with `sum_counts`), iteration by iteration as if applied when each ran."""
        pending, self.pending_counts = self.pending_counts, []
        ready, self._counts_in_flight = self._counts_in_flight, None
        if pending:
            stats = torch.stack([torch.stack([c.double(), p.double()]) for c, p in pending])  # [n, 2, L, E]
            if self.reads is not None:  # the copy stream (reads_on_copy_stream) or the training stream
                self._counts_in_flight = (self.reads.copy(stats), self.reads.landed() if stats.is_cuda else None)
            else:
                landed = torch.cuda.Event() if stats.is_cuda else None
                self._counts_in_flight = (host_copy(stats), landed)  # CUDA: queued into pinned memory, no host sync
                if landed is not None:
                    landed.record()
        if ready is None:
            return
        stats, landed = ready
        if landed is not None:
            landed.synchronize()  # recorded a whole window ago
        if self.sum_counts and dist.is_initialized():
            dist.all_reduce(stats, group=library_group(self.group))
        for s in stats:
            self.tracker.update(s[0], s[1])

    def operator_order(self) -> list[str]:
        self._update_popularity()
        freq = self.tracker.frequencies()
        if self._order is None or reorder_needed(
            self._order_freq, freq, self.cfg.reorder_change, self.cfg.reorder_fraction
        ):
            if self._order is not None:
                self.reorders += 1
            ranked = [self.grid[le] for le in order_experts(self.tracker.scores()) if le in self.grid]
            # A merged operator (a layer's experts as one) goes where its most popular expert goes: its max.
            experts = list(reversed(dict.fromkeys(reversed(ranked))))
            routers = [o.name for o in self.ops if o.kind == "router"]
            dense = [o.name for o in self.ops if o.kind == "dense"]
            self._order, self._order_freq = experts + routers + dense, freq.clone()
        return self._order

    def op_sizes(self) -> tuple[dict[str, int], dict[str, int]]:
        if self._sizes is None:
            self._sizes = agreed_sizes(self.op_by_name, self.compute_dtype, self.group)
        return self._sizes

    def cap_by_memory(self, memory, replicator) -> None:
        """The host-memory limit against the plan's worst case, before training: sets `w_cap` (or raises)."""
        if memory.limit is None:
            return
        saved = self._order, self._order_freq  # the first window plans as it would without a limit
        order, (full, comp) = self.operator_order(), self.op_sizes()
        self._order, self._order_freq = saved
        # Reorders permute the experts: the worst case puts those with the most local compute bytes last.
        tail = {o.name for o in self.ops if o.kind in ("router", "dense")}
        local = {o.name: o.compute_bytes(self.compute_dtype.itemsize) for o in self.ops}
        worst = sorted((n for n in order if n not in tail), key=local.__getitem__) + [n for n in order if n in tail]
        max_w = choose_window(order, full, comp, 0.0)  # the largest W Algorithm 1 can choose (its budget floor)
        if self.cfg.max_window is not None:
            max_w = min(max_w, self.cfg.max_window)
        pairs = () if replicator is None else replicator.pairs
        senders = sum(1 for _s, dst, replica in pairs if dst == self._rank and not replica)
        self.w_cap = memory.check(
            lambda w: plan_window(worst, full, comp, float("inf"), forced_window=w, warn=False),
            self.cfg.window,
            max_w,
            lambda x, op: self._agree(float(x), dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX, self.group),
            senders=senders,
        )

    def floor_slot_bytes(self) -> int:
        """The largest slot of the largest W Algorithm 1 can choose: the least any window needs per slot (device
        staging's possibility check). Collective the first time (agreed operator sizes)."""
        order = [o.name for o in self.ops if o.kind == "expert"]
        order += [o.name for o in self.ops if o.kind != "expert"]
        full, comp = self.op_sizes()
        w = choose_window(order, full, comp, 0.0)
        return plan_window(order, full, comp, float("inf"), forced_window=w, warn=False).worst_slot_bytes

    def inherit(self, old: WindowPlanner) -> None:
        """What copies cost is learned once, not per restart."""
        self.cost, self.auto_w = old.cost, old.auto_w
        if old.device_loss is not None and self.device_loss is not None:
            self.device_loss = old.device_loss
        self._prior_known = self._prior_known or old._prior_known
        self.bandwidth = self.bandwidth or old.bandwidth
        self.reorders += old.reorders
