"""Exclude rules: rsync-style ``--exclude`` patterns matched against manifest paths.

No I/O. Used by the scanner (excluded names are never listed) and the planner (excluded
destination entries are protected from ``--delete``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from tb5sync.errors import UsageError

__all__ = ["ExcludeRules", "NO_RULES", "exclude_option"]

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


#: Longest exclude pattern accepted, bytes of UTF-8 (rsync's MAXPATHLEN).
MAX_PATTERN = 4096

# Tokens of a compiled pattern: (kind, value). Kinds: "lit" one literal character, "one" ``?`` (any
# character but ``/``), "cls" a ``[...]`` class (value: its compiled one-character regex), "star"
# ``*`` (value False: within a component) or ``**`` (value True: across components).
_Token = tuple[str, object]


def _tokens(pat: str) -> list[_Token]:
    """The tokens of one rsync wildcard pattern (rsync's wildmatch): ``*`` within a component,
    ``**`` across components, ``?`` one character but ``/``, ``[...]`` a class, ``\\`` quotes."""
    out: list[_Token] = []
    i = 0
    while i < len(pat):
        c = pat[i]
        if c == "*":
            if pat[i : i + 2] == "**":
                while i < len(pat) and pat[i] == "*":
                    i += 1
                out.append(("star", True))
                continue
            out.append(("star", False))
        elif c == "?":
            out.append(("one", None))
        elif c == "[":
            got = _bracket(pat, i)
            if got is not None:
                out.append(("cls", re.compile(got[0], re.S)))
                i = got[1]
                continue
            out.append(("lit", c))
        elif c == "\\" and i + 1 < len(pat):
            i += 1
            out.append(("lit", pat[i]))
        else:
            out.append(("lit", c))
        i += 1
    return out


def _regex(tokens: list[_Token]) -> str:
    """The Python regex of ``tokens`` (without anchors)."""
    parts = []
    for kind, val in tokens:
        if kind == "star":
            parts.append(".*" if val else "[^/]*")
        elif kind == "one":
            parts.append("[^/]")
        elif kind == "cls":
            assert isinstance(val, re.Pattern)
            parts.append(val.pattern)
        else:
            parts.append(re.escape(str(val)))
    return "".join(parts)


class _Glob:
    """One pattern, matched in time linear in the path's length whatever the pattern.

    A backtracking regex of a pattern with several stars (``**?**?**?#``) takes time exponential
    in their number on a path that does not match, with the GIL held: one such pattern from a
    peer would stall a whole server. So Python's ``re`` serves only patterns with at most one
    star (their regex backtracks at most once per start position: quadratic at worst, on one
    component or path); any other pattern is matched by simulating its automaton (Thompson's
    construction: the set of pattern positions reachable after each character; K. Thompson,
    "Regular expression search algorithm", CACM 11(6), 1968), in O(path length x tokens).

    Parameters
    ----------
    pat : str
        The pattern without its leading ``/`` and trailing ``/``.
    any_dir : bool
        The pattern may match at any directory boundary of the path (an unanchored pattern
        that names a whole path), not only at its start.
    lead_dirs : bool
        A leading ``**/`` also matches no directory at all (rsync's rule for an unanchored
        pattern that begins with ``**/``).
    """

    __slots__ = ("tokens", "any_dir", "rx")

    def __init__(self, pat: str, any_dir: bool, lead_dirs: bool) -> None:
        if lead_dirs and pat.startswith("**/"):
            pat, any_dir = pat[3:], True  # "(?:.*/)?" = at any directory boundary
        self.tokens = _tokens(pat)
        self.any_dir = any_dir
        stars = sum(1 for kind, _ in self.tokens if kind == "star")
        self.rx = re.compile(rf"\A{_regex(self.tokens)}\Z", re.S) if stars <= 1 else None

    def match(self, text: str) -> bool:
        """True if the pattern matches all of ``text`` (or, with ``any_dir``, all of a suffix of
        ``text`` that starts at its start or right after a ``/``)."""
        starts = [0]
        if self.any_dir:
            starts += [i + 1 for i, c in enumerate(text) if c == "/"]
        for st in starts:
            sub = text[st:] if st else text
            if (self.rx.match(sub) is not None) if self.rx is not None else self._nfa(sub):
                return True
        return False

    def _nfa(self, text: str) -> bool:
        toks = self.tokens
        m = len(toks)

        def close(states: set[int]) -> set[int]:
            out = set(states)
            for i in sorted(states):
                while i < m and toks[i][0] == "star" and i + 1 not in out:
                    i += 1
                    out.add(i)
            return out

        cur = close({0})
        for c in text:
            nxt: set[int] = set()
            for i in cur:
                if i == m:
                    continue
                kind, val = toks[i]
                if kind == "star":
                    if val or c != "/":
                        nxt.add(i)
                elif kind == "lit":
                    if c == val:
                        nxt.add(i + 1)
                elif kind == "one":
                    if c != "/":
                        nxt.add(i + 1)
                elif val.match(c) is not None:  # type: ignore[union-attr]
                    nxt.add(i + 1)
            if not nxt:
                return False
            cur = close(nxt)
        return m in cur


def exclude_option(patterns: Sequence[str]) -> tuple[str, ...]:
    """The patterns of rsync's ``--exclude`` options as rsync reads them: a pattern starting with
    ``"- "`` is that exclude rule (the prefix dropped), a lone ``"!"`` clears the patterns given
    before it, and one starting with ``"+ "`` (an include rule: rsync(1), FILTER RULES, "the
    include/exclude command-line options ... only allow ... '+ ' or '- '") is refused, tb5sync
    having no include rules; anything else is an exclude pattern as it is.

    Raises
    ------
    UsageError
        A ``"+ "`` pattern, naming it.
    """
    out: list[str] = []
    for pat in patterns:
        if pat == "!":
            out.clear()
        elif isinstance(pat, str) and pat.startswith("+ "):
            raise UsageError(f"--exclude {pat!r} is an include rule ('+ ' prefix, as rsync reads it); "
                             f"tb5sync has exclude rules only")
        elif isinstance(pat, str) and pat.startswith("- "):
            out.append(pat[2:])
        else:
            out.append(pat)
    return tuple(out)


@dataclass(frozen=True)
class ExcludeRules:
    """rsync-style exclude patterns, matched against paths relative to the transfer root.

    Semantics (from rsync(1), "INCLUDE/EXCLUDE PATTERN RULES"):

    * a pattern ending in ``/`` matches directories only;
    * a pattern with no other ``/`` (and no ``**``) matches the final path component at any depth;
    * a pattern with a ``/`` or a ``**`` matches the whole relative path, anchored at the
      transfer root if it starts with ``/``, otherwise at any directory boundary;
    * a pattern ending in ``/***`` matches the directory named before it and everything in it;
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
        An empty pattern, or one longer than :data:`MAX_PATTERN` bytes.

    Notes
    -----
    Matching takes time linear in the path's length whatever the patterns (see ``_Glob``):
    patterns come from peers, and a server matches them against its own tree.
    """

    patterns: tuple[str, ...] = ()
    root: str = ""
    _compiled: tuple[tuple[_Glob, bool, bool], ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        compiled = []
        for pat in self.patterns:
            if not isinstance(pat, str) or not pat or pat == "/":
                raise UsageError(f"empty exclude pattern {pat!r}")
            if len(pat.encode("utf-8", "surrogateescape")) > MAX_PATTERN:
                raise UsageError(f"exclude pattern longer than {MAX_PATTERN} bytes: {pat[:60]!r}...")
            dir_only = pat.endswith("/")
            p = pat.rstrip("/")
            anchored = p.startswith("/")
            p = p.lstrip("/")
            whole = anchored or "/" in p or "**" in p
            compiled.append((_Glob(p, any_dir=whole and not anchored, lead_dirs=not anchored), dir_only, whole))
            if p.endswith("/***") and not p.endswith("\\/***") and len(p) > 4:
                # "dir/***" is "dir/**" and "dir" itself (rsync(1): "'dir_name/***' will match
                # both the directory (as if 'dir_name/' had been specified) and everything in
                # the directory"): the directory is left out whole, not kept empty.
                compiled.append((_Glob(p[:-4], any_dir=not anchored, lead_dirs=not anchored), True, True))
        object.__setattr__(self, "_compiled", tuple(compiled))

    def __bool__(self) -> bool:
        return bool(self.patterns)

    def match(self, relpath: str, is_dir: bool) -> bool:
        """True if ``relpath`` (relative to the transfer root, ``""`` never matches) is excluded."""
        if not relpath:
            return False
        base = relpath.rsplit("/", 1)[-1]
        return self._match(f"{self.root}/{relpath}" if self.root else relpath, base, is_dir)

    def excludes_source(self, is_dir: bool) -> bool:
        """True if the source itself is excluded: given without a trailing slash, its name
        (``root``) is a path below rsync's transfer root like any other (``--exclude=/src``
        on ``sync src dst/``), and rsync then copies nothing."""
        return bool(self.root) and self._match(self.root, self.root, is_dir)

    def _match(self, path: str, base: str, is_dir: bool) -> bool:
        for rx, dir_only, whole in self._compiled:
            if dir_only and not is_dir:
                continue
            if rx.match(path if whole else base):
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
