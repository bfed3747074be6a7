"""The fs session with names that are not valid UTF-8, and ``find``'s descriptors.

Names are bytes on disk; the fs session carries one that is not valid UTF-8 as
msgpack bin (:func:`tb5sync.tree.entry.path_to_wire`) both ways, and the client gives
it back as the surrogate-escaped str ``os.listdir`` gives (fsspec's
LocalFileSystem). A reply that still cannot be encoded is one error for that
request, never a dropped connection. ``find`` walks depth first and holds a
bounded number of directory descriptors whatever the tree's width or depth.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
from fsspec.implementations.local import LocalFileSystem

from conftest import served_fs, start_server
from conftest import tb5fs as tb5
from tb5sync import errors
import tb5sync.daemon.fsops as fsops
from tb5sync.wire.rpc import call_direct, open_session
from tb5sync.wire.transport import connect

BAD = b"\xff\xfe.txt"  # not valid UTF-8
BAD_STR = os.fsdecode(BAD)


@pytest.fixture
def srv(tmp_path: Any) -> Any:
    """``(live, fs, root)``: ROOT holds ``sub/a.txt``, ``sub/enc/<BAD>`` and a link ``sub/enc/l\\xfa`` to it."""
    root = tmp_path / "root"
    (root / "sub" / "enc").mkdir(parents=True)
    (root / "sub" / "a.txt").write_bytes(b"hello")
    broot = os.fsencode(str(root))
    with open(broot + b"/sub/enc/" + BAD, "wb") as f:
        f.write(b"x")
    os.symlink(BAD, broot + b"/sub/enc/l\xfa")
    with served_fs(str(root)) as (live, fs):
        yield live, fs, live.root


def _rel(root: str, names: list[str]) -> list[str]:
    """LocalFileSystem's names relative to ``root``, without tb5sync's state directory."""
    rel = (os.path.relpath(n, root) for n in names)
    return sorted(r for r in rel if r.split("/")[0] not in (".tb5sync", "."))


def test_non_utf8_names_listed_as_local_filesystem_lists_them(srv: Any, caplog: Any) -> None:
    live, fs, root = srv
    local = LocalFileSystem()
    with caplog.at_level(logging.INFO, logger="tb5sync"):
        assert sorted(fs.ls("sub/enc")) == _rel(root, local.ls(f"{root}/sub/enc")) == sorted(["sub/enc/" + BAD_STR, "sub/enc/l\udcfa"])
        assert sorted(fs.find("")) == _rel(root, local.find(root))
        assert "sub/enc/" + BAD_STR in fs.find("")
        info = fs.info("sub/enc/l\udcfa")
        assert info["destination"] == BAD_STR and info["islink"]
        assert fs.info("sub/enc/" + BAD_STR)["name"] == "sub/enc/" + BAD_STR
        assert [(d, sorted(fs_)) for d, _, fs_ in fs.walk("sub")] == [("sub", ["a.txt"]), ("sub/enc", sorted([BAD_STR, "l\udcfa"]))]
        assert fs.cat_file("sub/enc/" + BAD_STR) == b"x"
        assert fs.cat_ranges(["sub/enc/" + BAD_STR] * 2, [0, 0], [1, 1]) == [b"x", b"x"]
        # requests naming such a path: written, moved, removed under the same bytes
        fs.pipe_file("sub/enc/n\udcfb", b"y")
        assert os.path.exists(os.fsencode(root) + b"/sub/enc/n\xfb")
        fs.mv("sub/enc/n\udcfb", "sub/enc/m\udcfb")
        fs.rm("sub/enc/m\udcfb")
        assert sorted(os.listdir(os.fsencode(root) + b"/sub/enc")) == sorted([BAD, b"l\xfa"])
        with pytest.raises(FileNotFoundError) as exc:
            fs.info("sub/enc/\udcfcgone")
        assert "\\udcfc" in str(exc.value) or "\\xfc" in str(exc.value)
    assert "internal error" not in caplog.text and "Traceback" not in caplog.text


def test_non_utf8_name_goes_as_bytes_on_the_wire(srv: Any) -> None:
    live, _, _ = srv
    ch = connect("127.0.0.1", live.port, live.token, 5)
    try:
        open_session(ch, {"op": "fs"})
        names = [e["name"] for e in call_direct(ch, "ls", {"path": "sub/enc"})["entries"]]
        assert b"sub/enc/" + BAD in names and b"sub/enc/l\xfa" in names
        assert call_direct(ch, "info", {"path": b"sub/enc/" + BAD})["info"]["name"] == b"sub/enc/" + BAD
        assert call_direct(ch, "info", {"path": "sub/a.txt"})["info"]["size"] == 5  # the session goes on
    finally:
        ch.close()


def test_reply_that_cannot_be_encoded_is_one_error_and_the_session_goes_on(srv: Any, monkeypatch: Any, caplog: Any) -> None:
    live, _, _ = srv
    monkeypatch.setattr(fsops, "_wire_info", lambda info: info)  # names as Python holds them: not msgpack text
    ch = connect("127.0.0.1", live.port, live.token, 5)
    try:
        open_session(ch, {"op": "fs"})
        with caplog.at_level(logging.INFO, logger="tb5sync"):
            with pytest.raises(errors.RemoteOSError, match="cannot be sent"):
                call_direct(ch, "ls", {"path": "sub/enc"})
            assert call_direct(ch, "info", {"path": "sub/a.txt"})["info"]["size"] == 5
    finally:
        ch.close()
    lines = [r for r in caplog.records if "cannot be sent" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0].getMessage() and lines[0].exc_info is None
    assert "internal error" not in caplog.text


# ---- find: bounded descriptors -------------------------------------------------------------------


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _fds_below(root: str) -> int:
    """Descriptors of this process open on something below ``root`` (not ``root`` itself, nor the
    state directory's database)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            n += target.startswith(root + "/") and not target.startswith(f"{root}/.tb5sync/")
        except OSError:
            pass
    return n


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_find_holds_a_bounded_number_of_descriptors(tmp_path: Any, monkeypatch: Any) -> None:
    root = tmp_path / "root"
    wide, deep = 400, 60
    for i in range(wide):
        (root / "wide" / f"d{i:04d}").mkdir(parents=True)
    (root / "wide" / "d0007" / "f").write_bytes(b"f")
    chain = root / "deep"
    for i in range(deep):
        chain = chain / f"l{i}"
    chain.mkdir(parents=True)
    (chain / "leaf").write_bytes(b"leaf")
    live = start_server(str(root))
    fs = tb5(live)
    peak = [0]
    real = fsops.FsOps._listdir

    def spy(self: Any, dfd: int, parent: str, at_root: bool) -> Any:
        peak[0] = max(peak[0], _fds_below(live.root))
        return real(self, dfd, parent, at_root)

    try:
        fs.info("")  # the connections are open before the baseline
        monkeypatch.setattr(fsops.FsOps, "_listdir", spy)
        got = fs.find("", withdirs=True)
        assert sorted(got) == _rel(live.root, LocalFileSystem().find(live.root, withdirs=True))
        assert len(got) == 1 + wide + 1 + 1 + deep + 1
        assert "deep/" + "/".join(f"l{i}" for i in range(deep)) + "/leaf" in got
        # the held branch, the directory being listed and scandir's duplicate of it (was: every
        # subdirectory of a directory at once, 400 here)
        assert 3 <= peak[0] <= fsops._FIND_HELD + 2, peak[0]
        # maxdepth still counts levels below the top
        assert sorted(fs.find("deep", maxdepth=3, withdirs=True)) == ["deep", "deep/l0", "deep/l0/l1", "deep/l0/l1/l2"]
        assert _fds_below(live.root) == 0  # nothing left open
    finally:
        fs._holder.close()
        live.server.stop()


def test_find_over_a_too_deep_tree_is_one_error(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(fsops, "MAX_FIND_DEPTH", 20)
    root = tmp_path / "root"
    chain = root
    for i in range(30):
        chain = chain / f"l{i}"
    chain.mkdir(parents=True)
    live = start_server(str(root))
    fs = tb5(live)
    try:
        with pytest.raises(errors.UsageError, match="deeper than 20 levels"):
            fs.find("")
        assert _fds_below(live.root) == 0
        assert len(fs.find("l0/l1/l2/l3/l4/l5/l6/l7/l8/l9/l10/l11", withdirs=True)) == 1 + 18  # the session goes on (the top and l12..l29)
    finally:
        fs._holder.close()
        live.server.stop()
