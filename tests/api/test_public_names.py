"""What the docs show users importing exists, and is public.

Every `import torchmoe_ckpt...` / `from torchmoe_ckpt... import X` and every `tmc.X` in the Python code of
docs/*.md, README.md and examples/ must resolve, and come from the package root (or `torchmoe_ckpt.dcp`, the
DCP users' subset of the root: docs/api.md, "What is public"). A deeper path in the docs would teach users an
internal module, which a re-layout moves without a word (issue 46: `torchmoe_ckpt.watchdog` did).
"""

from __future__ import annotations

import ast
import importlib
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torchmoe_ckpt

ROOT = Path(__file__).resolve().parents[2]
PUBLIC_MODULES = ("torchmoe_ckpt", "torchmoe_ckpt.dcp")  # docs/api.md, "What is public"
FENCE = re.compile(r"^[ \t]*```([A-Za-z0-9_+-]*)[^\n]*\n(.*?)^[ \t]*```", re.S | re.M)
NOT_PYTHON = {"bash", "sh", "shell", "console", "json", "toml", "yaml", "text", "ini"}


@dataclass(frozen=True)
class Use:
    where: str  # file:line
    module: str  # the module imported from
    name: str | None  # the name taken from it (None: `import module`)


def _sources() -> list[tuple[str, int, str]]:
    """(file, first line, Python source) for every Python code block of the docs and README, and each example."""
    out = []
    for path in sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md"]):
        text = path.read_text()
        for m in FENCE.finditer(text):
            if m.group(1).lower() in NOT_PYTHON:
                continue
            out.append((str(path.relative_to(ROOT)), text.count("\n", 0, m.start(2)) + 1, m.group(2)))
    for path in sorted(ROOT.glob("examples/*.py")):
        out.append((str(path.relative_to(ROOT)), 1, path.read_text()))
    return out


def _trees(source: str) -> list[tuple[int, ast.AST]]:
    """The block parsed whole; a fragment that is not valid Python as a whole (a `...` line, prose) is parsed
    statement by statement, so its import lines still count."""
    try:
        return [(0, ast.parse(textwrap.dedent(source)))]
    except SyntaxError:
        pass
    trees = []
    for i, line in enumerate(source.splitlines()):
        try:
            trees.append((i, ast.parse(line.strip())))
        except SyntaxError:
            continue
    return trees


def _uses(file: str, start: int, source: str) -> list[Use]:
    uses: list[Use] = []
    for offset, tree in _trees(source):
        aliases = set()  # names bound to the package root (`import torchmoe_ckpt as tmc`)
        for node in ast.walk(tree):
            where = f"{file}:{start + offset + getattr(node, 'lineno', 1) - 1}"
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "torchmoe_ckpt":
                        uses.append(Use(where, a.name, None))
                        if a.name == "torchmoe_ckpt":
                            aliases.add(a.asname or a.name)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torchmoe_ckpt":
                uses.extend(Use(where, node.module or "", a.name) for a in node.names)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                uses.append(Use(f"{file}:{start + offset + node.lineno - 1}", "torchmoe_ckpt", node.attr))
    return uses


def _all_uses() -> list[Use]:
    return [u for file, start, source in _sources() for u in _uses(file, start, source)]


def test_the_scan_sees_the_docs_imports():
    """The scan finds what it must: the README's and the examples' `import torchmoe_ckpt as tmc` and their
    `tmc.Checkpointer`, a root import inside a doc's code block, and an import line inside a fragment."""
    uses = _all_uses()
    assert any(u.where.startswith("README.md") and u.module == "torchmoe_ckpt" and u.name is None for u in uses)
    assert any(u.where.startswith("examples/own_loop.py") and u.name == "Checkpointer" for u in uses)
    assert any(u.where.startswith("docs/failure-recovery.md") and u.name == "CollectiveWatchdog" for u in uses)
    fragment = "x = 1\n  ...(\nfrom torchmoe_ckpt.core.window import Window\n"
    assert _uses("f.md", 10, fragment) == [Use("f.md:12", "torchmoe_ckpt.core.window", "Window")]


def test_every_name_the_docs_import_resolves_and_is_public():
    bad = []
    for u in _all_uses():
        try:
            module = importlib.import_module(u.module)
            if u.name is not None:
                getattr(module, u.name)
        except (ImportError, AttributeError) as exc:
            bad.append(f"{u.where}: {u.module}{'.' + u.name if u.name else ''} does not resolve ({exc})")
            continue
        if u.module not in PUBLIC_MODULES:
            bad.append(f"{u.where}: {u.module} is internal: import {u.name or 'it'} from torchmoe_ckpt (the root)")
        elif u.name is not None and u.name not in module.__all__:
            bad.append(f"{u.where}: {u.module}.{u.name} is not in {u.module}.__all__")
    assert not bad, "\n".join(bad)


def test_api_md_lists_every_public_name():
    """docs/api.md says what is public: each name of the root's `__all__` appears in it."""
    spans = " ".join(re.findall(r"`([^`]+)`", (ROOT / "docs/api.md").read_text()))  # the code spans
    missing = [n for n in torchmoe_ckpt.__all__ if not re.search(rf"(?<![\w.]){re.escape(n)}\b", spans)]
    assert not missing, f"docs/api.md does not list {missing}"
