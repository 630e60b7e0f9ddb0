"""Where the Mixture-of-Experts layers of a model are, found by structure (or by a user's `OperatorSpec`).

Experts are recognised by shape, not name: grouped `[E, ...]` tensors (one module's, or one per sibling module)
or an `nn.ModuleList`/`ModuleDict` of E identical modules. The MoE block is the nearest ancestor that also holds
the router (a child with leading dim E, or named/typed like a router). `shared*` experts stay dense. A module that
looks like MoE but matched nothing is an error, so an unknown layout is never checkpointed with experts merged.
"""

from __future__ import annotations

import fnmatch
import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from ..core.config_values import OperatorSpec  # defined torch-free for config.py
from ..core.errors import ConfigError

__all__ = ["OperatorSpec", "OperatorDiscoveryError", "MoEBlock", "find_moe_blocks", "state_tensors", "ancestors"]

_ROUTER_NAMES = ("router", "gate", "gating", "wg")
_ROUTER_CLASS = re.compile(r"(Router|Gate|Gating)$")
_MOE_CLASS = re.compile(r"MoE|Moe|Experts|Router")
_WRAPPERS = re.compile(r"^(FSDP|CheckpointWrapper)")


class OperatorDiscoveryError(ConfigError):
    """The model's MoE layout could not be mapped to operators; the message names the module and the fix."""


@dataclass
class MoEBlock:
    path: str  # module path of the MoE block (router + experts)
    num_experts: int
    experts: list[str] = field(default_factory=list)  # expert module paths (list elements or grouped)
    grouped: list[str] = field(default_factory=list)  # fqns sliced along dim 0, one slice per expert
    per_expert: list[list[str]] = field(default_factory=list)  # list experts: expert e's own fqns
    router: list[str] = field(default_factory=list)  # router tensors (+ MoE-level [E] tensors)
    router_modules: list[str] = field(default_factory=list)  # modules whose forward routes (hooks go there)


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _under(path: str, prefix: str) -> bool:
    return prefix == "" or path == prefix or path.startswith(prefix + ".")


def _shared(path: str) -> bool:
    return any("shared" in part.lower() for part in path.split("."))


def state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer, once (tied aliases dropped): what the operators must cover."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters())
    modules = dict(model.named_modules())
    for fqn, b in model.named_buffers():
        owner = modules.get(_parent(fqn)) if "." in fqn else model
        if b is not None and fqn.rsplit(".", 1)[-1] not in getattr(owner, "_non_persistent_buffers_set", ()):
            out[fqn] = b
    return out


def ancestors(path: str):
    """`path`'s proper ancestors, nearest first, ending with the root ""."""
    while path:
        path = _parent(path)
        yield path


class _Tree:
    """The module tree with the state under each module (precomputed: models have thousands of modules)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.modules = dict(model.named_modules())
        self.children = {p: [f"{p}.{n}" if p else n for n, _ in m.named_children()] for p, m in self.modules.items()}
        self.tensors = state_tensors(model)
        self.direct: dict[str, list[str]] = {}
        self.under: dict[str, list[str]] = defaultdict(list)  # the state at or below each module
        for fqn in self.tensors:
            self.direct.setdefault(_parent(fqn), []).append(fqn)
            for a in ancestors(fqn):
                self.under[a].append(fqn)
        self.containers = {p for p, m in self.modules.items() if isinstance(m, (nn.ModuleList, nn.ModuleDict))}
        root = _WRAPPERS.sub("", type(model).__name__)
        # The family prefix of Hugging Face class names ("Qwen2Moe" in Qwen2MoeRMSNorm) is no evidence of MoE.
        self.family = re.split(r"For[A-Z]|Model$", root)[0] if re.search(r"For[A-Z]|Model$", root) else ""
        # Modules with a list or an MoE-looking module at or below them.
        moe_like = [p for p in self.modules if p in self.containers or self.looks_moe(p)]
        self.nested = {a for p in moe_like for a in (p, *ancestors(p))}

    def looks_moe(self, path: str) -> bool:
        name = _WRAPPERS.sub("", type(self.modules[path]).__name__)
        if self.family and name.startswith(self.family):
            name = name[len(self.family) :]
        listed = path in self.containers and "expert" in path.rsplit(".", 1)[-1].lower()
        return (bool(_MOE_CLASS.search(name)) or listed) and not _shared(path)


def _lead(t: torch.Tensor) -> int | None:
    return t.shape[0] if t.dim() >= 1 else None


def _grouped_candidates(tree: _Tree) -> list[tuple[list[str], int]]:
    """(expert module paths, E) for grouped tensors: one module with >= 2 agreeing [E, ...] tensors (one 3-D),
    or sibling modules that each hold a single 3-D [E, ...] tensor (and nothing else of dim >= 2)."""
    found: list[tuple[list[str], int]] = []
    singles: dict[tuple[str, int], list[str]] = {}
    for path in tree.modules:
        # A convolution's weight is [out_channels, in/groups, k...]: 3-D by nature, its dim 0 never experts (the
        # depthwise q/k convs of Qwen3.5's Gated DeltaNet sit beside an [out, dim] projection that looks like a gate).
        if _shared(path) or isinstance(tree.modules[path], nn.modules.conv._ConvNd):
            continue
        own = [tree.tensors[f] for f in tree.direct.get(path, []) if tree.tensors[f].dim() >= 2]
        for e in sorted({t.shape[0] for t in own if t.dim() == 3 and t.shape[0] >= 2}):
            if sum(t.shape[0] == e for t in own) >= 2:
                found.append(([path], e))
            elif len(own) == 1 and path:
                singles.setdefault((_parent(path), e), []).append(path)
    found += [(paths, e) for (_, e), paths in singles.items() if len(paths) >= 2]
    return found


def _list_candidates(tree: _Tree) -> list[tuple[list[str], int]]:
    """(element paths, E) for nn.ModuleList/ModuleDict experts: E >= 2 structurally identical modules that
    hold no lists and nothing MoE-like of their own (a list of transformer blocks is not a list of experts)."""
    found = []
    for path in sorted(tree.containers):
        elems = tree.children[path]
        if _shared(path) or len(elems) < 2 or any(el in tree.nested for el in elems):
            continue
        sigs = {tuple((f[len(el) :], tuple(tree.tensors[f].shape)) for f in tree.under[el]) for el in elems}
        if len(sigs) == 1 and next(iter(sigs)):
            found.append((elems, len(elems)))
    return found


def _router_at(tree: _Tree, level: str, e: int, expert_fqns: set[str], routers: list[str] | None):
    """Router modules and MoE-level [E] tensors directly under `level` (nothing that holds experts)."""

    def holds_experts(p: str) -> bool:
        return any(f.startswith(p + ".") for f in expert_fqns)

    def gate_like(m: str) -> bool:  # a projection to E: its output is what a router hook reads
        return any(tree.tensors[f].dim() == 2 and tree.tensors[f].shape[0] == e for f in tree.under[m])

    tensors = [
        f
        for f in tree.direct.get(level, [])
        if f not in expert_fqns and _lead(tree.tensors[f]) == e and tree.tensors[f].dim() <= 2
    ]
    if routers is not None:
        return [r for r in routers if _under(r, level) and r != level and not holds_experts(r)], tensors
    mods = []
    for child in tree.children[level]:
        if holds_experts(child) or _shared(child) or child in tree.containers:
            continue
        by_name = child.rsplit(".", 1)[-1].lower() in _ROUTER_NAMES or bool(
            _ROUTER_CLASS.search(type(tree.modules[child]).__name__)
        )
        if tree.under[child] and (gate_like(child) or by_name):
            mods.append(child)
    mods.sort(key=lambda m: not gate_like(m))  # the gate projection first
    return mods, tensors


def _place(tree: _Tree, start: str, e: int, expert_fqns: set[str], blocks: set[str], routers: list[str] | None):
    """Walk up from the experts to the MoE block: the first level holding a router, or the first level with
    other state (a router-less MoE), never past a repeated block."""
    level = start
    while True:
        mods, tensors = _router_at(tree, level, e, expert_fqns, routers)
        if mods or tensors:
            return level, mods, tensors
        if level in blocks or level == "" or any(f not in expert_fqns for f in tree.under[level]):
            return level, [], []
        level = _parent(level)


def _match(tree: _Tree, patterns: tuple[str, ...], role: str) -> list[str]:
    out = []
    for pat in patterns:
        hits = [p for p in tree.modules if p and fnmatch.fnmatchcase(p, pat)]
        if not hits:
            example = next((p for p in tree.modules if p.count(".") >= 3), "")
            raise OperatorDiscoveryError(
                f"OperatorSpec.{role} pattern {pat!r} matches no module of "
                f"{type(tree.model).__name__} (module names look like {example!r})"
            )
        out += [h for h in hits if h not in out]
    # fnmatch's * also crosses dots: a pattern that matches a module and its descendants names the module.
    chosen = set(out)
    return [p for p in out if not any(a in chosen for a in ancestors(p))]


def _spec_experts(tree: _Tree, paths: list[str]) -> list[tuple[list[str], int]]:
    groups: dict[tuple[str, int], list[str]] = {}  # (parent, expert count; -1: a list) -> paths
    for path in paths:
        if path in tree.containers or _parent(path) in tree.containers:  # the list, or its elements
            listed = path if path in tree.containers else _parent(path)
            groups[(listed, -1)] = tree.children[listed]
            continue
        lead = [tree.tensors[f].shape[0] for f in tree.direct.get(path, []) if tree.tensors[f].dim() >= 1]
        if not lead:
            raise OperatorDiscoveryError(
                f"OperatorSpec.experts matched {path!r}, which holds no tensors of its own: "
                "name the module that holds the grouped [E, ...] tensors or the expert list"
            )
        groups.setdefault((_parent(path), max(set(lead), key=lead.count)), []).append(path)
    return [(paths, len(paths) if e < 0 else e) for (_, e), paths in groups.items()]


def block_paths(tree: _Tree, skip: set[str]) -> set[str]:
    """Repeated blocks: outermost elements of a ModuleList/ModuleDict (expert lists aside). A one-element list
    counts (a pipeline stage may hold one layer) unless its element holds lists itself (a wrapper)."""
    holds_list = {a for c in tree.containers for a in ancestors(c)}
    elems = {
        c
        for p in tree.containers
        if p not in skip
        for c in tree.children[p]
        if len(tree.children[p]) >= 2 or c not in holds_list
    }
    return {b for b in elems if not any(a in elems for a in ancestors(b))}


def find_moe_blocks(
    model: nn.Module, spec: OperatorSpec | None = None
) -> tuple[list[MoEBlock], list[str], dict[str, torch.Tensor]]:
    """The MoE blocks of `model` and its repeated blocks, both in module order, and its state tensors."""
    tree = _Tree(model)
    spec = spec or OperatorSpec()
    if spec.experts:
        cands = _spec_experts(tree, _match(tree, spec.experts, "experts"))
    else:
        cands = _grouped_candidates(tree) + _list_candidates(tree)
    routers = _match(tree, spec.routers, "routers") if spec.routers else None
    walls = block_paths(tree, set())
    moes: dict[str, MoEBlock] = {}
    for experts, e in cands:
        listed = _parent(experts[0]) in tree.containers and experts == tree.children[_parent(experts[0])]
        if listed:
            per_expert = [tree.under[x] for x in experts]
            fqns = {f for group in per_expert for f in group}
            start = _parent(_parent(experts[0]))
        else:
            fqns = {f for x in experts for f in tree.direct.get(x, []) if _lead(tree.tensors[f]) == e}
            start = experts[0] if len(experts) == 1 else _parent(experts[0])
        level, mods, tensors = _place(tree, start, e, fqns, walls, routers)
        typed = any("expert" in (x + type(tree.modules[x]).__name__).lower() for x in experts + [_parent(experts[0])])
        if not spec.experts and not (mods or tensors) and not typed:
            continue  # grouped tensors with neither a router nor an expert name: no evidence of MoE (e.g. convs)
        if level in moes:
            raise OperatorDiscoveryError(
                f"module {level!r} holds two expert groups ({experts[0]!r} and another): "
                "say which one with OperatorSpec(experts=...)"
            )
        moe = moes[level] = MoEBlock(level, e, experts=list(experts), router_modules=mods)
        if listed:
            moe.per_expert = per_expert
        else:
            moe.grouped = [f for f in tree.tensors if f in fqns]
        moe.router = [f for m in mods for f in tree.under[m]] + tensors
    if routers is not None:
        used = {m for moe in moes.values() for m in moe.router_modules}
        for r in routers:
            if r not in used:
                raise OperatorDiscoveryError(
                    f"OperatorSpec.routers matched {r!r}, which is in no MoE block that "
                    "holds experts: check the experts pattern too"
                )
    _check_unmatched(tree, list(moes))
    order = {p: i for i, p in enumerate(tree.modules)}
    expert_lists = {_parent(m.experts[0]) for m in moes.values() if m.per_expert}
    blocks = sorted(block_paths(tree, expert_lists), key=order.__getitem__)
    return sorted(moes.values(), key=lambda m: order[m.path]), blocks, tree.tensors


def _check_unmatched(tree: _Tree, moe_paths: list[str]) -> None:
    for path in tree.modules:
        if tree.looks_moe(path) and tree.under[path] and not any(_under(path, m) or _under(m, path) for m in moe_paths):
            raise OperatorDiscoveryError(
                f"module {path or '<root>'!r} ({type(tree.modules[path]).__name__}) looks like a Mixture-of-Experts "
                f"layer but no experts were found in it: name them with OperatorSpec(experts=('{_glob(path)}."
                f"<experts module>',), routers=('{_glob(path)}.<router module>',))"
            )


def _glob(path: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", path) if path else "*"
