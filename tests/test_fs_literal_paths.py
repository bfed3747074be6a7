"""``tb5://`` takes a path that exists literally, even when it holds glob characters (``*``,
``?``, ``[``), and raises LocalFileSystem's error classes; both compared with fsspec's
LocalFileSystem on the same tree.

Where LocalFileSystem itself takes such a path literally (``info``, ``exists``, ``ls``, ``find``,
``du``, ``cat_file``, ``open``, ``rm``), its answer is the reference. Where this fsspec's
LocalFileSystem globs an existing literal name (``cat``, ``expand_path``, ``copy``, ``get``:
``cat("a[1].txt")`` reads ``a1.txt``), the reference is LocalFileSystem's own answer for the
file named, read with ``cat_file``: the rule is that an existing path is never a pattern.
"""

from __future__ import annotations

import os
from typing import Any

import fsspec
import pytest
from conftest import start_server, tb5fs

NAMES = {"a[1].txt": b"literal brackets", "a1.txt": b"what the glob matches", "st*r.txt": b"star", "q?.txt": b"question",
         "d[x]/f": b"inside", "dx/f": b"glob target"}


def _tree(root: str) -> None:
    for rel, data in NAMES.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)


@pytest.fixture
def pair(tmp_path: Any) -> Any:
    """``(tb5 filesystem, LocalFileSystem, local root)``: the same tree served and local."""
    served, local = str(tmp_path / "served"), str(tmp_path / "local")
    _tree(served)
    _tree(local)
    live = start_server(served)
    fs = tb5fs(live)
    try:
        yield fs, fsspec.filesystem("file"), local, served
    finally:
        live.server.stop()


def _rel(paths: list[str], root: str) -> list[str]:
    return sorted(os.path.relpath(p, root) if p.startswith("/") else p for p in paths)


@pytest.mark.parametrize("name", ["a[1].txt", "st*r.txt", "q?.txt"])
def test_reads_of_a_literal_name_like_localfs(pair: Any, name: str) -> None:
    fs, lfs, local, _served = pair
    lp = os.path.join(local, name)
    assert fs.exists(name) == lfs.exists(lp) is True
    assert fs.info(name)["size"] == lfs.info(lp)["size"]
    assert fs.cat_file(name) == lfs.cat_file(lp) == NAMES[name]
    with fs.open(name, "rb") as a, lfs.open(lp, "rb") as b:
        assert a.read() == b.read()
    # LocalFileSystem globs here; the file named is the reference
    assert fs.cat(name) == lfs.cat_file(lp)
    assert fs.expand_path(name) == [name]


def test_directories_with_glob_characters_like_localfs(pair: Any) -> None:
    fs, lfs, local, _served = pair
    lp = os.path.join(local, "d[x]")
    assert _rel(fs.ls("d[x]", detail=False), "") == _rel(lfs.ls(lp, detail=False), local)
    assert _rel(fs.find("d[x]"), "") == _rel(lfs.find(lp), local)
    assert fs.du("d[x]") == lfs.du(lp)
    assert sorted(fs.expand_path("d[x]", recursive=True)) == ["d[x]", "d[x]/f"]


def test_copy_and_get_a_literal_name(pair: Any, tmp_path: Any) -> None:
    fs, lfs, local, served = pair
    fs.copy("a[1].txt", "copy.txt")
    assert fs.cat_file("copy.txt") == lfs.cat_file(os.path.join(local, "a[1].txt"))
    out = str(tmp_path / "got.txt")
    fs.get("a[1].txt", out)
    with open(out, "rb") as f:
        assert f.read() == NAMES["a[1].txt"]
    into = tmp_path / "into"
    into.mkdir()
    fs.get("st*r.txt", str(into))
    assert (into / "st*r.txt").read_bytes() == NAMES["st*r.txt"]
    # a name that does not exist is still a pattern
    assert fs.expand_path("a?.txt") == ["a1.txt"]


def test_rm_a_literal_name_like_localfs(pair: Any) -> None:
    """``rm("a[1].txt")`` removed ``a1.txt`` (the glob's match) and kept the file named."""
    fs, lfs, local, served = pair
    fs.rm("a[1].txt")
    lfs.rm(os.path.join(local, "a[1].txt"))
    assert sorted(os.listdir(served)) == sorted(os.listdir(local) + [".tb5sync"])
    fs.rm("d[x]", recursive=True)
    lfs.rm(os.path.join(local, "d[x]"), recursive=True)
    assert sorted(os.listdir(served)) == sorted(os.listdir(local) + [".tb5sync"])
    assert fs.cat_file("a1.txt") == NAMES["a1.txt"]


@pytest.mark.parametrize(
    "call",
    [
        ("rm_file", "d[x]"),
        ("rm_file", "nope"),
        ("rm", "d[x]"),
        ("rm", "nope"),
        ("rmdir", "d[x]"),
        ("rmdir", "q?.txt"),
        ("cat_file", "nope"),
        ("cat_file", "d[x]"),
        ("info", "nope"),
        ("ls", "nope"),
        ("mv", "nope"),
    ],
    ids=lambda c: f"{c[0]}-{c[1]}",
)
def test_errors_are_localfs_classes(pair: Any, call: tuple[str, str]) -> None:
    fs, lfs, local, _served = pair
    method, name = call
    args_l: tuple[Any, ...] = (os.path.join(local, name),)
    args_r: tuple[Any, ...] = (name,)
    if method == "mv":
        args_l += (os.path.join(local, "elsewhere"),)
        args_r += ("elsewhere",)
    with pytest.raises(Exception) as ref:
        getattr(lfs, method)(*args_l)
    with pytest.raises(Exception) as got:
        getattr(fs, method)(*args_r)
    want = type(ref.value)
    # the builtin class LocalFileSystem raises, or the nearest builtin above it
    builtin = next(c for c in want.__mro__ if c.__module__ == "builtins")
    assert isinstance(got.value, builtin), f"{method}({name!r}): tb5 raised {type(got.value).__mro__}, LocalFileSystem {want.__name__}"
