"""Partial expert checkpoints (the machinery PEC/MoC and MoEtion share): per operator a host buffer with the
iteration it was last saved at; each checkpoint copies all non-expert operators and the experts a policy
selects, off the training thread (the same SnapshotEngine as our slots). Recovery loads every operator's
newest saved copy into a fresh trainer: a *mixed-age* model, lossy for every expert not saved at the
recovery point.

Lost-token accounting (PEC's PLT): per (MoE layer, expert) the tokens routed to it since its last save
(global counts, identical on every rank, so selection is too). Recovering from checkpoint s loses, per
expert, the tokens of iterations (s_e, s]; PLT = tokens lost / expert tokens processed (tokens x top-k,
summed over MoE layers)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from torchmoe_ckpt.capture.snapshot import SnapshotEngine, StateAccess
from torchmoe_ckpt.core.slot import Slot, build_slot
from torchmoe_ckpt.model.operators import discover_operators, expert_grid
from torchmoe_harness.baselines.common import HostCopyBaseline, Timer, restored_trainer, rng_state


class PartialExperts(HostCopyBaseline):
    exact = False

    def __init__(self, trainer, every: int = 1):
        self.every = every
        ops = discover_operators(trainer.model)
        self.op_by_name = {o.name: o for o in ops}
        self.grid = expert_grid(ops)  # (moe layer, expert) -> operator name
        self.n_layers = 1 + max(layer for layer, _ in self.grid)
        self.n_experts = 1 + max(e for _, e in self.grid)
        self.always = tuple(o.name for o in ops if o.kind != "expert")
        self.engine = SnapshotEngine(StateAccess(trainer.model, trainer.optimizer))  # on the model's device
        pin = self.engine.use_cuda  # pinned host buffers on a GPU, as our slots
        self.bufs = {
            o.name: build_slot(0, (o.name,), (), self.op_by_name, trainer.compute_dtype, pin_memory=pin) for o in ops
        }
        # bytes of one expert's full state (max over ranks: selection must be identical everywhere)
        t = torch.tensor([max(self.op_by_name[n].full_bytes() for n in self.grid.values())], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        self.expert_bytes = float(t)
        self.saved_at: dict[str, int] = {}  # operator -> iteration of its host copy
        self.unsaved = torch.zeros(self.n_layers, self.n_experts, dtype=torch.float64)
        self._counts: list[torch.Tensor] = []  # routed-token counts since the last fold, where the model made them
        self.latest = None  # (step, rng, tokens lost if recovering there)
        self.pending = None
        self.wait = Timer()
        self.checkpoints = 0
        self.bytes: list[int] = []
        self.tokens_processed = 0.0
        self.tokens_lost = 0.0

    # ---- policy (subclasses) ---------------------------------------------------------------------------
    def select(self) -> list[tuple[int, int]]:
        raise NotImplementedError

    def on_recovered(self) -> None:
        pass

    # ---- hooks -----------------------------------------------------------------------------------------
    def before_update(self, until_done: bool = False) -> None:
        if self._wait_for_copy(until_done):
            slot, step, rng, lost = self.pending
            for name in slot.active:
                self.saved_at[name] = step
            self.latest, self.pending = (step, rng, lost), None

    def _fold_counts(self) -> None:
        """The counts since the last checkpoint into `unsaved`: read once per checkpoint, not per iteration."""
        if self._counts:
            counts = torch.stack(self._counts).double().sum(0).cpu()
            self._counts = []
            self.unsaved += counts
            self.tokens_processed += float(counts.sum())

    def after_step(self, trainer, res) -> None:
        self._counts.append(res.expert_counts)
        if trainer.step % self.every:
            return
        self._fold_counts()
        self.before_update(until_done=True)
        chosen = self.select()
        for le in chosen:
            self.unsaved[le] = 0.0
        names = self.always + tuple(self.grid[le] for le in chosen)
        items = [it for n in names for it in self.bufs[n].items]
        slot = Slot(self.checkpoints, names, (), items)
        t0 = time.perf_counter()
        self.engine.capture(slot, trainer.step)
        self.wait.add(t0)
        # tokens lost if we recover from this checkpoint: what the experts not saved now still miss
        self.pending = (slot, trainer.step, rng_state(), float(self.unsaved.sum()))
        self.checkpoints += 1
        self.bytes.append(slot.nbytes)

    def recover(self, trainer, failed_at: int):
        self.engine.shutdown()
        t0 = time.perf_counter()
        self._fold_counts()
        self.pending = None  # an in-flight copy is torn by the crash
        if self.latest is None:
            from torchmoe_harness.baselines.dense_dcp import fresh_trainer_plain

            fresh, step, lost = fresh_trainer_plain(trainer.cfg), 0, 0.0
            self.saved_at.clear()
        else:
            step, rng, lost = self.latest
            order = sorted(self.saved_at, key=self.saved_at.get)  # oldest first: shared step counters end newest
            fresh = restored_trainer(trainer, [self.bufs[n] for n in order], step, rng)
        # Expert updates not in the checkpoint are gone: the unsaved counts restart from what was lost.
        self.tokens_lost += lost
        self.unsaved.zero_()
        self.engine = SnapshotEngine(StateAccess(fresh.model, fresh.optimizer))
        self.on_recovered()
        stale = [step - self.saved_at.get(n, 0) for n in self.grid.values()]
        return fresh, {
            "recovered_step": step,
            "seconds": time.perf_counter() - t0,
            "tokens_lost": lost,
            "stale_experts": sum(1 for s in stale if s > 0),
            "max_expert_staleness": max(stale, default=0),
        }

    def close(self) -> None:
        self.before_update(until_done=True)
        self._fold_counts()
        self.engine.shutdown()

    def stats(self) -> dict:
        return {
            "checkpoints": self.checkpoints,
            "interval": self.every,
            "wait_seconds_total": self.wait.total,
            "wait_seconds_max": self.wait.max,
            "bytes_per_checkpoint": sum(self.bytes) / len(self.bytes) if self.bytes else None,
            "dense_bytes": sum(b.nbytes for b in self.bufs.values()),
            "tokens_lost": self.tokens_lost,
            "tokens_processed": self.tokens_processed,
            "plt": self.tokens_lost / self.tokens_processed if self.tokens_processed else 0.0,
        }
