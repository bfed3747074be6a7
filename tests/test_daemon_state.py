"""A server's own state (ROOT/.tb5sync, its --store, its disk-test files) is out of every peer's reach.

- A push whose listing names ``.tb5sync`` (at any depth; forged: an honest scan never lists it)
  is refused before anything is written, and the receiving side's Destination refuses such a
  path on its own too.
- The state directory and the store are never reached through a symlink, and never written when
  they are someone else's: the server refuses to start, a store session is refused.
- A read-only server changes nothing under ROOT, store sessions included (no state directory, no
  store, not even SQLite's -wal/-shm files).
- A disk test stops when its client goes away or the server stops, and its file is removed; a
  test file left by a killed server is removed when a server starts on that state directory.

The expectations come from the promises in README's daemon safety section: no byte outside ROOT,
nothing of the server's state written by a peer, a read-only server writes nothing.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import http_cache_port, make_tree, snapshot, start_server, wait_for

import tb5sync
import tb5sync._os.diskbench as diskbench
import tb5sync.wire.messages as messages_mod
from tb5sync.remote.client import ls, parse_url
from tb5sync.errors import ConnectError, PathError, RemoteProtocolError, Tb5syncError, UsageError
from tb5sync.wire.rpc import open_session
from tb5sync.roles.sender import Sender
from tb5sync.daemon.server import Server
from tb5sync.store import Store
from tb5sync.remote.storeclient import pull_ref, push_ref
from tb5sync.wire.transport import dial

T0 = 1_600_000_000_000_000_000


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    os.utime(path, ns=(T0, T0))


def _rename(path: Any, a: str, b: str) -> Any:
    """``path`` (wire form: str or bytes) with every component ``a`` renamed ``b``."""
    if not isinstance(path, str):
        return path
    return "/".join(b if c == a else c for c in path.split("/"))


@pytest.fixture
def forge_state_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pushing client's listings call its directories named ``STATE`` ``.tb5sync`` (a forged
    listing: an honest scan never lists the state directory). Only the client's Sender is
    changed; the in-process server receives."""
    tree, entries = Sender.tree, Sender.entries

    def forged_tree(self: Sender, start: int = 0) -> dict[str, Any]:
        out = tree(self, start)
        return {**out, "dirs": [[_rename(r[0], "STATE", ".tb5sync"), *r[1:]] for r in out["dirs"]]}

    def forged_entries(self: Sender, dirs: list[str], skip: int = 0) -> dict[str, Any]:
        out = entries(self, [_rename(d, ".tb5sync", "STATE") for d in dirs], skip)
        return {**out, "entries": [[_rename(e[0], "STATE", ".tb5sync"), *e[1:]] for e in out["entries"]]}

    monkeypatch.setattr(Sender, "tree", forged_tree)
    monkeypatch.setattr(Sender, "entries", forged_entries)


def _attack_source(tmp_path: Path, where: str, outside: str) -> str:
    """A source whose ``WHERE/STATE`` holds a file, a 0777 directory and ``store -> outside``."""
    src = str(tmp_path / "src")
    state = os.path.join(src, where, "STATE")
    _write(os.path.join(state, "INJECTED.txt"), b"written by a client\n")
    _write(os.path.join(state, "state.sqlite"), b"garbage\n")
    os.symlink(outside, os.path.join(state, "store"))
    os.chmod(state, 0o777)
    _write(os.path.join(src, "plain"), b"an ordinary file\n")
    return src


def test_state_dir_name_is_one() -> None:
    import tb5sync._os.paths as _paths
    import tb5sync.tree.entry as entry

    assert entry.STATE_DIR == _paths.STATE_DIR == ".tb5sync"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["", "sub", "sub/deeper"], ids=["top", "nested", "deep"])
def test_push_listing_naming_the_state_dir_is_refused(tmp_path: Path, forge_state_dir: None, where: str) -> None:
    outside = str(tmp_path / "outside")
    os.makedirs(outside)
    src = _attack_source(tmp_path, where, outside)
    live = start_server(str(tmp_path / "root"), store=str(tmp_path / "root" / ".tb5sync" / "store"))
    try:
        state = os.path.join(live.root, ".tb5sync")
        before = snapshot(state)
        with pytest.raises(RemoteProtocolError, match=r"refused path .*\.tb5sync.*own state"):
            tb5sync.sync(src + "/", live.url(""), delete=True, timeout=30)
        assert snapshot(state) == before  # the server's state is untouched: no file, no link, same mode
        assert os.stat(state).st_mode & 0o777 == 0o700
        assert not os.path.lexists(os.path.join(live.root, where, ".tb5sync", "store"))
        assert os.listdir(outside) == []
        # the server still serves, and an honest push of the same tree (STATE not renamed) works
        assert ls(parse_url(live.url("")))  # type: ignore[arg-type]
    finally:
        live.server.stop()


@pytest.mark.timeout(60)
def test_pull_listing_naming_the_state_dir_is_refused(tmp_path: Path, forge_state_dir: None) -> None:
    """The same check on the client: a server whose listing names .tb5sync gets nothing written."""
    outside = str(tmp_path / "outside")
    os.makedirs(outside)
    live = start_server(str(tmp_path / "root"))
    try:
        src = _attack_source(tmp_path, "sub", outside)
        os.rename(src, os.path.join(live.root, "tree"))
        dst = tmp_path / "dst"
        with pytest.raises(RemoteProtocolError, match=r"refused path .*\.tb5sync.*own state"):
            tb5sync.sync(live.url("tree/"), str(dst) + "/", timeout=30)
        assert not any(".tb5sync" in d + "/".join(f) for d, _, f in os.walk(tmp_path / "dst"))
        assert os.listdir(outside) == []
    finally:
        live.server.stop()


@pytest.mark.timeout(60)
def test_destination_alone_refuses_a_state_dir_component(tmp_path: Path, forge_state_dir: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the listing check, the receiving Destination refuses every write whose path names .tb5sync."""
    monkeypatch.setattr(messages_mod, "check_peer_path", lambda path, what: path)
    outside = str(tmp_path / "outside")
    os.makedirs(outside)
    src = _attack_source(tmp_path, "", outside)
    live = start_server(str(tmp_path / "root"))
    try:
        state = os.path.join(live.root, ".tb5sync")
        before = snapshot(state)
        with pytest.raises(PathError, match=r"\.tb5sync is tb5sync's own state"):
            tb5sync.sync(src + "/", live.url(""), timeout=30)
        assert snapshot(state) == before
        assert os.listdir(outside) == []
    finally:
        live.server.stop()


@pytest.mark.timeout(30)
def test_server_refuses_a_state_dir_that_is_a_symlink(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    os.symlink(elsewhere, root / ".tb5sync")
    with pytest.raises(PathError, match="symlink"):
        Server(str(root), host="127.0.0.1", port=0)
    with pytest.raises(PathError, match="symlink"):
        Server(str(root), host="127.0.0.1", port=0, read_only=True)
    os.unlink(root / ".tb5sync")
    (root / ".tb5sync").write_bytes(b"not a directory")
    with pytest.raises(PathError, match="not a directory"):
        Server(str(root), host="127.0.0.1", port=0)
    sd = tmp_path / "sd"
    os.symlink(elsewhere, sd)
    (tmp_path / "root2").mkdir()
    with pytest.raises(PathError, match="symlink"):
        Server(str(tmp_path / "root2"), host="127.0.0.1", port=0, state_dir=str(sd))
    assert os.listdir(elsewhere) == []


@pytest.mark.timeout(30)
def test_server_refuses_someone_elses_state_dir(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give the directory to another user")
    root = tmp_path / "root"
    (root / ".tb5sync").mkdir(parents=True)
    os.chown(root / ".tb5sync", 65534, 65534)
    with pytest.raises(PathError, match="owned by uid 65534"):
        Server(str(root), host="127.0.0.1", port=0)
    Server(str(root), host="127.0.0.1", port=0, read_only=True).stop()  # only read: anyone's will do
    assert os.listdir(root / ".tb5sync") == []


@pytest.mark.timeout(60)
def test_store_reached_through_a_symlink_is_refused(tmp_path: Path) -> None:
    """ROOT/.tb5sync/store planted as a symlink to a store outside ROOT: neither read nor written."""
    outside = str(tmp_path / "private_store")
    secret = make_tree(str(tmp_path / "secret"), files=6)
    with Store(outside) as st:
        st.put("private/keys", secret)
    before = snapshot(outside)
    root = tmp_path / "root"
    (root / ".tb5sync").mkdir(parents=True, mode=0o700)
    os.symlink(outside, root / ".tb5sync" / "store")
    live = start_server(str(root), store=str(root / ".tb5sync" / "store"))
    try:
        with Store(tmp_path / "mine") as mine:
            with pytest.raises(PathError, match="symlink") as ei:
                pull_ref(mine, "private/keys", parse_url(live.url("")))  # type: ignore[arg-type]
            assert str(tmp_path) not in str(ei.value)  # the server's paths stay hidden
            mine.put("planted", secret)
            with pytest.raises(PathError, match="symlink"):
                push_ref(mine, "planted", parse_url(live.url("")))  # type: ignore[arg-type]
    finally:
        live.server.stop()
    assert snapshot(outside) == before


@pytest.mark.timeout(60)
def test_store_created_private_and_served(tmp_path: Path) -> None:
    """The default store is made 0700 (through no symlink) on the first store session of a writable server."""
    root = tmp_path / "root"
    root.mkdir()
    live = start_server(str(root), store=str(root / ".tb5sync" / "store"))
    try:
        with Store(tmp_path / "mine") as mine:
            mine.put("r", make_tree(str(tmp_path / "t"), files=6))
            push_ref(mine, "r", parse_url(live.url("")))  # type: ignore[arg-type]
    finally:
        live.server.stop()
    assert os.stat(root / ".tb5sync" / "store").st_mode & 0o777 == 0o700
    with Store(root / ".tb5sync" / "store") as st:
        assert [r.name for r in st.refs()] == ["r"]


def _tree_state(top: Path) -> dict[str, tuple[Any, ...]]:
    """Every path under ``top`` with its mode, size, mtime and content digest (files)."""
    import hashlib

    out = {}
    for d, dirs, files in os.walk(top):
        for n in dirs + files:
            p = os.path.join(d, n)
            st = os.lstat(p)
            h = hashlib.sha256(Path(p).read_bytes()).hexdigest() if os.path.isfile(p) and not os.path.islink(p) else ""
            out[os.path.relpath(p, top)] = (st.st_mode, st.st_size, st.st_mtime_ns, h)
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("store", ["missing", "existing"])
def test_read_only_server_writes_nothing_under_root(tmp_path: Path, store: str) -> None:
    root = tmp_path / "root"
    _write(str(root / "d" / "f"), b"hello\n")
    if store == "existing":
        with Store(root / ".tb5sync" / "store") as st:
            st.put("r", str(root / "d"))
    before = _tree_state(root)
    live = start_server(str(root), read_only=True, store=str(root / ".tb5sync" / "store"))
    try:
        remote = parse_url(live.url(""))
        with Store(tmp_path / "mine") as mine:
            if store == "missing":
                with pytest.raises(UsageError, match="store is empty"):
                    pull_ref(mine, "r", remote)  # type: ignore[arg-type]
            else:
                pull_ref(mine, "r", remote)  # type: ignore[arg-type]
                assert mine.cat("r", "f") == b"hello\n"
                before_write = _tree_state(root)
                with pytest.raises(Tb5syncError, match="read-only"):
                    push_ref(mine, "r", remote, as_name="r2")  # type: ignore[arg-type]
                assert _tree_state(root) == before_write
        tb5sync.sync(live.url("d/"), str(tmp_path / "out") + "/", timeout=30)
        assert (tmp_path / "out" / "f").read_bytes() == b"hello\n"
    finally:
        live.server.stop()
    assert _tree_state(root) == before


@pytest.mark.timeout(30)
def test_store_opened_read_only_creates_nothing(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no store here"):
        Store(tmp_path / "none", read_only=True)
    assert not (tmp_path / "none").exists()
    with Store(tmp_path / "s") as st:
        st.put("r", make_tree(str(tmp_path / "t"), files=6))
    before = _tree_state(tmp_path / "s")
    with Store(tmp_path / "s", read_only=True) as ro:
        assert [r.name for r in ro.refs()] == ["r"]
        assert ro.cat("r", "big.bin")[:1] and ro.manifest("r", touch=False)
    assert _tree_state(tmp_path / "s") == before


# ---- the disk test --------------------------------------------------------------------------


class _SlowOs:
    """``os`` for tb5sync._os.diskbench whose writes take 0.1 s each (so a test runs long enough to be cut)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    @staticmethod
    def write(fd: int, data: Any) -> int:
        time.sleep(0.1)
        return os.write(fd, data)


def _bench_files(state: str) -> list[str]:
    return [n for n in os.listdir(state) if n.startswith(".tb5sync-bench-")] if os.path.isdir(state) else []


@pytest.mark.timeout(60)
def test_disk_test_stops_when_its_client_goes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(diskbench, "os", _SlowOs())
    live = start_server(str(tmp_path / "root"))
    state = os.path.join(live.root, ".tb5sync")
    try:
        ch = dial("127.0.0.1", live.port, None, io_timeout=None)
        errors: list[BaseException] = []

        def run() -> None:
            try:
                open_session(ch, {"op": "disk", "bytes": 1 << 30})  # 256 blocks: 25 s at 0.1 s a block
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        wait_for(lambda: bool(_bench_files(state)), 10, "the disk test's file")
        ch.sock.shutdown(2)  # the client goes away
        took = wait_for(lambda: not _bench_files(state), 5, "the disk test's file removed")
        assert took < 5
        wait_for(lambda: live.server.connections == 0, 5, "the server to drop the connection")
        assert errors and isinstance(errors[0], (ConnectError, OSError))
        # the lock is free: a second test can run at once
        ch2 = dial("127.0.0.1", live.port, None, io_timeout=None)
        monkeypatch.setattr(diskbench, "os", os)
        try:
            res = open_session(ch2, {"op": "disk", "bytes": diskbench.MIN_SIZE})
        finally:
            ch2.close()
        assert res["bytes"] == diskbench.MIN_SIZE
        ch.close()
    finally:
        live.server.stop()
    assert _bench_files(state) == []


@pytest.mark.timeout(60)
def test_disk_test_stops_with_the_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(diskbench, "os", _SlowOs())
    live = start_server(str(tmp_path / "root"))
    state = os.path.join(live.root, ".tb5sync")
    ch = dial("127.0.0.1", live.port, None, io_timeout=None)
    t = threading.Thread(target=lambda: pytest.raises(Exception, open_session, ch, {"op": "disk", "bytes": 1 << 30}), daemon=True)
    t.start()
    try:
        wait_for(lambda: bool(_bench_files(state)), 10, "the disk test's file")
    finally:
        t0 = time.monotonic()
        live.server.stop()
        stopped = time.monotonic() - t0
        ch.close()
    assert stopped < 5  # not the 10 s stop() gives a connection thread
    assert _bench_files(state) == []


@pytest.mark.timeout(30)
def test_stale_disk_test_files_removed_at_start(tmp_path: Path) -> None:
    state = tmp_path / "root" / ".tb5sync"
    state.mkdir(parents=True, mode=0o700)
    stale, live_name = state / ".tb5sync-bench-0123456789abcdef.tmp", state / ".tb5sync-bench-fedcba9876543210.tmp"
    other = state / ".tb5sync-bench-notmine.tmp"
    for p in (stale, live_name, other):
        p.write_bytes(b"x" * 4096)
    held = os.open(live_name, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # a test still running (another server on this state directory)
    try:
        Server(str(tmp_path / "root"), host="127.0.0.1", port=0).stop()
        assert not stale.exists()
        assert live_name.exists() and other.exists()
        Server(str(tmp_path / "root"), host="127.0.0.1", port=0, read_only=True).stop()
        assert live_name.exists()  # a read-only server removes nothing
    finally:
        os.close(held)
    assert diskbench.remove_stale(str(state)) == 1
    assert not live_name.exists()


@pytest.mark.timeout(90)
def test_read_only_serve_http_cache_writes_nothing(tmp_path: Path) -> None:
    """``serve --read-only --http-cache``: the cache's store is opened read-only (its counters stay
    in memory); a missing one is not created (the server does not start)."""
    import http.client
    import signal
    import subprocess
    import sys

    from tb5sync.cache.httpcache import HttpCache

    root = tmp_path / "root"
    root.mkdir()

    def serve() -> subprocess.Popen[str]:
        args = ["serve", str(root), "--bind", "127.0.0.1:0", "--read-only", "--http-cache", "127.0.0.1:0"]
        return subprocess.Popen([sys.executable, "-m", "tb5sync.cli", *args], stderr=subprocess.PIPE, text=True)

    p = serve()
    err = p.communicate(timeout=60)[1]
    assert p.returncode != 0 and "store is empty" in err
    assert os.listdir(root) == []
    with HttpCache(root / ".tb5sync" / "store") as c:
        h = http.client.HTTPConnection("127.0.0.1", c.port, timeout=30)
        h.request("PUT", "/k", body=b"cached")
        assert h.getresponse().status == 200
        h.close()
    before = _tree_state(root)
    p = serve()
    try:
        assert p.stderr is not None
        port = http_cache_port(p.stderr)
        assert port
        h = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        for _ in range(3):
            h.request("GET", "/k")
            r = h.getresponse()
            assert (r.status, r.read()) == (200, b"cached")
        h.request("PUT", "/k2", body=b"x")
        r = h.getresponse()
        assert r.status == 403
        r.read()
        h.close()
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=30)
    assert p.returncode == 0
    assert _tree_state(root) == before
