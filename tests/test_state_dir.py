"""Where the per-tree state lives: a local or pulled destination receives no ``.tb5sync``
directory (rsync leaves nothing of its own in a destination); its scan cache, chunk index and
partial large files live in the user's cache directory (platformdirs, keyed by the destination's
device and inode) or in ``--state-dir`` / ``state_dir=``; a server keeps ``ROOT/.tb5sync`` or its
``--state-dir``. Losing the state only costs speed."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from typing import Any

import platformdirs
import pytest
from conftest import make_tree, snapshot, start_server

import tb5sync
from tb5sync.remote.client import default_state_dir
from tb5sync.roles.destination import Destination
from tb5sync.tree.state import TreeState


def _rows(state_dir: str) -> int:
    con = sqlite3.connect(os.path.join(state_dir, "state.sqlite"))
    try:
        return int(con.execute("SELECT count(*) FROM files").fetchone()[0])
    finally:
        con.close()


def _no_state_inside(dst: str) -> None:
    hidden = [os.path.join(d, n) for d, dirs, files in os.walk(dst) for n in dirs + files if n == ".tb5sync"]
    assert hidden == [], hidden


@pytest.mark.parametrize("route", ["local", "pull"])
def test_destination_gets_no_state_directory(tmp_path: Any, server: Any, route: str) -> None:
    src = make_tree(str(tmp_path / "src"), seed=3, files=10)
    dst = str(tmp_path / "dst")
    if route == "pull":
        shutil.copytree(src, os.path.join(server.root, "src"), symlinks=True)
        source = server.url("src/")
    else:
        source = src + "/"
    tb5sync.sync(source, dst)
    _no_state_inside(dst)
    assert snapshot(dst) == snapshot(src)
    where = default_state_dir(dst)
    assert where is not None and where.startswith(platformdirs.user_cache_dir("tb5sync"))
    assert _rows(where) > 0  # the files written were recorded there
    assert tb5sync.sync(source, dst).files_transferred == 0
    shutil.rmtree(where)  # a lost state costs speed, never correctness
    assert tb5sync.sync(source, dst).files_transferred == 0
    assert snapshot(dst) == snapshot(src)
    _no_state_inside(dst)


def test_state_dir_option_and_argument(tmp_path: Any) -> None:
    src = make_tree(str(tmp_path / "src"), seed=4, files=6)
    api_state, cli_state = str(tmp_path / "api-state"), str(tmp_path / "cli-state")
    tb5sync.sync(src + "/", str(tmp_path / "dst1"), state_dir=api_state)
    assert _rows(api_state) > 0
    assert not os.path.exists(default_state_dir(str(tmp_path / "dst1")) or "/nonexistent")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(tb5sync.__file__))}
    r = subprocess.run([sys.executable, "-m", "tb5sync.cli", "sync", "--state-dir", cli_state, src + "/", str(tmp_path / "dst2")],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert _rows(cli_state) > 0
    for d in ("dst1", "dst2"):
        _no_state_inside(str(tmp_path / d))
        assert snapshot(str(tmp_path / d)) == snapshot(src)


def test_server_state_dir(tmp_path: Any) -> None:
    src = make_tree(str(tmp_path / "src"), seed=5, files=4)
    default = start_server(str(tmp_path / "root1"))
    moved = start_server(str(tmp_path / "root2"), state_dir=str(tmp_path / "srv-state"))
    try:
        tb5sync.sync(src + "/", default.url("d"))
        tb5sync.sync(src + "/", moved.url("d"))
    finally:
        default.server.stop()
        moved.server.stop()
    assert os.path.isfile(os.path.join(default.root, ".tb5sync", "state.sqlite"))
    assert not os.path.exists(os.path.join(moved.root, ".tb5sync"))
    assert _rows(str(tmp_path / "srv-state")) > 0


def test_partials_need_the_same_file_system(tmp_path: Any) -> None:
    """Partial large files live in the state directory only when a rename can move them into
    place; a state on another file system (here /dev/shm, a tmpfs) falls back to a temporary
    name beside the final path, and the sync is still complete."""
    same = TreeState(str(tmp_path), state_dir=str(tmp_path / "state"))
    try:
        assert Destination(str(tmp_path / "dst"), same).partials
    finally:
        same.close()
    shm = "/dev/shm"
    if not os.path.isdir(shm) or os.stat(shm).st_dev == os.stat(str(tmp_path)).st_dev:
        pytest.skip("no second file system to put the state on")
    other_dir = os.path.join(shm, f"tb5-state-{os.getpid()}")
    try:
        other = TreeState(str(tmp_path), state_dir=other_dir)
        try:
            assert not Destination(str(tmp_path / "dst"), other).partials
        finally:
            other.close()
        src = make_tree(str(tmp_path / "src"), seed=6, files=3)  # holds a 9 MiB file
        tb5sync.sync(src + "/", str(tmp_path / "dst"), state_dir=other_dir)
        assert snapshot(str(tmp_path / "dst")) == snapshot(src)
        assert os.listdir(os.path.join(other_dir, "partial")) == []
    finally:
        shutil.rmtree(other_dir, ignore_errors=True)
