"""The README stays a front page: short, its two commands there, and every link it gives leads somewhere.

Detail belongs in docs/ (issue 46: at most 130 lines); a link to a moved file or a renamed heading would send a
newcomer nowhere, so each relative link must name an existing file and, with `#anchor`, one of its headings.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 130


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (but `-` and `_`), spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _broken_links(md: Path) -> list[str]:
    bad = []
    for target, anchor in re.findall(r"\]\(([^)#:\s]+)(?:#([^)\s]+))?\)", md.read_text()):
        path = (md.parent / target).resolve()
        if not path.exists():
            bad.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md":
            headings = {_slug(h) for h in re.findall(r"^#+ (.*)$", path.read_text(), re.M)}
            if anchor not in headings:
                bad.append(f"{target}#{anchor}: no such heading")
    return bad


def test_readme_is_short_and_keeps_its_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines (at most {MAX_LINES}): move detail to docs/"
    commands = [ln for ln in lines if re.match(r"make (demo|test)\s+#", ln)]
    assert [c.split()[1] for c in commands] == ["demo", "test"], commands


def test_readme_and_glossary_links_resolve():
    bad = [f"{md.name}: {b}" for md in (README, ROOT / "docs/glossary.md") for b in _broken_links(md)]
    assert not bad, bad


def test_the_link_check_sees_a_broken_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Title: one\n\n## Sub `x`\n")
    (tmp_path / "b.md").write_text("[ok](a.md#title-one) [ok](a.md#sub-x) [bad](a.md#nope) [gone](c.md)\n")
    assert _broken_links(tmp_path / "b.md") == ["a.md#nope: no such heading", "c.md: no such file"]
