"""torchrun worker of the GPU check's benchmark (phase 3, gpu_check_bench.py): one rank, one model, every system
taking turns in the same process (A B C A B C ..., the order rotated each repetition), as the MoE-regime bench does
(bench_moe_worker), measured the way a GPU needs:

- step time from CUDA events on the training stream (each step from its start to the next step's start: the time
  the device gives an iteration, waits for copies included) and wall time around the whole turn, the device
  synchronised at both ends; on a CPU the wall time of each step;
- the training thread's blocked time: its host time inside the system's calls (`after_step` and the hooks it puts
  before the update);
- device-to-host throughput of the system's copies (CUDA-event timed) against the pinned-copy peak measured here;
- host memory: RSS and pinned bytes in use (torch's host allocator) during the turn, and the system's own
  accounting where its `stats()` has one;
- host syncs on the training thread per iteration (CUDA sync debug mode);
- ours: every measured slot copy's stall, ready-to-start delay, copy time and bytes (gpu_check_slots.SlotTimer);
- after the repetitions, a short torch.profiler window of `none` and of ours (gpu_check_profile.py).

A system lives for one turn: built, warmed up, measured, finished and closed, so that only one system's host buffers
exist at a time and a model of half a billion parameters fits the host (every system's buffers at once would not).
After every turn the system and its slot sets are dropped (del, gc, the device cache emptied); its pinned blocks go
back to the OS (torch's host cache emptied) unless the next turn is of the same pinned footprint (`pin_class`: the
W = 4 ablations reuse one another's blocks, as pinning 16 GB again costs seconds per turn), and always when less
than 40% of the host's memory is available. Each turn prints one line with RSS and pinned bytes after that. What
auto W learned carries over to the next turn's instance, as `SparseCheckpointer.inherit_counters` carries it over a
restart. A turn whose fix switch this library lacks is skipped with one line (gpu_check_bench.missing_switch).

Regimes: the same model and process, one regime after the other (`spec["regimes"]`, gpu_check_bench.REGIMES): each
sets the accumulated micro-batches per step (given, or enough for a step of `min_step_s`) and runs its own turns'
repetitions under its own deadline. partial.json is rewritten after every turn (what a killed worker leaves).

Spec: {"run": RunConfig fields, "systems": {name: {"kind": ..., params}}, "periodic": {name: {"kind": ...,
"probe_every": k, "params": {...}}}, "regimes": [{"name", "systems": [names] or None, "periodic": [names],
"micro_batches" or "min_step_s", "reps", "measure", "deadline_s"}], "reps", "warmup", "measure", "windows",
"mtbf_iterations", "workdir", "profile": {"systems": [...], "steps": n, "start_by_s"} or None}. A periodic system
runs at `probe_every` in the first repetition, then at the ETTR-optimal interval its measured stall gives. Kinds:
those of `baselines.make_system`, and "ours_host" (ours with the host tier under workdir). rank 0 writes
report.json."""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import statistics
import time
from pathlib import Path

import torch

from torchmoe_ckpt.config import SparseConfig
from torchmoe_ckpt.persist.build_tiers import build_tiers
from torchmoe_ckpt.planning.schedule import measure_copy_bandwidth
from torchmoe_ckpt.sparse_checkpointer import RunContext, SparseCheckpointer
from torchmoe_harness.baselines import make_system
from torchmoe_harness.baselines.ours import Ours
from torchmoe_harness.bench_moe_worker import MAX_INTERVAL, _detach, _engine
from torchmoe_harness.ettr import SystemProfile, best_interval
from torchmoe_harness.gpu_check_bench import host_meminfo, missing_switch, pin_class
from torchmoe_harness.gpu_check_slots import SlotTimer
from torchmoe_harness.gpu_check_syncs import SyncCounter
from torchmoe_harness.scenario import run_identity
from torchmoe_harness.trainer import RunConfig, Trainer
from torchmoe_harness.worker import serve


class OursHostTier(Ours):
    """Ours with the host tier (slots persisted to shared memory under `root`, committed windows kept there)."""

    def __init__(self, trainer, root: str, window: int | None = None, overlap: float | None = None):
        host = {"root": root, "run_id": Path(root).name}
        self.cfg = SparseConfig(window=window, overlap=overlap, policy="sparse")
        self.ck = SparseCheckpointer(
            trainer.model,
            trainer.optimizer,
            trainer.compute_dtype,
            self.cfg,
            RunContext(
                tiers=build_tiers(host, trainer.rank, trainer.world, trainer.cfg.hsdp),
                identity=run_identity(trainer, host),
            ),
        )
        self._attached = None

    def close(self) -> None:
        self.ck.close(upload_timeout_s=30.0)


def build(kind: str, params: dict, trainer: Trainer, workdir: Path):
    if kind == "ours_host":
        return OursHostTier(trainer, str(workdir), **params)
    return make_system(kind, trainer, params, str(workdir))


def pinned_copy_peak(device: torch.device, nbytes: int) -> float:
    """Device-to-host bytes/s into pinned memory, best of 3 (CUDA events); on a CPU a plain host memcpy's."""
    if device.type != "cuda":
        return measure_copy_bandwidth()
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    best = math.inf
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    del src, dst
    return nbytes / max(best, 1e-9)


def rss_bytes() -> int:
    """This process's resident memory now (pinned and shared-memory pages it touched included)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def host_available_fraction() -> float:
    """MemAvailable / MemTotal of this machine (1.0 where /proc/meminfo has neither)."""
    info = host_meminfo()
    return info["MemAvailable"] / info["MemTotal"] if info.get("MemTotal") and "MemAvailable" in info else 1.0


def pinned_in_use(device: torch.device) -> int | None:
    if device.type != "cuda" or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    return int(torch.cuda.host_memory_stats().get("active_bytes.current", 0))


def pinned_reserved(device: torch.device) -> int | None:
    """Pinned bytes torch's host allocator holds, in use or cached (what emptying its cache gives back)."""
    if device.type != "cuda" or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    st = torch.cuda.host_memory_stats()
    return int(st.get("reserved_bytes.current", st.get("allocated_bytes.current", 0)))


def release(device: torch.device, empty_host: bool) -> dict:
    """After a turn (its system already dropped): garbage collected, the device cache emptied, and with
    `empty_host` (or when less than 40% of the host is available) torch's cached pinned blocks handed back."""
    gc.collect()
    emptied = False
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        if empty_host or host_available_fraction() < 0.4:
            # the caching host allocator keeps every freed pinned block, reused only at its own power-of-two size:
            # a GPU run's worker was killed with seven systems' blocks piled up (docs/gpu.md)
            torch._C._host_emptyCache()  # CUDA builds only
            emptied = True
    info = host_meminfo()
    return {
        "rss_bytes": rss_bytes(),
        "pinned_in_use_bytes": pinned_in_use(device),
        "pinned_reserved_bytes": pinned_reserved(device),
        "host_available_bytes": info.get("MemAvailable"),
        "host_cache_emptied": emptied,
    }


def memory_line(rep: int, name: str, seconds: float, m: dict) -> str:
    def gb(x):
        return "-" if x is None else f"{x / 1e9:.1f} GB"

    return (
        f"[bench] rep {rep} {name}: {seconds:.1f} s; after release RSS {gb(m['rss_bytes'])}, pinned in use "
        f"{gb(m['pinned_in_use_bytes'])}, pinned held {gb(m['pinned_reserved_bytes'])}, host available "
        f"{gb(m['host_available_bytes'])}{', host cache emptied' if m['host_cache_emptied'] else ''}"
    )


def own_host_bytes(system) -> tuple[int | None, dict | None]:
    """The system's own account of the host bytes it holds, where its stats() has one: ours (every part, counted
    from its owners: torchmoe_ckpt/capture/host_memory.py) or a baseline's `host_bytes`. Returns (total, parts)."""
    for stats in (system.stats(), system.ck.stats() if hasattr(system, "ck") else {}):
        mem = stats.get("host_memory")
        if isinstance(mem, dict) and isinstance(mem.get("total"), int):
            return mem["total"], mem["parts"]
        for key in ("host_bytes", "host_bytes_total"):
            if isinstance(stats.get(key), (int, float)):
                return int(stats[key]), None
    return None, None


class _Timed:
    """A before-update hook, with the host time the training thread spends in it."""

    def __init__(self, hook, box: list):
        self.hook, self.box = hook, box

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.hook(*args, **kwargs)
        finally:
            self.box[0] += time.perf_counter() - t0


MAX_WARMUP = 40  # steps: ours' warm-up ends earlier (two window starts and a window boundary)


def _warm(system) -> bool:
    """Ours is in steady state: two windows started (both slot sets exist, the second allocated ahead on the
    allocator's helper thread, which is done) and the window being filled is full (the next step starts one)."""
    ck = getattr(system, "ck", None)
    if ck is None:
        return True
    cur = ck.current
    return len(ck.counters.windows) >= 2 and not ck.slots.preparing and (cur is None or cur.captured >= cur.plan.window)


def turn(trainer: Trainer, system, warmup: int, measure: int, every: int = 1, windows: int = 1) -> dict:
    """Warm up (at least `warmup` steps; ours until `_warm`), then measure whole checkpoint intervals: `measure`
    steps rounded up to a multiple of the interval (`every`; ours: its W, and at least `windows` windows)."""
    cuda = trainer.device.type == "cuda"
    before = list(trainer.before_update)
    if system is not None:
        system.attach(trainer)
    added = [h for h in trainer.before_update if h not in before]
    blocked = [0.0]
    trainer.before_update[:] = before + [_Timed(h, blocked) for h in added]
    warmed = 0
    while warmed < warmup or (warmed < MAX_WARMUP and not _warm(system)):
        res = trainer.train_step()
        if system is not None:
            system.after_step(trainer, res)
        warmed += 1
    ck = getattr(system, "ck", None)
    if ck is not None and ck.current is not None:
        every = ck.current.plan.window
    steps = every * max(math.ceil(measure / every), windows if ck is not None else 1)
    eng = _engine(system)
    if eng is not None:  # the warm-up's last copy lands first: only the copies of the measured steps are counted
        eng.wait_done()
    copy0 = dict(eng.copy_totals) if eng is not None else None
    stage0 = len(getattr(system, "stage_seconds", []))
    if cuda:
        torch.cuda.synchronize(trainer.device)
    blocked[0] = 0.0
    timer = None
    if ck is not None:  # per slot: stall, ready -> start, copy, bytes (events read after the window)
        timer = SlotTimer.install(eng, lambda: ck.current.plan.window if ck.current is not None else None)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)] if cuda else []
    wall, counter = [], SyncCounter(enabled=cuda)
    t_start = time.perf_counter()
    with counter:
        for i in range(steps):
            counter.step = i
            if cuda:
                events[i].record()
            t0 = time.perf_counter()
            res = trainer.train_step()
            if system is not None:
                h0 = time.perf_counter()
                system.after_step(trainer, res)
                blocked[0] += time.perf_counter() - h0
            wall.append(time.perf_counter() - t0)
        if cuda:
            events[steps].record()
            torch.cuda.synchronize(trainer.device)
    out = {"wall_s": wall, "turn_wall_s": time.perf_counter() - t_start, "blocked_s": blocked[0], "warmup": warmed}
    out["device_s"] = [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(steps)] if cuda else list(wall)
    out["syncs"] = sum(counter.by_step.values()) if counter.enabled else None
    out["sync_sites"] = dict(counter.sites.most_common(4)) if counter.enabled else None
    out["rss_bytes"], out["pinned_in_use_bytes"] = rss_bytes(), pinned_in_use(trainer.device)
    if system is not None:
        out["own_host_bytes"], out["own_host_parts"] = own_host_bytes(system)
    trainer.before_update[:] = before + added
    if timer is not None:
        timer.stalls = False  # the wait below finishes the last copy: no update follows it
    _detach(system, trainer)  # finishes the copies in flight: the figures below count them
    trainer.before_update[:] = before
    if timer is not None:
        if cuda:
            torch.cuda.synchronize(trainer.device)
        timer.uninstall()
        out["slots"] = timer.collect()
    if eng is not None:
        out["copy_bytes"] = eng.copy_totals["bytes"] - copy0["bytes"]
        out["copy_s"] = eng.copy_totals["wall_s"] - copy0["wall_s"]
        out["copies"] = eng.copy_totals["copies"] - copy0["copies"]  # one per measured step
        out["copies_skipped"] = bool(getattr(eng, "skip_copies", False))  # bytes counted, none moved
    if hasattr(system, "stage_seconds"):  # DCP: the staging copies of this turn's checkpoints
        done = system.stage_seconds[stage0:]
        out["copy_bytes"], out["copy_s"] = system.state_bytes * len(done), sum(done)
    return out


def _probe_interval(probe: dict, base: list[dict], every: int, mtbf_iterations: float) -> int:
    """ETTR-optimal interval of a periodic system from one turn at interval `every`: its stall per checkpoint is
    `every` x (its mean step - the no-checkpoint step), at an MTBF of `mtbf_iterations` x that step."""
    t = statistics.median(statistics.fmean(b["device_s"]) for b in base)
    stall = max(1e-6, every * (statistics.fmean(probe["device_s"]) - t))
    p = SystemProfile("periodic", t, stall_s=stall, restart_s=t)
    return max(1, min(MAX_INTERVAL, best_interval(p, mtbf_iterations * t, max_interval=4 * MAX_INTERVAL)))


def rotation(order: list[str], classes: dict, rep: int) -> list[str]:
    """Repetition `rep`'s order: the runs of same-footprint turns (`classes`: gpu_check_bench.pin_class) rotated,
    and the turns inside each run rotated too, so that every turn moves and each footprint is still pinned once
    per repetition (rotating turn by turn split one run in two: a second pin of its sets, ~13 s on an H200)."""
    groups: list[list[str]] = []
    for name in order:
        if groups and classes[name] is not None and classes[groups[-1][0]] == classes[name]:
            groups[-1].append(name)
        else:
            groups.append([name])
    k = rep % len(groups)
    groups = groups[k:] + groups[:k]
    return [n for g in groups for n in g[rep % len(g) :] + g[: rep % len(g)]]


def _micro_batches(trainer: Trainer, regime: dict) -> int:
    """The regime's accumulated micro-batches: as given, or (`min_step_s`) enough for a step of at least that long,
    from the median of 3 timed steps with one micro-batch (device synchronised around each)."""
    if regime.get("min_step_s") is None:
        return int(regime.get("micro_batches") or 1)
    trainer.set_micro_batches(1)
    cuda = trainer.device.type == "cuda"
    times = []
    for _ in range(3):
        if cuda:
            torch.cuda.synchronize(trainer.device)
        t0 = time.perf_counter()
        trainer.train_step()
        if cuda:
            torch.cuda.synchronize(trainer.device)
        times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    return max(1, min(regime.get("max_micro_batches", 64), math.ceil(regime["min_step_s"] / max(step, 1e-6))))


class _Partial:
    """partial.json beside report.json, replaced whole after every turn: what a worker killed mid-phase (out of
    memory, a time limit) leaves for the parent (gpu_check_bench.run_bench reads it when torchrun fails)."""

    def __init__(self, out: Path, head: dict):
        self.path, self.head = out / "partial.json", head

    def write(self, regimes: dict) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dict(self.head, regimes=regimes, partial=True), default=str))
        tmp.replace(self.path)


def run(spec: dict, out: Path) -> dict:
    t_begin = time.perf_counter()
    cfg = RunConfig(**spec["run"])
    trainer = Trainer(cfg)
    params = sum(p.numel() for p in trainer.model.parameters())
    for _ in range(2):  # first iterations allocate (optimizer state, FSDP buffers): not part of any turn
        trainer.train_step()
    dense = sum(p.numel() * 12 for p in trainer.model.parameters())  # fp32 master + two AdamW moments
    peak = pinned_copy_peak(trainer.device, min(dense, 1 << 30))
    release(trainer.device, empty_host=True)  # the peak's own pinned buffer goes back
    workdir = Path(spec["workdir"])
    head = {
        "device": str(trainer.device),
        "device_name": torch.cuda.get_device_name(trainer.device) if trainer.device.type == "cuda" else "cpu",
        "params": params,
        "dense_bytes": dense,
        "pinned_copy_peak_bytes_per_s": peak,
        "setup_s": time.perf_counter() - t_begin,
    }
    partial = _Partial(out, head)
    regimes: dict[str, dict] = {}
    specs_all = {"none": None, **spec["systems"]}
    for regime in spec["regimes"]:
        name = regime["name"]
        trainer.set_micro_batches(_micro_batches(trainer, regime))
        print(f"[bench] regime {name}: {trainer.cfg.micro_batches} micro-batch(es) per step", flush=True)
        regimes[name] = {"micro_batches": trainer.cfg.micro_batches}
        wanted = regime.get("systems")
        specs = {n: sp for n, sp in specs_all.items() if wanted is None or n == "none" or n in wanted}
        periodic = {n: p for n, p in spec.get("periodic", {}).items() if n in regime.get("periodic", ())}
        _repetitions(trainer, spec, regime, specs, periodic, workdir, t_begin, partial, regimes)
        partial.write(regimes)
    trainer.set_micro_batches(1)
    profile, skipped = None, []
    prof_spec = spec.get("profile")
    if prof_spec and time.perf_counter() - t_begin <= prof_spec.get("start_by_s", math.inf):
        from torchmoe_harness.gpu_check_profile import profile_systems

        skipped_turns = {n for r in regimes.values() for n in r["skipped_turns"]}
        systems = {n: specs_all[n] for n in prof_spec["systems"] if n in specs_all and n not in skipped_turns}
        profile = profile_systems(trainer, systems, prof_spec["steps"], spec["warmup"], workdir, build)
        release(trainer.device, empty_host=True)
    elif prof_spec:
        skipped.append("the profiler window: the deadline would pass")
    return dict(
        head,
        regimes=regimes,
        skipped=skipped,
        profile=profile,
        steps=trainer.step,
        seconds=time.perf_counter() - t_begin,
    )


def _repetitions(
    trainer: Trainer,
    spec: dict,
    regime: dict,
    specs: dict,
    periodic: dict,
    workdir: Path,
    t_begin: float,
    partial: _Partial,
    regimes: dict,
) -> None:
    """One regime: its turns taking turns, the order rotated each repetition, until `regime["reps"]` or its
    deadline (no repetition starts that would end past it). Its turns, intervals and skips go into
    `regimes[regime["name"]]` as they come, so that partial.json, rewritten after every turn, has them."""
    deadline = regime.get("deadline_s") or math.inf
    reps, measure = regime.get("reps", spec["reps"]), regime.get("measure", spec["measure"])
    specs = dict(specs)
    skipped_turns = {n: why for n, sp in specs.items() if sp is not None and (why := missing_switch(sp))}
    for name, why in skipped_turns.items():
        print(f"[bench] {name}: skipped, {why}", flush=True)
    for name, p in periodic.items():
        specs[name] = {"kind": p["kind"], "every": p["probe_every"], **p.get("params", {})}
    order = [n for n in specs if n not in skipped_turns]
    turns: dict[str, list] = {name: [] for name in order}
    learned: dict[str, tuple] = {}  # ours: what auto W learned (copy cost, W), for the next turn's instance
    intervals, skipped, rep_s = {}, [], []
    record = regimes[regime["name"]]
    record.update(turns=turns, intervals=intervals, skipped=skipped, skipped_turns=skipped_turns, rep_s=rep_s)
    for rep in range(reps):
        t_rep = time.perf_counter()
        if rep_s and time.perf_counter() - t_begin + max(rep_s) > deadline:
            skipped.append(f"repetition {rep} and later: the deadline ({deadline:.0f} s) would pass")
            break
        if rep == 1:  # the probe measured: every periodic system at its best interval from now on
            for name, p in periodic.items():
                intervals[name] = _probe_interval(
                    turns[name][0], turns["none"], p["probe_every"], spec["mtbf_iterations"]
                )
                specs[name] = dict(specs[name], every=intervals[name])
        rotated = rotation(order, {n: pin_class(specs[n]) for n in order}, rep)
        for i, name in enumerate(rotated):
            sp = dict(specs[name] or {"kind": "none"})
            every = sp.get("every", 1)  # whole intervals are measured: the mean covers one checkpoint each
            t0 = time.perf_counter()
            kind = sp.pop("kind")
            system = None if kind == "none" else build(kind, sp, trainer, workdir / f"{name}-{rep}")
            if hasattr(system, "ck") and name in learned:
                system.ck.planner.cost, system.ck.planner.auto_w = learned[name]
            built_s = time.perf_counter() - t0
            res = turn(trainer, system, spec["warmup"], measure, every, regime.get("windows", spec.get("windows", 1)))
            if system is not None:
                if hasattr(system, "ck"):
                    learned[name] = (system.ck.planner.cost, system.ck.planner.auto_w)
                    res["windows_W"] = [w["W"] for w in system.ck.stats()["windows"]]
                res["stats"] = {k: v for k, v in system.stats().items() if isinstance(v, (int, float, str, list))}
                system.close()
            del system
            # the next turn of the same pinned footprint (`none` holds none) reuses these blocks; any other turn
            # gets them back from the OS, and so does the end of a repetition
            mine = pin_class(specs[name])
            nxt = next((c for n in rotated[i + 1 :] if (c := pin_class(specs[n])) is not None), None)
            res["after_release"] = mem = release(trainer.device, mine is not None and nxt != mine)
            shutil.rmtree(workdir / f"{name}-{rep}", ignore_errors=True)
            res.update(rep=rep, every=every, build_s=built_s, total_s=time.perf_counter() - t0)
            turns[name].append(res)
            print(memory_line(rep, name, res["total_s"], mem), flush=True)
            partial.write(regimes)
        rep_s.append(time.perf_counter() - t_rep)
    for name, p in periodic.items():  # only the turns at the interval chosen count (the probe's if it is the same)
        intervals.setdefault(name, p["probe_every"])
        turns[name] = [t for t in turns[name] if t["every"] == intervals[name]]


def main() -> None:
    serve(run)


if __name__ == "__main__":
    main()
