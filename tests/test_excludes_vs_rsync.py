"""Exclude patterns mean what rsync means, checked against rsync itself: every pattern form
(anchored, ``**`` at every position, ``dir/``, inner slashes, character classes, ``?``) on a
source given with and without its trailing slash. Without the slash the transfer root is the
source's parent, so ``/top.excl`` is anchored there and ``src/top.excl`` is still copied, while
``/src/top.excl`` excludes it (rsync(1), "INCLUDE/EXCLUDE PATTERN RULES")."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
from test_vs_rsync import T0, Harness, assert_same, digest_snapshot, freeze_dirs, rsync, settle, write

import tb5sync

PATTERNS = [
    # plain names: the last component, at any depth
    "top.excl", "*.log", "f?.bin", "sub1", "[ab]", "f[0-4].bin", "f[!0-4].bin", "[[:digit:]]*",
    # anchored at the transfer root
    "/top.excl", "/src/top.excl", "/d1", "/src/d1", "/*/top.excl", "/d1/sub1/f1.bin",
    # directories only
    "sub1/", "d4/", "/d1/", "a/",
    # inner slashes: matched against the end of the path, at a directory boundary
    "d1/sub1", "sub1/f1.bin", "src/d1", "d1/*/f1.bin", "a/b",
    # ** at every position
    "**/f1.bin", "d1/**", "d1/**/f1.bin", "**.bin", "/**/b", "a/**/b", "**/sub1/", "src/**/top.excl", "x**",
    # several stars in one component
    "*1*", "f*.b*",
    # "dir/***": the directory itself and everything in it (a file of that name stays)
    "empty/***", "sub1/***", "/sub1/***", "/src/d1/***", "**/sub1/***", "d1/*/***", "d4/***", "d*/***",
    "su*/***", "a/x/***", "- sub1/***", "- /d1/***",
]


pytestmark = pytest.mark.usefixtures("need_rsync")  # conftest: skipped without rsync


def _tree(src: str) -> None:
    for rel, data in [
        ("top.excl", b"top"), ("keep.log", b"log"), ("f1.bin", b"f1 top"), ("f7.bin", b"f7 top"), ("x1", b"x"),
        ("d1/sub1/f1.bin", b"f1 deep"), ("d1/sub1/f5.bin", b"f5"), ("d1/top.excl", b"nested"),
        ("d1/sub2/f1.bin", b"other"), ("d2/d1/f2.bin", b"d2/d1"), ("d4", b"a file named d4"),
        ("a/b", b"a/b"), ("a/x/b", b"a/x/b"), ("a/x/y/b", b"deep b"), ("b", b"b file"),
        ("sub1/f9.bin", b"top sub1"), ("x/sub1/notes.txt", b"notes"), ("9lives", b"digit"),
        ("src/d1/inner.txt", b"a src inside src"), ("src/top.excl", b"src/src"),
    ]:
        write(os.path.join(src, rel), data, 0o644, T0)
    os.makedirs(os.path.join(src, "empty"))
    os.makedirs(os.path.join(src, "d1", "empty"))
    freeze_dirs(src, T0)


@pytest.mark.parametrize("slash", [True, False], ids=["slash", "noslash"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_pattern_like_rsync(pattern: str, slash: bool) -> None:
    """Local route for the whole table (the rules run in the sender and in the planner, the same
    code on every route; the routes are compared below)."""
    with tempfile.TemporaryDirectory(prefix="tb5-excl-") as tmp:
        src = os.path.join(tmp, "sp", "src")
        _tree(src)
        spec = src + "/" if slash else src
        ref, mine = os.path.join(tmp, "ref"), os.path.join(tmp, "mine")
        rsync(spec, ref, exclude=[pattern])
        tb5sync.sync(spec, mine, exclude=[pattern])
        ignore = () if slash else ("",)  # without the slash, ref/ and mine/ only hold src
        assert_same(digest_snapshot(ref, ignore), digest_snapshot(mine, ignore), f"local {pattern!r}")



@pytest.mark.parametrize("patterns", [["/src"], ["src"], ["src/"], ["s*c"], ["/*"], ["*/", "keep"], ["/top.excl"]])
@pytest.mark.parametrize("spec", [("src", "dst/"), ("src", "new"), ("src/top.excl", "dst/"), ("src/top.excl", "nf")],
                         ids=["dir-into", "dir-as", "file-into", "file-as"])
def test_pattern_excluding_the_source_itself(tmp_path: Any, server: Any, patterns: list[str], spec: tuple[str, str]) -> None:
    """A source given without a trailing slash is a name below rsync's transfer root, so a
    pattern can exclude it: rsync then copies nothing (it still makes a destination named with a
    trailing slash) and, with --delete, deletes nothing. Local, push and pull, on a prefilled
    destination."""
    h = Harness(tmp_path, server)
    _tree(h.src)
    tpl = str(tmp_path / "tpl")
    write(os.path.join(tpl, "keep", "x"), b"keep", 0o644, T0)
    write(os.path.join(tpl, "dst", "src", "old.txt"), b"old", 0o644, T0)
    write(os.path.join(tpl, "dst", "top.excl"), b"old file", 0o644, T0)
    write(os.path.join(tpl, "new", "stale"), b"stale", 0o644, T0)
    freeze_dirs(tpl, T0)
    h.prepare(tpl)
    h.run(spec[0], spec[1], delete=True, exclude=patterns)
    h.check(ignore_mtime=["dst", "dst/src", "new", "nf"])


@pytest.mark.parametrize("slash", [True, False], ids=["slash", "noslash"])
@pytest.mark.parametrize("patterns", [["/top.excl"], ["/src/top.excl", "d1/**", "sub1/"], ["/d1/", "**/b"],
                                      ["empty/***"], ["sub1/***", "- /a/***"], ["**/d1/***"], ["/src/d1/***", "d4/***"]])
def test_anchored_patterns_on_every_route(tmp_path: Any, server: Any, patterns: list[str], slash: bool) -> None:
    """The issue's example and a few more, local, push and pull, with --delete on a prefilled
    destination (excluded destination entries are protected where rsync protects them)."""
    h = Harness(tmp_path, server)
    _tree(h.src)
    tpl = str(tmp_path / "tpl")
    landing = os.path.join(tpl, "dst") if slash else os.path.join(tpl, "dst", "src")
    _tree(landing)
    write(os.path.join(landing, "top.excl"), b"destination's own", 0o600, T0)
    write(os.path.join(landing, "d1", "extra.txt"), b"extra", 0o644, T0)
    freeze_dirs(tpl, T0)
    h.prepare(tpl)
    settle(h.sp)
    h.run("src/" if slash else "src", "dst", delete=True, exclude=patterns)
    h.check(ignore_mtime=["dst", "dst/src", "dst/d1", "dst/src/d1"])
