"""Optimizer state, whatever the optimizer: what each parameter's state holds, how an operator's share is cut
(like the parameter, along the dims a factored state keeps, or once per tensor for 0-dim `step`), and whether
replay with frozen operators is exact: each optimizer's `UpdateRule` (model/update_rules.py) says how its update
couples elements; operator discovery made the operators no finer than that (model/granularity.py), and what no
granularity can replay is refused here. Several optimizers at once are one `Optimizers`, each parameter in
exactly one.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from ..core.errors import UncapturedStateError
from ..core.operator import Operator, Piece, StatePiece
from .operators import local_offset
from .update_rules import UpdateRule, cut_couples, optimizer_list, register_update_rule, rule_of

__all__ = [
    "Optimizers",
    "UpdateRule",
    "register_update_rule",
    "optimizer_list",
    "check_optimizers",
    "init_optimizer_state",
    "attach_optimizer_state",
    "check_optimizer_state",
    "rule_of",
]

RESERVED = ("master", "compute", "buffer")  # slot roles of the other items: no state key may be named so


class MergedState(Mapping):
    """`optimizer.state` of several optimizers: param -> its state dict in the optimizer that owns it."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self._optimizers = optimizers
        self._owner = {id(p): o for o in optimizers for g in o.param_groups for p in g["params"]}

    def __getitem__(self, p):
        o = self._owner.get(id(p))
        if o is None:
            raise KeyError(p)
        return o.state[p]

    def __contains__(self, p) -> bool:
        o = self._owner.get(id(p))
        return o is not None and p in o.state

    def get(self, p, default=None):
        return self[p] if p in self else default

    def __iter__(self) -> Iterator:
        return (p for o in self._optimizers for p in o.state)

    def __len__(self) -> int:
        return sum(len(o.state) for o in self._optimizers)


class Optimizers:
    """Several optimizers stepped, captured and replayed as one (`torch.optim.Optimizer`-like: `param_groups`
    and `state` of all of them, in order). `step_with`: the object whose `step()` runs them (TorchTitan's
    container, so that its step pre-hooks run), else each optimizer's own `step()` in order."""

    def __init__(self, optimizers, step_with=None):
        self.optimizers = optimizer_list(optimizers)
        self._step_with = step_with

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self):
        return self.optimizers[0].state if len(self.optimizers) == 1 else MergedState(self.optimizers)

    def step(self, closure=None):
        if closure is not None:
            raise UncapturedStateError("a step closure cannot be replayed: step without one")
        if self._step_with is not None:
            return self._step_with.step()
        for o in self.optimizers:
            o.step()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


def as_optimizers(optimizer):
    """A torch optimizer as it is, several (a list, a container) as one `Optimizers`."""
    if isinstance(optimizer, Optimizers):
        return optimizer
    if isinstance(optimizer, (list, tuple)) or getattr(optimizer, "optimizers", None) is not None:
        step_with = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        return Optimizers(optimizer, step_with)
    return optimizer


def check_optimizers(model: nn.Module, optimizer) -> None:
    """Every optimizer has a known update rule and settings replay reproduces; every trainable parameter of
    `model` belongs to exactly one optimizer. Refusals are one line each."""
    opts = optimizer_list(optimizer)
    owner: dict[int, torch.optim.Optimizer] = {}
    for o in opts:
        rule = rule_of(o)
        for g in o.param_groups:
            if rule.check is not None and (why := rule.check(g)):
                raise UncapturedStateError(why)
            for p in g["params"]:
                if owner.get(id(p), o) is not o:
                    raise UncapturedStateError(
                        f"parameter {_name(model, p)} is in two optimizers ({type(owner[id(p)]).__name__} and "
                        f"{type(o).__name__}): each parameter must belong to exactly one"
                    )
                owner[id(p)] = o
    for name, p in model.named_parameters():
        if id(p) not in owner and p.requires_grad:
            raise UncapturedStateError(
                f"parameter {name} is not in the optimizer, so the slot format has no optimizer state for it: pass "
                "every trainable parameter to the optimizer(s), or set requires_grad=False (then it is held by value)"
            )


def _name(model: nn.Module, p: torch.Tensor) -> str:
    return next((n for n, q in model.named_parameters() if q is p), f"<a parameter of shape {tuple(p.shape)}>")


def init_optimizer_state(optimizer, state_dtype: torch.dtype | None = None) -> None:
    """Create, for every trainable parameter without state, the state its optimizer's lazy init would (zeros, step
    0), so slots load into it in place and a parameter without a gradient yet has state to copy. Non-scalar
    states take `state_dtype`, else the dtype existing states of that key have (if not their parameter's), else
    the parameter's."""
    for o in optimizer_list(optimizer):
        rule = rule_of(o)
        dtypes = _state_dtypes(o) if state_dtype is None else {}
        for group in o.param_groups:
            for p in group["params"]:
                if not p.requires_grad or len(o.state.get(p, {})) > 0:
                    continue  # never updated (no state, no empty entry in state_dict), or initialised already
                st = rule.init(group, p, state_dtype)
                for k, dt in dtypes.items():
                    if k in st and st[k].dim() > 0 and st[k].dtype != dt:
                        st[k] = st[k].to(dt)
                if st:
                    o.state[p].update(st)


def _state_dtypes(o: torch.optim.Optimizer) -> dict[str, torch.dtype]:
    out: dict[str, torch.dtype] = {}
    for p, st in o.state.items():
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() > 0 and v.dtype != p.dtype:
                out.setdefault(k, v.dtype)
    return out


def attach_optimizer_state(model: nn.Module, ops, optimizer, checked: bool = False) -> None:
    """Check `optimizer` against the operators, create its missing state, and set every operator's
    `Operator.state` (what its slots hold of the optimizer state). Idempotent: callers that may come first call it.

    Args:
        model: the model `optimizer` trains.
        ops: the operators (a list, or name -> Operator); their `state` is set in place.
        optimizer: a torch optimizer, or a list of them (each parameter in exactly one).
        checked: the caller ran `check_optimizers(model, optimizer)` already.

    Raises:
        UncapturedStateError: slots could not hold or replay this optimizer's state: an unsupported optimizer
            or state, an update that couples parameters of different operators ("global" coupling), or operators
            cut finer than the update allows (discovered without this optimizer).
    """
    ops = list(ops.values()) if isinstance(ops, dict) else list(ops)
    if _attached_already(model, ops, optimizer):
        return
    if not checked:
        check_optimizers(model, optimizer)
    init_optimizer_state(optimizer)  # the state its first step would create
    opts = optimizer_list(optimizer)
    _check_cuts(model, ops, opts)
    _check_global(model, ops, opts)
    _assign_state(model, ops, Optimizers(opts).state)
    _remember_attached(model, ops, optimizer)


# optimizer -> (its model, {id(operator): operator}) that attach_optimizer_state last set `state` from, all held
# weakly. Checkpointer, recover() and SparseCheckpointer each attach, as any of them may be the caller's first: on
# one start-up path the work (checks, state creation, the pieces) then runs once. A list of optimizers cannot be
# held weakly: it is attached at every call.
_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _attached_already(model: nn.Module, ops: list, optimizer) -> bool:
    try:
        done = _ATTACHED.get(optimizer)
    except TypeError:  # not weakly referenceable (a list) or unhashable
        return False
    if done is None:
        return False
    model_ref, op_refs = done
    return model_ref() is model and all(id(op) in op_refs and op_refs[id(op)]() is op for op in ops)


def _remember_attached(model: nn.Module, ops: list, optimizer) -> None:
    try:
        _ATTACHED[optimizer] = (weakref.ref(model), {id(op): weakref.ref(op) for op in ops})
    except TypeError:
        pass


def _check_cuts(model: nn.Module, ops: list, opts: list) -> None:
    """Every tensor the operators cut (an expert's slice of a grouped tensor) has an update rule that allows the
    cut: its elements are updated independently across it. Operators discovered with the optimizer always pass
    (granularity.py merged what couples); this catches operators discovered without it."""
    rules = {id(p): (o, rule_of(o)) for o in opts for g in o.param_groups for p in g["params"]}
    params = dict(model.named_parameters())
    cuts: dict[str, set[int]] = {}
    for op in ops:
        for fqn, dims in op.cuts.items():
            cuts.setdefault(fqn, set()).update(dims)
    for fqn, dims in cuts.items():
        p = params.get(fqn)
        if p is not None and id(p) in rules:
            _check_coupling(fqn, p, sorted(dims), *rules[id(p)], sum(fqn in op.cuts for op in ops))


def _check_global(model: nn.Module, ops: list, opts: list) -> None:
    """An optimizer whose update mixes different parameters ("global") replays exactly only when all of them are
    in one operator: replay steps the active ones while the others are frozen at placeholder values."""
    names = {id(p): n for n, p in model.named_parameters()}
    holders: dict[str, set[str]] = {}
    for op in ops:
        for fqn in {pc.fqn for pc in op.pieces if pc.is_param} | set(op.cuts):
            holders.setdefault(fqn, set()).add(op.name)
    for o in opts:
        rule = rule_of(o)
        if rule.coupling != "global":
            continue
        held = sorted({h for g in o.param_groups for p in g["params"] for h in holders.get(names.get(id(p), ""), ())})
        if len(held) > 1:
            shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
            raise UncapturedStateError(
                f"{type(o).__name__} {rule.why}: its update couples parameters across {len(held)} operators "
                f"({shown}), so replay with some of them frozen cannot reproduce it, at any operator granularity "
                "short of the whole model: put those parameters on an optimizer that updates each tensor on its own "
                "(e.g. AdamW, Adafactor, Muon)"
            )


def _assign_state(model: nn.Module, ops: list, state) -> None:
    """Each operator's `state`: per parameter piece it owns, the optimizer state pieces its slots hold."""
    params = dict(model.named_parameters())
    seen: dict[int, str] = {}
    for op in ops:
        op.state = {
            pc.fqn: tuple(_state_piece(op, pc, k, v, seen) for k, v in state.get(params[pc.fqn], {}).items())
            for pc in op.pieces
            if pc.is_param and pc.fqn in params
        }


def _check_coupling(fqn: str, p: torch.Tensor, dims: list[int], opt, rule: UpdateRule, n_ops: int) -> None:
    if not cut_couples(rule, p.dim(), dims):
        return
    where = "inside its matrices (the last two dims)" if rule.coupling == "matrix" else "at all"
    raise UncapturedStateError(
        f"{type(opt).__name__} {rule.why}, and {fqn} {tuple(p.shape)} is cut into {n_ops} operators along dim "
        f"{', '.join(map(str, dims))}, which it cannot be {where}: replay would mix frozen operators' placeholder "
        "state into the active ones. Discover the operators with the optimizer (discover_operators(model, "
        "optimizer=...), as Checkpointer and start() do): that layer's experts then become one operator"
    )


def _state_piece(op: Operator, pc: Piece, key: str, v, seen: dict[int, str]) -> StatePiece:
    """The part of state tensor `v` (of parameter piece `pc`) that operator `op` owns on this rank."""
    where = f"optimizer state {key!r} of {pc.fqn}"
    if key in RESERVED:
        raise UncapturedStateError(f"{where}: the name is reserved for slot items ({', '.join(RESERVED)})")
    if not torch.is_tensor(v):
        raise UncapturedStateError(f"{where} is a {type(v).__name__}, not a tensor: slots hold tensors only")
    if v.dim() == 0:
        return StatePiece(key, None, v.dtype)
    owner = seen.setdefault(id(v), pc.fqn)
    if owner != pc.fqn:
        raise UncapturedStateError(f"{where} is shared with {owner}: slots hold state per parameter")
    glob, shape = tuple(v.shape), pc.global_shape
    if len(glob) != len(shape) or any(h not in (g, 1) for h, g in zip(glob, shape)):
        raise UncapturedStateError(
            f"{where} has shape {glob}, neither the parameter's {shape} nor one that keeps some of its dims: a slot "
            f"cannot cut it per operator"
        )
    lo, ls = local_offset(v)
    cut = op.cuts.get(pc.fqn, ())
    offs, sizes, slices = [], [], []
    for i, (h, g) in enumerate(zip(glob, shape)):
        if h == g:  # kept dim: the operator's range of the parameter
            a, b = (pc.global_offset[i], pc.global_offset[i] + pc.shape[i]) if i in cut else (0, g)
        elif i in cut:
            raise UncapturedStateError(
                f"{where} has shape {glob}: it reduces dim {i}, along which {op.name} is cut from the tensor, so "
                "one value is shared by several operators"
            )
        else:
            a, b = 0, 1
        a, b = max(a, lo[i]), min(b, lo[i] + ls[i])  # what this rank holds of it
        b = max(a, b)
        offs.append(a)
        sizes.append(b - a)
        slices.append(slice(a - lo[i], b - lo[i]))
    if (glob, tuple(offs), tuple(slices), tuple(sizes)) == (shape, pc.global_offset, pc.local_slices, pc.shape):
        return StatePiece(key, pc, v.dtype)  # cut like the parameter: the parameter's own piece
    return StatePiece(key, Piece(pc.fqn, True, glob, tuple(offs), tuple(slices), tuple(sizes), v.dtype), v.dtype)


def check_optimizer_state(model: nn.Module, optimizer, ops) -> None:
    """After the first update: every parameter's state still has the keys, dtypes and shapes the slots hold."""
    params = dict(model.named_parameters())
    state = Optimizers(optimizer_list(optimizer)).state
    for op in ops.values() if isinstance(ops, dict) else ops:
        for fqn, pieces in (op.state or {}).items():
            live = state.get(params[fqn], {})
            got = {k: (tuple(v.shape), v.dtype) if torch.is_tensor(v) else type(v).__name__ for k, v in live.items()}
            want = {s.key: (s.piece.global_shape if s.piece is not None else (), s.dtype) for s in pieces}
            if got != want:
                raise UncapturedStateError(
                    f"optimizer state of {fqn} changed after the first step: slots hold {_fmt(want)}, the "
                    f"optimizer now has {_fmt(got)}; create the state before the checkpointer (in its final dtype) "
                    "or use a stock optimizer"
                )


def _fmt(d: dict) -> str:
    return "{" + ", ".join(f"{k}: {v[1] if isinstance(v, tuple) else v}" for k, v in sorted(d.items())) + "}"
