"""Exclude patterns are matched in time linear in the path, whatever a peer sends.

A server matches the client's ``--exclude`` patterns against its own tree; a backtracking regex
of a pattern with many stars (``**?**?...#``) took exponential time with the GIL held and froze
the whole daemon. The expected values here come from Python's ``re`` on the same glob (the
reference semantics of rsync's wildmatch as this module implements them), on inputs small
enough for it to finish.
"""

from __future__ import annotations

import re
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from tb5sync.tree.excludes import ExcludeRules, _Glob, _regex, _tokens


def _reference(pat: str, text: str, any_dir: bool) -> bool:
    rx = _regex(_tokens(pat))
    if any_dir:
        rx = f"(?:.*/)?{rx}"
    return re.match(rf"\A{rx}\Z", text, re.S) is not None


def test_hostile_patterns_match_in_linear_time() -> None:
    rules = ExcludeRules(("**?" * 16 + "#", "*?" * 20 + "#", "**/" + "*a" * 30 + "#", "/" + "**/" * 12 + "z"))
    path = "some/ordinary/directory/tree/" + "x" * 200 + "/file.txt"
    t0 = time.perf_counter()
    for _ in range(20):
        assert not rules.match(path, False)
        assert not rules.match(path, True)
    assert time.perf_counter() - t0 < 2.0  # exponential matching took minutes at 36 characters


def test_long_patterns_are_refused() -> None:
    import pytest

    from tb5sync.errors import UsageError

    with pytest.raises(UsageError, match="longer than"):
        ExcludeRules(("a" * 5000,))


_chars = st.sampled_from(list("ab/.x"))
_pat_chars = st.sampled_from(["a", "b", "/", ".", "*", "**", "?", "[ab]", "[!a]", "x"])


@settings(max_examples=400, deadline=None)
@given(pat=st.lists(_pat_chars, min_size=1, max_size=8).map("".join), text=st.lists(_chars, max_size=12).map("".join), any_dir=st.booleans())
def test_automaton_agrees_with_the_regex(pat: str, text: str, any_dir: bool) -> None:
    g = _Glob(pat, any_dir=any_dir, lead_dirs=False)
    expected = _reference(pat, text, any_dir)
    assert g.match(text) == expected
    g.rx = None  # force the automaton even for one-star patterns
    assert g.match(text) == expected
