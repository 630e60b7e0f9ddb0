"""Dense DCP checkpoints every k iterations, on the same storage code as our dense exports:
sync  `dcp.save` of the whole state in the critical path (PC_disk / CheckFreq without pipelining);
async `dcp.async_save` through `DenseExporter`, staged as TorchTitan's `async_mode = "async_with_pinned_mem"`
      stages: DCP's `DefaultStager` copies the state into pinned shared memory on a stream of its own, in a
      background thread (`use_async_staging`, `use_non_blocking_copy`), and the training thread waits for that
      staging only before the next optimizer step would overwrite its sources (TorchTitan's
      `maybe_wait_for_staging`), then the write goes on behind. On a CPU (no pinned memory, no streams) the same
      stager copies in its background thread with plain copies.

Recovery: the newest export whose `.metadata` exists (DCP's commit) on every rank, loaded into a fresh
trainer with `load_dense` (FSDP2's own load path); the RNG state of that step comes from a small per-rank
file written next to it. Exact: everything after the export is recomputed from the deterministic data."""

from __future__ import annotations

import threading
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
        self.stager = pinned_stager(trainer.device) if asynchronous else None
        self.exporter = (
            DenseExporter(f"file://{self.root}", every=every, keep=keep, async_stager=self.stager)
            if asynchronous
            else None
        )
        self.wait = Timer()  # the training thread's waits: the save call, and the staging before an update
        self.checkpoints = 0
        self.bytes: list[int] = []
        self.state_bytes = 0  # tensor bytes of one staged state (model + optimizer, this rank)
        self.stage_seconds: list[float] = []  # save call to staging done (the device-to-host copy), per checkpoint
        self.commit_lag_s: list[float] = []  # async: staged (training goes on) to durable, per export

    def attach(self, trainer) -> DenseDcp:
        if self.asynchronous and self.before_update not in trainer.before_update:
            trainer.before_update.append(self.before_update)
        return self

    def before_update(self) -> None:
        """The next update overwrites what the staging copy reads: wait for the staging in flight to finish."""
        fut = getattr(self.exporter._future, "staging_completion", None)
        if fut is not None and not fut.done():
            t0 = time.perf_counter()
            fut.result()
            self.wait.add(t0)

    def after_step(self, trainer, res) -> None:
        step = trainer.step
        if step % self.every:
            return
        t0 = time.perf_counter()
        if self.asynchronous:
            self.exporter.wait()  # one save at a time (export waits here too): the last staging is over
            if single_use(self.stager):
                self.stager.close()
                self.stager = self.exporter.async_stager = pinned_stager(trainer.device)
            t_stage = time.perf_counter()
            self.exporter.export(trainer.model, trainer.optimizer, step)
            fut = getattr(self.exporter._future, "staging_completion", None)
            if fut is not None:
                fut.add_done_callback(lambda _f: self.stage_seconds.append(time.perf_counter() - t_stage))
            if not self.state_bytes:
                self.state_bytes = state_bytes(trainer.model, trainer.optimizer)
            self._watch_commit(self.root / step_dirname(step) / METADATA)
        else:
            export_dense(trainer.model, trainer.optimizer, f"file://{self.root / step_dirname(step)}", step)
        torch.save(rng_state(), self.root / f"rng-{step}-rank{self.rank}.pt")
        self.wait.add(t0)
        self.checkpoints += 1
        if not self.asynchronous and self.rank == 0:
            self.bytes.append(_dir_bytes(self.root / step_dirname(step)) // self.world)
            self._prune()

    def _watch_commit(self, metadata: Path) -> None:
        """How long after the training thread went on the export became durable (its .metadata written, what
        `recover` looks for): a failure in that time cannot use it. A side thread waits for the file and takes
        the time it was written from its mtime (the thread itself may notice late, when the GIL is busy)."""
        staged = time.time()

        def watch() -> None:
            while not metadata.exists():
                if time.time() - staged > 600:
                    return
                time.sleep(0.005)
            self.commit_lag_s.append(max(0.0, metadata.stat().st_mtime - staged))

        threading.Thread(target=watch, name="tmoe-dcp-commit-watch", daemon=True).start()

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
        # `trainer` lost its state in place (common.lose_state): the export is loaded into it
        t0 = time.perf_counter()
        if step == 0:
            trainer = fresh_trainer_plain(trainer.cfg)
            phases = {"rebuild": time.perf_counter() - t0}
        else:
            trainer.set_step(load_dense(trainer.model, trainer.optimizer, f"file://{self.root / step_dirname(step)}"))
            restore_rng(torch.load(self.root / f"rng-{step}-rank{self.rank}.pt", map_location="cpu"))
            phases = {"load": time.perf_counter() - t0}  # DCP: find, read and load in one call
        return trainer, {"recovered_step": step, "seconds": time.perf_counter() - t0, "phases": phases}

    def close(self) -> None:
        if self.exporter is not None:
            had = self.exporter._future is not None
            self.exporter.wait()
            if had and self.rank == 0 and self.exporter.exported:
                self.bytes.append(_dir_bytes(self.root / step_dirname(self.exporter.exported[-1])) // self.world)
        if self.stager is not None:
            self.stager.close()
            self.stager = None

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
            out["stage_seconds"] = list(self.stage_seconds)
            out["stage_bytes"] = self.state_bytes
            out["staging"] = self.staging
            out["commit_lag_s_mean"] = sum(self.commit_lag_s) / len(self.commit_lag_s) if self.commit_lag_s else 0.0
            out["commit_lag_s"] = list(self.commit_lag_s)
        return out

    @property
    def staging(self) -> str:
        opts = getattr(self.stager, "_config", None)
        return "default" if opts is None else ("pinned" if opts.use_pinned_memory else "unpinned") + "+async"


def pinned_stager(device: torch.device):
    """DCP's `DefaultStager` as TorchTitan's `async_with_pinned_mem` sets it up: pinned shared memory, async staging on
    a stream of its own, non-blocking copies. Without CUDA: async staging with plain copies (pinned memory and
    non-blocking copies need an accelerator)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = torch.device(device).type == "cuda"
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=cuda
        )
    )


def single_use(stager) -> bool:
    """torch 2.11's DefaultStager empties its copy table at the end of every stage, so a second stage fails
    (`KeyError: <class 'type'>`); torch 2.13's keeps it, and one stager serves every save (as TorchTitan uses it).
    On 2.11 each save gets a stager of its own: what it costs there (its staging buffers are dropped after every
    stage on 2.11 anyway)."""
    inner = getattr(stager, "_state_dict_stager", None)
    return inner is not None and not getattr(inner, "_deepcopy_dispatch", True)


def state_bytes(model, optimizer) -> int:
    """Tensor bytes of this rank's model and optimizer state (local shards): what one dense save stages."""
    from torchmoe_harness.trainer import local

    tensors = [local(p) for p in model.parameters()] + [
        local(v) for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)
    ]
    return sum(t.numel() * t.element_size() for t in tensors)


def fresh_trainer_plain(cfg):
    from torchmoe_harness.trainer import Trainer

    return Trainer(cfg)  # nothing durable yet: start over from the deterministic initialisation
