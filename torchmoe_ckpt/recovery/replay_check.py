"""How a replayed iteration is checked against the original run: the policy, its bound, and the up-front check.

"exact" (default): every replayed loss (and gradient norm, where recomputed) equals the logged one bit for bit;
on CUDA that needs deterministic kernels, so "exact" on a CUDA model is refused unless they are on.
"tolerant": accepted within a relative `tolerance`, reported as approximate with the largest deviation; the
bound stays far below what a wrong batch does (docs/gpu.md).
"""

from __future__ import annotations

import math
import os

import torch

from ..core.config_values import DEFAULT_TOLERANCE, REPLAY_CHECKS, ReplayPolicy  # torch-free, for config.py
from ..core.errors import ConfigError, TorchmoeError

__all__ = [
    "DEFAULT_TOLERANCE",
    "REPLAY_CHECKS",
    "ReplayDivergence",
    "ReplayPolicy",
    "ReplayComparison",
    "check_replay_check",
    "replay_verdict",
]

CUBLAS_CONFIGS = (":4096:8", ":16:8")  # the two workspace settings cuBLAS documents as deterministic


class ReplayDivergence(TorchmoeError, RuntimeError):
    """A replayed iteration did not reproduce the logged loss, so the rebuilt state would not be the run's."""


def check_replay_check(mode: str, device: torch.device | str) -> None:
    """Refuse "exact" for a model on a CUDA device without deterministic kernels (one line, both fixes)."""
    if mode != "exact" or torch.device(device).type != "cuda":
        return
    missing = []
    if not torch.are_deterministic_algorithms_enabled():
        missing.append("torch.use_deterministic_algorithms(True) is off")
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in CUBLAS_CONFIGS:
        missing.append("CUBLAS_WORKSPACE_CONFIG is not set")
    if missing:
        raise ConfigError(
            f"replay_check='exact' on CUDA needs deterministic kernels ({' and '.join(missing)}): call "
            "torch.use_deterministic_algorithms(True) and start the job with CUBLAS_WORKSPACE_CONFIG=:4096:8, or "
            f"set replay_check='tolerant' (recovery within replay_tolerance, reported as approximate)"
        )


def relative_deviation(replayed: torch.Tensor, logged: torch.Tensor) -> float:
    """|replayed - logged| / |logged| in float64 (0 when bit-equal; inf when only one is finite)."""
    a, b = float(replayed.detach().double().sum()), float(logged.detach().double().sum())
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-30)


class ReplayComparison:
    """Checks each replayed iteration of one recovery and keeps the largest deviations for the report."""

    def __init__(self, policy: ReplayPolicy | None = None):
        self.policy = policy or ReplayPolicy()
        self.exact = True  # every compared value bit-equal so far
        self.max_loss_deviation = 0.0
        self.max_grad_norm_deviation = 0.0
        self.grad_norms_compared = 0

    def check(self, where: str, res, rec) -> None:
        """Compare the replayed step `res` with its record `rec`; raise ReplayDivergence per the policy."""
        loss = res.loss.detach().to("cpu")
        norm = getattr(res, "replayed_grad_norm", None)
        norm = None if norm is None else norm.detach().to("cpu")
        self.grad_norms_compared += norm is not None
        if torch.equal(loss, rec.loss) and (norm is None or torch.equal(norm, rec.grad_norm.to(norm.dtype))):
            return
        self.exact = False
        dl = relative_deviation(loss, rec.loss)
        dn = 0.0 if norm is None else relative_deviation(norm, rec.grad_norm)
        self.max_loss_deviation = max(self.max_loss_deviation, dl)
        self.max_grad_norm_deviation = max(self.max_grad_norm_deviation, dn)
        what = f"loss {float(loss.double().sum())!r} (logged {float(rec.loss.double().sum())!r})" + (
            "" if norm is None else f", gradient norm {float(norm)!r} (logged {float(rec.grad_norm)!r})"
        )
        if self.policy.mode == "tolerant":
            if max(dl, dn) <= self.policy.tolerance:
                return
            raise ReplayDivergence(
                f"replay of {where} gave {what}: relative deviation {max(dl, dn):.3g} exceeds replay_tolerance "
                f"{self.policy.tolerance:g}, far more than kernel non-determinism does: the window's batches or "
                "state are not this run's (another run, model or data order). The window is not loaded"
            )
        raise ReplayDivergence(
            f"replay of {where} gave {what}, not bit for bit. Likely causes (most usual first): randomness outside "
            "torch's CPU generator and CUDA generators (random.random(), numpy or an RNG of your own inside forward), "
            "state the checkpoint "
            "does not capture (a non-persistent buffer or a Python attribute that changes during training), a "
            "non-deterministic kernel or a different thread count (replay_check='tolerant' accepts those within a "
            "bound), or a model/data/world size other than the run that wrote the window. The window is not loaded"
        )

    def report(self) -> dict:
        return {
            "replay_check": self.policy.mode,
            "exact": self.exact,
            "max_loss_deviation": self.max_loss_deviation,
            "max_grad_norm_deviation": self.max_grad_norm_deviation,
            "replay_tolerance": self.policy.tolerance if self.policy.mode == "tolerant" else None,
            "grad_norms_compared": self.grad_norms_compared,
        }


def replay_verdict(report: dict) -> str:
    """How a recovery's replay compared, for its status line (an approximate recovery says so, with numbers)."""
    if report.get("exact", True):
        return "every replayed loss matched the original run bit for bit"
    return (
        f"APPROXIMATE: replay_check=tolerant accepted a replay that deviated from the original run by up to "
        f"{report.get('max_loss_deviation', 0.0):.3g} (loss) and {report.get('max_grad_norm_deviation', 0.0):.3g} "
        f"(gradient norm), relative; bound {report.get('replay_tolerance')}"
    )
