"""Exclude rules: rsync-style ``--exclude`` patterns matched against manifest paths.

No I/O. Used by the scanner (excluded names are never listed) and the planner (excluded
destination entries are protected from ``--delete``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .errors import UsageError

__all__ = ["ExcludeRules", "NO_RULES"]

def _glob_to_regex(pat: str) -> str:
    out = []
    i = 0
    while i < len(pat):
        c = pat[i]
        if c == "*":
            if pat[i : i + 3] == "**/":
                out.append("(?:.*/)?")  # zero or more whole directories
                i += 3
                continue
            if pat[i : i + 2] == "**":
                out.append(".*")
                i += 2
                continue
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = pat.find("]", i + 1)
            if j == -1:
                out.append(re.escape(c))
            else:
                body = pat[i + 1 : j].replace("\\", "\\\\")
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append(f"[{body}]")
                i = j + 1
                continue
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


@dataclass(frozen=True)
class ExcludeRules:
    """rsync-style exclude patterns, matched against paths relative to the transfer root.

    Semantics (from rsync(1), "INCLUDE/EXCLUDE PATTERN RULES"):

    * a pattern ending in ``/`` matches directories only;
    * a pattern with no other ``/`` matches the final path component at any depth;
    * a pattern with a ``/`` matches the whole relative path, anchored at the
      transfer root if it starts with ``/``, otherwise at any directory boundary;
    * ``*`` matches within a component, ``**`` across components, ``?`` one char,
      ``[...]`` a character class.

    An excluded directory is not descended into.

    Raises
    ------
    UsageError
        An empty pattern.
    """

    patterns: tuple[str, ...] = ()
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
            whole = anchored or "/" in p
            rx = _glob_to_regex(p)
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
        for rx, dir_only, whole in self._compiled:
            if dir_only and not is_dir:
                continue
            if rx.match(relpath if whole else base):
                return True
        return False

    def excluded_by_parent(self, relpath: str) -> bool:
        """True if ``relpath`` or any of its parent directories is excluded."""
        parts = relpath.split("/")
        for i in range(1, len(parts)):
            if self.match("/".join(parts[:i]), True):
                return True
        return False


#: The empty rule set (matches nothing).
NO_RULES = ExcludeRules()
