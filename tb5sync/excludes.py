"""Exclude rules: rsync-style ``--exclude`` patterns matched against manifest paths.

No I/O. Used by the scanner (excluded names are never listed) and the planner (excluded
destination entries are protected from ``--delete``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .errors import UsageError

__all__ = ["ExcludeRules", "NO_RULES"]

#: POSIX character classes inside ``[...]`` (rsync's wildmatch knows these), as regex ranges.
_CLASSES = {
    "alnum": "a-zA-Z0-9",
    "alpha": "a-zA-Z",
    "blank": " \\t",
    "cntrl": "\\x00-\\x1f\\x7f",
    "digit": "0-9",
    "graph": "\\x21-\\x7e",
    "lower": "a-z",
    "print": "\\x20-\\x7e",
    "punct": re.escape("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"),
    "space": " \\t\\n\\r\\f\\v",
    "upper": "A-Z",
    "xdigit": "0-9A-Fa-f",
}


def _bracket(pat: str, i: int) -> tuple[str, int] | None:
    """The regex of the ``[...]`` class starting at ``pat[i]`` and the index past it, or None
    when it is not closed (the ``[`` is then literal). ``!`` or ``^`` first negates, a ``]``
    first is literal, ``[:name:]`` is a POSIX class, a backslash quotes the next character."""
    j = i + 1
    neg = j < len(pat) and pat[j] in "!^"
    if neg:
        j += 1
    body: list[str] = []
    first = True
    while j < len(pat):
        c = pat[j]
        if c == "]" and not first:
            return ("[^" if neg else "[") + "".join(body) + "]", j + 1
        first = False
        if c == "[" and pat.startswith("[:", j):
            k = pat.find(":]", j + 2)
            name = pat[j + 2 : k] if k != -1 else ""
            if name in _CLASSES:
                body.append(_CLASSES[name])
                j = k + 2
                continue
        if c == "\\" and j + 1 < len(pat):
            j += 1
            c = pat[j]
        if c == "-" and body and j + 1 < len(pat) and pat[j + 1] != "]":
            body.append("-")
        else:
            body.append(re.escape(c))
        j += 1
    return None


def _glob_to_regex(pat: str, lead_dirs: bool) -> str:
    """The regex of one rsync wildcard pattern (rsync's wildmatch): ``*`` within a component,
    ``**`` across components, ``?`` one character but ``/``, ``[...]`` a class, ``\\`` quotes.

    ``lead_dirs``: a leading ``**/`` also matches no directory at all (rsync's rule for an
    unanchored pattern that begins with ``**/``); elsewhere ``**/`` needs at least one.
    """
    out = []
    i = 0
    if lead_dirs and pat.startswith("**/"):
        out.append("(?:.*/)?")
        i = 3
    while i < len(pat):
        c = pat[i]
        if c == "*":
            if pat[i : i + 2] == "**":
                while i < len(pat) and pat[i] == "*":
                    i += 1
                out.append(".*")
                continue
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            got = _bracket(pat, i)
            if got is not None:
                out.append(got[0])
                i = got[1]
                continue
            out.append(re.escape(c))
        elif c == "\\" and i + 1 < len(pat):
            i += 1
            out.append(re.escape(pat[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


@dataclass(frozen=True)
class ExcludeRules:
    """rsync-style exclude patterns, matched against paths relative to the transfer root.

    Semantics (from rsync(1), "INCLUDE/EXCLUDE PATTERN RULES"):

    * a pattern ending in ``/`` matches directories only;
    * a pattern with no other ``/`` (and no ``**``) matches the final path component at any depth;
    * a pattern with a ``/`` or a ``**`` matches the whole relative path, anchored at the
      transfer root if it starts with ``/``, otherwise at any directory boundary;
    * ``*`` matches within a component, ``**`` across components (a leading ``**/`` of an
      unanchored pattern also matches at the top), ``?`` one char, ``[...]`` a character
      class (``!``/``^`` negates, POSIX ``[:digit:]`` and the like), ``\\`` quotes.

    The transfer root is the source's parent when the source is given without a trailing
    slash (``rsync -a src dst``): ``root`` is then the source's name, and paths are matched
    as ``root/path``, so ``/top.excl`` is anchored above ``src`` and ``/src/top.excl`` names
    ``src/top.excl``. With the slash ``root`` is ``""``.

    An excluded directory is not descended into.

    Raises
    ------
    UsageError
        An empty pattern.
    """

    patterns: tuple[str, ...] = ()
    root: str = ""
    _compiled: tuple[tuple[re.Pattern[str], bool, bool], ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        compiled = []
        for pat in self.patterns:
            if not pat or pat == "/":
                raise UsageError(f"empty exclude pattern {pat!r}")
            dir_only = pat.endswith("/")
            p = pat.rstrip("/")
            anchored = p.startswith("/")
            p = p.lstrip("/")
            whole = anchored or "/" in p or "**" in p
            rx = _glob_to_regex(p, lead_dirs=not anchored)
            if whole and not anchored:
                rx = f"(?:.*/)?{rx}"
            compiled.append((re.compile(rf"\A{rx}\Z", re.S), dir_only, whole))
        object.__setattr__(self, "_compiled", tuple(compiled))

    def __bool__(self) -> bool:
        return bool(self.patterns)

    def match(self, relpath: str, is_dir: bool) -> bool:
        """True if ``relpath`` (relative to the transfer root, ``""`` never matches) is excluded."""
        if not relpath:
            return False
        base = relpath.rsplit("/", 1)[-1]
        if self.root:
            relpath = f"{self.root}/{relpath}"
        for rx, dir_only, whole in self._compiled:
            if dir_only and not is_dir:
                continue
            if rx.match(relpath if whole else base):
                return True
        return False

    def excluded_by_parent(self, relpath: str) -> bool:
        """True if any parent directory of ``relpath`` (below the transfer's base) is excluded."""
        parts = relpath.split("/")
        for i in range(1, len(parts)):
            if self.match("/".join(parts[:i]), True):
                return True
        return False


    def under(self, root: str) -> ExcludeRules:
        """These patterns with ``root`` (the source's name when given without a trailing slash, else ``""``)."""
        return self if root == self.root else ExcludeRules(self.patterns, root)


#: The empty rule set (matches nothing).
NO_RULES = ExcludeRules()
