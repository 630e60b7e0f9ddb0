"""Run identity: what makes a checkpointed state belong to one training run.

The run id plus a fingerprint (SHA-256 of canonical JSON) of its parts: operators, every tensor's name, shape and
dtype, expert counts, the optimizer kind and state-shaping hyper-parameters (not the LR), compute dtype, world
size and HSDP degree, the process seed and the caller's data identity. The parts are kept in every manifest so
a mismatch is *named* ("world size 2 != 4"). `free` parts (steps, LRs) may change and are only reported.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from ..core.errors import ConfigError
from .optim_state import init_optimizer_state, optimizer_list

__all__ = [
    "RunIdentity",
    "IdentityMismatch",
    "build_identity",
    "identity_mismatch",
    "allowed_changes",
    "mesh_replicate",
    "TorchSeed",
    "torch_seed",
    "given_seed",
    "USER_SEED_LIMIT",
]

# Optimizer param-group keys that do not shape the state (the LR is scheduled; the rest are kernel choices).
_NOT_STATE = frozenset({"params", "lr", "initial_lr", "foreach", "fused", "capturable", "differentiable", "name"})


# torch seeds its CPU generator from /dev/urandom when it starts: 64 random bits, another value in every process.
# A seed a person gives is a small number (below 2**32 in practice) or the same on every rank. So whether the user
# seeded torch is read off the value itself, not off when this module was imported (docs/failure-recovery.md).
USER_SEED_LIMIT = 2**32


@dataclass(frozen=True)
class TorchSeed:
    """`torch.initial_seed()` as read when the checkpointer was built, before recovery restores an RNG state (that
    changes it): the user's `torch.manual_seed(n)` or torch's random default. `given_seed` tells which, once every
    rank's value is known (`startup.start` gathers them)."""

    value: int


def torch_seed() -> TorchSeed:
    """This process's torch seed now (the own loop's `Checkpointer(seed="auto")`)."""
    return TorchSeed(int(torch.initial_seed()))


def given_seed(this_rank: int, every_rank: list[int]) -> int | None:
    """The seed the user gave torch, else None (torch's random default: not part of a run's identity, or the run's
    own restarts, each with another random seed, would refuse its windows). Given when it is below 2**32 (torch's
    own is below that with probability 2**-32) or the same on every rank of a multi-rank job (torch's own differs
    per process). A user's seed of 2**32 or more that differs between ranks is not recognised: pass
    `Checkpointer(seed=n)`."""
    if this_rank < USER_SEED_LIMIT:
        return int(this_rank)
    if len(every_rank) > 1 and len(set(every_rank)) == 1:
        return int(this_rank)
    return None


class IdentityMismatch(ConfigError):
    """Windows exist for this run id but were written by another run (other model, optimizer, dtype, world
    size or data): refused with one line naming the difference and the fix."""


@dataclass(frozen=True)
class RunIdentity:
    run_id: str | None
    parts: dict  # what the fingerprint covers (JSON-able)
    free: dict = field(default_factory=dict)  # recorded, allowed to change: LRs, planned steps

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(_canonical(dict(self.parts, run_id=self.run_id)).encode()).hexdigest()

    def to_dict(self) -> dict:
        return {"run_id": self.run_id, "fingerprint": self.fingerprint, "parts": self.parts, "free": self.free}

    @staticmethod
    def from_dict(d: dict) -> RunIdentity:
        return RunIdentity(d.get("run_id"), json.loads(_canonical(d.get("parts") or {})), dict(d.get("free") or {}))


def _canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def mesh_replicate(model: nn.Module) -> int:
    """The replicate degree of an HSDP mesh (1 for FSDP2 or no sharding): TorchTitan's `dp_replicate` mesh
    dimension where the mesh names it, else the first dimension of a 2-D mesh that replicates the parameters. Not
    any 2-D mesh's first dimension: under FSDP x TP that is the FSDP shard (issue 44), and replica peers that are
    taken to hold the same data would hold none of each other's."""
    for p in model.parameters():
        if isinstance(p, DTensor) and p.device_mesh.ndim >= 2:
            names = p.device_mesh.mesh_dim_names or ()
            if "dp_replicate" in names:
                return p.device_mesh.size(names.index("dp_replicate"))
            if p.device_mesh.ndim == 2 and isinstance(p.placements[0], Replicate):
                return p.device_mesh.size(0)
            return 1
    return 1


def _state_layout(opt) -> list:
    """The optimizer's state keys and dtypes (bf16 moments are another layout than fp32 ones)."""
    keys = {(k, str(getattr(v, "dtype", type(v).__name__))) for st in opt.state.values() for k, v in st.items()}
    return sorted([k, d.replace("torch.", "")] for k, d in keys)


def _hyper(group: dict) -> dict:
    out = {}
    for k, v in sorted(group.items()):
        if k in _NOT_STATE or torch.is_tensor(v):
            continue
        if isinstance(v, (bool, int, float, str)) or v is None:
            out[k] = v
        elif isinstance(v, (tuple, list)) and all(isinstance(x, (bool, int, float)) for x in v):
            out[k] = list(v)
    return out


def build_identity(  # noqa: PLR0913  (one argument per part of the identity; the optional ones with defaults)
    model: nn.Module,
    optimizer,
    compute_dtype: torch.dtype,
    ops,
    run_id: str | None = None,
    world_size: int = 1,
    hsdp_replicate: int | None = None,
    data: str | None = None,
    steps: int | None = None,
    seed: int | None = None,
) -> RunIdentity:
    """The identity of a run from what it trains. `ops`: list or name -> Operator; `data` (the data order) and
    `seed` (`given_seed`) are fingerprinted when given; `steps` (planned iterations) is free."""
    op_list = list(ops.values()) if isinstance(ops, dict) else list(ops)
    counted: Counter[str] = Counter()
    for o in op_list:
        if o.kind == "expert":
            counted[o.moe or ""] += len(o.experts)  # the experts, whether one operator holds one or a layer's
    experts = dict(counted)
    tensors = {n: [list(t.shape), str(t.dtype).replace("torch.", "")] for n, t in model.named_parameters()}
    opts = optimizer_list(optimizer)
    init_optimizer_state(opts)  # the state its first step would create, so its layout is part of the identity
    parts = {
        "world_size": int(world_size),
        "hsdp_replicate": int(hsdp_replicate if hsdp_replicate is not None else mesh_replicate(model)),
        "compute_dtype": str(compute_dtype).replace("torch.", ""),
        "experts": experts,
        "operators": [o.name for o in op_list],
        "tensors": tensors,
        "optimizer": [type(o).__name__ for o in opts],
        "optimizer_hyper": [_hyper(g) for o in opts for g in o.param_groups],
        "optimizer_state": [_state_layout(o) for o in opts],
        "data": data,
    }
    if seed is not None:  # absent, not null: windows written before the seed was recorded keep their fingerprint
        parts["seed"] = int(seed)
    merged = {o.name: o.merged for o in op_list if o.merged}
    if merged:  # absent when every expert is its own operator (granularity.py): `inspect` shows why they are not
        parts["merged_experts"] = merged
    # The base LR (a scheduler's initial_lr): the current LR depends on where the schedule is.
    lrs = [g.get("initial_lr", g.get("lr")) for o in opts for g in o.param_groups]
    free = {"lrs": [float(x) for x in lrs if isinstance(x, (int, float))], "steps": steps}
    return RunIdentity(run_id, json.loads(_canonical(parts)), free)


def _short(v) -> str:
    if isinstance(v, list) and all(not isinstance(x, (list, dict)) for x in v):
        return "(" + ", ".join(str(x) for x in v) + ")"
    s = json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else str(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _diff(found: dict, want: dict) -> str | None:
    """The first difference between two identities' parts, in words (found != expected): the parts a user can
    name first (world size, dtype, ...), then experts, tensors, operators, optimizer hyper-parameters, the rest;
    then the names of the other parts that differ too, so that another model altogether says so ("...; also:
    model tensors, operators") where its first difference alone (a dtype) would read like a setting to change."""
    differs = (
        (_diff_simple, None),
        (_diff_experts, "experts"),
        (_diff_tensors, "tensors"),
        (_diff_operators, "operators"),
        (_diff_hyper, "optimizer_hyper"),
        (_diff_rest, None),
    )
    for differ, part in differs:
        first = differ(found, want)
        if first is None:
            continue
        if part is None:  # a simple part or the rest: the part the message names
            named = [k for k in found.keys() | want.keys() if first.startswith(_part_name(k) + " ")]
            part = max(named, key=lambda k: len(_part_name(k)), default=None)  # "optimizer state ..." > "optimizer"
        also = [_part_name(k) for k in _differing_parts(found, want) if k != part]
        return first + (f"; also: {', '.join(dict.fromkeys(also))}" if also else "")
    return None


def _part_name(key: str) -> str:
    """What a message calls an identity part."""
    return dict(_SIMPLE_PARTS).get(key) or _OTHER_PART_NAMES.get(key, key)


def _differing_parts(found: dict, want: dict) -> list[str]:
    """Every identity part that differs, in `_diff`'s order."""
    order = [k for k, _ in _SIMPLE_PARTS] + list(_OTHER_PART_NAMES)
    keys = order + sorted(k for k in found.keys() | want.keys() if k not in order)
    return [k for k in keys if found.get(k) != want.get(k)]


_SIMPLE_PARTS = (  # (key, what the message calls it), in the order they are reported
    ("world_size", "world size"),
    ("hsdp_replicate", "HSDP replicate degree"),
    ("compute_dtype", "dtype"),
    ("seed", "seed"),
    ("data", "data/seed identity"),
    ("optimizer", "optimizer"),
    ("optimizer_state", "optimizer state (key, dtype)"),
)


_OTHER_PART_NAMES = {
    "experts": "expert count",
    "tensors": "model tensors",
    "operators": "operators",
    "optimizer_hyper": "optimizer hyper-parameters",
}


def _diff_simple(found: dict, want: dict) -> str | None:
    for key, name in _SIMPLE_PARTS:
        if found.get(key) != want.get(key):
            return f"{name} {_short(found.get(key))} != {_short(want.get(key))}"
    return None


def _diff_experts(found: dict, want: dict) -> str | None:
    fe, we = found.get("experts") or {}, want.get("experts") or {}
    for moe in sorted(set(fe) | set(we)):
        if fe.get(moe) != we.get(moe):
            return f"expert count {fe.get(moe, 0)} != {we.get(moe, 0)} in {moe or 'the model'}"
    return None


def _diff_tensors(found: dict, want: dict) -> str | None:
    ft, wt = found.get("tensors") or {}, want.get("tensors") or {}
    for name in sorted(set(ft) | set(wt)):
        if name not in wt:
            return f"tensor {name} is not in this model"
        if name not in ft:
            return f"tensor {name} of this model is not in the window"
        if ft[name][0] != wt[name][0]:
            return f"shape of {name} {_short(ft[name][0])} != {_short(wt[name][0])}"
        if ft[name][1] != wt[name][1]:
            return f"dtype of {name} {ft[name][1]} != {wt[name][1]}"
    return None


def _diff_operators(found: dict, want: dict) -> str | None:
    return "operator names differ" if found.get("operators") != want.get("operators") else None


def _diff_hyper(found: dict, want: dict) -> str | None:
    fh, wh = found.get("optimizer_hyper") or [], want.get("optimizer_hyper") or []
    if len(fh) != len(wh):
        return f"optimizer param groups {len(fh)} != {len(wh)}"
    for i, (a, b) in enumerate(zip(fh, wh)):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                where = f" (param group {i})" if len(fh) > 1 else ""
                return f"optimizer {k} {_short(a.get(k))} != {_short(b.get(k))}{where}"
    return None


def _diff_rest(found: dict, want: dict) -> str | None:
    for k in sorted(set(found) | set(want)):
        if found.get(k) != want.get(k):
            return f"{k} {_short(found.get(k))} != {_short(want.get(k))}"
    return None


def identity_mismatch(found: dict | None, expected: RunIdentity) -> str | None:
    """Why a window written with identity `found` (a manifest's dict) is not `expected`'s ("window value != this
    run's value"); None = same run."""
    if not found:
        return "the window records no run identity (written by another version or tool)"
    if found.get("run_id") != expected.run_id:
        return f"run id {found.get('run_id')!r} != {expected.run_id!r}"
    fp = found.get("fingerprint")
    if fp == expected.fingerprint and RunIdentity.from_dict(found).fingerprint == fp:
        return None
    return _diff(found.get("parts") or {}, expected.parts) or "run fingerprint differs"


def allowed_changes(found: dict | None, expected: RunIdentity) -> list[str]:
    """What changed between the window's run and this attempt that is allowed (said in the log)."""
    was, now = (found or {}).get("free") or {}, expected.free
    out = []
    if was.get("lrs") is not None and now.get("lrs") is not None and was["lrs"] != now["lrs"]:
        out.append(f"learning rate {_short(was['lrs'])} -> {_short(now['lrs'])}")
    if was.get("steps") is not None and now.get("steps") is not None and was["steps"] != now["steps"]:
        out.append(f"steps {was['steps']} -> {now['steps']}")
    return out


def refusal(run_id: str | None, reason: str) -> str:
    """The one line that refuses another run's windows, with the fix."""
    return (
        f"run id {run_id!r} holds windows of another run ({reason} [window != this run]); refusing to load "
        f"them: start this job with a new run id (or delete that run's windows if they are no longer needed)"
    )
