"""SparseConfig: how windows are sized and filled, with its choices and the CUDA default of `overlap`.

Torch-free and below every layer that reads it: the window planner takes a SparseConfig, the slot allocator checks
`host_buffers` against HOST_BUFFERS. `torchmoe_ckpt.config` re-exports every name (users import it from there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from .config_values import is_kind, parse_bytes
from .errors import ConfigError

__all__ = [
    "SparseConfig",
    "Popularity",
    "HostBuffers",
    "CopyPhase",
    "POPULARITIES",
    "HOST_BUFFERS",
    "COPY_PHASES",
    "CUDA_OVERLAP",
    "Policy",
    "POLICIES",
    "DEFAULT_MTBF_S",
    "MTBF_REFERENCE_GPUS",
    "parse_duration",
]

CUDA_OVERLAP = 0.4  # the first window's overlap on CUDA, until the device's loss is measured: see `overlap`

# The choice fields' values, each written once: the Literal is the field's type, the tuple is what is checked.
Popularity = Literal["hard", "soft", "decayed", "capacity"]
HostBuffers = Literal["auto", "arena", "shm-registered"]
CopyPhase = Literal["after_update", "backward"]
Policy = Literal["auto", "sparse", "dense"]
POLICIES: tuple[str, ...] = get_args(Policy)  # (planning/policy.py)
POPULARITIES: tuple[str, ...] = get_args(Popularity)
HOST_BUFFERS: tuple[str, ...] = get_args(HostBuffers)  # (capture/slot_alloc.py)
COPY_PHASES: tuple[str, ...] = get_args(CopyPhase)  # (capture/copy_phase.py)
# The default expected time between failures: Llama 3's report (419 unexpected interruptions in 54 days of
# pre-training on 16,384 H100s, about one every 3 h) scaled to the run's size, failures being per GPU:
# DEFAULT_MTBF_S x MTBF_REFERENCE_GPUS / ranks (planning/policy.py, `resolved_mtbf_s`).
DEFAULT_MTBF_S = 3 * 3600.0
MTBF_REFERENCE_GPUS = 16384
_UNITS = {"s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_OPTIONAL = ("window", "overlap", "bandwidth_bytes_per_s")  # None is allowed (auto / measured)
_SHARES = ("decay", "reorder_change", "reorder_fraction")  # in [0, 1]


@dataclass
class SparseConfig:
    """How windows are sized and filled: W (the window), the order operators are captured in, the memory bound."""

    window: int | None = None
    """W, the iterations (slots) of one window: every operator is captured once per window, so a failure replays
    at most W iterations. None: Algorithm 1 picks W from what one slot copy costs (priced as below)."""

    overlap: float | None = None
    """The share of one iteration a slot's copy may take, hidden behind compute (W is sized so it fits): a fixed
    rule, the override. None: 1.0 on a CPU (copies run beside the step); on CUDA W is priced by what the device
    loses, measured (`max_step_overhead`, planning/calibration.py; CUDA_OVERLAP only until it is measured)."""

    max_step_overhead: float = 0.02
    """CUDA, auto W, `overlap` None: the share of the step the copies may add on the device. The planner measures
    the step time without copies (the first iterations) and with them, derives the device's cost per copied byte,
    and picks the smallest W whose predicted added step time stays within this share; re-planned when the measured
    overhead drifts past it (docs/sparse-checkpointing.md, "Auto W on a GPU"). In (0, 1]."""

    bandwidth_bytes_per_s: float | None = None
    """The copy bandwidth slots are priced with. None: what copies cost while training, measured in the first
    window; a number: that fixed bandwidth (reproducible plans, benchmarks)."""

    popularity: Popularity = "hard"
    """What orders the experts' full captures in a window, least popular first (ascending; routers and dense blocks
    last): "hard" (routed top-k token counts), "soft" (router probabilities), "decayed" (counts aged by `decay` per
    iteration), "capacity" (`expert_capacity`)."""

    decay: float = 0.9
    """"decayed" popularity: the weight of the previous count per iteration, in [0, 1]."""

    reorder_change: float = 0.10
    """An expert counts as changed when its routed-token frequency moved by more than this share of its old value
    (relative, in [0, 1]); see `reorder_fraction`."""

    reorder_fraction: float = 0.25
    """The order is regenerated at a window start only when at least this share of the experts changed (by more than
    `reorder_change`), in [0, 1]: a few experts drifting do not reshuffle every window."""

    expert_capacity: list[list[float]] | None = None
    """"capacity" popularity: a weight per expert, [moe layers][experts]."""

    sliding: bool = False
    """Every slot also copies the compute weights of operators already captured in its window, so any W
    consecutive slots recover (a failure loses only its own iteration); more bytes per slot (docs/benchmarks.md)."""

    host_memory_limit: int | str | None = None
    """Bytes of host memory per rank the checkpointer may hold (host_memory.py), or a size such as "64 GiB";
    checked against the plan's worst case at construction and at every window start. None: no limit (still
    counted)."""

    max_window: int | None = None
    """Auto W is never above this (a smaller W holds fewer bytes per window). None: no bound."""

    copy_chunk_bytes: int | None = None
    """CUDA: copy each same-dtype slot item in chunks of at most this many bytes with a 1-element kernel between
    them, so the device-to-host copy engine, shared by every stream, serves the training stream's own small reads
    (`.item()`, `.tolist()`) in between instead of queueing them behind the slot (capture/copy_chunks.py, the GPU
    check's phase 4 measures it). None: one copy per item. On a CPU the same code path runs, to no effect."""

    reads_on_copy_stream: bool = True
    """CUDA: the checkpointer's own device-to-host reads of each step (the replay record's batch, loss, gradient
    norm and hyper-parameters; the routed-token counts at a window start) go into pinned memory on the copy stream,
    after an event, from device-side clones, instead of on the training stream, where they would queue behind the
    copy engine; they are read later (when the window is persisted, at the next window start). False: on the
    training stream, non-blocking (runtime/deferred_reads.py). On a CPU the same path runs, to the same values."""

    copy_phase: CopyPhase = "after_update"
    """When a slot's copy is issued: "after_update" (at once, after the optimizer step of its iteration) or
    "backward" (from the first backward hook of the next iteration, the part of the step with no host reads;
    still the post-update state of its iteration, since the next update waits for the copy first). The copy is
    issued at the latest when the next update, a commit or a flush needs it (capture/copy_phase.py)."""

    device_staging: bool = False
    """Opt-in: the slot is first copied device-to-device (cast fused) into a staging buffer right after the update,
    which the next update waits for; the copy to the host then runs from the staging buffer over the next
    iteration. Needs one slot of free device memory (on a CPU: host memory, counted against
    `host_memory_limit`); refused in one line when even the smallest slot cannot fit, skipped (and counted) for
    a window whose slot does not fit (capture/device_staging.py)."""

    policy: Policy = "auto"
    """What a recovery point is (docs/sparse-checkpointing.md, "Policy"): "sparse" (windows of W slots, every
    iteration), "dense" (a dense snapshot, the full state of every operator, every `dense_interval` iterations: a
    W = 1 window taken only every k iterations; recovery loads it and training re-runs the iterations since),
    "auto" (whichever planning/policy.py predicts to keep more useful training time (ETTR) from the measured step
    time, copy cost, restart time and `mtbf`; decided after the first calibration steps, re-decided at window
    boundaries with hysteresis). Under "auto" a forced `window` means "sparse", a forced `dense_interval` "dense"."""

    dense_interval: int | None = None
    """"dense": iterations between dense snapshots, >= 1. None: the interval with the best predicted ETTR."""

    mtbf: float | str | None = None
    """The expected time between failures of the whole job: seconds (> 0) or a duration such as "3h", "90m", "2d".
    None: ~3 h at 16,384 GPUs, scaled to this job's ranks (Llama 3's pre-training report: 419 unexpected
    interruptions in 54 days on 16,384 GPUs; failures are per GPU, so fewer GPUs fail less often)."""

    host_buffers: HostBuffers = "auto"
    """Slot buffers (slot_alloc.py): "auto" (slot files on a CPU with a host tier, else "arena"), "arena" (one
    arena per slot set, pinned on CUDA), "shm-registered" (CUDA: slot files page-locked; opt-in, unmeasured)."""

    def __post_init__(self):
        self._check_types()
        self._check_ranges()
        self.host_memory_limit = parse_bytes(self.host_memory_limit, "host_memory_limit")
        self._check_choices()
        self._check_policy()

    def _check_policy(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(
                f'SparseConfig.policy {self.policy!r} is not one of {", ".join(POLICIES)}: use "auto" (chosen from '
                'measured costs), "sparse" (windows) or "dense" (a dense snapshot every dense_interval iterations)'
            )
        if self.dense_interval is not None and (not is_kind(self.dense_interval, int) or self.dense_interval < 1):
            raise ConfigError(
                f"SparseConfig.dense_interval must be an integer >= 1 (iterations between dense snapshots) or None "
                f"(auto), got {self.dense_interval!r}"
            )
        if self.policy == "sparse" and self.dense_interval is not None:
            raise ConfigError(
                f'SparseConfig.dense_interval={self.dense_interval} is for policy "dense": drop it or set '
                'policy="dense" (or "auto")'
            )
        if self.policy == "dense" and self.window is not None:
            raise ConfigError(
                f'SparseConfig.window={self.window} is for policy "sparse": drop it or set policy="sparse" (or "auto")'
            )
        if self.policy == "auto" and self.window is not None and self.dense_interval is not None:
            raise ConfigError(
                'SparseConfig sets both window (sparse) and dense_interval (dense) under policy "auto": set one, or '
                "name the policy"
            )
        if self.sliding and self.policy == "dense":
            raise ConfigError('SparseConfig.sliding is a sparse-window option: drop it or set policy="sparse"')
        self.mtbf = parse_duration(self.mtbf, "SparseConfig.mtbf")

    @property
    def fixed_policy(self) -> str | None:
        """The policy the config fixes ("sparse" or "dense"), or None when "auto" is left to choose."""
        if self.policy != "auto":
            return self.policy
        if self.window is not None or self.sliding:
            return "sparse"  # W forced (or sliding windows asked for): the user chose windows
        if self.dense_interval is not None:
            return "dense"
        return None

    def _check_types(self) -> None:
        """A wrong type ("3" from a job file) fails here with one clear line, not later in a comparison."""
        for name in ("sliding", "reads_on_copy_stream", "device_staging"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"SparseConfig.{name} must be true or false, got {getattr(self, name)!r}")
        for name in _OPTIONAL + _SHARES:
            v, kinds = getattr(self, name), (int,) if name == "window" else (int, float)
            if (v is not None or name not in _OPTIONAL) and not is_kind(v, kinds):
                raise ConfigError(
                    f"SparseConfig.{name} must be {'an integer' if name == 'window' else 'a number'}"
                    f"{' or None' if name in _OPTIONAL else ''}, got {v!r}"
                )

    def _check_ranges(self) -> None:
        if self.window is not None and self.window < 1:
            raise ConfigError(f"window must be >= 1 or None (auto), got {self.window}")
        if self.overlap is not None and not 0 < self.overlap < math.inf:
            raise ConfigError(f"overlap must be a finite number > 0 (share of an iteration), got {self.overlap}")
        if self.bandwidth_bytes_per_s is not None and not 0 < self.bandwidth_bytes_per_s < math.inf:
            raise ConfigError(
                "bandwidth_bytes_per_s must be a finite number > 0 or None (measured), got "
                f"{self.bandwidth_bytes_per_s}"
            )
        if not is_kind(self.max_step_overhead, (int, float)) or not 0 < self.max_step_overhead <= 1:
            raise ConfigError(
                f"SparseConfig.max_step_overhead must be a share of the step in (0, 1], got {self.max_step_overhead!r}"
            )
        for name in _SHARES:
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"SparseConfig.{name} must be in [0, 1], got {getattr(self, name)}")

    def _check_choices(self) -> None:
        if self.max_window is not None and (not is_kind(self.max_window, int) or self.max_window < 1):
            raise ConfigError(f"max_window must be an integer >= 1 or None, got {self.max_window!r}")
        if self.copy_chunk_bytes is not None and (not is_kind(self.copy_chunk_bytes, int) or self.copy_chunk_bytes < 1):
            raise ConfigError(f"copy_chunk_bytes must be an integer >= 1 or None, got {self.copy_chunk_bytes!r}")
        if self.host_buffers not in HOST_BUFFERS:
            raise ConfigError(f"host_buffers {self.host_buffers!r} is not one of {', '.join(HOST_BUFFERS)}")
        if self.copy_phase not in COPY_PHASES:
            raise ConfigError(f"copy_phase {self.copy_phase!r} is not one of {', '.join(COPY_PHASES)}")
        if self.popularity not in POPULARITIES:
            raise ConfigError(f"popularity {self.popularity!r} is not one of {', '.join(POPULARITIES)}")


def parse_duration(value: float | str | None, name: str) -> float | None:
    """Seconds from a number (> 0) or a duration string ("3h", "90m", "45 min", "2d", "600s", "600"); None stays."""
    if value is None:
        return None
    fix = f'{name} must be seconds > 0 or a duration such as "3h", "90m", "2d" (None: the default), got {value!r}'
    if isinstance(value, str):
        text = value.strip().lower()
        num = text.rstrip("abcdefghijklmnopqrstuvwxyz").strip()
        unit = text[len(num) :].strip() or "s"
        try:
            seconds = float(num) * _UNITS[unit]
        except (ValueError, KeyError):
            raise ConfigError(fix) from None
    elif is_kind(value, (int, float)):
        seconds = float(value)
    else:
        raise ConfigError(fix)
    if not 0 < seconds < math.inf:
        raise ConfigError(fix)
    return seconds
