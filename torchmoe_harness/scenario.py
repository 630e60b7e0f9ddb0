"""Train with sparse checkpointing and injected failures, recovering in place, for the recovery tests
and `torchmoe-ckpt selftest`.

A simulated failure throws the whole training state away: the restarted trainer is built with *different*
initial weights, so anything recovery forgets to restore shows up as a mismatch against the fault-free run.
What survives is what would survive in host memory: the newest committed window. Failure phases:
  "update" - the rank dies in iteration f after backward, before the optimizer step;
  "copy"   - the snapshot copy of iteration f is torn half-way; the failure surfaces in iteration f+1;
  "kill"   - a real `kill -9` of rank `rank` in iteration f (first attempt only); torchrun
             (--max-restarts) restarts every worker, and with "resume" they recover from the host tier;
  "freeze" - rank `rank` sends itself SIGSTOP in iteration f (first attempt only): a hung, not dead, peer.
             `at`: "update" (default; after backward, before the optimizer step) or "forward" (start of
             the step). The others block in a collective until the watchdog (spec "watchdog_timeout_s")
             ends them; torchrun then restarts every worker (the watchdog's stop guard SIGKILLs the
             stopped one on torchrun's SIGTERM, which a stopped process never acts on).

Spec "replay_check" ("exact", the default, or "tolerant") and "replay_tolerance": how recovery checks its replay
(torchmoe_ckpt.replay_check; "exact" on a GPU refuses to start without deterministic kernels).

Spec "watchdog_timeout_s" (None: off) arms a CollectiveWatchdog around each train step and checkpointer
call; "watchdog_events" (a path) keeps its hang records across restarts for the report. Spec "jit": true
(needs both) adds the just-in-time checkpoint of jit.py: healthy replicas save on failure, restarts use it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch

from torchmoe_ckpt.config import SparseConfig, TierConfig
from torchmoe_ckpt.errors import UnusableCheckpointError
from torchmoe_ckpt.identity import IdentityMismatch, RunIdentity, build_identity
from torchmoe_ckpt.operators import discover_operators
from torchmoe_ckpt.recovery import recover
from torchmoe_ckpt.replay_check import DEFAULT_TOLERANCE, ReplayPolicy, check_replay_check
from torchmoe_ckpt.snapshot import SimulatedCopyFault
from torchmoe_ckpt.sparse_checkpointer import SparseCheckpointer
from torchmoe_ckpt.sparse_to_dense import sparse_to_dense
from torchmoe_ckpt.storage.tiers import Tiers, build_tiers, node_of
from torchmoe_ckpt.watchdog import CollectiveWatchdog, read_events
from torchmoe_harness.trainer import Trainer

log = logging.getLogger("torchmoe_ckpt.scenario")
PHASES = ("update", "copy", "kill", "freeze")


class SimulatedCrash(RuntimeError):
    pass


def _crash() -> None:
    raise SimulatedCrash("injected failure before the optimizer step")


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _freeze_self() -> None:
    # SIGSTOP stops every thread, this process's watchdog included: the peers must notice on their own.
    os.kill(os.getpid(), signal.SIGSTOP)


def _tear(slot, n) -> None:
    raise SimulatedCopyFault(f"injected failure after {n} of {len(slot.items)} items of slot {slot.index}")


def _tiers(trainer: Trainer, host: dict | None) -> Tiers:
    """(HostTier, PeerTier, ObjectTier) from the spec's "host_tier" section, or Nones."""
    if not host:
        return Tiers(None, None, None)
    return build_tiers(host, trainer.rank, trainer.world, trainer.cfg.hsdp)


def run_identity(trainer: Trainer, host: dict | None) -> RunIdentity:
    """This run's identity (identity.py). The data seed is part of it: a job on other data with the same run
    id never resumes this one's windows. The planned steps and the LR are not (they may change)."""
    cfg = trainer.cfg
    run_id = TierConfig.from_dict(host).resolved_run_id() if host else None
    ops = discover_operators(trainer.model)
    return build_identity(
        trainer.model,
        trainer.optimizer,
        trainer.compute_dtype,
        ops,
        run_id,
        trainer.world,
        cfg.hsdp,
        data=f"seed={cfg.seed}",
        steps=cfg.steps,
    )


def _node_dir(trainer: Trainer, host: dict) -> Path:
    """This rank's node directory, as build_tiers lays it out."""
    cfg = TierConfig.from_dict(host)
    rpn = int(cfg.ranks_per_node or os.environ.get("LOCAL_WORLD_SIZE", trainer.world))
    return Path(cfg.root) / f"node-{node_of(trainer.rank, rpn)}"


def _lose_node(node_dir: Path, node: int | None) -> str:
    """Emulate losing node `node` (None: every node): its host directory, with every copy on it, is wiped."""
    import shutil

    import torch.distributed as dist

    if node is None or node_dir.name == f"node-{node}":
        shutil.rmtree(node_dir, ignore_errors=True)
    dist.barrier()
    return "every node's host memory lost" if node is None else f"node {node} lost (host directory wiped)"


def _corrupt(tier, how: str) -> str:
    """Damage this rank's newest committed window on the host tier (failure-injection tests)."""
    wid = tier.window_ids()[-1]
    man = tier.manifest(wid)
    rel = next(r for r in sorted(man.files) if r.endswith(".distcp"))
    path = tier.window_dir(wid) / rel
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    return f"{how} {rel} of window {wid}"


def restart(
    trainer: Trainer,
    ck: SparseCheckpointer,
    ck_cfg: SparseConfig,
    host: dict | None = None,
    fail: dict | None = None,
    wd: CollectiveWatchdog | None = None,
    replay_check: ReplayPolicy | None = None,
) -> tuple[Trainer, SparseCheckpointer, dict]:
    """Drop the live state; rebuild from the newest committed window (from the storage tiers if configured,
    else the in-memory one), or cold-start when there is none."""
    committed = ck.committed
    ck.engine.shutdown()
    if ck.tier_writer is not None:
        ck.tier_writer.abandon()
    cfg = trainer.cfg
    rep: dict = {}
    fail = fail or {}
    if host:
        if ck.tier_writer is not None and ck.tier_writer.uploader is not None:
            ck.tier_writer.uploader.flush(30)  # the test waits for the store to catch up, training never does
        # Nodes are lost before the restarted job opens its tiers (and takes the run lock), as in reality.
        if fail.get("lose_node") is not None:
            rep["lost"] = _lose_node(_node_dir(trainer, host), fail["lose_node"])
        if fail.get("lose_all_hosts"):
            rep["lost"] = _lose_node(_node_dir(trainer, host), None)
        tier, replicator, store = _tiers(trainer, host)
        if fail.get("corrupt"):
            import torch.distributed as dist

            rep["corrupted"] = _corrupt(tier, fail["corrupt"]) if trainer.rank == 0 else None
            dist.barrier()
    del trainer
    t0 = time.perf_counter()
    fresh = Trainer(cfg, init_seed=cfg.seed + 7777)  # another init: what recovery forgets shows as a mismatch
    if host:
        res = recover(
            fresh,
            Tiers(tier, replicator, store),
            ck.op_by_name,
            fresh.compute_dtype,
            fresh.rank,
            identity=ck.identity,
            watchdog=wd,
            replay_check=replay_check,
        )
        committed = res.window
        rep.update(res.report)
    elif committed is not None:
        rep.update(sparse_to_dense(fresh, committed, replay_check).to_dict())
    if committed is None:
        fresh = Trainer(cfg)  # nothing to recover from: start over from the deterministic initialisation
        rep.update(cold_start="the initialisation", recovered_step=0, replayed_iterations=0)
    rep["restart_seconds"] = time.perf_counter() - t0
    tier, replicator, store = _tiers(fresh, host)
    new_ck = SparseCheckpointer(
        fresh.model,
        fresh.optimizer,
        fresh.compute_dtype,
        ck_cfg,
        committed=committed,
        host_tier=tier,
        replicator=replicator,
        store=store,
        identity=run_identity(fresh, host),
    ).inherit_counters(ck)
    return fresh, new_ck.attach(fresh), rep


def resume_from_host_tier(
    trainer: Trainer, host: dict, wd: CollectiveWatchdog | None = None, replay_check: ReplayPolicy | None = None
):
    """Process start: recover from the newest window every rank can get from the tiers, if any."""
    t0 = time.perf_counter()
    ops = {o.name: o for o in discover_operators(trainer.model)}
    fresh = Trainer(trainer.cfg, init_seed=trainer.cfg.seed + 7777)
    try:
        res = recover(
            fresh,
            _tiers(trainer, host),
            ops,
            fresh.compute_dtype,
            fresh.rank,
            identity=run_identity(trainer, host),
            watchdog=wd,
            replay_check=replay_check,
        )
    except (IdentityMismatch, UnusableCheckpointError) as exc:  # another run's, or none usable: one line, exit 2
        log.error("event=refused rank=%d: %s", trainer.rank, exc)
        sys.stderr.flush()
        os._exit(2)
    if res.window is None:
        return trainer, None, None  # nothing to recover from: a fresh start from the deterministic init
    return fresh, res.window, dict(res.report, restart_seconds=time.perf_counter() - t0)


def _check_jit(spec: dict) -> bool:
    """Spec "jit": true saves each healthy rank's state when a peer fails (jit.py); bad combinations fail here."""
    if not spec.get("jit"):
        return False
    if not spec.get("host_tier"):
        raise ValueError("spec 'jit' needs a 'host_tier' section (JIT copies are written to the host tier): add one")
    if not spec.get("watchdog_timeout_s"):
        raise ValueError(
            "spec 'jit' needs 'watchdog_timeout_s' (the watchdog detects the failure that triggers "
            "the save): set it, e.g. 30"
        )
    return True


def run_with_checkpointing(trainer: Trainer, spec: dict, losses: dict[int, torch.Tensor]) -> tuple[Trainer, dict]:
    cfg = trainer.cfg
    ck_cfg = SparseConfig(**spec["checkpoint"])
    policy = ReplayPolicy(spec.get("replay_check", "exact"), spec.get("replay_tolerance", DEFAULT_TOLERANCE))
    check_replay_check(policy.mode, trainer.device)
    pending = [dict(f) for f in spec.get("failures", [])]
    for f in pending:
        if f.get("phase", "update") not in PHASES:
            raise ValueError(f"unknown failure phase {f.get('phase')!r}; use one of {PHASES}")
    host = spec.get("host_tier")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    recoveries: list[dict] = []
    committed = None
    use_jit, jit_rep = _check_jit(spec), None
    # Recovery (fetch, agreement, replay) is watched like training: a rank frozen in replay ends the job.
    wd = CollectiveWatchdog(spec.get("watchdog_timeout_s"), rank=trainer.rank, events_path=spec.get("watchdog_events"))
    if use_jit and host and spec.get("resume"):
        from torchmoe_ckpt.jit import resume as jit_resume

        # A copy is loaded into a trainer with other initial weights: anything it fails to restore shows.
        trainer, jit_rep = jit_resume(
            trainer,
            host,
            _tiers(trainer, host)[0],
            lambda for_copy: Trainer(cfg, init_seed=cfg.seed + 7777 if for_copy else None),
        )
        if jit_rep is not None:
            recoveries.append(dict(jit_rep, attempt=attempt))
    if host and spec.get("resume") and jit_rep is None:
        trainer, committed, rep = resume_from_host_tier(trainer, host, wd, policy)
        if rep is None:  # no window anywhere: say what this run starts from
            src = (
                f"dense export {spec['initial_load']['uri']} (step {trainer.step})"
                if spec.get("initial_load")
                else "the initialisation"
            )
            log.warning(
                "event=cold_start rank=%d attempt=%d run=%s from=%r: no committed window in any tier: a new run starts",
                trainer.rank,
                attempt,
                TierConfig.from_dict(host).resolved_run_id(),
                src,
            )
            rep = (
                {"cold_start": src, "recovered_step": trainer.step} if attempt > 0 or spec.get("initial_load") else None
            )
        if rep is not None:
            recoveries.append(dict(rep, attempt=attempt))
    tier, replicator, store = _tiers(trainer, host)
    # After a JIT resume, new windows must sort after the ones already on the tiers.
    ck = SparseCheckpointer(
        trainer.model,
        trainer.optimizer,
        trainer.compute_dtype,
        ck_cfg,
        committed=committed,
        host_tier=tier,
        replicator=replicator,
        store=store,
        identity=run_identity(trainer, host),
        first_window_id=None if jit_rep is None else jit_rep["next_window_id"],
    ).attach(trainer)
    step_seconds: list[float] = []
    step_cpu: list[float] = []  # process CPU (every thread: training, copy, tier threads) per step
    jit = None
    if use_jit:
        from torchmoe_ckpt.jit import JitCheckpointer

        jit = JitCheckpointer(trainer, host, tier.dir / "jit")
        if not jit.enabled and trainer.rank == 0:
            log.warning(
                "event=jit_off reason=no_replicas hsdp=%d: pure FSDP keeps one copy of each shard, so a "
                "failed rank's state exists nowhere else; recovery uses the committed window",
                cfg.hsdp,
            )
        jit.arm(wd)
    while True:
        nxt = trainer.step + 1
        fail = next((f for f in pending if f["step"] == nxt), None)
        try:
            if trainer.step >= cfg.steps:
                with wd.watch("checkpoint.close"):
                    ck.close()  # a copy torn in the last iteration surfaces here
                break
            if fail is not None:
                pending.remove(fail)
                if fail.get("phase", "update") == "update":
                    trainer.before_update.append(_crash)
                elif fail["phase"] == "kill" and attempt == 0 and trainer.rank == fail.get("rank", 0):
                    trainer.before_update.append(_kill_self)
                elif fail["phase"] == "freeze" and attempt == 0 and trainer.rank == fail.get("rank", 0):
                    if fail.get("at", "update") == "update":
                        trainer.before_update.append(_freeze_self)
                    else:
                        _freeze_self()
            t0, c0 = time.perf_counter(), time.process_time()
            if jit is not None:
                jit.begin(nxt)
            with wd.watch(f"train_step {nxt}"):
                res = trainer.train_step()
            losses[res.step] = res.loss
            if fail is not None and fail.get("phase") == "copy":
                ck.engine.fault_hook = _tear
            with wd.watch(f"checkpoint.after_step {nxt}"):
                ck.after_step(res)
            step_seconds.append(time.perf_counter() - t0)
            step_cpu.append(time.process_time() - c0)
        except (SimulatedCrash, SimulatedCopyFault) as exc:
            log.info("failure at iteration %d: %s", nxt, exc)
            inflight = ck.current
            position = inflight.captured if inflight is not None else 0
            inflight_id = inflight.id if inflight is not None else None
            if isinstance(exc, SimulatedCopyFault) and inflight is not None:
                position -= 1  # the torn slot was never captured
            trainer, ck, rep = restart(trainer, ck, ck_cfg, host, fail, wd, policy)
            if jit is not None:
                jit.set_trainer(trainer)
            rep.update(failed_at=nxt, error=str(exc), slot_position=position, inflight_window_id=inflight_id)
            recoveries.append(rep)
    if ck.tier_writer is not None:
        with wd.watch("host_tier.flush"):
            ck.tier_writer.flush()
        if ck.tier_writer.uploader is not None:
            ck.tier_writer.uploader.flush(30)  # end of training: let the last upload land before reporting
        ck.tier_writer.release_lease()  # a clean end: the next job on this store prefix need not wait
    stats = ck.stats()
    ck.engine.shutdown()
    wd.close()
    out = {"recoveries": recoveries, "checkpoint": stats, "step_seconds": step_seconds, "step_cpu_s": step_cpu}
    if jit is not None:
        jit.disarm()
        out["jit"] = {"enabled": jit.enabled, "shard": jit.shard, "replicas": jit.replicas}
    if wd.enabled:
        out["watchdog"] = dict(wd.stats(), events=read_events(spec.get("watchdog_events")))
    return trainer, out
