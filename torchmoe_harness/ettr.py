"""ETTR (effective training time ratio): the papers' formula, its exact form, and a failure simulator.

ETTR = useful training time / wall-clock time, where useful time is the iterations that survive to the end
of the run, each at the iteration time *without* checkpointing.

A system is a `SystemProfile`: iterations of `t_iter` seconds plus `per_iter_overhead_s`, a recovery point
every `interval` iterations that costs an extra `stall_s` on the training thread, and per failure a
recovery of `restart_s` + `replay_iters` x `replay_s_per_iter` after which training resumes from the newest
recovery point (everything after it is redone). Lossy systems (PEC/MoC, MoEtion) also lose expert updates:
`lossy` describes how many tokens per failure and, for MoC's Dynamic-K, how the checkpointed expert count K
and with it the stall grow after failures.

  ettr_paper  MoEvement §2.4 / Daly first order:
              1/(1 + T_ckpt/(T_iter x interval)) x 1/(1 + E[R]/MTBF),  E[R] = R_fixed + interval x T_iter / 2
  ettr_exact  the expectation under the simulator's model (Poisson failures on the wall clock, a failure
              during recovery restarts it): E[T_segment] = MTBF e^{R/MTBF} (e^{tau/MTBF} - 1)  (Daly 2006)
  simulate    event simulation with Poisson failures at an MTBF or a replayed failure-time trace
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field, replace

from torchmoe_ckpt.planning.policy import ettr


@dataclass
class LossyModel:
    """Partial expert checkpointing: each checkpoint saves all non-expert state and `k` of `experts` experts
    per MoE layer. A failure loses, per expert, the tokens routed to it since its last save: with round-robin
    selection (P = experts/k) that is (P-1)/2 checkpoint intervals' worth of expert tokens on average;
    `selection_factor` < 1 for popularity-aware selection (MoEtion: ~0.5 of round-robin's tokens at risk)."""

    experts: int
    k: int = 1
    selection_factor: float = 1.0
    # stall per checkpoint as a function of K: max(0, dense_stall_s x (nonexpert + (1-nonexpert) K/E) - hidden_s)
    dense_stall_s: float = 0.0
    nonexpert_fraction: float = 0.1
    hidden_s: float = 0.0
    # MoC Dynamic-K: after each failure, while lost/processed expert tokens (PLT so far) > plt_limit, K *= 2
    dynamic_k: bool = False
    plt_limit: float = 0.02

    def stall(self, k: int) -> float:
        frac = self.nonexpert_fraction + (1 - self.nonexpert_fraction) * k / self.experts
        return max(0.0, self.dense_stall_s * frac - self.hidden_s)

    def lost_intervals_per_failure(self, k: int) -> float:
        """Checkpoint intervals' worth of expert tokens lost per failure (round-robin staleness)."""
        return self.selection_factor * (self.experts / k - 1) / 2


@dataclass
class SystemProfile:
    name: str
    t_iter: float  # s, one iteration without checkpointing (the useful work)
    interval: int = 1  # iterations between recovery points
    per_iter_overhead_s: float = 0.0  # added to every iteration (async copy contention, waits)
    stall_s: float = 0.0  # extra training-thread time at each recovery point
    restart_s: float = 0.0  # per failure: detect, restart, load
    replay_iters: float = 0.0  # iterations replayed during recovery (sparse: W-1)
    replay_s_per_iter: float | None = None  # default t_iter
    lossy: LossyModel | None = None
    exact: bool = True
    note: str = ""
    commit_lag_s: float = 0.0  # a recovery point is usable this long after its iteration (an async write's)

    @property
    def iter_s(self) -> float:
        return self.t_iter + self.per_iter_overhead_s

    def recovery_s(self) -> float:
        rs = self.t_iter if self.replay_s_per_iter is None else self.replay_s_per_iter
        return self.restart_s + self.replay_iters * rs

    def stall(self, k: int | None = None) -> float:
        if self.lossy is not None and self.lossy.dense_stall_s:
            return self.lossy.stall(self.lossy.k if k is None else k)
        return self.stall_s

    def segment_s(self, k: int | None = None) -> float:
        return self.interval * self.iter_s + self.stall(k)

    def overhead_fraction(self) -> float:
        """Steady-state checkpointing cost per iteration / t_iter."""
        return (self.segment_s() / self.interval - self.t_iter) / self.t_iter

    def to_dict(self) -> dict:
        return asdict(self)


def ettr_paper(p: SystemProfile, mtbf_s: float) -> float:
    """The papers' first-order formula (MoEvement §2.4, after Daly): checkpoint cost x failure cost."""
    e_r = p.recovery_s() + 0.5 * p.interval * p.iter_s
    return 1.0 / (1.0 + p.overhead_fraction()) / (1.0 + e_r / mtbf_s)


def ettr_exact(p: SystemProfile, mtbf_s: float) -> float:
    """Expected ETTR under the simulator's model (static K), for an infinite horizon: the library's formula
    (torchmoe_ckpt.planning.policy.ettr, what `policy="auto"` decides on)."""
    return ettr(p.interval, p.t_iter, mtbf_s, p.per_iter_overhead_s, p.stall(), p.recovery_s())


def best_interval(p: SystemProfile, mtbf_s: float, max_interval: int = 5000) -> int:
    """Oracle interval (Gemini in MoEvement's evaluation): the one that maximises ETTR at this MTBF."""
    return max(range(1, max_interval + 1), key=lambda k: ettr_exact(replace(p, interval=k), mtbf_s))


def overhead_capped_interval(p: SystemProfile, cap: float = 0.03) -> int:
    """CheckFreq's policy in MoEvement's evaluation: the most frequent interval with overhead <= cap."""
    k = 1
    while replace(p, interval=k).overhead_fraction() > cap and k < 1_000_000:
        k += 1
    return k


# ---- the simulator ----------------------------------------------------------------------------------------


def poisson_trace(mtbf_s: float, horizon_s: float, seed: int = 0) -> list[float]:
    rnd = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rnd.expovariate(1.0 / mtbf_s)
        if t >= horizon_s:
            return out
        out.append(t)


def periodic_trace(mtbf_s: float, horizon_s: float) -> list[float]:
    """One failure every MTBF (what a fixed-MTBF 12-hour run injects: 6 failures at 2H)."""
    return [mtbf_s * i for i in range(1, int(horizon_s / mtbf_s) + 1) if mtbf_s * i < horizon_s]


@dataclass
class SimResult:
    ettr: float
    wall_s: float
    useful_s: float
    iterations: int
    failures: int
    lost_iterations: int  # iterations redone (progress beyond the newest recovery point)
    recovery_s: float  # restart + replay, summed (restarted recoveries included)
    checkpoint_s: float  # overhead + stalls of iterations that survived or were lost
    tokens_lost_intervals: float  # lossy: lost expert tokens, in checkpoint intervals' worth of expert tokens
    plt: float  # lossy: lost / processed expert tokens
    final_k: int | None = None
    k_history: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def simulate(
    p: SystemProfile,
    horizon_s: float | None = None,
    iterations: int | None = None,
    mtbf_s: float | None = None,
    trace: list[float] | None = None,
    seed: int = 0,
    recoveries: list[float] | None = None,
) -> SimResult:
    """Run `p` until `horizon_s` of wall time or until `iterations` are done, with failures at the times of
    `trace` (seconds of wall time) or Poisson at `mtbf_s`. Progress advances one segment (`interval`
    iterations + stall) at a time; a failure inside a segment or a recovery loses the unfinished segment.
    `recoveries`: the recovery seconds of the 1st, 2nd, ... failure (a replayed run's own; `p`'s after them)."""
    if (horizon_s is None) == (iterations is None):
        raise ValueError("give exactly one of horizon_s, iterations")
    if trace is None:
        if mtbf_s is None:
            raise ValueError("give mtbf_s or a trace")
        rnd = random.Random(seed)

        def failures():
            t = 0.0
            while True:
                t += rnd.expovariate(1.0 / mtbf_s)
                yield t

        fail_iter = failures()
    else:
        fail_iter = iter(sorted(trace))
    nxt = next(fail_iter, math.inf)
    lossy = p.lossy
    k = lossy.k if lossy else None
    k_hist = [(0.0, k)] if lossy else []
    now = done = lost_it = 0
    now = 0.0
    rec_s = ck_s = lost_tok = 0.0
    n_fail = n_rec = 0
    end_t = horizon_s if horizon_s is not None else math.inf
    goal = iterations if iterations is not None else math.inf
    a = p.iter_s
    while now < end_t and done < goal:
        n = min(p.interval, goal - done) if iterations is not None else p.interval
        seg = n * a + (p.stall(k) if n == p.interval else 0.0)
        if now + seg <= min(nxt, end_t):  # segment completes: a new recovery point
            now += seg
            done += n
            ck_s += seg - n * p.t_iter
            continue
        if end_t <= nxt:  # horizon ends inside the segment: count its finished iterations as useful
            part = int((end_t - now) / a)
            done += min(part, n)
            now = end_t
            break
        # failure inside the segment
        part = min(int((nxt - now) / a), n)
        lost_it += part
        ck_s += part * (a - p.t_iter)
        now = nxt
        n_fail += 1
        if lossy:
            lost_tok += lossy.lost_intervals_per_failure(k)
        n_rec += 1
        r = recoveries[n_rec - 1] if recoveries and n_rec <= len(recoveries) else p.recovery_s()
        while True:  # recovery; a failure during it restarts it
            nxt = next(fail_iter, math.inf)
            if now + r <= nxt:
                now += r
                rec_s += r
                break
            rec_s += nxt - now
            now = nxt
            n_fail += 1
        if lossy and lossy.dynamic_k:
            processed = max(done / p.interval, 1.0)  # checkpoint intervals' worth of expert tokens
            while lost_tok / processed > lossy.plt_limit and k < lossy.experts:
                k = min(2 * k, lossy.experts)
                k_hist.append((now, k))
    done = int(min(done, goal))
    useful = done * p.t_iter
    plt = lost_tok / max(done / p.interval, 1.0) if lossy else 0.0
    return SimResult(
        useful / now if now > 0 else 0.0, now, useful, done, n_fail, lost_it, rec_s, ck_s, lost_tok, plt, k, k_hist
    )


def failure_iterations(mtbf_iterations: float, count: int, seed: int = 0, first: int = 2) -> tuple[int, list[int]]:
    """(steps, iterations): `count` failures at the same iterations for every system, a Poisson process in
    iterations conditioned on `count` failures in `count` x MTBF iterations (uniform order statistics), distinct,
    from iteration `first` on. A failure strikes the first execution of its iteration, before its update."""
    steps = max(int(round(count * mtbf_iterations)), count + first)
    rnd = random.Random(seed)
    return steps, sorted(rnd.sample(range(first, steps + 1), count))


def simulate_iterations(
    p: SystemProfile,
    iterations: int,
    fail_at: list[int],
    fail_fraction: float = 1.0,
    recoveries: list[float] | None = None,
    sliding: bool = False,
    from_recovery: bool = False,
    commit_lags: list[float] | None = None,
    iter_times: list[float] | None = None,
    failed_s: list[float] | None = None,
) -> SimResult:
    """Run `p` for `iterations` with a failure in the first execution of each iteration of `fail_at`, after
    `fail_fraction` of it. The recovery point is the newest completed segment end (every `interval` iterations
    from 0, or, `from_recovery`, from the last recovery point, as windows start again after a recovery; or,
    `sliding`, the iteration before the failed one) that was durable when the failure struck (`commit_lag_s`
    after it completed); recovery costs `recoveries[i]` for the i-th failure (default `p.recovery_s()`), then
    every iteration after the recovery point is trained again; `commit_lags[i]`: the i-th checkpoint's own lag
    (a replayed run's, in the order they were taken; `p.commit_lag_s` after them). Checkpoint costs are in
    `p.iter_s` (stalls amortised: `stall_s` is not charged separately here). A replayed run can also give its
    pace as it was: `iter_times[i]`, the i-th executed iteration's wall time (then `p.iter_s` after them), and
    `failed_s[i]`, the i-th failure's time in its failed iteration: whether an async checkpoint was durable
    when a failure struck depends on the time since it, which a mean pace misjudges when the iterations right
    after a checkpoint are slower (its background write shares the cores)."""
    a = p.iter_s
    lags = iter(commit_lags or ())
    times = iter(iter_times or ())
    fails = sorted(set(fail_at))
    now, step, lost, rec_s, n, base = 0.0, 0, 0, 0.0, 0, 0
    ready = {0: 0.0}  # recovery point (iteration) -> wall time it became durable
    while step < iterations:
        nxt = step + 1
        if fails and fails[0] == nxt:
            fails.pop(0)
            now += failed_s[n] if failed_s and n < len(failed_s) else fail_fraction * a
            usable = [pt for pt, t in ready.items() if t <= now and pt <= step]
            point = step if sliding else max(usable)
            lost += step - point
            r = recoveries[n] if recoveries and n < len(recoveries) else p.recovery_s()
            now += r
            rec_s += r
            n += 1
            base = point if from_recovery else 0
            step = point
            ready = {pt: t for pt, t in ready.items() if pt <= point}
            continue
        now += next(times, a)
        step = nxt
        if (step - base) % p.interval == 0 or sliding:
            ready[step] = now + next(lags, p.commit_lag_s)
    useful = iterations * p.t_iter
    return SimResult(useful / now, now, useful, iterations, n, lost, rec_s, 0.0, 0.0, 0.0)


def simulate_mean(p: SystemProfile, horizon_s: float, mtbf_s: float, seeds: int = 20) -> float:
    return sum(simulate(p, horizon_s, mtbf_s=mtbf_s, seed=s).ettr for s in range(seeds)) / seeds


# ---- profiles from measurements -----------------------------------------------------------------------------


def profiles_from_bench(res: dict, model: str | None = None) -> list[SystemProfile]:
    """SystemProfiles from `torchmoe-ckpt bench` JSON (one model): measured step time without
    checkpointing, per-iteration overhead, interval, recovery time."""
    m = next(r for r in res["models"] if model in (None, r["model"]))
    t_base = m["baseline_step_s"]
    out = []
    for key, s in m["systems"].items():
        if key.startswith("baseline") or "step_s" not in s or "recovery_s" not in s:
            continue  # no failure injected in that run: no recovery time to feed
        interval = int(s.get("interval") or s.get("window") or 1)
        out.append(
            SystemProfile(
                key,
                t_base,
                interval=interval,
                per_iter_overhead_s=max(0.0, s["step_s"] - t_base),
                restart_s=float(s.get("recovery_s") or 0.0),  # measured recovery includes any replay
                exact=bool(s.get("exact", True)),
                note="measured",
            )
        )
    return out


# ---- MoEvement Table 3, DeepSeek-MoE (96 A100, PP12 x EP8, 12-hour runs) -----------------------------------

MTBFS = {"2H": 7200.0, "1H": 3600.0, "30M": 1800.0, "20M": 1200.0, "10M": 600.0}
# The paper's Table 3 ETTR for DeepSeek-MoE, to print next to the simulated shape.
PAPER_TABLE3 = {
    "CheckFreq": [0.902, 0.877, 0.827, 0.777, 0.672],
    "Gemini": [0.910, 0.894, 0.853, 0.814, 0.728],
    "MoC": [0.933, 0.349, 0.324, 0.168, 0.134],
    "MoEvement": [0.975, 0.970, 0.965, 0.956, 0.951],
}
DEEPSEEK = {
    "params": 16.4e9,
    "gpus": 96,
    "pp": 12,
    "experts": 64,
    "expert_fraction": 0.91,  # 27 MoE layers x 64 x 3x2048x1408
    "t_iter": 2.9,  # s; Table 3's overhead percentages imply ~2.7-3.5 s
    "checkfreq_stall_s": 9.9,  # 0.08 s/iteration x 124 (Table 3): snapshot + persist interference
    "gemini_stall_s": 4.35,  # Fig. 1: checkpointing every iteration is 2.5x slower (CPU memory + peer copy)
    "moc_dense_stall_s": 10.7,  # §2.2: MoC at all experts is ~4.7x slower (two-level PEC, persisted)
    "moc_k1_overhead_s": 0.22,  # Table 3: MoC 0.22 s/iteration at K=1
    "moevement_overhead_s": 0.06,
    "moevement_window": 6,
    "restart_in_memory_s": 3.0,  # restart + load from CPU memory / peers
    "restart_remote_s": 46.0,  # + load 230 GB from blob storage at 40 Gbps
    "moc_plt_limit": 0.02,  # Dynamic-K limit: not given by the papers (calibrated, see docs)
}


def deepseek_profiles(d: dict | None = None) -> dict[str, SystemProfile]:
    """Profiles of the four systems from a model/cluster description (default: DeepSeek-MoE above).
    Intervals are set per MTBF by the policies (see `table3`)."""
    d = dict(DEEPSEEK, **(d or {}))
    t = d["t_iter"]
    nonexpert = 1 - d["expert_fraction"]
    k1_frac = nonexpert + d["expert_fraction"] / d["experts"]
    moc = LossyModel(
        experts=d["experts"],
        k=1,
        dense_stall_s=d["moc_dense_stall_s"],
        nonexpert_fraction=nonexpert,
        hidden_s=d["moc_dense_stall_s"] * k1_frac - d["moc_k1_overhead_s"],
        dynamic_k=True,
        plt_limit=d["moc_plt_limit"],
    )
    return {
        "CheckFreq": SystemProfile(
            "CheckFreq",
            t,
            stall_s=d["checkfreq_stall_s"],
            restart_s=d["restart_remote_s"],
            note="interval: overhead <= 3%",
        ),
        "Gemini": SystemProfile(
            "Gemini",
            t,
            stall_s=d["gemini_stall_s"],
            restart_s=d["restart_in_memory_s"],
            note="interval: oracle (best ETTR per MTBF)",
        ),
        "MoC": SystemProfile(
            "MoC",
            t,
            interval=1,
            restart_s=d["restart_in_memory_s"],
            lossy=moc,
            exact=False,
            note="K=1 of 64 per iteration, Dynamic-K",
        ),
        "MoEvement": SystemProfile(
            "MoEvement",
            t,
            interval=d["moevement_window"],
            per_iter_overhead_s=d["moevement_overhead_s"],
            restart_s=d["restart_in_memory_s"],
            replay_iters=d["moevement_window"] - 1,
            replay_s_per_iter=t / d["pp"],
            note=f"W={d['moevement_window']}, localized replay",
        ),
    }


def table3(hours: float = 12.0, failures: str = "periodic", seeds: int = 20, model: dict | None = None) -> dict:
    """Simulated ETTR per system and MTBF for the DeepSeek-MoE setting; intervals per the paper's policies."""
    horizon = hours * 3600
    base = deepseek_profiles(model)
    rows = []
    for label, mtbf in MTBFS.items():
        for name, p in base.items():
            if name == "Gemini":
                p = replace(p, interval=best_interval(p, mtbf))
            elif name == "CheckFreq":
                p = replace(p, interval=overhead_capped_interval(p, 0.03))
            runs = (
                [simulate(p, horizon, trace=periodic_trace(mtbf, horizon))]
                if failures == "periodic"
                else [simulate(p, horizon, mtbf_s=mtbf, seed=s) for s in range(seeds)]
            )
            n = len(runs)
            rows.append(
                {
                    "system": name,
                    "mtbf": label,
                    "interval": p.interval,
                    "overhead_s": p.segment_s() / p.interval - p.t_iter,
                    "overhead_fraction": p.overhead_fraction(),
                    "ettr": sum(r.ettr for r in runs) / n,
                    "ettr_formula": ettr_paper(p, mtbf),
                    "recovery_s": sum(r.recovery_s + r.lost_iterations * p.iter_s for r in runs) / n,
                    "failures": sum(r.failures for r in runs) / n,
                    "final_k": runs[0].final_k,
                    "plt": sum(r.plt for r in runs) / n,
                    "paper_ettr": PAPER_TABLE3[name][list(MTBFS).index(label)],
                }
            )
    return {
        "setting": "DeepSeek-MoE 16.4B, 96 A100 (PP12 x EP8), MoEvement Table 3",
        "hours": hours,
        "failures": failures,
        "model": dict(DEEPSEEK, **(model or {})),
        "rows": rows,
    }


def format_table3(res: dict) -> str:
    names = list(PAPER_TABLE3)
    lines = [
        f"{res['setting']}; {res['hours']:g} h, {res['failures']} failures",
        "",
        "| MTBF | " + " | ".join(f"{n} interval | {n} ETTR (paper)" for n in names) + " |",
        "|---|" + "---|---|" * len(names),
    ]
    for label in MTBFS:
        cells = []
        for n in names:
            r = next(x for x in res["rows"] if x["system"] == n and x["mtbf"] == label)
            iv = f"{r['interval']}" + (f" (K={r['final_k']})" if r["final_k"] else "")
            cells.append(f"{iv} | {r['ettr']:.3f} ({r['paper_ettr']:.3f})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_measured(rows: list[dict]) -> str:
    lines = [
        "| system | interval | overhead | recovery s | MTBF s | ETTR (exact) | ETTR (paper formula) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['system']} | {r['interval']} | {r['overhead_fraction']:+.3f} | {r['recovery_s']:.3f} | "
            f"{r['mtbf_s']:g} | {r['ettr']:.3f} | {r['ettr_formula']:.3f} |"
        )
    return "\n".join(lines)


def measured_rows(bench: dict, mtbfs_s: list[float], model: str | None = None) -> list[dict]:
    """ETTR of the bench's measured systems at the given MTBFs (exact expectation, Poisson failures)."""
    rows = []
    for p in profiles_from_bench(bench, model):
        for m in mtbfs_s:
            rows.append(
                {
                    "system": p.name,
                    "interval": p.interval,
                    "overhead_fraction": p.overhead_fraction(),
                    "recovery_s": p.recovery_s(),
                    "mtbf_s": m,
                    "ettr": ettr_exact(p, m),
                    "ettr_formula": ettr_paper(p, m),
                    "exact": p.exact,
                }
            )
    return rows


def run_simulate(
    out: str | None = None,
    failures: str = "poisson",
    seeds: int = 20,
    hours: float = 12.0,
    bench: str | None = None,
    mtbfs_s: list[float] | None = None,
) -> tuple[dict, str]:
    """`torchmoe-ckpt simulate`: Table 3's shape for DeepSeek-MoE, plus (with `bench`) ETTR of the measured
    systems at scaled-down MTBFs. Returns (JSON-able result, text)."""
    import json
    from pathlib import Path

    res = {"table3": table3(hours, failures, seeds)}
    text = format_table3(res["table3"])
    if bench:
        b = json.loads(Path(bench).read_text())
        res["measured"] = {}
        for m in b["models"]:
            t = m["baseline_step_s"]
            ms = mtbfs_s or [1000 * t, 200 * t, 50 * t]  # in iterations of this machine: rare to frequent
            res["measured"][m["model"]] = rows = measured_rows(b, ms, m["model"])
            text += f"\n\nMeasured ({m['model']}, t_iter {t * 1000:.1f} ms), exact-formula ETTR:\n" + format_measured(
                rows
            )
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(res, indent=1))
    return res, text
