"""The line a user reads after a recovery: which window, where its copy came from, how the replay compared with the
original run, and where the time went (the lines while a job runs: persist/run_status.py). Rank 0 speaks at INFO,
other ranks log the same line at DEBUG. Logger "torchmoe_ckpt", lines start "torchmoe:".
"""

from __future__ import annotations

import logging

from ..recovery.replay_check import replay_verdict

log = logging.getLogger("torchmoe_ckpt")


# Where a recovery's time goes, in the order it is spent (RecoveryReport.phases, the checkpointer's stats):
PHASES = (
    "find",  # the newest usable window located: listed, checked, agreed, fetched from a tier
    "safety_copy",  # the trainer's state kept on the host until a replay succeeds (given back when all fail)
    "rebuild",  # what the load needs besides the bytes (optimizer state allocated for in-place loads)
    "load",  # the window's slot bytes copied into the live tensors
    "replay",  # the window's iterations replayed (frozen operators: forward and input gradients only)
    "redo",  # iterations after the recovered one trained again, up to where the failure found training
)


def phases_text(phases: dict) -> str:
    """'find 0.01 s, rebuild 0.00 s, load 0.03 s, replay 0.21 s' (the phases present, in PHASES order)."""
    return ", ".join(f"{k} {phases[k]:.2f} s" for k in PHASES if phases.get(k) is not None)


def recovery_line(report: dict) -> str:
    """The line a user reads after a recovery: which window, where the copy came from, how the replay compared
    with the original run (replay_check.replay_verdict) and where the time went."""
    src = str(report.get("source") or "?")  # "host", "peer N" or "object store" (recovery/agreed_window.py)
    where = "this node's host memory" if src == "host" else src
    if report.get("source_peer") is not None:  # "peer N": the typed N beside it
        where = f"the host memory of rank {report['source_peer']}"
    n = report.get("replayed_iterations", 0)
    phases = phases_text(report.get("phases") or {})
    return (
        f"recovered step {report.get('recovered_step')} from window {report.get('window_id')} (copy from {where}), "
        f"replayed {n} iteration(s) in {report.get('seconds', 0.0):.2f} s; {replay_verdict(report)}"
        + (f" ({phases})" if phases else "")
    )


def log_recovery(report: dict, rank: int = 0) -> str:
    """Rank 0 says it; another rank too when its copy came from elsewhere than its own host memory."""
    text = recovery_line(report)
    log.log(
        logging.INFO if rank == 0 or report.get("source") != "host" else logging.DEBUG,
        "torchmoe: %s%s",
        "" if rank == 0 else f"rank {rank}: ",
        text,
    )
    return text
