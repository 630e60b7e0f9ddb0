"""ETTR against the copy regime: the dense snapshot's copy time as a fraction of an iteration, from the papers'
inputs (MoEvement Table 3, DeepSeek-MoE on A100s) through the simulator (ettr.py). The bench's measured sweep
(bench_ettr) covers this machine's regimes; this extends it to the papers' scale and precision.

Model per fraction f (copy of one dense snapshot = f x T_iter over the host link, hidden behind the next
iteration's forward and backward, `hide` x T_iter, as the copy must end before the next update):
  dense every iteration   stall max(0, f - hide) x T_iter per iteration (Gemini at k = 1)
  dense at its best k     the same stall every k iterations, k ETTR-optimal at the MTBF (Gemini's oracle)
  sparse (ours)           W = the smallest window whose worst slot's copy hides behind an iteration; a slot of a
                          window W copies the full state of 1/W of the operators and the compute weights of
                          those after them: worst slot = dense x (1/W + (W - 1)/W x compute/full); a stall when
                          no W hides it; per failure W - 1 replayed iterations (`replay` x T_iter each) and, as a
                          sliding window recovers to the iteration before the failed one, nothing redone
Recovery also costs a restart (Table 3's in-memory restart) and, for the dense systems, the snapshot's load."""

from __future__ import annotations

from dataclasses import replace

from torchmoe_harness.ettr import SystemProfile, best_interval, ettr_exact

PAPER = {  # MoEvement Table 3 / §5 inputs (ettr.DEEPSEEK), mixed precision: 12 B full state, 2 B compute weights
    "setting": "DeepSeek-MoE 16.4B, 96 A100 (MoEvement Table 3 inputs)",
    "t_iter": 2.9,
    "restart_s": 3.0,
    "overhead_fraction": 0.06 / 2.9,  # MoEvement's measured per-iteration overhead (Table 3)
    "compute_over_full": 2 / 12,
    "hide": 0.9,  # forward + backward share of an iteration, which a copy can overlap
    "replay": 1.0,  # a replayed iteration costs a training step (no upstream logging, no localized replay)
    "max_window": 16,
    "mtbfs_s": {"1H": 3600.0, "10M": 600.0},
}


def sparse_window(f: float, compute_over_full: float, hide: float, max_window: int) -> tuple[int, float]:
    """(W, stall per iteration in iterations): the smallest W whose worst slot's copy hides behind `hide`."""
    for w in range(1, max_window + 1):
        worst = f * (1 / w + (w - 1) / w * compute_over_full)
        if worst <= hide:
            return w, 0.0
    return max_window, worst - hide


def profiles(f: float, inputs: dict | None = None) -> dict[str, SystemProfile]:
    """The three systems at copy fraction `f` (intervals of the periodic one set per MTBF by `curves`)."""
    d = dict(PAPER, **(inputs or {}))
    t, hide = d["t_iter"], d["hide"]
    stall = max(0.0, f - hide) * t
    w, sparse_stall = sparse_window(f, d["compute_over_full"], hide, d["max_window"])
    dense = SystemProfile("dense every iteration", t, interval=1, stall_s=stall, restart_s=d["restart_s"] + f * t)
    return {
        "dense every iteration": dense,
        "dense at its best interval": replace(dense, name="dense at its best interval"),
        "sparse (ours)": SystemProfile(
            "sparse (ours)",
            t,
            interval=1,  # a sliding window: every iteration is a recovery point
            per_iter_overhead_s=d["overhead_fraction"] * t + sparse_stall * t,
            restart_s=d["restart_s"] + f * t,  # loading the window's bytes: about one dense snapshot's
            replay_iters=w - 1,
            replay_s_per_iter=d["replay"] * t,
            note=f"W={w}",
        ),
    }


def curves(fractions: list[float], inputs: dict | None = None) -> dict:
    """ETTR (exact expectation, Poisson failures) of every system at each fraction and MTBF; with the window
    and interval chosen, and the crossover: the smallest fraction where sparse beats the dense snapshot every
    iteration (and its best interval)."""
    d = dict(PAPER, **(inputs or {}))
    out: dict = {"setting": d["setting"], "fractions": list(fractions), "mtbfs": {}}
    for label, mtbf in d["mtbfs_s"].items():
        rows: dict[str, list] = {}
        for f in fractions:
            for name, p in profiles(f, d).items():
                if name == "dense at its best interval":
                    p = replace(p, interval=best_interval(p, mtbf, max_interval=2000))
                rows.setdefault(name, []).append(
                    {"ettr": ettr_exact(p, mtbf), "interval": p.interval, "replayed": p.replay_iters}
                )
        out["mtbfs"][label] = {
            "mtbf_s": mtbf,
            "systems": rows,
            "crossover_vs_every_iteration": crossover(fractions, rows["sparse (ours)"], rows["dense every iteration"]),
            "crossover_vs_best_interval": crossover(
                fractions, rows["sparse (ours)"], rows["dense at its best interval"]
            ),
        }
    return out


def crossover(fractions: list[float], ours: list[dict], other: list[dict]) -> float | None:
    """The smallest fraction from which ours' ETTR is >= the other's (linear between points); 0 when ours is
    ahead everywhere, None when never."""
    diff = [a["ettr"] - b["ettr"] for a, b in zip(ours, other)]
    if diff and diff[0] >= 0:
        return 0.0
    for i in range(1, len(diff)):
        if diff[i] >= 0 > diff[i - 1]:
            f0, f1 = fractions[i - 1], fractions[i]
            return f0 + (f1 - f0) * (-diff[i - 1]) / (diff[i] - diff[i - 1])
    return None
