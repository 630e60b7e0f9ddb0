"""Layering of the library, read from the source with `ast` (nothing is imported): `torchmoe_ckpt` never
imports what sits on top of it (the harness, bench, baselines, simulator, TorchTitan and its glue), imports
only the standard library, torch and its optional extras, and has no import circle among its modules.
Inside the library, every module sits in the package of its layer (LAYERS, bottom first) or is one of the
front-door files (FRONT_DOOR), and a layer imports only the layers below it (and itself); the front door may
import anything. The exceptions are listed one by one, with their reason (ALLOWED_UPWARD).
Every import counts: module-level and function-local ones (a function-local import must not hide a circle),
relative ones resolved against the importing module."""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = "torchmoe_ckpt"
# Packages on top of the library, and the library modules that moved to torchmoe_harness (a stale import of
# one of those would silently resolve to nothing, or to a leftover file).
FORBIDDEN_TOP = ("torchmoe_harness", "titan_integration", "torchtitan")
MOVED = (
    "torchmoe_ckpt.harness",
    "torchmoe_ckpt.bench",
    "torchmoe_ckpt.baselines",
    "torchmoe_ckpt.selftest",
    "torchmoe_ckpt.ettr",
    "torchmoe_ckpt.dcp.format_compare",
)
# Third-party packages the library may import: torch, numpy (a dependency) and the optional extras.
THIRD_PARTY_OK = {
    "torch",
    "numpy",
    "fsspec",
    "s3fs",
    "adlfs",
    "azure",
    "tensorstore",
    "matplotlib",
    "transformers",  # the hf extra: export/ builds the target model (function-local imports)
    "safetensors",  # transformers' own dependency: export/ writes the shards with it
}


# The library's layers, bottom first: (rank, package, what it holds). A package imports only packages of a lower
# rank, and modules of its own; packages of the same rank never import each other. docs/architecture.md draws
# this table as the import graph and names every module.
LAYERS = (
    (
        0,
        "core",
        "shared data, no threads: errors, torch-free configs and their checks, operator pieces, window plans, slots, "
        "windows, replay records",
    ),
    (1, "runtime", "process services: process groups, fault points, exit, watchdog, device copies"),
    (2, "model", "what is checkpointed: operators, MoE structure, optimizer state, routing, run identity"),
    (3, "planning", "Algorithm 1, the window planner, popularity, peer placement"),
    (4, "storage_format", "the bytes on disk and in the store: layout, manifests, slot format, checksums, files"),
    (5, "ownership", "who may write a run: the run lock (local) and the store lease (object store)"),
    (6, "tiers", "the tiers behind one contract: host memory, peers, the object store (DCP and tensorstore)"),
    (7, "persist", "what runs the tiers: building them, the persist thread, uploader, health, status lines"),
    (8, "dcp", "DCP planners and StorageWriter/Reader adapters over the tiers"),
    (9, "capture", "the copy engine, slot pools and their allocators, host memory"),
    (10, "recovery", "recover, sparse-to-dense, replay checks and records, RNG, JIT checkpoint"),
    (11, "pipeline", "stage-boundary logs and localized recovery"),
    (11, "export", "exports of a committed window: Hugging Face safetensors folders from slot 0"),
    (12, "ops", "the recovery line, the command line, inspect/verify"),
)
# Modules at the package root: the front door (what a user imports, the start-up sequence). It may import any layer.
FRONT_DOOR = ("__init__", "checkpointer", "checkpointer_parts", "config", "startup", "sparse_checkpointer")
# Imports against the order, each with its reason: (importing module, imported module). Empty: TierConfig,
# ObjectStoreConfig and the checks they need (check_uri, check_timeout) live in core/ (core/tier_config.py,
# core/config_values.py), so the tiers and the JIT checkpoint read them from below; keep it empty.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    source: str  # importing module, e.g. torchmoe_ckpt.tiers.host_tier
    target: str  # absolute name as written or resolved, e.g. torchmoe_ckpt.storage_format.manifest.file_entry
    module: str  # the part that must be a module: torchmoe_ckpt.storage_format.manifest (the target may be one too)
    line: int
    local: bool  # inside a function or method

    def where(self) -> str:
        return f"{self.source}:{self.line}{' (function-local)' if self.local else ''} imports {self.target}"


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of `package` (a directory under `root`): dotted name -> file."""
    out = {}
    for f in sorted((root / package).rglob("*.py")):
        parts = list(f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def imports_of(name: str, path: Path) -> list[Import]:
    """All imports of one module, anywhere in it, as absolute names (`from X import y` gives X.y: y may be a
    module or a name defined in X; `owning_module` tells which)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    local_lines = {
        n.lineno
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        for n in ast.walk(f)
        if isinstance(n, (ast.Import, ast.ImportFrom))
    }
    out = []
    for node in ast.walk(tree):
        local = getattr(node, "lineno", 0) in local_lines
        if isinstance(node, ast.Import):
            out += [Import(name, a.name, a.name, node.lineno, local) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module
            out += [Import(name, f"{stem}.{a.name}", stem, node.lineno, local) for a in node.names]
    return out


def owning_module(i: Import, modules: set[str]) -> str | None:
    """The module of `modules` an import loads: the target itself if it is a module, else the module it is
    taken from; None for other packages, and for a module that does not exist (yet)."""
    return i.target if i.target in modules else i.module if i.module in modules else None


def forbidden(imports: list[Import]) -> list[Import]:
    return [
        i
        for i in imports
        if i.target.split(".")[0] in FORBIDDEN_TOP or any(i.target == m or i.target.startswith(m + ".") for m in MOVED)
    ]


def foreign(imports: list[Import], own: str = LIBRARY) -> list[Import]:
    """Imports of third-party packages outside the standard library, torch and the extras (what `forbidden`
    reports is left to it)."""
    above = set(forbidden(imports))
    return [
        i
        for i in imports
        if (top := i.target.split(".")[0]) not in (own, LIBRARY)
        and i not in above
        and top not in sys.stdlib_module_names
        and top not in THIRD_PARTY_OK
    ]


def graph(imports: list[Import], modules: set[str]) -> dict[str, dict[str, Import]]:
    """module -> {imported module of the same package -> one import line that makes the edge}. A package
    importing a name from its own `__init__` is no edge."""
    g: dict[str, dict[str, Import]] = {m: {} for m in modules}
    for i in imports:
        dst = owning_module(i, modules)
        if dst is not None and dst != i.source:
            g[i.source].setdefault(dst, i)
    return g


def components(g: dict[str, dict]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted. Self-edges do not
    exist (see `graph`), so these are exactly the import circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the number of modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            comps.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return [c for c in comps if len(c) > 1]


def cycle_in(comp: list[str], g: dict[str, dict]) -> list[str]:
    """One shortest cycle [a, b, ..., a] through the component's first module (breadth-first inside it)."""
    start, members, prev, frontier = comp[0], set(comp), {}, [comp[0]]
    while frontier and start not in prev:
        nxt = []
        for v in frontier:
            for w in sorted(g[v]):
                if w in members and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    path, v = [start], prev[start]
    while v != start:
        path.append(v)
        v = prev[v]
    return [start] + path[:0:-1] + [start]


def cycles(g: dict[str, dict]) -> list[list[str]]:
    return [cycle_in(c, g) for c in components(g)]


def describe(comp: list[str], g: dict[str, dict[str, Import]]) -> str:
    cycle = cycle_in(comp, g)
    return (
        f"circle among {', '.join(comp)}; one cycle: "
        + " -> ".join(cycle)
        + "\n    "
        + "\n    ".join(g[a][b].where() for a, b in zip(cycle, cycle[1:]))
    )


def scan(root: Path, package: str) -> tuple[list[Import], dict[str, dict[str, Import]]]:
    mods = module_names(root, package)
    imports = [i for name, path in mods.items() for i in imports_of(name, path)]
    return imports, graph(imports, set(mods))


def rank_of(module: str, package: str = LIBRARY, layers=LAYERS, front=FRONT_DOOR) -> int | None:
    """The rank of a library module's layer; the front door ranks above every layer; None: in no layer."""
    parts = module.split(".")[1:]
    if not parts or (len(parts) == 1 and parts[0] in front):  # the package's __init__, a front-door file
        return max(r for r, *_ in layers) + 1
    ranks = {name: r for r, name, _ in layers}
    return ranks.get(parts[0]) if len(parts) > 1 or parts[0] in ranks else None


def layer_name(module: str) -> str:
    parts = module.split(".")[1:]
    return parts[0] if len(parts) > 1 or (parts and parts[0] not in FRONT_DOOR) else "front door"


def outside_layers(modules, package: str = LIBRARY, layers=LAYERS, front=FRONT_DOOR) -> list[str]:
    """Modules in no layer package and not front-door files (a stray module at the root, or an unknown package)."""
    return sorted(m for m in modules if rank_of(m, package, layers, front) is None)


def against_order(
    imports: list[Import], modules: set[str], package: str = LIBRARY, layers=LAYERS, front=FRONT_DOOR, allowed=()
) -> list[Import]:
    """Imports of a module of a higher-ranked layer, or of another package of the same rank, less the `allowed`
    (importing module, imported module) pairs, names relative to the package."""
    strip = len(package) + 1
    bad = []
    for i in imports:
        dst = owning_module(i, modules)
        if dst is None or dst == i.source:
            continue
        src_rank, dst_rank = rank_of(i.source, package, layers, front), rank_of(dst, package, layers, front)
        if src_rank is None or dst_rank is None:
            continue  # reported by outside_layers
        src_pkg, dst_pkg = i.source[strip:].split(".")[0], dst[strip:].split(".")[0]
        top = max(r for r, *_ in layers) + 1
        if src_rank == top or src_pkg == dst_pkg or dst_rank < src_rank:
            continue
        if (i.source[strip:], dst[strip:]) in allowed:
            continue
        bad.append(i)
    return bad


# ---- the library ------------------------------------------------------------------------------------------
def test_library_does_not_import_what_sits_on_top_of_it():
    imports, _ = scan(ROOT, LIBRARY)
    bad = forbidden(imports)
    assert not bad, "the library imports the harness/bench/baselines/simulator/TorchTitan:\n  " + "\n  ".join(
        i.where() for i in bad
    )


def test_library_imports_only_stdlib_torch_and_its_extras():
    imports, _ = scan(ROOT, LIBRARY)
    bad = foreign(imports)
    assert not bad, f"third-party imports outside {sorted(THIRD_PARTY_OK)}:\n  " + "\n  ".join(i.where() for i in bad)


def test_library_has_no_import_circle():
    _, g = scan(ROOT, LIBRARY)
    found = components(g)
    assert not found, "import circles among library modules:\n  " + "\n  ".join(describe(c, g) for c in found)


def test_every_library_module_sits_in_its_layer_or_the_front_door():
    found = outside_layers(module_names(ROOT, LIBRARY))
    assert not found, (
        f"modules in no layer package of {[name for _, name, _ in LAYERS]} and not front-door files "
        f"{list(FRONT_DOOR)} (put each in the package of its layer, or add a new layer to LAYERS):\n  "
        + "\n  ".join(found)
    )


def test_library_imports_follow_the_layer_order():
    mods = module_names(ROOT, LIBRARY)
    imports, _ = scan(ROOT, LIBRARY)
    bad = against_order(imports, set(mods), allowed=ALLOWED_UPWARD)
    lines = [f"{i.where()}  [{layer_name(i.source)} -> {layer_name(owning_module(i, set(mods)))}]" for i in bad]
    assert not bad, (
        "imports against the layer order (LAYERS: a layer imports only lower ones; move the shared definition down "
        "into core/ rather than import upward):\n  " + "\n  ".join(lines)
    )


def test_allowed_upward_imports_still_exist():
    """An exception that no longer happens leaves the list (so that the list stays the truth)."""
    mods = module_names(ROOT, LIBRARY)
    imports, _ = scan(ROOT, LIBRARY)
    strip = len(LIBRARY) + 1
    seen = {(i.source[strip:], (owning_module(i, set(mods)) or "")[strip:]) for i in imports}
    stale = sorted(set(ALLOWED_UPWARD) - seen)
    assert not stale, f"ALLOWED_UPWARD entries that no import needs any more: {stale}"


def test_layer_packages_exist_and_name_their_layer():
    for _, name, _ in LAYERS:
        init = ROOT / LIBRARY / name / "__init__.py"
        assert init.is_file(), f"layer package {name}/ is missing"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{name}/__init__.py says what the layer holds"


def architecture_block(text: str) -> list[tuple[str, str]]:
    """(package, module file) as docs/architecture.md's layer block names them, top first; the package is "" for
    the front door (the `torchmoe_ckpt/` section)."""
    block = text.split("## Layers", 1)[1].split("```", 2)[1]
    out, pkg = [], None
    for line in block.splitlines():
        head = re.match(r"\s*(\w+)/\s", line)
        if head and head.group(1) == LIBRARY:
            pkg = ""
        elif head and pkg is not None:
            pkg = head.group(1)
        if pkg is not None:
            out += [(pkg, f) for f in re.findall(r"\b(\w+\.py)\b", line)]
    return out


def test_architecture_doc_draws_the_layers_and_names_every_module():
    named = architecture_block((ROOT / "docs" / "architecture.md").read_text())
    have = set()
    for path in module_names(ROOT, LIBRARY).values():
        rel = path.relative_to(ROOT / LIBRARY)
        if rel.name != "__init__.py" or len(rel.parts) == 1:
            have.add(("" if len(rel.parts) == 1 else rel.parts[0], rel.name))
    missing, stale = sorted(have - set(named)), sorted(set(named) - have)
    assert not missing and not stale, f"docs/architecture.md's layer block: not named {missing}; no such module {stale}"
    ranks = {name: r for r, name, _ in LAYERS} | {"": max(r for r, *_ in LAYERS) + 1}
    order = [ranks[p] for p, _ in named]
    assert order == sorted(order, reverse=True), "the block draws the layers top first, in the order of LAYERS"


def test_moved_modules_are_gone_from_the_library():
    mods = module_names(ROOT, LIBRARY)
    left = [m for m in mods if any(m == x or m.startswith(x + ".") for x in MOVED)]
    assert not left, f"modules that belong to torchmoe_harness are still in the library: {left}"


def test_torchtitan_glue_does_not_need_the_harness():
    """titan_integration sits on the library only: with the library clean (above), TorchTitan's runs never
    load the harness (its pipeline path once loaded TinyMoE through torchmoe_ckpt.pipeline.stage_io)."""
    imports, _ = scan(ROOT, "titan_integration")
    bad = [
        i
        for i in imports
        if i.target.split(".")[0] == "torchmoe_harness"
        or any(i.target == m or i.target.startswith(m + ".") for m in MOVED)
    ]
    assert not bad, "\n  ".join(i.where() for i in bad)


def test_torchtitan_glue_has_no_import_circle():
    """titan_integration's modules import each other one way (a function-local import counts): the checkpoint
    manager never reaches back into the trainer that builds it."""
    _, g = scan(ROOT, "titan_integration")
    found = components(g)
    assert not found, "import circles in titan_integration:\n  " + "\n  ".join(describe(c, g) for c in found)


# ---- the checker itself fails when it should --------------------------------------------------------------
def _fake_package(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_checker_finds_a_function_local_harness_import_and_a_hidden_circle(tmp_path):
    _fake_package(
        tmp_path,
        {
            "lib/__init__.py": "",
            "lib/a.py": "from .sub.b import thing\n",
            "lib/sub/__init__.py": "",
            "lib/sub/b.py": "def f():\n    from ..c import other  # hides the circle\n    return other\nthing = 1\n",
            "lib/c.py": "from . import a\nimport json\n",
            "lib/d.py": "def g():\n    from torchmoe_harness.trainer import Trainer\n"
            "    import titan_integration.train\n"
            "    from torchmoe_ckpt.harness import launch\n    import requests\n",
        },
    )
    imports, g = scan(tmp_path, "lib")
    bad = forbidden(imports)
    assert [(i.source, i.target, i.local) for i in bad] == [
        ("lib.d", "torchmoe_harness.trainer.Trainer", True),
        ("lib.d", "titan_integration.train", True),
        ("lib.d", "torchmoe_ckpt.harness.launch", True),
    ]
    assert [i.target for i in foreign(imports, own="lib")] == ["requests"]
    assert g["lib.sub.b"]["lib.c"].local and g["lib.c"]["lib.a"].line == 1  # relative imports resolved
    assert components(g) == [["lib.a", "lib.c", "lib.sub.b"]]
    assert cycles(g) == [["lib.a", "lib.sub.b", "lib.c", "lib.a"]]
    text = describe(components(g)[0], g)
    assert "lib.sub.b:2 (function-local) imports lib.c.other" in text, text


def test_checker_passes_a_clean_graph():
    g = {"a": {"b": None}, "b": {"c": None}, "c": {}, "d": {"b": None}}
    assert cycles(g) == []
    assert cycles({"a": {"b": None}, "b": {"c": None}, "c": {"a": None}}) == [["a", "b", "c", "a"]]


def test_checker_finds_an_import_against_the_order_and_a_stray_module(tmp_path):
    _fake_package(
        tmp_path,
        {
            "lib/__init__.py": "from .front import go\n",
            "lib/front.py": "from .top.t import x\nfrom .low.l import y\n",  # the front door imports anything
            "lib/stray.py": "",  # in no layer
            "lib/low/__init__.py": "",
            "lib/low/l.py": "def f():\n    from ..mid.m import z  # upward, function-local\n    return z\ny = 1\n",
            "lib/low/l2.py": "from .l import y\n",  # its own layer
            "lib/side/__init__.py": "",
            "lib/side/s.py": "from ..low import l2\n",  # a peer of low: no
            "lib/mid/__init__.py": "",
            "lib/mid/m.py": "from ..low.l import y\nfrom .. import front\nz = 2\n",  # down: yes; the front door: no
            "lib/top/__init__.py": "",
            "lib/top/t.py": "from ..mid import m\nfrom ..side.s import w\nx = 3\n",
        },
    )
    layers = ((0, "low", ""), (0, "side", ""), (1, "mid", ""), (2, "top", ""))
    mods = module_names(tmp_path, "lib")
    imports, _ = scan(tmp_path, "lib")
    assert outside_layers(mods, "lib", layers, ("__init__", "front")) == ["lib.stray"]
    bad = against_order(imports, set(mods), "lib", layers, ("__init__", "front"))
    assert sorted((i.source, i.target, i.local) for i in bad) == [
        ("lib.low.l", "lib.mid.m.z", True),
        ("lib.mid.m", "lib.front", False),
        ("lib.side.s", "lib.low.l2", False),
    ]
    allowed = {("low.l", "mid.m"): "reason"}
    assert len(against_order(imports, set(mods), "lib", layers, ("__init__", "front"), allowed)) == 2


def test_public_names_are_lazy_complete_and_the_dcp_ones_in_step():
    """`import torchmoe_ckpt` imports nothing else (the names come on first use, PEP 562); every name in
    `__all__` resolves, the DCP users' names are exactly dcp.__all__, and `sparse_to_dense` stays the function
    after its submodule (recovery/sparse_to_dense.py) is imported."""
    import subprocess

    code = (
        "import sys, torchmoe_ckpt as t\n"
        "assert 'torch' not in sys.modules and 'torchmoe_ckpt.checkpointer' not in sys.modules, sorted(sys.modules)\n"
        "import torchmoe_ckpt.recovery.sparse_to_dense\n"
        "assert callable(t.sparse_to_dense) and t.sparse_to_dense.__name__ == 'sparse_to_dense'\n"
        "from torchmoe_ckpt import dcp\n"
        "assert set(t._DCP_EXPORTS) == set(dcp.__all__), set(t._DCP_EXPORTS) ^ set(dcp.__all__)\n"
        "missing = [n for n in t.__all__ if getattr(t, n, None) is None]\n"
        "assert not missing and len(set(t.__all__)) == len(t.__all__), missing\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
