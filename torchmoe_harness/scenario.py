"""Train with sparse checkpointing and injected failures, recovering in place, for the recovery tests
and `torchmoe-ckpt selftest`.

A simulated failure throws the whole training state away: the restarted trainer is built with *different*
initial weights, so anything recovery forgets to restore shows up as a mismatch against the fault-free run.
What survives is what would survive in host memory: the newest committed window. Failure phases:
  "update" - the rank dies in iteration f after backward, before the optimizer step;
  "copy"   - the snapshot copy of iteration f is torn half-way; the failure surfaces in iteration f+1;
  "kill"   - a real `kill -9` of rank `rank` in iteration f (first attempt only); torchrun
             (--max-restarts) restarts every worker, and with "resume" they recover from the host tier;
  "freeze" - rank `rank` sends itself SIGSTOP in iteration f (first attempt only, once: a rank let go with
             SIGCONT trains on, the cluster tests' pause point): a hung, not dead, peer. The others
             block in a collective until the watchdog (spec "watchdog_timeout_s") ends them; torchrun then
             restarts every worker (the watchdog's stop guard SIGKILLs the stopped one on torchrun's SIGTERM,
             which a stopped process never acts on).
  For "kill" and "freeze": `at`: "update" (default; after backward, before the optimizer step) or "forward"
  (start of the step). `settled`: true waits first until this rank's host tier has written, and its peers
  received, every window committed so far (a host lost after its copies were replicated: the replication is
  asynchronous, and under load it may still be behind otherwise). At "update" the window whose last copy
  finished in iteration f-1 has just been committed and handed to the persist thread, which races the
  signal. A test that asserts the recovered step uses "forward" with `settled`, where that step is known.

Spec "replay_check" ("exact", the default, or "tolerant") and "replay_tolerance": how recovery checks its replay
(torchmoe_ckpt.recovery.replay_check; "exact" on a GPU refuses to start without deterministic kernels).

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

from torchmoe_ckpt.capture.snapshot import SimulatedCopyFault
from torchmoe_ckpt.config import SparseConfig, TierConfig
from torchmoe_ckpt.core.errors import UnusableCheckpointError
from torchmoe_ckpt.model.identity import IdentityMismatch, RunIdentity, build_identity
from torchmoe_ckpt.model.operators import discover_operators
from torchmoe_ckpt.persist.build_tiers import Tiers, node_of
from torchmoe_ckpt.recovery.replay_check import DEFAULT_TOLERANCE, ReplayPolicy, check_replay_check
from torchmoe_ckpt.recovery.resume import RecoveryOptions, ResumeResult
from torchmoe_ckpt.recovery.sparse_to_dense import sparse_to_dense
from torchmoe_ckpt.runtime.watchdog import CollectiveWatchdog, read_events
from torchmoe_ckpt.sparse_checkpointer import SparseCheckpointer
from torchmoe_ckpt.startup import IdentityParts, StartupHooks, start
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


def _once(trainer: Trainer, hook):
    """`hook` as a before-update hook that runs once: a frozen rank that is let go (SIGCONT, the cluster tests'
    pause point) trains on instead of stopping again in every later iteration."""

    def run() -> None:
        trainer.before_update.remove(run)
        hook()

    return run


def _tear(slot, n) -> None:
    raise SimulatedCopyFault(f"injected failure after {n} of {len(slot.items)} items of slot {slot.index}")


def identity_facts(cfg) -> IdentityParts:
    """What this run's identity names besides the model (identity.py): the data seed is part of it (a job on
    other data with the same run id never resumes this one's windows); the planned steps are not (they may grow)."""
    return IdentityParts(data=f"seed={cfg.seed}", steps=cfg.steps, hsdp_replicate=cfg.hsdp)


def run_identity(trainer: Trainer, host: dict | None) -> RunIdentity:
    """This run's identity, as `start` builds it (for a checkpointer built without it: gpu_check_bench_worker)."""
    facts = identity_facts(trainer.cfg)
    run_id = TierConfig.from_dict(host).resolved_run_id() if host else None
    ops = discover_operators(trainer.model, optimizer=trainer.optimizer)  # as start() discovers them
    return build_identity(
        trainer.model,
        trainer.optimizer,
        trainer.compute_dtype,
        ops,
        run_id,
        trainer.world,
        facts.hsdp_replicate,
        data=facts.data,
        steps=facts.steps,
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
    """Emulate the process dying and a new one starting: drop the live state; rebuild from the newest committed
    window (from the storage tiers if configured, else the one in memory), or cold-start when there is none."""
    committed = ck.committed
    ck.abandon(upload_wait_s=30.0 if host else 0.0)  # the test waits for the store to catch up, training never does
    cfg = trainer.cfg
    rep: dict = {}
    fail = fail or {}
    # Nodes are lost before the restarted job opens its tiers (and takes the run lock), as in reality. A real death
    # stops the writer with the process; the abandoned one first finishes its job in flight (bounded: it may wait on
    # a peer that dropped the same job), or it writes a torn window into the wiped directory and hands it to the
    # store (seen once: "local copy of window 2 does not verify").
    if host and (fail.get("lose_node") is not None or fail.get("lose_all_hosts")):
        ck.wait_abandoned(10.0)
    if host and fail.get("lose_node") is not None:
        rep["lost"] = _lose_node(_node_dir(trainer, host), fail["lose_node"])
    if host and fail.get("lose_all_hosts"):
        rep["lost"] = _lose_node(_node_dir(trainer, host), None)
    del trainer
    t0 = time.perf_counter()
    fresh = Trainer(cfg, init_seed=cfg.seed + 7777)  # another init: what recovery forgets shows as a mismatch

    def corrupt(tiers: Tiers) -> None:
        if fail.get("corrupt"):
            import torch.distributed as dist

            rep["corrupted"] = _corrupt(tiers.host, fail["corrupt"]) if fresh.rank == 0 else None
            dist.barrier()

    def in_memory(tiers: Tiers | None, _identity) -> tuple[ResumeResult, Trainer] | None:
        if tiers is not None or committed is None:  # no tiers: the window the "dead" process held in memory
            return None
        done = sparse_to_dense(fresh, committed, replay_check)
        return ResumeResult(committed, done.recovered_step, done.to_dict()), fresh

    started = start(
        fresh,
        fresh.compute_dtype,
        ck_cfg,
        host or None,
        identity=identity_facts(cfg),
        recovery=RecoveryOptions(replay_check=replay_check, watchdog=wd),
        hooks=StartupHooks(
            on_tiers=corrupt,
            recover_with=in_memory,
            cold_start=lambda: Trainer(cfg),  # nothing to recover from: the deterministic initialisation
        ),
    )
    if started.recovered:
        rep.update(started.resumed.report)
    else:
        if started.resumed is not None:
            rep.update(started.resumed.report)
        rep.update(cold_start="the initialisation", recovered_step=0, replayed_iterations=0)
    rep["restart_seconds"] = time.perf_counter() - t0
    new_ck = started.checkpointer.inherit_counters(ck)
    return started.trainer, new_ck.attach(started.trainer), rep


def _start(trainer: Trainer, spec: dict, ck_cfg: SparseConfig, wd, policy, attempt: int, recoveries: list):
    """Process start: the library's start-up sequence; recovery (with "resume") from a JIT copy if one beats the
    newest window (spec "jit"), else from the newest window every rank can get from the tiers, if any. Returns
    the trainer to train, its checkpointer and the host tier's run directory (None without tiers)."""
    cfg, host = trainer.cfg, spec.get("host_tier")
    resume = bool(host and spec.get("resume"))
    jit_rep = None

    def jit_first(tiers: Tiers, _identity) -> tuple[ResumeResult, Trainer] | None:
        nonlocal jit_rep
        from torchmoe_ckpt.recovery.jit import resume as jit_resume

        # A copy is loaded into a trainer with other initial weights: anything it fails to restore shows.
        got, jit_rep = jit_resume(
            trainer,
            host,
            tiers.host,
            lambda for_copy: Trainer(cfg, init_seed=cfg.seed + 7777 if for_copy else None),
        )
        if jit_rep is None:
            return None  # the window path (the trainer given is untouched)
        # new windows sort after the ones already on the tiers
        rep = jit_rep.to_dict()
        return ResumeResult(None, jit_rep.recovered_step, rep, next_window_id=jit_rep.next_window_id), got

    t0 = time.perf_counter()
    try:
        started = start(
            Trainer(cfg, init_seed=cfg.seed + 7777) if resume else trainer,  # another init: what recovery forgets
            trainer.compute_dtype,
            ck_cfg,
            host,
            identity=identity_facts(cfg),
            resume=resume,
            recovery=RecoveryOptions(replay_check=policy, watchdog=wd),
            hooks=StartupHooks(
                recover_with=jit_first if resume and _check_jit(spec) else None,
                cold_start=(lambda: trainer) if resume else None,  # nothing recovered: the deterministic init
            ),
        )
    except (IdentityMismatch, UnusableCheckpointError) as exc:  # another run's, or none usable: one line, exit 2
        log.error("event=refused rank=%d: %s", trainer.rank, exc)
        sys.stderr.flush()
        os._exit(2)
    if jit_rep is not None:
        recoveries.append(dict(jit_rep.to_dict(), attempt=attempt))
    elif started.recovered:
        recoveries.append(dict(started.resumed.report, restart_seconds=time.perf_counter() - t0, attempt=attempt))
    elif resume:  # no window anywhere: say what this run starts from
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
        if attempt > 0 or spec.get("initial_load"):
            recoveries.append({"cold_start": src, "recovered_step": trainer.step, "attempt": attempt})
    host_dir = started.tiers.host.dir if started.tiers is not None else None
    return started.trainer, started.checkpointer, host_dir  # not `started`: its recovered window is let go


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
    use_jit = _check_jit(spec)
    # Recovery (fetch, agreement, replay) is watched like training: a rank frozen in replay ends the job.
    wd = CollectiveWatchdog(spec.get("watchdog_timeout_s"), rank=trainer.rank, events_path=spec.get("watchdog_events"))
    trainer, ck, host_dir = _start(trainer, spec, ck_cfg, wd, policy, attempt, recoveries)
    ck.attach(trainer)
    step_seconds: list[float] = []
    step_cpu: list[float] = []  # process CPU (every thread: training, copy, tier threads) per step
    jit = None
    if use_jit:
        from torchmoe_ckpt.recovery.jit import JitCheckpointer

        jit = JitCheckpointer(trainer, host, host_dir / "jit")
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
                    ck.flush()  # a copy torn in the last iteration surfaces here; the host tier written
                break
            if fail is not None:
                pending.remove(fail)
                if fail.get("phase", "update") == "update":
                    trainer.before_update.append(_crash)
                elif fail["phase"] in ("kill", "freeze") and attempt == 0 and trainer.rank == fail.get("rank", 0):
                    if fail.get("settled"):
                        ck.flush(commit=False)  # no collective: the peers go on into the next step
                    act = _kill_self if fail["phase"] == "kill" else _freeze_self
                    if fail.get("at", "update") == "update":
                        trainer.before_update.append(_once(trainer, act))
                    else:
                        act()
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
    # End of training: the last upload may land before reporting; the store lease goes (the next job on this store
    # prefix need not wait); the exit summary; every thread stops.
    ck.close(upload_timeout_s=30.0)
    stats = ck.stats()
    wd.close()
    out = {"recoveries": recoveries, "checkpoint": stats, "step_seconds": step_seconds, "step_cpu_s": step_cpu}
    out["status_lines"] = [] if ck.persist is None else list(ck.persist.status.lines)[-16:]  # what a user read
    if jit is not None:
        jit.disarm()
        out["jit"] = {"enabled": jit.enabled, "shard": jit.shard, "replicas": jit.replicas}
    if wd.enabled:
        out["watchdog"] = dict(wd.stats(), events=read_events(spec.get("watchdog_events")))
    return trainer, out
