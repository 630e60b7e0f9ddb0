"""WindowPlanner: what the next window holds, the same on every rank of the planning group.

At each window start the checkpointer asks for a plan. The planner orders the operators (experts by popularity,
re-sorted only when the reorder rule fires, then routers and dense blocks), prices a slot's copy budget from what
copies cost under training (or a given bandwidth), picks W (Algorithm 1; forced when configured; the largest any
rank proposes, agreed in the background during the window before) and returns the slot plan
(schedule.plan_window). It also gives the largest W a host-memory limit allows (checked once, at construction).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .config import CUDA_OVERLAP, SparseConfig
from .distributed import library_group
from .operators import Operator, agreed_sizes, expert_grid
from .popularity import PopularityTracker, order_experts, reorder_needed
from .schedule import CopyCost, WindowPlan, choose_window, copy_budget, measure_copy_bandwidth, plan_window

log = logging.getLogger("torchmoe_ckpt")

_PROBED: dict[str, float] = {}  # the idle copy bandwidth, measured once per process (agreed across ranks)


class WindowPlanner:
    """Plans the windows of one rank. `agree(value, op)`: a collective over the ranks that agree on the copy
    bandwidth (the checkpointer's agree group); `group`: the ranks that plan together (same operators);
    `sum_counts`: the routed-token counts given to `add_counts` are this rank's own (summed over `group` here);
    `cuda`: the model is on CUDA (the default copy budget, SparseConfig.overlap)."""

    def __init__(
        self,
        cfg: SparseConfig,
        ops: list[Operator],
        compute_dtype: torch.dtype,
        group: dist.ProcessGroup | None,
        agree,
        sum_counts: bool,
        rank: int,
        cuda: bool = False,
    ):
        self.cfg, self.ops, self.compute_dtype, self.group = cfg, ops, compute_dtype, group
        self.overlap = cfg.overlap if cfg.overlap is not None else CUDA_OVERLAP if cuda else 1.0
        self._agree, self.sum_counts, self._rank = agree, sum_counts, rank
        self.op_by_name = {o.name: o for o in ops}
        self.grid = expert_grid(ops)
        n_layers = 1 + max((layer for layer, _ in self.grid), default=-1)
        n_experts = 1 + max((e for _, e in self.grid), default=-1)
        cap = None if cfg.expert_capacity is None else torch.tensor(cfg.expert_capacity, dtype=torch.float64)
        self.tracker = PopularityTracker(
            max(n_layers, 1), max(n_experts, 1), policy=cfg.popularity, decay=cfg.decay, capacity=cap
        )
        # Routed-token counts per iteration, left on the device until the next window start needs the popularity.
        self.pending_counts: list[tuple[torch.Tensor, torch.Tensor]] = []
        # The last window's counts on their way to the host (CUDA: a pinned copy and its event), applied at the
        # next window start: the popularity lags one window, so reading it never waits for the device.
        self._counts_in_flight: tuple[torch.Tensor, object] | None = None
        self.reorders = 0
        self._order: list[str] | None = None
        self._order_freq: torch.Tensor | None = None
        self._sizes: tuple[dict[str, int], dict[str, int]] | None = None
        # The copy bandwidth: given, or probed when a window is first priced without it (once per process, agreed
        # across ranks; never on a recovery's path). It is the prior until copies under training are observed.
        self.bandwidth: float | None = cfg.bandwidth_bytes_per_s
        self.cost = CopyCost(self.bandwidth or _PROBED.get("bytes_per_s") or 1e9)
        self._prior_known = self.bandwidth is not None or "bytes_per_s" in _PROBED
        self.t_iter: float | None = None
        self.auto_w: int | None = None
        self._w_pending: tuple | None = None  # (async all-reduce, tensor): the next window's agreed W
        self.w_cap: int | None = None  # the largest W under the host-memory limit (None: no limit, or W forced)
        self._warned_unfit = False  # an impossible copy budget is reported once, not every window
        self._last_split: tuple[list[str], int, WindowPlan] | None = None  # (order, W, plan): see _same_split

    # ---- what training tells the planner -------------------------------------------------------------
    def observe_step(self, seconds: float, counts: torch.Tensor, probs: torch.Tensor) -> None:
        self.t_iter = seconds if self.t_iter is None else 0.7 * self.t_iter + 0.3 * seconds
        self.pending_counts.append((counts, probs))  # read at the next window start
        self.cost.observe_step(seconds)

    def observe_copy(self, nbytes: int, wall_s: float, wait_s: float) -> None:
        self.cost.observe_copy(nbytes, wall_s, wait_s)

    # ---- the plan ----------------------------------------------------------------------------------------
    def plan(self) -> tuple[WindowPlan, float]:
        """The next window's plan and the copy budget per slot it was priced with (bytes; inf when W is forced)."""
        order = self.operator_order()
        full, comp = self.op_sizes()
        budget, auto_w = float("inf"), None
        if self.cfg.window is None:
            if self.cfg.bandwidth_bytes_per_s is None:  # priced by what copies cost under training
                if not self._prior_known:
                    self._probe_prior()
                budget = self.cost.budget_bytes(self.overlap)
            else:
                budget = copy_budget(self.t_iter, self.bandwidth, self.overlap)
            auto_w = self._agreed_w(
                min(
                    choose_window(order, full, comp, budget, self.auto_w, sliding=self.cfg.sliding),
                    self.w_cap or len(order),
                )
            )
        w = self.cfg.window if auto_w is None else auto_w
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
            self._last_split = (order, w, plan)
        self._warned_unfit = self._warned_unfit or not plan.fits
        return plan, budget

    def _same_split(self, order: list[str], w: int, budget: float) -> WindowPlan | None:
        """The last plan again when neither the order (the same list: it is replaced at a reorder) nor W changed:
        a forced or agreed W splits on W and the order alone (schedule.plan_window), only `fits` depends on the
        budget. Saves the split's search at every window start (~1 ms; every iteration at W = 1)."""
        if self._last_split is None:
            return None
        last_order, last_w, last = self._last_split
        if last_order is not order or last_w != w:
            return None
        fits = all(s.bytes <= budget for s in last.slots)
        return WindowPlan(last.slots, float(budget), fits, last.order, last.sliding)

    def _agreed_w(self, proposal: int) -> int:
        """Every rank plans the same window: W is the largest any rank proposed. Proposals are agreed in the
        background during the window before (an async 8-byte all-reduce), so no rank waits here for a slower one;
        only the first window agrees on the spot."""
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
        return auto_w

    def _update_popularity(self) -> None:
        """The routed-token counts of the iterations of the window before the last one, into the popularity
        tracker. At each window start the last window's counts are stacked and queued for the host (CUDA: a
        non-blocking copy into pinned memory: no host sync), and the ones queued at the window start before are
        applied: long landed, so nothing waits. Applying means summing over the planning group's ranks with
        `sum_counts` (one collective on the library's gloo group), then iteration by iteration, in order, exactly
        as if each had been applied when it ran (counts are whole numbers). Every rank lags by the same window."""
        pending, self.pending_counts = self.pending_counts, []
        ready, self._counts_in_flight = self._counts_in_flight, None
        if pending:
            stats = torch.stack([torch.stack([c.double(), p.double()]) for c, p in pending])  # [n, 2, L, E]
            if stats.is_cuda:
                host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
                host.copy_(stats, non_blocking=True)
                landed = torch.cuda.Event()
                landed.record()
                self._counts_in_flight = (host, landed)
            else:
                self._counts_in_flight = (stats.cpu(), None)
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
            experts = [self.grid[le] for le in order_experts(self.tracker.scores()) if le in self.grid]
            routers = [o.name for o in self.ops if o.kind == "router"]
            dense = [o.name for o in self.ops if o.kind == "dense"]
            self._order, self._order_freq = experts + routers + dense, freq.clone()
        return self._order

    def op_sizes(self) -> tuple[dict[str, int], dict[str, int]]:
        # Sizes never change during a run: agreed once (one collective), not at every window.
        if self._sizes is None:
            self._sizes = agreed_sizes(self.op_by_name, self.compute_dtype, self.group)
        return self._sizes

    def _probe_prior(self) -> None:
        """Measure the idle copy bandwidth once per process (slowest rank's), the price until copies are seen."""
        if "bytes_per_s" not in _PROBED:
            _PROBED["bytes_per_s"] = self._agree(measure_copy_bandwidth(), dist.ReduceOp.MIN)
        self.bandwidth = _PROBED["bytes_per_s"]
        self.cost.prior_s_per_byte = 1.0 / self.bandwidth
        self._prior_known = True

    # ---- the host-memory limit ---------------------------------------------------------------------------
    def cap_by_memory(self, memory, replicator) -> None:
        """The limit against the worst case of the plan, before training (host_memory.py): sets `w_cap`, the
        largest W auto mode may choose under it (agreed over the planning ranks); None when there is no limit or
        W is forced. Raises HostMemoryLimitError with the figure when no window fits."""
        if memory.limit is None:
            return
        saved = self._order, self._order_freq  # the first window plans as it would without a limit
        order, (full, comp) = self.operator_order(), self.op_sizes()
        self._order, self._order_freq = saved
        # Reorders permute the experts (routers and dense blocks stay last). Plans use sizes agreed over the ranks,
        # so the slot boundaries stay, but which experts this rank holds most of moves: the worst case puts those
        # with the most local compute bytes last (frozen in the most slots).
        tail = {o.name for o in self.ops if o.kind in ("router", "dense")}
        itemsize = torch.empty((), dtype=self.compute_dtype).element_size()
        local = {o.name: o.compute_bytes(itemsize) for o in self.ops}
        worst = sorted((n for n in order if n not in tail), key=local.__getitem__) + [n for n in order if n in tail]

        def plans(w: int) -> WindowPlan:
            return plan_window(worst, full, comp, float("inf"), forced_window=w, warn=False)

        max_w = choose_window(order, full, comp, 0.0)  # the largest W Algorithm 1 can choose (its budget floor)
        if self.cfg.max_window is not None:
            max_w = min(max_w, self.cfg.max_window)
        me = self._rank
        senders = (
            0 if replicator is None else sum(1 for _s, dst, replica in replicator.pairs if dst == me and not replica)
        )
        self.w_cap = memory.check(
            plans,
            self.cfg.window,
            max_w,
            lambda x, op: self._agree(float(x), dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX, self.group),
            senders=senders,
        )

    def inherit(self, old: WindowPlanner) -> None:
        """What copies cost is learned once, not per restart."""
        self.cost, self.auto_w = old.cost, old.auto_w
        self._prior_known = self._prior_known or old._prior_known
        self.bandwidth = self.bandwidth or old.bandwidth
        self.reorders += old.reorders
