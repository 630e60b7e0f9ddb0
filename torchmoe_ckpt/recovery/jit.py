"""Just-in-time (JIT) checkpoint: when a peer fails, every healthy rank saves its own state without any
collective, and the restarted job resumes from it, losing at most one iteration instead of ~1.5 windows.

The live state is consistent at failure detection (JIT paper, EuroSys'24, section 3.3): every state change
happens after the iteration's last collective, in one local section under `trainer.update_lock`, so a rank
blocked in a collective holds the state at the start of iteration i or i+1; saving under the same lock waits
for a slow update. Per-iteration accumulators (routed-token counters) are stored as zeros.

Where: `<host dir>/jit/step-<S>/rank-<R>/state.pt` (and under the object store's run prefix); `COMPLETE.json`
(size + CRC32, step, shard), written last, is the commit. When: the watchdog's on_failure hook, or torchrun's
SIGTERM (read by a helper thread through the wakeup fd, so it runs while the main thread is stuck in gloo).
Restart (collective): the newest step at which every shard has a complete copy wins if it is newer than the
last committed window. Pure FSDP has no replicas: JIT is off.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import torch

from ..core.tier_config import TierConfig
from ..model.operators import local_tensor as _local
from ..runtime.agreement import all_gather_objects, all_ok
from ..runtime.watchdog import write_all  # os.write on fd 2: this may run while another thread holds a stream lock
from ..storage_format.checksums import crc32_bytes
from ..storage_format.commit import write_last
from ..storage_format.files import StoreFiles
from ..storage_format.layout import jit_step_dirname as step_dirname
from ..storage_format.layout import writer_name as rank_dirname
from ..storage_format.store_open import open_store
from .jit_copies import MARKER, STATE, JitMarker, JitSaved, choose, list_copies, read_copy
from .sparse_to_dense import init_optimizer_state

log = logging.getLogger("torchmoe_ckpt.jit")
# Accumulated during the forward, consumed and zeroed by the update: zero at the start of any iteration.
TRANSIENT_BUFFERS = ("tokens_per_expert_E", "router_prob_E")
LOCK_WAIT_S = 10.0  # an update section is milliseconds of local compute; longer means something is wrong


def shard_layout(mesh) -> tuple[str, int]:
    """(shard key, replicate degree). Ranks with the same key hold bit-identical state (HSDP replicas)."""
    names = list(mesh.mesh_dim_names or [f"d{i}" for i in range(mesh.ndim)])
    coord = mesh.get_coordinate()
    shape = "x".join(str(mesh.size(i)) for i in range(mesh.ndim))
    rep = mesh.size(names.index("dp_replicate")) if "dp_replicate" in names else 1
    key = f"mesh={shape}:" + ",".join(f"{n}={c}" for n, c in zip(names, coord) if n != "dp_replicate")
    return key, rep


def jit_store(cfg: dict, run_id: str) -> StoreFiles:
    """The object-store side: the host side's layout, under `<uri>/<run>/jit/`."""
    fs, root = open_store(cfg["uri"], cfg.get("storage_options"), probe=False)
    return StoreFiles(fs, f"{root.rstrip('/')}/{run_id}/jit", cfg["uri"])


class JitCheckpointer:
    """Save this rank's state once, on failure detection; see the module docstring."""

    def __init__(self, trainer, host_cfg: dict, jit_dir: Path):
        self.set_trainer(trainer)
        self.dir = Path(jit_dir)
        self.run_id = TierConfig.from_dict(host_cfg).resolved_run_id()
        self.shard, self.replicas = shard_layout(trainer.mesh)
        self.enabled = self.replicas > 1
        # opened now, not on the failure path (fsspec imports and connects)
        self.store = (
            jit_store(host_cfg["object_store"], self.run_id) if self.enabled and host_cfg.get("object_store") else None
        )
        self.begun = trainer.step  # the newest iteration this rank started (see begin())
        self._once = threading.Lock()
        self.saved: JitSaved | None = None
        self._armed = False

    def set_trainer(self, trainer) -> None:
        """Call between iterations: inside one, FSDP2 registers the *unsharded* parameters on the modules."""
        self.trainer = trainer
        self.params = list(trainer.model.named_parameters())

    def begin(self, iteration: int) -> None:
        self.begun = iteration

    def arm(self, watchdog) -> None:
        """Save on the watchdog's failure events and on SIGTERM. Call from the main thread."""
        if not self.enabled:
            return
        watchdog.on_failure.append(lambda failure: self.save(failure.event, failure.op))
        r, w = os.pipe()
        os.set_blocking(w, False)
        # A Python-level handler makes the C handler write the signal number to the wakeup fd, not terminate.
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        threading.Thread(target=self._signals, args=(r,), name="tmoe-jit-sigterm", daemon=True).start()
        self._armed = True

    def disarm(self) -> None:
        self._armed = False

    def _signals(self, fd: int) -> None:
        while True:
            data = os.read(fd, 64)
            if signal.SIGTERM in data:
                if self._armed:
                    self.save("sigterm", None)
                os._exit(128 + signal.SIGTERM)

    def capture(self) -> tuple[int, dict[str, torch.Tensor], float]:
        """(completed step, tensors, lr) of this rank, between two updates (under the trainer's lock)."""
        t = self.trainer
        if not t.update_lock.acquire(timeout=LOCK_WAIT_S):
            raise TimeoutError(f"the optimizer update did not finish within {LOCK_WAIT_S} s")
        try:
            out: dict[str, torch.Tensor] = {}
            for name, p in self.params:
                out[f"param/{name}"] = _local(p).detach().clone()
                for key, val in t.optimizer.state.get(p, {}).items():
                    out[f"optim/{name}/{key}"] = _local(val).clone() if torch.is_tensor(val) else torch.tensor(val)
            for name, b in t.model.named_buffers():
                if b is not None and not name.endswith(TRANSIENT_BUFFERS):
                    out[f"buffer/{name}"] = b.clone()
            return t.step, out, t.optimizer.param_groups[0]["lr"]
        finally:
            t.update_lock.release()

    def save(self, reason: str, op: str | None) -> JitSaved | None:
        """Write this rank's JIT copy (once per process; a second caller waits for the first)."""
        if not self.enabled:
            return None
        with self._once:
            if self.saved is not None:
                return self.saved
            t0 = time.perf_counter()
            rank = self.trainer.rank
            try:
                step, tensors, lr = self.capture()
                if step == 0:  # no update yet: the deterministic initialisation is the state; cold start
                    self.saved = JitSaved(skipped="no update yet")
                    line = f"event=jit_skipped rank={rank} reason={reason}: no update yet, a restart cold-starts\n"
                    write_all(2, line)
                    return self.saved
                buf = io.BytesIO()
                torch.save({"step": step, "lr": lr, "shard": self.shard, "tensors": tensors}, buf)
                data = buf.getvalue()
                marker = JitMarker(
                    step,
                    rank,
                    self.shard,
                    begun=max(self.begun, step),
                    lr=lr,
                    bytes=len(data),
                    crc32=crc32_bytes(data),
                    reason=reason,
                    op=op,
                    world=self.trainer.world,
                    attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                )
                rel = f"{step_dirname(step)}/{rank_dirname(rank)}"
                d = self.dir / rel
                d.mkdir(parents=True, exist_ok=True)
                (d / MARKER).unlink(missing_ok=True)  # a copy left by an earlier attempt is replaced whole
                (d / STATE).write_bytes(data)
                marker_bytes = marker.to_json()
                write_last(d / MARKER, marker_bytes)  # the marker, written last, is the commit
                host_s = time.perf_counter() - t0
                stored = None
                if self.store is not None:
                    try:
                        self.store.write(f"{rel}/{STATE}", data)
                        self.store.write(f"{rel}/{MARKER}", marker_bytes)
                        stored = True
                    except Exception as exc:  # the host copy already counts; the store is for lost nodes
                        stored = f"failed: {type(exc).__name__}: {exc}"
                for sd in self.dir.glob("step-*"):  # this rank's older copies are superseded (marker first)
                    if sd.name < step_dirname(step):
                        (sd / rank_dirname(rank) / MARKER).unlink(missing_ok=True)
                        shutil.rmtree(sd / rank_dirname(rank), ignore_errors=True)
                seconds = round(time.perf_counter() - t0, 4)
                self.saved = JitSaved(marker, round(host_s, 4), seconds, stored)
                write_all(
                    2,
                    f"event=jit_saved rank={rank} step={step} begun={marker.begun} reason={reason} "
                    f"bytes={len(data)} seconds={seconds} store={stored} dir={d}\n",
                )
            except Exception as exc:
                self.saved = JitSaved(error=f"{type(exc).__name__}: {exc}")
                write_all(2, f"event=jit_save_failed rank={rank} reason={reason} error={type(exc).__name__}: {exc}\n")
            return self.saved


# ---- restart ---------------------------------------------------------------------------------------------
def window_step_bound(tier) -> int:
    """The newest step a committed window on every rank's host tier recovers to (-1: none). Collective."""
    mine = {}
    for wid in tier.window_ids():
        try:
            man = tier.manifest(wid)
            mine[wid] = man.start_step + man.window - 1
        except (OSError, ValueError):
            continue
    everyone = all_gather_objects(mine)
    common = set.intersection(*(set(m) for m in everyone))
    return max((everyone[0][w] for w in common), default=-1)


def apply_state(trainer, blob: dict) -> None:
    tensors = blob["tensors"]
    init_optimizer_state(trainer.optimizer)
    want = set()
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            want.add(f"param/{name}")
            _local(p).copy_(tensors[f"param/{name}"])
            for key, val in trainer.optimizer.state[p].items():
                want.add(f"optim/{name}/{key}")
                _local(val).copy_(tensors[f"optim/{name}/{key}"])
        for name, b in trainer.model.named_buffers():
            if b is None:
                continue
            if name.endswith(TRANSIENT_BUFFERS):
                b.zero_()
            else:
                want.add(f"buffer/{name}")
                b.copy_(tensors[f"buffer/{name}"])
    extra = set(tensors) - want
    if extra:
        raise ValueError(f"JIT copy holds tensors this model does not have: {sorted(extra)[:3]}")
    trainer.set_step(blob["step"])
    if trainer.optimizer.param_groups[0]["lr"] != blob["lr"]:  # the schedule must reproduce the saved LR
        raise ValueError(
            f"LR schedule gives {trainer.optimizer.param_groups[0]['lr']!r} at step {blob['step']}, "
            f"the JIT copy saved {blob['lr']!r}: not the same run configuration"
        )


class _JitTrainer(Protocol):
    """What `resume` reads of a trainer (the harness's and TorchTitan's)."""

    @property
    def mesh(self) -> object: ...  # the device mesh its shard layout is read from
    @property
    def rank(self) -> int: ...


T = TypeVar("T", bound=_JitTrainer)


def _incomplete_copies(jit_dir: Path) -> list[Path]:
    """Host copies without a valid marker (a save cut short, or damaged): never used, only reported."""
    complete = {c.path for c in list_copies(jit_dir, None)}
    return [d for d in sorted(jit_dir.glob("step-*/rank-*")) if str(d) not in complete]


@dataclass(frozen=True)
class JitResumeReport:
    """What a resume from a just-in-time copy did (`to_dict()`: the JSON keys the harness reports carry)."""

    jit_step: int  # the step of the copy every shard had
    replayed_iterations: int  # iterations that began after the copy (run again after the restart)
    failed_iteration: int  # the iteration the failure hit
    window_step: int  # the newest committed window's step (the copy was newer)
    jit_copy_rank: int  # whose copy this rank loaded
    jit_copy_where: str  # "host" or "store"
    jit_copies: int  # copies listed over every shard
    next_window_id: int  # where new window ids start (after every window on the tiers)
    restart_seconds: float

    @property
    def recovered_step(self) -> int:
        return self.jit_step

    def to_dict(self) -> dict:
        return dict(asdict(self), source="jit", recovered_step=self.recovered_step)


def resume(trainer: T, host_cfg: dict, tier, rebuild: Callable[[bool], T]) -> tuple[T, JitResumeReport | None]:
    """Collective: load the newest all-shard JIT copy if it beats the last committed window. Returns (trainer,
    report); report None means "use the window path". `rebuild(for_copy)` builds a fresh trainer of the run:
    True, the one the copy is loaded into; False, the normal initial state (some shard's copy cannot be loaded)."""
    t0 = time.perf_counter()
    key, _ = shard_layout(trainer.mesh)
    jit_dir = Path(tier.dir) / "jit"
    cfg = host_cfg.get("object_store")
    store = jit_store(cfg, TierConfig.from_dict(host_cfg).resolved_run_id()) if cfg else None
    everyone = all_gather_objects((key, list_copies(jit_dir, store)))
    step, shards = choose(everyone)
    bound = window_step_bound(tier)
    next_window = 1 + max(all_gather_objects(max(tier.window_ids(require_manifest=False), default=-1)))
    if step is None or step <= bound:
        why = (
            "no step with a complete copy of every shard"
            if step is None
            else f"JIT step {step} is not newer than the committed window's step {bound}"
        )
        incomplete = _incomplete_copies(jit_dir)
        if trainer.rank == 0 and (incomplete or any(c for _, c in everyone)):
            log.warning(
                "event=jit_not_used reason=%r window_step=%d incomplete_copies_ignored=%d", why, bound, len(incomplete)
            )
        return trainer, None
    # host memory before the store; among host copies this rank's own, then the lowest replica rank
    me = trainer.rank
    mine = sorted(shards[key], key=lambda c: (c.where != "host", c.marker.rank != me, c.marker.rank))
    del trainer
    fresh = rebuild(True)  # everything must come from the copy
    used = None
    for c in mine:
        try:
            apply_state(fresh, read_copy(c, store))
            used = c
            break
        except Exception as exc:  # torn, corrupt or foreign: try the next replica's copy
            where = f"{c.where}:{c.path}"
            log.warning(f"event=jit_copy_rejected rank={fresh.rank} copy={where} error={type(exc).__name__}: {exc}")
    if not all_ok(used is not None):  # some shard not loaded: the window path, from a fresh init
        return rebuild(False), None
    assert used is not None  # agreed: every rank loaded one
    begun = max(c.marker.begun for cs in shards.values() for c in cs)
    rep = JitResumeReport(
        jit_step=step,
        replayed_iterations=begun - step,
        failed_iteration=begun,
        window_step=bound,
        jit_copy_rank=used.marker.rank,
        jit_copy_where=used.where,
        jit_copies=sum(len(v) for v in shards.values()),
        next_window_id=next_window,
        restart_seconds=time.perf_counter() - t0,
    )
    log.warning(
        f"event=jit_resumed rank={fresh.rank} step={step} from_rank={used.marker.rank} where={used.where} "
        f"replayed_iterations={begun - step} window_step={bound}"
    )
    return fresh, rep
