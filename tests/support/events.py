"""The one parser of the library's structured lines, for tests: they read `event=` fields, not phrases.

A line such as

    INFO torchmoe_ckpt.recovery.resume: event=recovered run=r1 window=3 source=host steps=0..7 replayed=4 ...
        rejected=none: every replayed loss matched the original run bit for bit

is an `Event` named "recovered" whose `fields` are the `key=value` tokens after `event=NAME` (values as strings:
"0..7", "none", "[1, 2]") and whose `prose` is the text after the first ": " outside a value. Values are read as
the library writes them:

- quoted (a `%r` repr or a json dump, `reason='run lock of /x: OSError: ...'`, `op="train_step 10"`): the string
  inside, unescaped; a colon inside the quotes is part of the value;
- bracketed (`rejected=[1, 2]`): up to the matching bracket, spaces included;
- plain: up to the next space, or a ": " (where the prose starts);
- a bare word between fields joins the value before it (`tier=object store rank=1`: tier is "object store"); bare
  words after the last field start the prose (`... total=1.20 (seconds, total from ...)`).

Whatever precedes `event=` on the line (a log level and logger, torchrun's `[default0]:`, `torchmoe: `) is ignored.
Typical use:

    ev = one(log, "recovered", window=2)          # exactly one such line: fails listing the events seen otherwise
    assert ev["replayed"] == "4" and ev["source"] == "object store"
    assert not find(log, "cold_start")            # no such line at all
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

_START = re.compile(r"(?:^|(?<=[\s:\]]))event=([A-Za-z0-9_]+)")
_OPEN = {"[": "]", "(": ")", "{": "}"}


@dataclass(frozen=True)
class Event:
    name: str
    fields: dict[str, str] = field(default_factory=dict)
    prose: str = ""
    line: str = ""

    def __getitem__(self, key: str) -> str:
        return self.fields[key]

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.fields.get(key, default)

    def int(self, key: str) -> int:
        return int(self.fields[key])

    def float(self, key: str) -> float:
        return float(self.fields[key])

    def matches(self, name: str | None = None, **want) -> bool:
        """This event is `name` (any when None) and each field in `want` has exactly that value (compared as str)."""
        if name is not None and self.name != name:
            return False
        return all(k in self.fields and self.fields[k] == str(v) for k, v in want.items())


def _prose_at(s: str, i: int) -> bool:
    return s[i] == ":" and (i + 1 == len(s) or s[i + 1] == " ")


def _quoted(s: str, i: int) -> tuple[str, int]:
    """The quoted value starting at s[i] (a quote): its text, unescaped, and the index after the closing quote."""
    q, j = s[i], i + 1
    while j < len(s) and s[j] != q:
        j += 2 if s[j] == "\\" else 1
    raw = s[i : j + 1]
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw[1:-1]
    return (value if isinstance(value, str) else raw[1:-1]), j + 1


def _plain(s: str, i: int) -> tuple[str, int]:
    """A value up to the next space or ": " outside brackets; brackets (and quotes within them) kept whole."""
    j, stack = i, []
    while j < len(s):
        c = s[j]
        if stack:
            if c in "'\"":
                j = _quoted(s, j)[1]
                continue
            if c == stack[-1]:
                stack.pop()
            elif c in _OPEN:
                stack.append(_OPEN[c])
        elif c == " " or _prose_at(s, j):
            break
        elif c in _OPEN:
            stack.append(_OPEN[c])
        j += 1
    return s[i:j], j


def _token(s: str, i: int) -> tuple[str | None, str, int]:
    """(key, value, end) of the token at s[i]: key None for a bare word."""
    m = re.match(r"[A-Za-z_][A-Za-z0-9_.]*=", s[i:])
    if m is None:
        word, j = _plain(s, i)
        return None, word, j
    j = i + m.end()
    if j < len(s) and s[j] in "'\"":
        value, j = _quoted(s, j)
    else:
        value, j = _plain(s, j)
    return m.group()[:-1], value, j


def parse(line: str) -> Event | None:
    """The event on this line (None: the line has no `event=`)."""
    line = line.rstrip("\n")
    m = _START.search(line)
    if m is None:
        return None
    s, i = line, m.end()
    tokens: list[tuple[str | None, str, int]] = []  # (key, value, start)
    prose_from = len(s)
    while i < len(s):
        if s[i] == " ":
            i += 1
            continue
        if _prose_at(s, i):
            prose_from = i + 1
            break
        key, value, j = _token(s, i)
        tokens.append((key, value, i))
        i = j
    # Bare words after the last field are the prose; those between fields belong to the value before them.
    last = max((n for n, t in enumerate(tokens) if t[0] is not None), default=-1)
    if last + 1 < len(tokens):
        prose_from = tokens[last + 1][2]
    fields: dict[str, str] = {}
    prev = None
    for key, value, _ in tokens[: last + 1]:
        if key is None:
            if prev is not None:
                fields[prev] += " " + value
            continue
        fields[key], prev = value, key
    return Event(m.group(1), fields, s[prose_from:].lstrip(": ").strip(), line)


def events(text: str, name: str | None = None, **want) -> list[Event]:
    """Every event in `text` (lines), in order; only those named `name` with these field values when given."""
    out = [ev for ln in text.splitlines() if (ev := parse(ln)) is not None]
    return [ev for ev in out if ev.matches(name, **want)]


find = events


def _seen(text: str) -> str:
    evs = events(text)
    return "\n".join(ev.line.strip() for ev in evs[-30:]) or "(no event= lines)"


def one(text: str, name: str, **want) -> Event:
    """The one event `name` with these field values; fails (listing the events seen) on none or several."""
    got = events(text, name, **want)
    assert len(got) == 1, f"expected one event={name} {want}, found {len(got)}; events seen:\n{_seen(text)}"
    return got[0]


def first(text: str, name: str, **want) -> Event:
    """The first event `name` with these field values; fails (listing the events seen) on none."""
    got = events(text, name, **want)
    assert got, f"expected an event={name} {want}, found none; events seen:\n{_seen(text)}"
    return got[0]


def names(text: str) -> list[str]:
    """The event names in `text`, in order."""
    return [ev.name for ev in events(text)]
