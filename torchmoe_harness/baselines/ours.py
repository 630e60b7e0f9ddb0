"""Our sparse per-iteration checkpointer behind the baselines' interface (recovery in process: sparse-to-dense
from the newest committed window, or with `sliding` from the newest W consecutive slots: exact)."""

from __future__ import annotations

import time

from torchmoe_ckpt.config import SparseConfig
from torchmoe_ckpt.sparse_checkpointer import SparseCheckpointer


class Ours:
    exact = True

    def __init__(
        self,
        trainer,
        window: int | None = 4,
        overlap: float | None = None,
        bandwidth_bytes_per_s: float | None = None,
        throttle_bytes_per_s: float | None = None,
        sliding: bool = False,
        config: dict | None = None,
        skip_copies: bool = False,
        host_root: str | None = None,
        restart_s: float | None = None,
    ):
        """`config`: more SparseConfig fields (the GPU check's ablations switch one fix on at a time; the policy
        sweep's `policy`, `mtbf`); `skip_copies`: the copy path runs without copying (SnapshotEngine.skip_copies:
        isolates its Python); `host_root`: the host tier under this directory (/dev/shm: slot files a kill -9
        leaves, as in a real run; None: slots in this process only); `restart_s`: what a restart costs here (the
        policy's input, which a real run measures at its restart: an in-place recovery is the emulated restart, so
        each one's measured seconds replace it)."""
        self.cfg = SparseConfig(
            window=window,
            overlap=overlap,
            bandwidth_bytes_per_s=bandwidth_bytes_per_s,
            sliding=sliding,
            **(config or {}),
        )
        self.throttle = throttle_bytes_per_s  # an emulated slower host link (SnapshotEngine.throttle_bytes_per_s)
        self.skip_copies = skip_copies
        self.host_root, self.restart_s = host_root, restart_s
        self.tiers = None
        if host_root is not None:
            import torch.distributed as dist

            from torchmoe_ckpt.persist.build_tiers import build_tiers

            rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
            self.tiers = build_tiers({"root": host_root, "run_id": "ours", "ranks_per_node": world}, rank, world)
        self.ck = self._checkpointer(trainer)
        self._attached = None

    def _checkpointer(self, trainer) -> SparseCheckpointer:
        from torchmoe_ckpt.sparse_checkpointer import RunContext

        ck = SparseCheckpointer(
            trainer.model, trainer.optimizer, trainer.compute_dtype, self.cfg, RunContext(tiers=self.tiers)
        )
        ck.engine.throttle_bytes_per_s = self.throttle
        if self.restart_s is not None:
            ck.restart_s = self.restart_s
        if self.skip_copies:
            ck.engine.skip_copies = True
        return ck

    def attach(self, trainer) -> Ours:
        if self._attached is not trainer and self.ck.before_update not in trainer.before_update:
            self.ck.attach(trainer)
        self._attached = trainer
        return self

    def after_step(self, trainer, res) -> None:
        self.ck.after_step(res)

    def recover(self, trainer, failed_at: int):
        """Sparse-to-dense from the newest committed window in host memory into `trainer`, whose state was lost
        in place (common.lose_state); the checkpointer carries on with its buffers. With no window committed
        yet, a new trainer from the deterministic initialisation and a new checkpointer."""
        t0 = time.perf_counter()
        rep = self.ck.recover_in_memory(trainer)
        if rep is not None and self.restart_s is not None:
            self.restart_s = self.ck.restart_s = rep.seconds  # this restart's measured cost, as a restart reports it
        if rep is None:
            from torchmoe_harness.baselines.dense_dcp import fresh_trainer_plain

            self.ck.abandon()
            trainer = fresh_trainer_plain(trainer.cfg)
            self.ck = self._checkpointer(trainer).inherit_counters(self.ck)
            self._attached = None
            return trainer, {
                "recovered_step": 0,
                "seconds": time.perf_counter() - t0,
                "phases": {"rebuild": time.perf_counter() - t0},
            }
        return trainer, {
            "recovered_step": rep.recovered_step,
            "seconds": time.perf_counter() - t0,
            "replayed_iterations": rep.replayed_iterations,
            "window": rep.window,
            "bytes_loaded": rep.bytes_loaded,
            "phases": rep.phases.to_dict(),
        }

    def close(self) -> None:
        self.ck.close()

    def stats(self) -> dict:
        s = self.ck.stats()
        w = s["windows"][-1]["W"] if s["windows"] else None
        windows = [x.W for x in self.ck.counters.windows]
        return {
            "windows_W": windows,  # every window's W, in order (auto W may change it)
            "copy": s["copy"],
            "checkpoints": s["slots_captured"],
            "interval": w,
            "window": w,
            "wait_seconds_total": s["wait_seconds_total"],
            "wait_seconds_max": s["wait_seconds_max"],
            "bytes_per_checkpoint": s["mean_slot_bytes"],
            "dense_bytes": s["dense_bytes"],
            # a whole window's mean slot (what an iteration copies in steady state), as planned
            "planned_mean_slot_bytes": s["windows"][-1]["mean_slot_bytes"] if s["windows"] else None,
            "policy": s.get("policy"),  # the policy in force, its W or k, each candidate's predicted ETTR, why
            "host_tier": s.get("host_tier"),
        }
