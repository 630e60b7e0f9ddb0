"""Dense DCP checkpoints every k iterations, on the same storage code as our dense exports:
sync  `dcp.save` of the whole state in the critical path (PC_disk / CheckFreq without pipelining);
async `dcp.async_save` through `DenseExporter` (staging copy on the training thread, write behind).

Recovery: the newest export whose `.metadata` exists (DCP's commit) on every rank, loaded into a fresh
trainer with `load_dense` (FSDP2's own load path); the RNG state of that step comes from a small per-rank
file written next to it. Exact: everything after the export is recomputed from the deterministic data."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from torchmoe_ckpt.dcp.dense_export import METADATA, DenseExporter, export_dense, load_dense, step_dirname
from torchmoe_harness.baselines.common import Timer, restore_rng, rng_state


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class DenseDcp:
    exact = True

    def __init__(self, trainer, workdir: str, every: int = 4, asynchronous: bool = False, keep: int = 2):
        self.root = Path(workdir) / ("dcp_async" if asynchronous else "dcp_sync")
        self.root.mkdir(parents=True, exist_ok=True)
        self.every, self.asynchronous, self.keep = every, asynchronous, keep
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.exporter = DenseExporter(f"file://{self.root}", every=every, keep=keep) if asynchronous else None
        self.wait = Timer()
        self.checkpoints = 0
        self.bytes: list[int] = []

    def attach(self, trainer) -> DenseDcp:
        return self

    def after_step(self, trainer, res) -> None:
        step = trainer.step
        if step % self.every:
            return
        t0 = time.perf_counter()
        if self.asynchronous:
            self.exporter.export(trainer.model, trainer.optimizer, step)
        else:
            export_dense(trainer.model, trainer.optimizer, f"file://{self.root / step_dirname(step)}", step)
        torch.save(rng_state(), self.root / f"rng-{step}-rank{self.rank}.pt")
        self.wait.add(t0)
        self.checkpoints += 1
        if not self.asynchronous and self.rank == 0:
            self.bytes.append(_dir_bytes(self.root / step_dirname(step)) // self.world)
            self._prune()

    def _prune(self) -> None:
        done = sorted(self._complete())
        for old in done[: -self.keep]:
            import shutil

            shutil.rmtree(self.root / step_dirname(old), ignore_errors=True)

    def _complete(self) -> list[int]:
        return [int(p.name.split("-")[1]) for p in self.root.glob("step-*") if (p / METADATA).exists()]

    def recover(self, trainer, failed_at: int):
        # What is durable at the crash: exports whose metadata exists now (an in-flight one is lost).
        done = torch.tensor([max(self._complete(), default=0)], dtype=torch.int64)
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        step = int(done)
        if self.exporter is not None and self.exporter._future is not None:
            # Join the background writer of the lost export (not part of recovery), without its retention: that
            # would delete the export chosen above, which is older than the one just finished.
            keep, self.exporter.keep = self.exporter.keep, 0
            self.exporter.wait()
            self.exporter.keep = keep
            if self.rank == 0 and self.exporter.exported:
                self.bytes.append(_dir_bytes(self.root / step_dirname(self.exporter.exported[-1])) // self.world)
        t0 = time.perf_counter()
        cfg = trainer.cfg
        del trainer
        fresh = fresh_trainer_plain(cfg) if step == 0 else fresh_trainer_from(cfg)
        if step:
            fresh.set_step(load_dense(fresh.model, fresh.optimizer, f"file://{self.root / step_dirname(step)}"))
            restore_rng(torch.load(self.root / f"rng-{step}-rank{self.rank}.pt", map_location="cpu"))
        return fresh, {"recovered_step": step, "seconds": time.perf_counter() - t0}

    def close(self) -> None:
        if self.exporter is not None:
            had = self.exporter._future is not None
            self.exporter.wait()
            if had and self.rank == 0 and self.exporter.exported:
                self.bytes.append(_dir_bytes(self.root / step_dirname(self.exporter.exported[-1])) // self.world)

    def stats(self) -> dict:
        out = {
            "checkpoints": self.checkpoints,
            "interval": self.every,
            "wait_seconds_total": self.wait.total,
            "wait_seconds_max": self.wait.max,
            "bytes_per_checkpoint": sum(self.bytes) / len(self.bytes) if self.bytes else None,
        }
        if self.exporter is not None:
            out["export_s_max"] = max(self.exporter.export_seconds, default=0.0)
        return out


def fresh_trainer_plain(cfg):
    from torchmoe_harness.trainer import Trainer

    return Trainer(cfg)  # nothing durable yet: start over from the deterministic initialisation


def fresh_trainer_from(cfg):
    from torchmoe_harness.trainer import Trainer

    return Trainer(cfg, init_seed=cfg.seed + 7777)
