"""A source written ``link/`` is the directory the link points to, as rsync (and POSIX path
resolution) reads it; ``link`` without the slash is the link itself. Expected values from
``rsync -a`` on the same trees."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import tb5sync
from tb5sync.errors import PathError, Tb5syncError

from conftest import LiveServer, start_server

pytestmark = pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync is the reference")


def _tree(root: Path) -> dict[str, object]:
    out: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            rel = str(p.relative_to(root))
            out[rel] = ("l", os.readlink(p)) if p.is_symlink() else ("d",) if p.is_dir() else ("f", p.read_bytes())
    return out


def _make(tmp: Path) -> Path:
    (tmp / "src" / "sub" / "deep").mkdir(parents=True)
    (tmp / "src" / "sub" / "a.txt").write_text("a")
    (tmp / "src" / "sub" / "deep" / "b").write_text("b")
    os.symlink("src/sub", tmp / "sublink")
    return tmp / "sublink"


@pytest.mark.parametrize("dest_state", ["missing", "empty", "full"])
def test_local_link_with_slash_copies_the_directory(tmp_path: Path, dest_state: str) -> None:
    link = _make(tmp_path)
    ours, ref = tmp_path / "ours", tmp_path / "ref"
    if dest_state != "missing":
        for d in (ours, ref):
            d.mkdir()
            if dest_state == "full":
                (d / "keep").write_text("k")
    subprocess.run(["rsync", "-a", f"{link}/", f"{ref}/"], check=True)
    tb5sync.sync(f"{link}/", f"{ours}/")
    assert not ours.is_symlink()
    assert _tree(ours) == _tree(ref)


def test_local_link_without_slash_is_copied_as_a_link(tmp_path: Path) -> None:
    link = _make(tmp_path)
    ours, ref = tmp_path / "ours", tmp_path / "ref"
    ours.mkdir(), ref.mkdir()
    subprocess.run(["rsync", "-a", str(link), f"{ref}/"], check=True)
    tb5sync.sync(str(link), f"{ours}/")
    assert _tree(ours) == _tree(ref)


def test_push_and_pull_of_link_with_slash(tmp_path: Path) -> None:
    link = _make(tmp_path)
    ref = tmp_path / "ref"
    subprocess.run(["rsync", "-a", f"{link}/", f"{ref}/"], check=True)
    root = tmp_path / "root"
    root.mkdir()
    os.symlink("inside", root / "lnk")
    (root / "inside").mkdir()
    os.symlink(str(tmp_path / "src"), root / "esc")  # leads out of ROOT
    srv: LiveServer = start_server(str(root))
    try:
        tb5sync.sync(f"{link}/", srv.url("pushed/"))
        assert _tree(root / "pushed") == _tree(ref)
        tb5sync.sync(srv.url("pushed/"), f"{tmp_path / 'pulled'}/")
        assert _tree(tmp_path / "pulled") == _tree(ref)
        shutil.copytree(ref, root / "inside" / "x")
        tb5sync.sync(srv.url("lnk/"), f"{tmp_path / 'vialink'}/")
        assert not (tmp_path / "vialink").is_symlink() and _tree(tmp_path / "vialink") == _tree(root / "inside")
        with pytest.raises(PathError):
            tb5sync.sync(srv.url("esc/"), f"{tmp_path / 'escaped'}/")
        assert not os.path.lexists(tmp_path / "escaped")
    finally:
        srv.server.stop()


def test_link_with_slash_to_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    os.symlink("f", tmp_path / "flink")
    with pytest.raises(Tb5syncError, match="not a directory"):
        tb5sync.sync(f"{tmp_path / 'flink'}/", f"{tmp_path / 'out'}/")
