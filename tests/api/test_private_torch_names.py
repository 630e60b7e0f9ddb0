"""Every private torch name the library touches is listed, with why, and was checked on the torch versions named.

Private names (`torch._C...`, `torch.distributed._...`, `_foreach_*`, `tensor._local_tensor`, a `_name` imported
from a public torch module) are not covered by torch's compatibility promise: a release may move or drop one
without a deprecation. The list (tests/api/private_torch_names.py) is where an upgrade starts: check each entry
against the new torch, then add its version to CHECKED_ON. The scan reads the library's source with `ast` (no
regex over text): a private name in a comment or a docstring does not count, one behind `getattr(x, "_n")` does.
"""

from __future__ import annotations

import ast
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from private_torch_names import CHECKED_ON, PRIVATE_NAMES  # the list beside this test

ROOT = Path(__file__).resolve().parents[2]
VERSION = ".".join(torch.__version__.split("+")[0].split(".")[:2])  # "2.13"
LIBRARY = ROOT / "torchmoe_ckpt"


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


@dataclass(frozen=True)
class Touch:
    name: str  # "torch.x._y" (a path from torch), or "._y" (a private attribute of an object of unknown type)
    where: str  # file:line


def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _up_to_last_private(parts: list[str]) -> str | None:
    last = max((i for i, p in enumerate(parts) if _private(p)), default=None)
    return None if last is None else ".".join(parts[: last + 1])


def _own_names(trees: dict[str, ast.Module]) -> set[str]:
    """Every name the library binds itself (functions, classes, variables, attributes it assigns, `setattr`
    strings): a private attribute with one of these names is the library's own, not torch's."""
    own = set()
    for tree in trees.values():
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                own.add(n.id)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, (ast.Store, ast.Del)):
                own.add(n.attr)
            elif isinstance(n, ast.arg):
                own.add(n.arg)
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                own.add(n.target.id)
            elif _is_attr_call(n, ("setattr",)):
                own.add(n.args[1].value)  # type: ignore[union-attr]
    return own


def _is_attr_call(n: ast.AST, funcs: tuple[str, ...]) -> bool:
    return (
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id in funcs
        and len(n.args) >= 2
        and isinstance(n.args[1], ast.Constant)
        and isinstance(n.args[1].value, str)
    )


def _torch_aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> the torch path it stands for (`import torch.distributed as dist`: dist -> torch.distributed;
    `from torch import nn`: nn -> torch.nn)."""
    out = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name.split(".")[0] == "torch":
                    out[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").split(".")[0] == "torch":
            for a in n.names:
                out[a.asname or a.name] = f"{n.module}.{a.name}"
        elif (  # rdzv = importlib.import_module("torch.distributed.rendezvous")
            isinstance(n, ast.Assign)
            and len(n.targets) == 1
            and isinstance(n.targets[0], ast.Name)
            and isinstance(n.value, ast.Call)
            and (_dotted(n.value.func) or [""])[-1] in ("import_module", "__import__")
            and n.value.args
            and isinstance(n.value.args[0], ast.Constant)
            and str(n.value.args[0].value).split(".")[0] == "torch"
        ):
            out[n.targets[0].id] = str(n.value.args[0].value)
    return out


def _resolve(path: str) -> object | None:
    """The torch object at a dotted path, or None."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):  # the longest importable module, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
        return obj
    return None


def _subclass_touches(tree: ast.Module, file: str, path_of) -> list[Touch]:
    """A class deriving from a torch class touches the private members of its base it overrides, or calls
    through `super()` (pipeline/stock.py's stage overrides PipelineStage's private `_warmup_forward_vote`)."""
    touches = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        bases = [".".join(p) for b in cls.bases if (p := path_of(b))]
        if not bases:
            continue
        for n in ast.walk(cls):
            name = None
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(n.name):
                name = n.name
            elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Call) and _private(n.attr):
                if isinstance(n.value.func, ast.Name) and n.value.func.id == "super":
                    name = n.attr
            for base in bases:
                if name and hasattr(_resolve(base), name):
                    touches.append(Touch(f"{base}.{name}", f"{file}:{n.lineno}"))  # type: ignore[attr-defined]
    return touches


def _other_modules(tree: ast.Module) -> set[str]:
    """Local names bound to modules other than torch (`import os`, `from fsspec import x`)."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out |= {a.asname or a.name.split(".")[0] for a in n.names if a.name.split(".")[0] != "torch"}
        elif isinstance(n, ast.ImportFrom) and (n.level > 0 or (n.module or "").split(".")[0] != "torch"):
            out |= {a.asname or a.name for a in n.names}
    return out


def scan(files: list[Path], root: Path) -> list[Touch]:
    trees = {str(f.relative_to(root)): ast.parse(f.read_text(), str(f)) for f in files}
    own = _own_names(trees)
    touches = []
    for file, tree in trees.items():
        aliases = _torch_aliases(tree)
        inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        # getattr(torch._C, "_x") is one name, torch._C._x
        inner |= {
            id(n.args[0])
            for n in ast.walk(tree)
            if _is_attr_call(n, ("getattr", "hasattr")) and _private(n.args[1].value)
        }  # type: ignore[union-attr]
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        others = _other_modules(tree)

        def path_of(node: ast.AST, aliases: dict[str, str] = aliases) -> list[str] | None:
            parts = _dotted(node)
            if parts is None or parts[0] not in aliases:
                return None
            return [*aliases[parts[0]].split("."), *parts[1:]]

        touches += _subclass_touches(tree, file, path_of)
        for n in ast.walk(tree):
            where = f"{file}:{getattr(n, 'lineno', 0)}"
            if isinstance(n, ast.Import):
                names = [a.name for a in n.names if a.name.split(".")[0] == "torch"]
                touches += [Touch(p, where) for a in names if (p := _up_to_last_private(a.split(".")))]
            elif isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").split(".")[0] == "torch":
                for a in n.names:
                    if p := _up_to_last_private([*(n.module or "").split("."), a.name]):
                        touches.append(Touch(p, where))
            elif isinstance(n, ast.Attribute) and id(n) not in inner:
                path = path_of(n)
                dotted = _dotted(n)
                if path is not None:
                    if p := _up_to_last_private(path):
                        touches.append(Touch(p, where))
                elif dotted is None or dotted[0] not in others:  # os._exit, argparse._SubParsersAction: not torch's
                    # an attribute of an object whose type the source does not say: torch's unless ours
                    for part in dotted[1:] if dotted else [n.attr]:
                        if _private(part) and part not in own:
                            touches.append(Touch("." + part, where))
            elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
                parts = n.value.split(".")  # a module named in a string: sys.modules.get("torch.x._y")
                if parts[0] == "torch" and len(parts) > 1 and all(p.isidentifier() for p in parts):
                    if p := _up_to_last_private(parts):
                        touches.append(Touch(p, where))
            elif _is_attr_call(n, ("getattr", "hasattr")) and _private(attr := n.args[1].value):  # type: ignore[union-attr]
                base = path_of(n.args[0])
                if base is not None:
                    touches.append(Touch(".".join([*base, attr]), where))
                elif attr not in own:
                    touches.append(Touch("." + attr, where))
    return touches


def _library_touches() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for t in scan(sorted(LIBRARY.rglob("*.py")), ROOT):
        out.setdefault(t.name, []).append(t.where)
    return out


def test_the_scan_finds_each_kind_of_private_name(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "import torch\nimport torch.distributed as dist\nimport torch.distributed._tools as tl\n"
        "from torch import nn\nfrom torch.optim.optimizer import _get_scalar_dtype\n"
        "def f(t, x):\n"
        "    torch._foreach_copy_([t], [t])\n"  # a private function of torch
        "    dist.distributed_c10d._world.pg_map\n"  # through an alias, cut after the private part
        "    getattr(torch._C, '_host_emptyCache', None)\n"  # behind getattr
        "    isinstance(x, nn.modules.conv._ConvNd)\n"
        "    x._local_tensor\n"  # an object's private attribute
        "    self._mine = 1; x._mine\n"  # the library's own: not counted
        "    hasattr(x, '_mp_policy')\n"
        "    '''torch._C._not_code'''  # torch._also_not\n"
        "    import os; os._exit(1)\n"  # not torch's
        "    getattr(dist.rendezvous._create_c10d_store, 'used', False)\n"  # a public getattr of a private name
        "    sys.modules.get('torch.distributed.tensor._random')\n"  # a module named in a string
        "rz = importlib.import_module('torch.distributed.rendezvous')\n"
        "rz._create_c10d_store = None\n"  # an alias made by import_module; assigned: still torch's
        "class Opt(torch.optim.Optimizer):\n"
        "    def _cuda_graph_capture_health_check(self): super()._cuda_graph_capture_health_check()\n"
        "    def _ours(self): pass\n"  # private, but not the base's
    )
    found = sorted({t.name for t in scan([src], tmp_path)})
    assert found == [
        "._local_tensor",
        "._mp_policy",
        "torch._C._host_emptyCache",
        "torch._foreach_copy_",
        "torch.distributed._tools",
        "torch.distributed.distributed_c10d._world",
        "torch.distributed.rendezvous._create_c10d_store",
        "torch.distributed.tensor._random",
        "torch.nn.modules.conv._ConvNd",
        "torch.optim.Optimizer._cuda_graph_capture_health_check",
        "torch.optim.optimizer._get_scalar_dtype",
    ], found


def test_every_private_torch_name_the_library_touches_is_listed():
    found = _library_touches()
    unlisted = {n: w for n, w in found.items() if n not in PRIVATE_NAMES}
    assert not unlisted, (
        "private torch names not in tests/api/private_torch_names.py (add each with why it is needed, or use a "
        "public API): " + "; ".join(f"{n} at {', '.join(w)}" for n, w in sorted(unlisted.items()))
    )
    stale = sorted(n for n in set(PRIVATE_NAMES) - set(found) if VERSION not in PRIVATE_NAMES[n].absent_in)
    assert not stale, f"listed in tests/api/private_torch_names.py but no longer touched (remove them): {stale}"
    assert all(e.why.strip() for e in PRIVATE_NAMES.values())


def test_this_torch_is_one_the_list_was_checked_on():
    version = VERSION
    assert version in CHECKED_ON, (
        f"torch {torch.__version__}: the private names in tests/api/private_torch_names.py were checked on "
        f"{sorted(CHECKED_ON)} only; check each entry against this torch, then add {version!r} to CHECKED_ON"
    )


def test_each_private_path_is_where_the_list_says_in_this_torch():
    """Each path from torch exists in this torch, unless `absent_in` names this version or it is `cuda_only` on
    a CPU build (then it must be absent: the entry says the truth). A required one is used unguarded: never absent."""
    wrong = []
    for name, e in sorted(PRIVATE_NAMES.items()):
        if not name.startswith("torch."):
            continue
        there = _resolve(name) is not None
        expected = VERSION not in e.absent_in and (torch.version.cuda is not None or not e.cuda_only)
        if there != expected:
            wrong.append(f"{name}: {'present' if there else 'absent'} in torch {torch.__version__}")
    assert not wrong, wrong
    assert not [n for n, e in PRIVATE_NAMES.items() if e.required and e.absent_in], "a required name is never absent"
