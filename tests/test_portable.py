"""Every Linux-only call has a portable path chosen at run time, and these tests force it here
(docs/ARCHITECTURE.md, "Portability"). ``$TB5SYNC_PORTABLE=1`` takes every portable path at once;
with it, the Linux-only functions of ``os`` are removed from the module for the test (as on
macOS, which has none of them but ``sendfile`` and ``preadv``), so a call that slipped past the
switch fails. Then the failures that make a Linux call give way at run time (``copy_file_range``
across file systems, ``sendfile`` refused)."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from typing import Any

import pytest
from conftest import make_tree, snapshot, start_server, tb5fs

import tb5sync
import tb5sync.engine.basis as _basis
import tb5sync._os.io as _io
from tb5sync._os.paths import Jail
from tb5sync.store import Store
from tb5sync.store.materialise import reflink_supported
from tb5sync.wire.transport import set_keepalive

LINUX_ONLY = ("copy_file_range", "preadv", "sendfile")


@pytest.fixture
def portable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TB5SYNC_PORTABLE", "1")
    for name in LINUX_ONLY:
        monkeypatch.delattr(os, name, raising=False)
    calls: list[Any] = []
    monkeypatch.setattr(_basis, "_sync_file_range", lambda *a: calls.append(a))
    yield
    assert not calls, "sync_file_range was called with $TB5SYNC_PORTABLE=1"


def _change_big(src: str) -> None:
    """Rewrite the middle of the 9 MiB file: a delta against the destination's copy (basis reads)."""
    big = os.path.join(src, "big.bin")
    with open(big, "r+b") as f:
        f.seek(4 * 1024 * 1024)
        f.write(os.urandom(100_000))


def test_sync_every_route(portable: None, tmp_path: Path) -> None:
    src = make_tree(str(tmp_path / "src"))
    live = start_server(str(tmp_path / "server"))
    try:
        for _ in range(2):  # a cold copy, then a delta of a changed large file
            tb5sync.sync(src + "/", str(tmp_path / "local"))
            tb5sync.sync(src + "/", live.url("push/"))
            tb5sync.sync(live.url("push/"), str(tmp_path / "pull"))
            for dst in (tmp_path / "local", Path(live.root) / "push", tmp_path / "pull"):
                assert snapshot(src) == snapshot(str(dst)), dst
            _change_big(src)
    finally:
        live.server.stop()


def test_fs_copy_and_append(portable: None, tmp_path: Path) -> None:
    live = start_server(str(tmp_path / "server"))
    try:
        fs = tb5fs(live)
        data = os.urandom(3 * 1024 * 1024 + 5)
        fs.pipe_file("a.bin", data)
        fs.cp_file("a.bin", "b.bin")  # the server's copy op
        with fs.open("b.bin", "ab") as f:  # append: the old bytes copied into the new version first
            f.write(b"tail")
        assert (Path(live.root) / "b.bin").read_bytes() == data + b"tail"
    finally:
        live.server.stop()


def test_store_get_without_reflink(portable: None, tmp_path: Path) -> None:
    assert not reflink_supported()
    src = make_tree(str(tmp_path / "src"), files=10)
    store = Store(str(tmp_path / "store"))
    try:
        store.put("t", src)
        store.get("t", str(tmp_path / "out"))
    finally:
        store.close()
    assert snapshot(src) == snapshot(str(tmp_path / "out"))


def test_jail_walks_and_sockets_skip_linux_options(portable: None, tmp_path: Path) -> None:
    jail = Jail(str(tmp_path))
    try:
        assert not jail.uses_openat2
    finally:
        jail.close()
    s = socket.socket()
    try:
        done = set_keepalive(s, 30, 60)
        assert "TCP_USER_TIMEOUT" not in done and "SO_KEEPALIVE" in done
    finally:
        s.close()


def test_io_helpers_portable_paths(portable: None, tmp_path: Path) -> None:
    p = tmp_path / "f"
    p.write_bytes(b"0123456789" * 1000)
    fd = os.open(p, os.O_RDONLY)
    out = os.open(tmp_path / "g", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        buf = bytearray(10)
        assert _io.read_into(fd, memoryview(buf), 5) == 10 and bytes(buf) == b"5678901234"
        assert _io.copy_range(fd, out, 7, 3, 0) == 7
        assert _io.copy_range(fd, out, 5, 20_000, 7) == 0  # the source's end
    finally:
        os.close(fd)
        os.close(out)
    assert (tmp_path / "g").read_bytes() == b"3456789"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here (macOS)")
def test_usable_cpus_is_the_affinity_set() -> None:
    """Pinned to one CPU (as ``taskset -c N`` does), the process may use one, whatever the machine has."""
    old = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(old)})
        assert _io.usable_cpus() == 1
    finally:
        os.sched_setaffinity(0, old)
    assert _io.usable_cpus() == len(old)


def test_usable_cpus_portable(portable: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    assert _io.usable_cpus() == (os.cpu_count() or 1)


@pytest.mark.skipif(not hasattr(os, "copy_file_range"), reason="no copy_file_range here")
def test_copy_file_range_refused_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``EXDEV`` (another file system, older kernels) and the like: a read and a write instead."""
    def refuse(*_a: Any) -> int:
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    live = start_server(str(tmp_path / "server"))
    try:
        fs = tb5fs(live)
        data = os.urandom(2 * 1024 * 1024 + 3)
        fs.pipe_file("a.bin", data)
        fs.cp_file("a.bin", "b.bin")
        assert (Path(live.root) / "b.bin").read_bytes() == data
    finally:
        live.server.stop()


@pytest.mark.skipif(not hasattr(os, "sendfile"), reason="no sendfile here")
def test_sendfile_refused_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system whose files sendfile cannot read (EINVAL): the channel sends them by pread + send."""
    refused: list[int] = []

    def refuse(*_a: Any) -> int:
        refused.append(1)
        raise OSError(errno.EINVAL, "not here")

    monkeypatch.setattr(os, "sendfile", refuse)
    live = start_server(str(tmp_path / "server"))
    try:
        src = make_tree(str(Path(live.root) / "src"), files=6)
        tb5sync.sync(live.url("src/"), str(tmp_path / "pull"))
        assert snapshot(src) == snapshot(str(tmp_path / "pull"))
    finally:
        live.server.stop()
    assert refused, "the pull sent no file part with sendfile: the fallback was not exercised"
