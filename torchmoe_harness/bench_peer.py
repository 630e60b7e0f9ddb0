"""The peer-tier section of `make bench`: what replicating to another node's memory costs when the copy crosses the
same link as training's collectives, ours (sparse windows) against a dense snapshot replicated to the peer node
(Gemini-style), on 2 real nodes of the namespace cluster (cluster.py) at link rates set with `tc tbf`.

`run(out, say) -> dict`, `markdown(res) -> list[str]`, `plot(res, path)` (the section interface of
`bench.run_bench`); alone: `python -m torchmoe_harness.bench_peer [--out DIR]` (merged into DIR/bench.json).
Where namespaces cannot be made (not root, no `ip`/`tc`), the section skips in one line.

Method (docs/benchmarks.md, "Peer tier on a shared link"): the harness model `MODEL`, fp32, FSDP2 over 2 nodes x 1
rank, so every step's all-gathers and reduce-scatters cross the throttled link. Per rate, one job each:
  host     replicas = 0, W = 3: training and the host tier only (the base step, `t_iter`)
  sparse   replicas = 1, W = 3: ours, each window pushed to the other node once committed
  sparse_auto  replicas = 1, W = 3, peer_interval "auto": ours, every k-th window pushed, k chosen so that the pushes
           take at most 5 % of the link's time (tiers/peer_interval.py); its overhead is from the MEAN step
           (a median hides a push every k windows), and its ETTR interval is W x the measured windows per push
  dense    replicas = 1, W = 1: every iteration a full snapshot (each slot holds the whole state), pushed to the
           other node: a dense snapshot replicated every iteration (when the link is still busy with the last one,
           the newest is sent and the ones in between are skipped: the effective interval is measured)
and `host` once more after the other two (t_iter is the mean of both: the shared machine drifts between jobs), and
one unlimited `host` job: the collectives' share of the step at a rate is 1 - t(unlimited) / t(rate).
Overhead = median step / t_iter - 1 (the first `WARMUP` steps left out). The dense snapshot at its best interval
k is priced from the dense job: each snapshot shipped costs its measured training time (overhead x t_iter x the
effective interval), so at interval k the overhead is that / k; k maximises ETTR (ettr.best_interval).

ETTR: one trace of node losses at the same wall-clock times for every system and rate (`TRACE`: Poisson, seeded),
simulated by ettr.simulate from each system's measured profile. Restarts are treated alike: the same restart
time `RESTART_S` for every system, plus what is system-specific and measured: pulling the lost node's copy
over the link (its bytes / the link's measured rate), ours' replay of its window, and the replication lag (work
after the newest copy on the peer is lost)."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from torchmoe_harness.ettr import SystemProfile, best_interval, poisson_trace, simulate

MODEL = {"dim": 64, "num_experts": 8, "expert_hidden": 128, "n_layers": 2, "n_heads": 2}
RUN = {"model": MODEL, "steps": 20, "dtype": "fp32"}
RATES = ("400mbit", "100mbit", "40mbit")
WINDOW = 3
WARMUP = 4
RESTART_S = 30.0  # detect, relaunch, rejoin: the same for every system
TRACE = {"mtbf_s": 600.0, "horizon_s": 4 * 3600.0, "seed": 0}
HEADING = "## Peer tier on a shared link (2 namespace nodes, `tc tbf`)"
SYSTEMS = ("sparse", "sparse_auto", "dense_k1", "dense_best")
LABELS = {
    "sparse": f"ours: sparse windows, W = {WINDOW}, replicas = 1",
    "sparse_auto": f"ours, peer_interval auto (W = {WINDOW}, every k-th window pushed; 20-step job: its start-up)",
    "dense_k1": "dense snapshot replicated every iteration",
    "dense_best": "dense snapshot replicated at its best interval (modelled from the one above)",
}
JOBS = {"host": (0, WINDOW), "sparse": (1, WINDOW), "sparse_auto": (1, WINDOW), "dense": (1, 1)}  # (replicas, W)
JOBS_RUN = {**JOBS, "host_again": JOBS["host"]}
INTERVAL = {"sparse_auto": "auto"}  # job -> TierConfig.peer_interval (1 where not named)


# The steady state of peer_interval "auto" (`steady`): longer jobs, priced from the iteration on which the rule has
# its measurements (the first pushes, at k = 1-2, fall in the 20-step job's measured steps: its start-up).
STEADY_STEPS = 60
STEADY_FROM = 16  # the steps before (5 windows of 3) are left out of the steady-state means


def _spec(
    replicas: int, window: int, root: str, run_id: str, interval: int | str = 1, steps: int | None = None
) -> dict:
    host = {"root": root, "run_id": run_id, "replicas": replicas, "peer_interval": interval}
    run = dict(RUN, steps=steps or RUN["steps"])
    return {"run": run, "checkpoint": {"window": window}, "resume": False, "host_tier": host, "timeout_s": 120}


def _job(c, work: Path, rate: str | None, name: str, steps: int | None = None, tag_suffix: str = "") -> dict:
    """One fault-free job on the cluster `c`, its links at `rate`; its measured figures (rank 0's report).
    `steps`: the job's length (RUN's otherwise); every step's wall and CPU seconds are kept then."""
    replicas, window = JOBS_RUN[name]
    tag = f"{(rate or 'unlimited')}-{name}{tag_suffix}"
    out = work / tag
    out.mkdir(parents=True)
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(_spec(replicas, window, "/dev/shm/tmoe", tag, INTERVAL.get(name, 1), steps)))
    program = ["-m", "torchmoe_harness.worker", "--spec", str(spec_path), "--out", str(out)]
    t0 = time.perf_counter()
    for n in c.nodes:
        c.throttle(n, rate)
    agents = [c.start(n, program, rdzv_id=tag) for n in c.nodes]
    codes = c.wait(600, agents)
    if codes != [0, 0]:
        logs = "\n".join(n.log()[-2000:] for n in c.nodes)
        raise RuntimeError(f"peer-tier bench job {tag}: exit codes {codes}\n{logs}")
    rep = json.loads((out / "report.json").read_text())
    steps = rep["step_seconds"][WARMUP:]
    ck = rep["checkpoint"]
    peers = ck.get("peers") or {}
    sent = [link for link in peers.get("links", []) if link["direction"] == "to"]
    shipped = peers.get("windows_replicated", 0)
    return {
        "rate": rate,
        "job": name,
        "replicas": replicas,
        "window": window,
        "step_s": statistics.median(steps),
        "step_s_mean": statistics.mean(steps),
        "steps": len(steps),
        "dense_bytes": ck["dense_bytes"],  # one dense snapshot of this rank
        "windows_committed": ck["windows_committed"],
        "windows_replicated": shipped,
        "windows_superseded": peers.get("windows_superseded", 0),
        "bytes_sent": peers.get("bytes_sent", 0),
        "window_bytes": peers.get("own_data_bytes", 0) / shipped if shipped else 0,  # slot data per shipped window
        "link_bytes_per_s": statistics.mean(link["bytes_per_s"] for link in sent) if sent else None,
        "replication_lag_s": statistics.mean(peers["replication_lag_s"]) if peers.get("replication_lag_s") else 0.0,
        "lag_windows_max": peers.get("lag_windows_max", 0),
        "peer_interval": peers.get("peer_interval", 1),  # the k in use at the end ("auto": the agreed one)
        "wall_s": round(time.perf_counter() - t0, 1),
        **({"step_seconds": rep["step_seconds"], "step_cpu_s": rep.get("step_cpu_s", [])} if steps else {}),
    }


def _rate_bytes_per_s(rate: str) -> float:
    from torchmoe_harness.cluster import _rate_bps

    return _rate_bps(rate) / 8


def profiles(point: dict) -> dict[str, SystemProfile]:
    """The three systems' ETTR profiles from one rate's measured jobs."""
    host, sp, dn = point["jobs"]["host"], point["jobs"]["sparse"], point["jobs"]["dense"]
    t = host["step_s"]
    link = sp["link_bytes_per_s"] or _rate_bytes_per_s(point["rate"])
    pull_sparse = sp["window_bytes"] / link  # the lost node's newest window, pulled back over the link
    pull_dense = dn["dense_bytes"] / (dn["link_bytes_per_s"] or link)
    sparse = SystemProfile(
        "sparse",
        t,
        interval=WINDOW,
        per_iter_overhead_s=max(0.0, sp["step_s"] - t),
        restart_s=RESTART_S + pull_sparse + sp["replication_lag_s"],
        replay_iters=WINDOW,
    )
    k_eff = dn["windows_committed"] / max(dn["windows_replicated"], 1)  # iterations per snapshot shipped
    per_snapshot = max(0.0, dn["step_s"] - t) * k_eff  # training time one shipped snapshot costs
    dense_k1 = SystemProfile(
        "dense_k1",
        t,
        interval=max(1, round(k_eff)),
        per_iter_overhead_s=max(0.0, dn["step_s"] - t),
        restart_s=RESTART_S + pull_dense + dn["replication_lag_s"],
    )
    base = SystemProfile(
        "dense_best", t, interval=1, stall_s=per_snapshot, restart_s=RESTART_S + pull_dense + dn["replication_lag_s"]
    )
    k = max(best_interval(base, TRACE["mtbf_s"], max_interval=2000), max(1, round(k_eff)))
    out = {"sparse": sparse, "dense_k1": dense_k1, "dense_best": replace(base, interval=k)}
    au = point["jobs"].get("sparse_auto")
    if au is not None:  # older results have no such job
        t_au = au.get("base_step_s_mean", point["jobs"]["host"].get("step_s_mean", t))
        pushes = au["windows_committed"] / max(au["windows_replicated"], 1)  # windows per push, measured
        out["sparse_auto"] = SystemProfile(
            "sparse_auto",
            t,
            interval=max(1, round(WINDOW * max(pushes, au["peer_interval"]))),  # the newest pushed window is older
            per_iter_overhead_s=max(0.0, au["step_s_mean"] / t_au - 1) * t,
            restart_s=RESTART_S + pull_sparse + au["replication_lag_s"],
            replay_iters=WINDOW,
        )
    return out


def analyse(point: dict, unlimited: dict) -> dict:
    t = point["jobs"]["host"]["step_s"]
    trace = poisson_trace(TRACE["mtbf_s"], TRACE["horizon_s"], TRACE["seed"])
    profs = profiles(point)
    point["collective_share"] = max(0.0, 1 - unlimited["step_s"] / t)
    point["systems"] = {}
    for name, p in profs.items():
        sim = simulate(p, horizon_s=TRACE["horizon_s"], trace=trace)
        job = point["jobs"][name if name.startswith("sparse") else "dense"]
        overhead = job["step_s"] / t - 1 if name != "dense_best" else p.overhead_fraction()
        if name == "sparse_auto":  # the mean step against the mean base step of its own session
            base = job.get("base_step_s_mean", point["jobs"]["host"].get("step_s_mean", t))
            overhead = job["step_s_mean"] / base - 1
        point["systems"][name] = {
            # measured: median step / t_iter - 1, signed (run-to-run noise on this shared machine shows as
            # negative values); the ETTR profile takes it clamped at 0; dense_best's is modelled (module doc)
            "overhead": overhead,
            "overhead_in_ettr": p.overhead_fraction(),
            "interval": p.interval,
            "restart_s": p.restart_s,
            "ettr": sim.ettr,
            "failures": sim.failures,
            "lost_iterations": sim.lost_iterations,
            # link time per iteration the copies take: bytes shipped per iteration / the link's rate
            "link_s_per_iter": _link_s_per_iter(point, name, p),
        }
    return point


def _link_s_per_iter(point: dict, name: str, p: SystemProfile) -> float:
    jobs = point["jobs"]
    job = jobs[name] if name.startswith("sparse") else jobs["dense"]
    rate = job["link_bytes_per_s"] or _rate_bytes_per_s(point["rate"])
    per_copy = job["window_bytes"] if name.startswith("sparse") else job["dense_bytes"]
    return per_copy / rate / p.interval


def run(out: Path, say, settings: dict | None = None) -> dict:
    from torchmoe_harness.cluster import why_unavailable

    reason = why_unavailable()
    if reason:
        say(f"peer-tier section skipped: no namespace cluster here ({reason})")
        return {"skipped": reason}
    from torchmoe_harness.cluster import Cluster

    rates = tuple((settings or {}).get("rates", RATES))
    work = Path(tempfile.mkdtemp(prefix="tmoe-bench-peer-"))
    t0 = time.perf_counter()
    points = []
    with Cluster(nodes=2, out=work / "cluster") as c:  # one cluster, its links re-throttled per rate
        say("peer tier: 2 namespace nodes, unlimited link (the collectives' reference)")
        unlimited = _job(c, work, None, "host")
        for rate in rates:
            jobs = {}
            for name in (*JOBS, "host_again"):  # the base measured before and after: the machine's drift
                say(f"peer tier: link {rate}, job {name}")
                jobs[name] = _job(c, work, rate, name)
            first, again = jobs["host"], jobs.pop("host_again")
            jobs["host"] = _base(first, again)
            points.append(analyse({"rate": rate, "jobs": jobs}, unlimited))
        steady_auto = measure_steady(c, work, rates, say)
    res = {
        "model": MODEL,
        "run": RUN,
        "window": WINDOW,
        "trace": TRACE,
        "trace_failures": len(poisson_trace(TRACE["mtbf_s"], TRACE["horizon_s"], TRACE["seed"])),
        "restart_s": RESTART_S,
        "unlimited": unlimited,
        "points": points,
        "steady_auto": steady_auto,
    }
    price_steady(res)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def _base(first: dict, again: dict) -> dict:
    """The base job measured before and after the others: the mean of both (median and mean step)."""
    runs = [first["step_s"], again["step_s"]]
    means = [first["step_s_mean"], again["step_s_mean"]]
    return dict(first, step_s=statistics.mean(runs), step_s_runs=runs, step_s_mean=statistics.mean(means))


def rerun(res: dict, rates: list[str], names: list[str], say) -> dict:
    """Measure only the jobs `names` at `rates` (each between two base jobs of its own: the machine drifts between
    sessions) into the stored results `res`, and analyse those rates again; the rest stays as measured."""
    from torchmoe_harness.cluster import Cluster, why_unavailable

    reason = why_unavailable()
    if reason:
        raise SystemExit(f"peer-tier rerun: no namespace cluster here ({reason})")
    by_rate = {p["rate"]: p for p in res["points"]}
    work = Path(tempfile.mkdtemp(prefix="tmoe-bench-peer-"))
    t0 = time.perf_counter()
    with Cluster(nodes=2, out=work / "cluster") as c:
        for rate in rates:
            got = {}
            for name in ("host", *names, "host_again"):
                say(f"peer tier rerun: link {rate}, job {name}")
                got[name] = _job(c, work, rate, name)
            base = _base(got["host"], got["host_again"])
            for name in names:  # priced against its own session's base step
                by_rate[rate]["jobs"][name] = dict(
                    got[name], base_step_s=base["step_s"], base_step_s_mean=base["step_s_mean"]
                )
            analyse(by_rate[rate], res["unlimited"])
    res.setdefault("reruns", []).append({"rates": rates, "jobs": names, "seconds": round(time.perf_counter() - t0, 1)})
    return res


def steady(rates, say, steps: int = STEADY_STEPS) -> dict:
    """`measure_steady` on a cluster of its own (`--steady`, without the rest of the section)."""
    from torchmoe_harness.cluster import Cluster, why_unavailable

    reason = why_unavailable()
    if reason:
        return {"skipped": reason}
    work = Path(tempfile.mkdtemp(prefix="tmoe-bench-peer-steady-"))
    with Cluster(nodes=2, out=work / "cluster") as c:
        return measure_steady(c, work, rates, say, steps)


def measure_steady(
    c, work: Path, rates, say, steps: int = STEADY_STEPS, start: int = STEADY_FROM, repeats: int = 2
) -> dict:
    """peer_interval "auto" in its steady state on the cluster `c`: per rate, `repeats` rounds of (host,
    sparse_auto), then host once more, each `steps` long; the mean step from iteration `start + 1` on. Overhead:
    auto's mean over the mean of the host jobs around it; the noise: the host jobs' spread (max / min - 1) in the
    same session."""
    t0 = time.perf_counter()
    points = []
    for rate in rates:
        hosts, autos = [], []
        order = [name for _ in range(repeats) for name in ("host", "sparse_auto")] + ["host"]
        for i, name in enumerate(order):
            say(f"peer tier steady state: link {rate}, job {name} ({steps} steps, {i + 1} of {len(order)})")
            job = _job(c, work, rate, name, steps=steps, tag_suffix=f"-steady{i}")
            (hosts if name == "host" else autos).append(job)
        points.append(_steady_point(rate, hosts, autos, start))
    return {
        "steps": steps,
        "from": start,
        "repeats": repeats,
        "points": points,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _steady_point(rate: str, hosts: list[dict], autos: list[dict], start: int) -> dict:
    def mean_from(job: dict, key: str) -> float:
        return statistics.mean(job[key][start:])

    base = [mean_from(j, "step_seconds") for j in hosts]
    auto = [mean_from(j, "step_seconds") for j in autos]
    base_cpu = [mean_from(j, "step_cpu_s") for j in hosts]
    auto_cpu = [mean_from(j, "step_cpu_s") for j in autos]
    # each auto job against the mean of the host jobs just before and after it (the machine drifts)
    overheads = [a / statistics.mean(base[i : i + 2]) - 1 for i, a in enumerate(auto)]
    return {
        "rate": rate,
        "base_step_s": base,
        "auto_step_s": auto,
        "overheads": overheads,
        "overhead": statistics.mean(overheads),
        "noise": max(base) / min(base) - 1,  # the same host job, measured len(base) times
        "base_cpu_s": base_cpu,
        "auto_cpu_s": auto_cpu,
        "cpu_overhead": statistics.mean(auto_cpu) / statistics.mean(base_cpu) - 1,
        "windows": [(j["windows_replicated"], j["windows_committed"], j["peer_interval"]) for j in autos],
        "link_s_per_iter": statistics.mean(
            j["bytes_sent"] / (j["link_bytes_per_s"] or _rate_bytes_per_s(rate)) / len(j["step_seconds"]) for j in autos
        ),
    }


def price_steady(res: dict) -> None:
    """The steady-state auto rows' ETTR: the 20-step auto job's profile (pull, replay, replication lag) with the
    steady state's overhead and push interval (W x the k the rule settled on: a node loss goes back to the newest
    pushed window), on the same trace."""
    st = res.get("steady_auto") or {}
    by_rate = {p["rate"]: p for p in res.get("points", []) if "sparse_auto" in p["jobs"]}
    trace = poisson_trace(TRACE["mtbf_s"], TRACE["horizon_s"], TRACE["seed"])
    for sp in st.get("points", []):
        point = by_rate.get(sp["rate"])
        if point is None:
            continue
        start_up = profiles(point)["sparse_auto"]
        interval = max(1, round(WINDOW * statistics.mean(k for _, _, k in sp["windows"])))
        prof = replace(start_up, interval=interval, per_iter_overhead_s=max(0.0, sp["overhead"]) * start_up.t_iter)
        sp["interval"] = interval
        sp["ettr"] = simulate(prof, horizon_s=TRACE["horizon_s"], trace=trace).ettr


def steady_markdown(st: dict) -> list[str]:
    if "skipped" in st:
        return ["", f"Steady state of peer_interval auto: skipped ({st['skipped']})."]
    lines = [
        "",
        f"### peer_interval auto in its steady state ({st['steps']}-step jobs, means from iteration {st['from'] + 1}; "
        f"{st['repeats']} auto jobs per rate, each against the host jobs just before and after it)",
        "",
        "| link | base step (host jobs) | auto step | overhead (each job) | host jobs' spread | CPU per step vs base | "
        "windows pushed / committed, k at the end | link s / iteration | interval | ETTR |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in st["points"]:
        ms = lambda xs: " / ".join(f"{x * 1e3:.0f}" for x in xs)  # noqa: E731
        pushed = ", ".join(f"{a} / {b}, k = {k}" for a, b, k in p["windows"])
        lines.append(
            f"| {p['rate']} | {ms(p['base_step_s'])} ms | {ms(p['auto_step_s'])} ms | {p['overhead']:+.1%} "
            f"({', '.join(f'{o:+.1%}' for o in p['overheads'])}) | {p['noise']:.1%} | {p['cpu_overhead']:+.1%} | "
            f"{pushed} | {p['link_s_per_iter'] * 1e3:.0f} ms | {p.get('interval', '-')} | "
            + (f"{p['ettr']:.3f} |" if "ettr" in p else "- |")
        )
    return lines


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def markdown(res: dict) -> list[str]:
    lines = ["", HEADING, ""]
    if "skipped" in res:
        return [*lines, f"Skipped: {res['skipped']}."]
    pts = res["points"]
    if not pts:
        return [*lines, "No rate measured."]
    j = pts[0]["jobs"]
    lines += [
        f"Model {res['model']}, fp32, FSDP2 over 2 nodes x 1 rank; state per rank: dense snapshot "
        f"{_mib(j['dense']['dense_bytes'])}, ours' window (W = {res['window']}) {_mib(j['sparse']['window_bytes'])} of "
        f"slot data. ETTR: node losses at the same {res['trace_failures']} "
        f"wall-clock times (Poisson, MTBF {res['trace']['mtbf_s']:.0f} s, {res['trace']['horizon_s'] / 3600:.0f} h), "
        f"restart {res['restart_s']:.0f} s for every system plus its own pull, replay and replication lag.",
        "",
        "| link | step, no peer tier | collectives' share | system | overhead | interval | link s / iteration | ETTR |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in pts:
        t = p["jobs"]["host"]["step_s"]
        for name in (n for n in SYSTEMS if n in p["systems"]):
            s = p["systems"][name]
            lines.append(
                f"| {p['rate']} | {t * 1e3:.0f} ms | {p['collective_share']:.0%} | {LABELS[name]} | "
                f"{s['overhead']:+.1%} | {s['interval']} | {s['link_s_per_iter'] * 1e3:.0f} ms | {s['ettr']:.3f} |"
            )
    auto = [p for p in pts if "sparse_auto" in p["jobs"]]
    if auto:
        lines += ["", "Ours with peer_interval auto (share 5 %): windows pushed of committed, the k agreed at the end "]
        lines[-1] += "(overhead: the mean step against its own session's base): " + ", ".join(
            f"{p['rate']} {p['jobs']['sparse_auto']['windows_replicated']} of "
            f"{p['jobs']['sparse_auto']['windows_committed']}, k = {p['jobs']['sparse_auto']['peer_interval']}"
            for p in auto
        )
    lines += ["", "Dense every iteration: windows skipped on the busy link (the newest sent) per rate: "]
    lines[-1] += ", ".join(
        f"{p['rate']} {p['jobs']['dense']['windows_superseded']} of {p['jobs']['dense']['windows_committed']}"
        for p in pts
    )
    if res.get("steady_auto"):
        lines += steady_markdown(res["steady_auto"])
    return lines


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "skipped" in res or not res.get("points"):
        return
    pts = res["points"]
    rates = [p["rate"] for p in pts]
    x = list(range(len(rates)))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name in SYSTEMS:
        xs = [i for i, p in zip(x, pts) if name in p["systems"]]  # a row measured at some rates only
        if not xs:
            continue
        a.plot(xs, [pts[i]["systems"][name]["overhead"] * 100 for i in xs], marker="o", label=LABELS[name])
        b.plot(xs, [pts[i]["systems"][name]["ettr"] for i in xs], marker="o", label=LABELS[name])
    steady_pts = {p["rate"]: p for p in (res.get("steady_auto") or {}).get("points", []) if "ettr" in p}
    xs = [i for i, r in zip(x, rates) if r in steady_pts]
    if xs:
        label = "ours, peer_interval auto, steady state (60-step jobs)"
        a.plot(xs, [steady_pts[rates[i]]["overhead"] * 100 for i in xs], marker="s", ls="--", label=label)
        b.plot(xs, [steady_pts[rates[i]]["ettr"] for i in xs], marker="s", ls="--", label=label)
    for ax, title in ((a, "per-iteration overhead (%)"), (b, "ETTR (same node-loss trace)")):
        ax.set_xticks(x, rates)
        ax.set_xlabel("link rate (tc tbf, both directions)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    fig.legend(*a.get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=8)
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _arg(name: str) -> str | None:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None


def main() -> None:
    """`--out DIR`; `--rerun JOB[,JOB] --rates RATE[,RATE]`: only those jobs at those rates, into DIR's results;
    `--steady [--steps N] [--rates ...]`: only peer_interval auto's steady state (`steady`), into DIR's results."""
    out = Path(_arg("--out") or "benchmarks/results")
    out.mkdir(parents=True, exist_ok=True)
    say = lambda m: print(f"[bench] {m}", file=sys.stderr, flush=True)  # noqa: E731
    again = _arg("--rerun")
    rates = (_arg("--rates") or ",".join(RATES)).split(",")
    if again or "--steady" in sys.argv:
        res = json.loads((out / "bench.json").read_text())["peer_tier"]
        if again:
            res = rerun(res, rates, again.split(","), say)
        if "--steady" in sys.argv:
            res["steady_auto"] = steady(rates, say, steps=int(_arg("--steps") or STEADY_STEPS))
        price_steady(res)
    else:
        res = run(out, say)
    from torchmoe_harness.bench import merge_section  # bench imports this module: late, no cycle at import

    merge_section(out, "peer_tier", res, res.get("seconds", 0.0))
    print("\n".join(markdown(res)))


if __name__ == "__main__":
    main()
