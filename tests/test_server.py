"""Tests of the daemon (:mod:`tb5sync.daemon.server`) against a live server on 127.0.0.1, port 0.

Every failure case checks three things: a clear error of the right tb5sync class whose message
names what was wrong; the server keeps serving (a small sync succeeds afterwards); nothing
half-written is left at the destination (no ``*.tb5tmp`` file, no final path for a failed file).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import LiveServer, snapshot, start_server

import tb5sync
import tb5sync.wire.protocol as P
from tb5sync.remote.client import ls as remote_ls
from tb5sync.remote.client import parse_url
from tb5sync.errors import (
    AuthError,
    ConnectError,
    DestinationError,
    PathError,
    ReadOnlyError,
    RemoteNotFoundError,
    SourceChangedError,
    Tb5syncError,
    UsageError,
    VersionMismatchError,
)
from tb5sync.wire.protocol import FrameType
from tb5sync.roles.sender import Sender
from tb5sync.wire.rpc import open_session
from tb5sync.wire.transport import Channel, connect

RAW = struct.Struct("!4sBBHII")
TOKEN = b"s3cret-token"
REPO = str(Path(__file__).resolve().parent.parent)


# ---- helpers -------------------------------------------------------------------------------


def write(path: str | os.PathLike[str], data: bytes) -> str:
    os.makedirs(os.path.dirname(os.fspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return os.fspath(path)


def small_tree(base: str) -> str:
    """Three small files in two directories."""
    write(os.path.join(base, "a.txt"), b"alpha\n")
    write(os.path.join(base, "sub", "b.bin"), os.urandom(5000))
    write(os.path.join(base, "sub", "c.txt"), b"")
    return base


def temp_files(root: str) -> list[str]:
    """Every ``*.tb5tmp`` under ``root`` (state dir included)."""
    out = []
    for dirpath, _dirs, files in os.walk(root):
        out += [os.path.join(dirpath, f) for f in files if f.endswith(".tb5tmp")]
    return out


def assert_serving(live: LiveServer, tmp_path: Path, token: bytes | None = None) -> None:
    """The server still answers: push a small tree and pull it back, byte-identical."""
    tag = uuid.uuid4().hex[:8]
    src = small_tree(str(tmp_path / f"alive-{tag}"))
    tb5sync.sync(src + "/", live.url(f"alive-{tag}"), token=token, streams=2)
    back = str(tmp_path / f"alive-back-{tag}")
    tb5sync.sync(live.url(f"alive-{tag}/"), back, token=token, streams=2)
    assert snapshot(back) == snapshot(src)
    assert snapshot(os.path.join(live.root, f"alive-{tag}")) == snapshot(src)
    assert temp_files(live.root) == []


def read_frames(sock: socket.socket) -> tuple[list[P.Frame], str]:
    """Read until the peer closes; returns the frames and how it ended ("eof" or "reset")."""
    buf = b""
    how = "eof"
    while True:
        try:
            k = sock.recv(65536)
        except ConnectionResetError:
            how = "reset"
            break
        if not k:
            break
        buf += k
    reader = P.FrameReader()
    if buf:
        reader.receive_data(buf)
    reader.receive_data(b"")
    frames = []
    while True:
        ev = reader.next_event()
        if ev is P.NEED_DATA:
            return frames, how
        assert isinstance(ev, P.Frame)
        frames.append(ev)


def raw_exchange(port: int, data: bytes) -> tuple[list[P.Frame], str]:
    """Send ``data`` on a fresh connection and read what comes back until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(data)
        return read_frames(s)


def error_of(frame: P.Frame) -> dict[str, Any]:
    assert frame.header.type is FrameType.ERROR
    assert frame.header.version == P.PROTOCOL_VERSION
    return P.decode_control(frame.payload)


@contextlib.contextmanager
def fake_server(reply: Callable[[P.Header, bytes], bytes]) -> Iterator[int]:
    """A one-shot fake peer on 127.0.0.1:0: reads the client's first frame, sends ``reply(...)``."""
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    lsock.settimeout(5)

    def recv_exact(conn: socket.socket, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            k = conn.recv(n - len(buf))
            if not k:
                raise ConnectionError("closed")
            buf += k
        return buf

    def run() -> None:
        try:
            conn, _ = lsock.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(5)
            with contextlib.suppress(OSError):
                header = P.parse_header(recv_exact(conn, 16))
                payload = recv_exact(conn, header.length)
                conn.sendall(reply(header, payload))
                conn.recv(1)  # wait for the client to hang up

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield lsock.getsockname()[1]
    finally:
        with contextlib.suppress(OSError):
            lsock.shutdown(socket.SHUT_RDWR)
        lsock.close()
        t.join(5)
        assert not t.is_alive(), "the fake server's thread hung"


def with_version(frame: bytes, version: int) -> bytes:
    return frame[:4] + bytes([version]) + frame[5:]


def free_port() -> int:
    """A port on 127.0.0.1 with nothing listening (bound, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def ls_url(url: str, token: bytes | str | None = None) -> list[Any]:
    """The entries :func:`tb5sync.remote.client.ls` gives for a ``tb5://`` URL."""
    remote = parse_url(url)
    assert remote is not None
    return remote_ls(remote, token=token)


@pytest.fixture
def src(tmp_path: Path) -> str:
    return small_tree(str(tmp_path / "src"))


@pytest.fixture
def no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TB5SYNC_TOKEN", raising=False)


# ---- authentication ------------------------------------------------------------------------

REFUSED = AuthError  # an auth failure is an AuthError (CLI exit 5), never a ConnectError


def test_wrong_token_is_refused(token_server: LiveServer, src: str, tmp_path: Path, no_env_token: None) -> None:
    with pytest.raises(REFUSED, match="wrong token"):
        tb5sync.sync(src + "/", token_server.url("dst"), token=b"not-the-token")
    assert not os.path.lexists(os.path.join(token_server.root, "dst"))
    with pytest.raises(REFUSED, match="wrong token"):
        tb5sync.sync(token_server.url(""), str(tmp_path / "pulled"), token="not-the-token")
    assert not os.path.lexists(tmp_path / "pulled")
    assert_serving(token_server, tmp_path, TOKEN)


def test_no_token_against_token_server_is_refused(
    token_server: LiveServer, src: str, tmp_path: Path, no_env_token: None
) -> None:
    with pytest.raises(REFUSED, match="requires a token"):
        tb5sync.sync(src + "/", token_server.url("dst"))
    assert not os.path.lexists(os.path.join(token_server.root, "dst"))
    assert_serving(token_server, tmp_path, TOKEN)


@pytest.mark.parametrize("case", ["wrong-push", "wrong-pull", "wrong-ls", "none-push", "none-ls"])
def test_auth_failure_is_auth_error(token_server: LiveServer, src: str, tmp_path: Path, no_env_token: None, case: str) -> None:
    token = None if case.startswith("none") else b"not-the-token"
    with pytest.raises(AuthError, match="token") as info:
        if case.endswith("push"):
            tb5sync.sync(src + "/", token_server.url("dst"), token=token)
        elif case.endswith("pull"):
            tb5sync.sync(token_server.url(""), str(tmp_path / "pulled"), token=token)
        else:
            ls_url(token_server.url(""), token=token)
    assert isinstance(info.value, PermissionError)


@pytest.mark.parametrize("token", [TOKEN, TOKEN.decode()], ids=["bytes", "str"])
def test_right_token_works(token_server: LiveServer, src: str, tmp_path: Path, token: bytes | str, no_env_token: None) -> None:
    stats = tb5sync.sync(src + "/", token_server.url("dst"), token=token)
    assert stats.files_transferred == 3
    assert snapshot(os.path.join(token_server.root, "dst")) == snapshot(src)
    tb5sync.sync(token_server.url("dst/"), str(tmp_path / "back"), token=token)
    assert snapshot(str(tmp_path / "back")) == snapshot(src)


def test_token_from_environment(token_server: LiveServer, src: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TB5SYNC_TOKEN", TOKEN.decode())
    tb5sync.sync(src + "/", token_server.url("env"))
    tb5sync.sync(token_server.url("env/"), str(tmp_path / "back"))
    assert snapshot(str(tmp_path / "back")) == snapshot(src)
    monkeypatch.setenv("TB5SYNC_TOKEN", "wrong")
    with pytest.raises(REFUSED, match="wrong token"):
        tb5sync.sync(src + "/", token_server.url("env2"))
    assert not os.path.lexists(os.path.join(token_server.root, "env2"))
    # an explicit token wins over the environment
    tb5sync.sync(src + "/", token_server.url("env3"), token=TOKEN)
    assert snapshot(os.path.join(token_server.root, "env3")) == snapshot(src)


def test_token_server_refuses_raw_peer_without_auth(token_server: LiveServer, tmp_path: Path) -> None:
    """A peer that answers the challenge with an empty MAC gets an ERROR frame, not a session."""
    with socket.create_connection(("127.0.0.1", token_server.port), timeout=5) as s:
        s.sendall(P.encode_control(FrameType.HELLO, 0, {"nonce": os.urandom(32)}))
        ch = Channel(s)
        got = ch.recv_frame()
        assert got is not None and got[0].type is FrameType.CHALLENGE
        assert P.decode_control(got[1])["auth"] is True
        s.sendall(P.encode_control(FrameType.AUTH, 0, {"mac": b""}))
        s.sendall(P.encode_control(FrameType.OPEN, 0, {"op": "ls", "path": ""}))
        frames, _ = read_frames(s)
    assert frames, "no ERROR frame before the close"
    body = error_of(frames[0])
    assert body["kind"] == "AuthError" and "token" in body["message"]
    assert all(f.header.type is FrameType.ERROR for f in frames)
    assert_serving(token_server, tmp_path, TOKEN)


# ---- protocol violations -------------------------------------------------------------------


def test_version_mismatch_gets_error_frame_and_close(server: LiveServer, tmp_path: Path) -> None:
    hello = with_version(P.encode_control(FrameType.HELLO, 0, {"nonce": os.urandom(32)}), P.PROTOCOL_VERSION + 1)
    assert RAW.unpack(hello[:16])[1] == P.PROTOCOL_VERSION + 1
    frames, _ = raw_exchange(server.port, hello)
    assert frames, "the server closed without an ERROR frame"
    body = error_of(frames[0])  # our version in its header
    assert body["kind"] == "VersionMismatchError"
    assert f"we speak {P.PROTOCOL_VERSION}" in body["message"] and f"peer speaks {P.PROTOCOL_VERSION + 1}" in body["message"]
    assert_serving(server, tmp_path)


@pytest.mark.parametrize("case", ["version", "garbage", "absurd-length"])
def test_handshake_failure_sends_exactly_one_error_frame(server: LiveServer, case: str) -> None:
    data = {
        "version": with_version(P.encode_control(FrameType.HELLO, 0, {"nonce": os.urandom(32)}), P.PROTOCOL_VERSION + 1),
        "garbage": b"\x00" * 16,
        "absurd-length": RAW.pack(b"TB5S", P.PROTOCOL_VERSION, FrameType.HELLO, 0, 0, 0xFFFFFFFF),
    }[case]
    frames, _ = raw_exchange(server.port, data)
    assert [f.header.type for f in frames] == [FrameType.ERROR]


def test_client_against_a_version_2_server(tmp_path: Path, src: str) -> None:
    """Our client, talking to a (fake) server of protocol version 2, raises VersionMismatchError."""

    def challenge_v2(header: P.Header, payload: bytes) -> bytes:
        assert header.type is FrameType.HELLO and header.version == P.PROTOCOL_VERSION
        return with_version(P.encode_control(FrameType.CHALLENGE, 0, {"nonce": os.urandom(32), "auth": False}), P.PROTOCOL_VERSION + 1)

    with fake_server(challenge_v2) as port, pytest.raises(VersionMismatchError) as info:
        tb5sync.sync(src + "/", f"tb5://127.0.0.1:{port}/dst")
    assert (info.value.ours, info.value.theirs) == (P.PROTOCOL_VERSION, P.PROTOCOL_VERSION + 1)
    assert f"peer speaks {P.PROTOCOL_VERSION + 1}" in str(info.value)

    def error_v2(header: P.Header, payload: bytes) -> bytes:  # what a v2 server does with a v1 client
        return with_version(P.encode_control(FrameType.ERROR, 0, {"kind": "VersionMismatchError", "message": "we speak a newer version"}), P.PROTOCOL_VERSION + 1)

    with fake_server(error_v2) as port, pytest.raises(VersionMismatchError):
        tb5sync.sync(f"tb5://127.0.0.1:{port}/x", str(tmp_path / "pulled"))
    assert not os.path.lexists(tmp_path / "pulled")


@pytest.mark.parametrize(
    "data",
    [
        RAW.pack(b"TB5S", P.PROTOCOL_VERSION, FrameType.HELLO, 0, 0, 0xFFFFFFFF),
        RAW.pack(b"TB5S", P.PROTOCOL_VERSION, FrameType.DATA, 0, 0, 0xFFFFFFFF),
        b"GET / HTTP/1.1\r\n",
        os.urandom(16),
        b"\x00" * 16,
    ],
    ids=["absurd-hello", "absurd-data", "http", "random", "zeros"],
)
def test_bad_first_frame_gets_error_frame_and_close(server: LiveServer, tmp_path: Path, data: bytes) -> None:
    t0 = time.monotonic()
    frames, _ = raw_exchange(server.port, data)
    assert time.monotonic() - t0 < 2, "the server waited instead of refusing the header at once"
    assert frames, "the server closed without an ERROR frame"
    body = error_of(frames[0])
    assert body["kind"] in ("RemoteProtocolError", "VersionMismatchError")
    assert body["message"]
    assert_serving(server, tmp_path)


@pytest.mark.parametrize("after", ["handshake", "pull-session"])
def test_absurd_length_after_handshake(server: LiveServer, tmp_path: Path, after: str) -> None:
    """An absurd length is refused (ERROR frame, close) at any point of a connection."""
    os.makedirs(os.path.join(server.root, "d"))
    write(os.path.join(server.root, "d", "f"), b"x")
    ch = connect("127.0.0.1", server.port, None)
    try:
        if after == "pull-session":
            resp = open_session(ch, {"op": "pull", "path": "d", "options": {}, "streams": 1})
            assert resp["kind"] == "d"
        ch.sock.settimeout(5)
        ch.sock.sendall(RAW.pack(b"TB5S", P.PROTOCOL_VERSION, FrameType.REQUEST, 0, 1, 0xFFFFFFFF))
        frames, _ = read_frames(ch.sock)
    finally:
        ch.close()
    assert frames
    body = error_of(frames[0])
    assert body["kind"] == "RemoteProtocolError"
    assert str(0xFFFFFFFF) in body["message"]
    assert_serving(server, tmp_path)


def test_many_bad_connections_do_not_take_the_server_down(server: LiveServer, tmp_path: Path) -> None:
    for i in range(20):
        raw_exchange(server.port, os.urandom(16 + i))
    # and a connection that opens and says nothing at all
    with socket.create_connection(("127.0.0.1", server.port), timeout=5):
        pass
    assert_serving(server, tmp_path)


@pytest.mark.parametrize(
    "msg",
    [{"op": "nope"}, {"op": "pull", "path": 5}, {"op": "pull", "path": "", "streams": 0}, {"op": "join", "session": "x", "index": 1}],
    ids=["unknown-op", "path-not-str", "streams-0", "join-unknown"],
)
def test_bad_open_is_refused(server: LiveServer, tmp_path: Path, msg: dict[str, Any]) -> None:
    ch = connect("127.0.0.1", server.port, None)
    try:
        with pytest.raises(Tb5syncError):
            open_session(ch, msg)
    finally:
        ch.close()
    assert_serving(server, tmp_path)


# ---- path jail -----------------------------------------------------------------------------

ESCAPES = ["..", "../etc", "a/../../etc", "sub/../..", "./../x"]


@pytest.mark.parametrize("path", ESCAPES)
def test_dotdot_is_refused(server: LiveServer, src: str, tmp_path: Path, path: str) -> None:
    os.makedirs(os.path.join(server.root, "a"), exist_ok=True)
    with pytest.raises(PathError, match=r"\.\."):
        tb5sync.sync(server.url(path), str(tmp_path / "pulled"))
    assert not os.path.lexists(tmp_path / "pulled")
    with pytest.raises(PathError, match=r"\.\."):
        tb5sync.sync(src + "/", server.url(path))
    with pytest.raises(PathError, match=r"\.\."):
        ls_url(server.url(path))
    assert not os.path.lexists(tmp_path / "etc") and not os.path.lexists(tmp_path / "x")
    assert_serving(server, tmp_path)


def test_absolute_path_is_refused(server: LiveServer, src: str, tmp_path: Path) -> None:
    url = f"tb5://127.0.0.1:{server.port}//etc/passwd"
    r = parse_url(url)
    assert r is not None and r.path == "/etc/passwd"
    with pytest.raises(PathError, match="absolute"):
        tb5sync.sync(url, str(tmp_path / "pulled"))
    assert not os.path.lexists(tmp_path / "pulled")
    with pytest.raises(PathError, match="absolute"):
        tb5sync.sync(src + "/", f"tb5://127.0.0.1:{server.port}/{tmp_path}/planted")
    assert not os.path.lexists(tmp_path / "planted")
    for op in ("pull", "ls", "push"):
        ch = connect("127.0.0.1", server.port, None)
        try:
            with pytest.raises(PathError, match="absolute"):
                open_session(ch, {"op": op, "path": "/etc", "options": {}, "streams": 1, "name": "x", "src_kind": "d"})
        finally:
            ch.close()
    assert_serving(server, tmp_path)


@pytest.mark.parametrize("name", ["..", ".", "", "a/b", "x\0y"], ids=["dotdot", "dot", "empty", "slash", "nul"])
def test_push_with_bad_source_name_is_refused(server: LiveServer, tmp_path: Path, name: str) -> None:
    ch = connect("127.0.0.1", server.port, None)
    try:
        with pytest.raises(PathError):
            open_session(ch, {"op": "push", "path": "", "name": name, "src_kind": "d", "options": {}, "streams": 1})
    finally:
        ch.close()
    assert sorted(os.listdir(server.root)) == [".tb5sync"]
    assert_serving(server, tmp_path)


@pytest.fixture
def outside(tmp_path: Path) -> str:
    """A directory next to (not inside) the server root, with a secret file."""
    d = str(tmp_path / "outside")
    write(os.path.join(d, "secret.txt"), b"top secret\n")
    return d


def test_symlink_out_of_root_is_not_followed_on_pull(server: LiveServer, outside: str, tmp_path: Path) -> None:
    os.symlink(outside, os.path.join(server.root, "evil"))
    os.symlink("/etc", os.path.join(server.root, "etc_link"))
    for path in ("evil/secret.txt", "evil/sub/x", "etc_link/hostname", "etc_link/passwd"):
        with pytest.raises(PathError, match="outside"):
            tb5sync.sync(server.url(path), str(tmp_path / "pulled") + "/")
        assert not os.path.lexists(tmp_path / "pulled" / "secret.txt")
        assert not os.path.lexists(tmp_path / "pulled" / "passwd")
        with pytest.raises(PathError, match="outside"):
            ls_url(server.url(path))
    # the link itself (however spelled): a symlink or a refusal, never the outside content
    for i, path in enumerate(("evil", "evil/", "evil/.", "etc_link/")):
        dst = tmp_path / f"pulled-{i}"
        try:
            tb5sync.sync(server.url(path), str(dst) + "/")
        except PathError:
            continue
        if dst.is_symlink():
            continue
        for dirpath, dirs, files in os.walk(dst):
            for f in dirs + files:
                p = os.path.join(dirpath, f)
                if os.path.islink(p):
                    assert os.readlink(p) in (outside, "/etc")
                else:
                    assert stat.S_ISDIR(os.lstat(p).st_mode) or b"top secret" not in Path(p).read_bytes()
                    assert f not in ("secret.txt", "passwd", "hostname")
    # ls of the link shows the link, not the outside directory's content
    entries = ls_url(server.url("evil"))
    assert [(e.path, e.kind, e.target) for e in entries] == [("", "l", outside)]
    assert_serving(server, tmp_path)


def test_symlink_out_of_root_on_push_below_it(server: LiveServer, outside: str, src: str, tmp_path: Path) -> None:
    os.symlink(outside, os.path.join(server.root, "evil"))
    before = snapshot(outside)
    for path in ("evil/x", "evil/x/", "evil/a/b"):
        with pytest.raises(PathError, match="outside"):
            tb5sync.sync(src + "/", server.url(path))
        with pytest.raises(PathError, match="outside"):
            tb5sync.sync(src, server.url(path))
    assert snapshot(outside) == before
    assert_serving(server, tmp_path)


@pytest.mark.parametrize("dst", ["evil", "evil/"])
@pytest.mark.parametrize("kind", ["dir", "file"])
def test_push_into_symlink_to_outside_stays_in_root(
    server: LiveServer, outside: str, src: str, tmp_path: Path, dst: str, kind: str
) -> None:
    os.symlink(outside, os.path.join(server.root, "evil"))
    before = snapshot(outside)
    source = src if kind == "dir" else os.path.join(src, "a.txt")
    try:
        tb5sync.sync(source, server.url(dst))
    except PathError:
        pass
    assert snapshot(outside) == before, "the server wrote outside its root"


def test_symlink_inside_root_works(server: LiveServer, src: str, tmp_path: Path) -> None:
    real = os.path.join(server.root, "real")
    write(os.path.join(real, "f.txt"), b"inside\n")
    write(os.path.join(real, "deep", "g.txt"), b"deeper\n")
    os.symlink("real", os.path.join(server.root, "inner"))
    tb5sync.sync(server.url("inner/f.txt"), str(tmp_path / "one.txt"))
    assert (tmp_path / "one.txt").read_bytes() == b"inside\n"
    tb5sync.sync(server.url("inner/deep/"), str(tmp_path / "deep"))
    assert (tmp_path / "deep" / "g.txt").read_bytes() == b"deeper\n"
    names = [e.path for e in ls_url(server.url("inner/deep"))]
    assert names == ["", "g.txt"]
    tb5sync.sync(src + "/", server.url("inner/pushed"))
    assert snapshot(os.path.join(real, "pushed")) == snapshot(src)


def test_symlinks_are_synced_as_links(server: LiveServer, outside: str, tmp_path: Path) -> None:
    os.symlink(outside, os.path.join(server.root, "link_to_outside"))
    os.symlink("/etc/passwd", os.path.join(server.root, "abs_file_link"))
    os.symlink("nowhere/at/all", os.path.join(server.root, "dangling"))
    # a single entry
    tb5sync.sync(server.url("link_to_outside"), str(tmp_path / "single") + "/")
    got = tmp_path / "single" / "link_to_outside"
    assert got.is_symlink() and os.readlink(got) == outside
    # the whole root: links stay links with their targets untouched
    tb5sync.sync(server.url(""), str(tmp_path / "all") + "/")
    for name, target in [("link_to_outside", outside), ("abs_file_link", "/etc/passwd"), ("dangling", "nowhere/at/all")]:
        p = tmp_path / "all" / name
        assert p.is_symlink() and os.readlink(p) == target
    assert not (tmp_path / "all" / "secret.txt").exists()
    # push: a source symlink to outside is stored as a link on the server, not followed
    srcdir = tmp_path / "with_links"
    write(srcdir / "plain.txt", b"p")
    os.symlink(outside, srcdir / "out")
    tb5sync.sync(str(srcdir) + "/", server.url("stored"))
    stored = Path(server.root) / "stored" / "out"
    assert stored.is_symlink() and os.readlink(stored) == outside


# ---- read-only and allow-list --------------------------------------------------------------


def test_read_only_server(tmp_path: Path, src: str) -> None:
    live = start_server(str(tmp_path / "ro"), read_only=True)
    try:
        small_tree(os.path.join(live.root, "data"))
        with pytest.raises(ReadOnlyError, match="read-only") as info:
            tb5sync.sync(src + "/", live.url("new"))
        assert isinstance(info.value, PermissionError)
        assert not os.path.lexists(os.path.join(live.root, "new"))
        with pytest.raises(ReadOnlyError):
            tb5sync.sync(os.path.join(src, "a.txt"), live.url("data/a.txt"))
        assert Path(live.root, "data", "a.txt").read_bytes() == b"alpha\n"
        tb5sync.sync(live.url("data/"), str(tmp_path / "pulled"))
        assert snapshot(str(tmp_path / "pulled")) == snapshot(os.path.join(live.root, "data"))
        assert temp_files(live.root) == []
    finally:
        live.server.stop()


def test_allow_list_refuses_other_networks(tmp_path: Path, src: str) -> None:
    live = start_server(str(tmp_path / "allow10"), allow=["10.0.0.0/8"])
    try:
        for _ in range(5):  # the refusal must reach the client every time (no lost ERROR frame)
            with pytest.raises(REFUSED, match="127.0.0.1.*not allowed"):
                tb5sync.sync(src + "/", live.url("dst"))
        with pytest.raises(REFUSED, match="not allowed"):
            tb5sync.sync(live.url(""), str(tmp_path / "pulled"))
        assert not os.path.lexists(os.path.join(live.root, "dst"))
        assert not os.path.lexists(tmp_path / "pulled")
    finally:
        live.server.stop()


def test_allow_list_refusal_is_auth_error(tmp_path: Path, src: str) -> None:
    live = start_server(str(tmp_path / "allow10"), allow=["10.0.0.0/8"])
    try:
        with pytest.raises(AuthError, match="not allowed"):
            tb5sync.sync(src + "/", live.url("dst"))
    finally:
        live.server.stop()


@pytest.mark.parametrize("allow", [["127.0.0.0/8"], ["10.0.0.0/8", "127.0.0.1/32"], ["127.0.0.1"]])
def test_allow_list_accepts_matching_network(tmp_path: Path, allow: list[str]) -> None:
    live = start_server(str(tmp_path / "allow127"), allow=allow)
    try:
        assert_serving(live, tmp_path)
    finally:
        live.server.stop()


def test_bad_cidr_is_usage_error(tmp_path: Path) -> None:
    from tb5sync.daemon.server import Server

    with pytest.raises(UsageError, match="allow"):
        Server(str(tmp_path), port=0, allow=["not-a-network"])


# ---- unreachable host ----------------------------------------------------------------------


def test_unreachable_port_is_connect_error(tmp_path: Path, src: str) -> None:
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(ConnectError, match=f"127.0.0.1:{port}") as info:
        tb5sync.sync(src + "/", f"tb5://127.0.0.1:{port}/dst")
    assert isinstance(info.value, ConnectionError)
    with pytest.raises(ConnectError, match=f"127.0.0.1:{port}"):
        tb5sync.sync(f"tb5://127.0.0.1:{port}/x", str(tmp_path / "pulled"))
    assert time.monotonic() - t0 < 2
    assert not os.path.lexists(tmp_path / "pulled")


# ---- destination not writable --------------------------------------------------------------


@pytest.mark.parametrize("what", ["tree", "small-file", "large-file"])
def test_file_in_the_way_is_destination_error(server: LiveServer, tmp_path: Path, src: str, what: str) -> None:
    write(os.path.join(server.root, "afile"), b"I am a file\n")
    source = {
        "tree": src,
        "small-file": os.path.join(src, "a.txt"),
        "large-file": write(tmp_path / "big" / "big.bin", os.urandom(5 * 1024 * 1024)),
    }[what]
    before = snapshot(server.root)
    with pytest.raises(Tb5syncError, match="afile") as info:
        tb5sync.sync(source, server.url("afile/sub/"))
    assert isinstance(info.value, DestinationError), f"{type(info.value).__name__}: {info.value}"
    assert Path(server.root, "afile").read_bytes() == b"I am a file\n"
    assert snapshot(server.root) == before
    assert temp_files(server.root) == []
    assert_serving(server, tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory_is_destination_error(server: LiveServer, tmp_path: Path, src: str) -> None:
    locked = os.path.join(server.root, "locked")
    os.makedirs(locked)
    os.chmod(locked, 0o555)
    try:
        with pytest.raises(DestinationError, match="locked"):
            tb5sync.sync(src, server.url("locked/"))
        assert os.listdir(locked) == []
    finally:
        os.chmod(locked, 0o755)
    assert temp_files(server.root) == []
    assert_serving(server, tmp_path)


# ---- interrupted transfer and resume ------------------------------------------------------

_KILLABLE_PUSH = """
import sys, time
import tb5sync
from tb5sync.roles.sender import Sender

orig = Sender.read_ranges
calls = [0]

def read_ranges(self, *args, **kw):
    calls[0] += 1
    if calls[0] > 1:  # the first batch goes out; the rest waits for the kill
        time.sleep(60)
    return orig(self, *args, **kw)

Sender.read_ranges = read_ranges
tb5sync.sync(sys.argv[1], sys.argv[2], streams=1, compress="none")
"""


def test_killed_sender_leaves_nothing_and_rerun_resumes(server: LiveServer, tmp_path: Path) -> None:
    big = write(tmp_path / "big" / "model.bin", os.urandom(64 * 1024 * 1024))
    partial = Path(server.root, ".tb5sync", "partial")
    final = Path(server.root, "dst", "model.bin")
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLABLE_PUSH, big, server.url("dst/")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 20
        size = 0
        while time.monotonic() < deadline and proc.poll() is None:
            sizes = [p.stat().st_size for p in partial.glob("*")] if partial.is_dir() else []
            if sizes and max(sizes) > 0:
                if max(sizes) == size:  # the first batch is written and nothing more moves
                    break
                size = max(sizes)
            time.sleep(0.05)
        assert proc.poll() is None, f"the push ended before it could be killed: {proc.stderr.read()!r}"  # type: ignore[union-attr]
        assert size > 0, "no partial data appeared"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert proc.stderr is not None
        proc.stderr.close()
    assert not final.exists(), "a half-written file is at the final path"
    assert temp_files(server.root) == []
    stats = tb5sync.sync(big, server.url("dst/"), streams=1)
    assert stats.chunks_reused > 0, stats
    assert stats.files_transferred == 1
    assert sha(str(final)) == sha(big)
    assert final.stat().st_size == 64 * 1024 * 1024
    assert not any(partial.glob("*")), "the partial file was not moved into place"


# ---- source changing during the transfer ---------------------------------------------------


@pytest.fixture(params=["local", "push", "pull"])
def route(request: pytest.FixtureRequest, server: LiveServer, tmp_path: Path) -> tuple[str, str, str, str]:
    """``(source dir, sync src, sync dst, final dir)`` for each route; the source holds ``f.bin`` and ``keep.txt``."""
    if request.param == "pull":
        base = os.path.join(server.root, "srcdir")
        return base, server.url("srcdir/"), str(tmp_path / "out"), str(tmp_path / "out")
    base = str(tmp_path / "srcdir")
    if request.param == "push":
        return base, base + "/", server.url("out"), os.path.join(server.root, "out")
    return base, base + "/", str(tmp_path / "out"), str(tmp_path / "out")


def _source_to_disturb(base: str, size: int) -> tuple[str, str, Any]:
    """Write ``f.bin`` (``size`` random bytes) and ``keep.txt`` under ``base``; return the file's path,
    the Sender method that will read it (large files: ranges, small: whole files) and that method."""
    path = write(os.path.join(base, "f.bin"), os.urandom(size))
    write(os.path.join(base, "keep.txt"), b"keep\n")
    method = "read_ranges" if size >= 4 * 1024 * 1024 else "read_files"
    return path, method, getattr(Sender, method)


@pytest.mark.parametrize("size", [100_000, 5 * 1024 * 1024], ids=["small", "large"])
def test_source_grows_during_transfer(
    route: tuple[str, str, str, str], monkeypatch: pytest.MonkeyPatch, size: int, server: LiveServer, tmp_path: Path
) -> None:
    base, s, d, final_dir = route
    path, method, orig = _source_to_disturb(base, size)
    original = Path(path).read_bytes()
    calls = []

    def changing(self: Sender, *args: Any, **kw: Any) -> Any:
        if not calls:
            with open(path, "ab") as f:
                f.write(b"appended while the transfer ran\n")
            st = os.stat(path)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        calls.append(1)
        return orig(self, *args, **kw)

    monkeypatch.setattr(Sender, method, changing)
    final_content = original + b"appended while the transfer ran\n"
    out = os.path.join(final_dir, "f.bin")
    try:
        tb5sync.sync(s, d)
    except SourceChangedError as exc:
        assert "f.bin" in str(exc)
        if os.path.exists(out):
            assert Path(out).read_bytes() in (original, final_content)
    else:
        assert Path(out).read_bytes() == final_content
        assert os.stat(out).st_mtime_ns == os.stat(path).st_mtime_ns
    assert calls, f"{method} was never called"
    assert Path(final_dir, "keep.txt").read_bytes() == b"keep\n"
    assert temp_files(final_dir) == []
    monkeypatch.undo()
    assert_serving(server, tmp_path)


@pytest.mark.parametrize("size", [100_000, 5 * 1024 * 1024], ids=["small", "large"])
def test_source_vanishes_during_transfer(
    route: tuple[str, str, str, str], monkeypatch: pytest.MonkeyPatch, size: int, server: LiveServer, tmp_path: Path
) -> None:
    base, s, d, final_dir = route
    path, method, orig = _source_to_disturb(base, size)

    def vanishing(self: Sender, *args: Any, **kw: Any) -> Any:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return orig(self, *args, **kw)

    monkeypatch.setattr(Sender, method, vanishing)
    with pytest.raises(SourceChangedError, match="f.bin"):
        tb5sync.sync(s, d)
    assert not os.path.lexists(os.path.join(final_dir, "f.bin"))
    assert Path(final_dir, "keep.txt").read_bytes() == b"keep\n"  # everything else was synced
    assert temp_files(final_dir) == []
    monkeypatch.undo()
    assert_serving(server, tmp_path)


def test_missing_source_on_server_is_not_found(server: LiveServer, tmp_path: Path) -> None:
    with pytest.raises(RemoteNotFoundError, match="nope"):
        tb5sync.sync(server.url("nope"), str(tmp_path / "pulled"))
    assert not os.path.lexists(tmp_path / "pulled")
    assert_serving(server, tmp_path)


# ---- the command line ----------------------------------------------------------------------


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "TB5SYNC_TOKEN"}
    full_env["PYTHONPATH"] = REPO
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "tb5sync.cli", *args], check=False, env=full_env, capture_output=True, text=True, timeout=60
    )


def one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("tb5sync: error: "), stderr
    return lines[0]


def test_cli_wrong_token(token_server: LiveServer, src: str, tmp_path: Path) -> None:
    r = run_cli("sync", src + "/", token_server.url("dst"), env={"TB5SYNC_TOKEN": "wrong"})
    assert r.returncode != 0
    assert "wrong token" in one_error_line(r.stderr)
    token_file = tmp_path / "token"
    token_file.write_text("also-wrong\n")
    r = run_cli("sync", src + "/", token_server.url("dst"), "--token-file", str(token_file))
    assert r.returncode != 0
    assert "wrong token" in one_error_line(r.stderr)
    assert not os.path.lexists(os.path.join(token_server.root, "dst"))
    token_file.write_text("s3cret-token\n")
    r = run_cli("sync", src + "/", token_server.url("dst"), "--token-file", str(token_file))
    assert r.returncode == 0, r.stderr
    assert snapshot(os.path.join(token_server.root, "dst")) == snapshot(src)


def test_cli_wrong_token_exit_code_is_auth(token_server: LiveServer, src: str) -> None:
    r = run_cli("sync", src + "/", token_server.url("dst"), env={"TB5SYNC_TOKEN": "wrong"})
    assert r.returncode == AuthError.exit_code, r.stderr


@pytest.mark.parametrize(
    ("url", "code"),
    [("tb5://127.0.0.1:{free}/x", ConnectError.exit_code), ("tb5://127.0.0.1:{port}/../x", PathError.exit_code)],
    ids=["connect", "path"],
)
def test_cli_exit_codes(server: LiveServer, tmp_path: Path, url: str, code: int) -> None:
    r = run_cli("sync", url.format(free=free_port(), port=server.port), str(tmp_path / "pulled"))
    assert r.returncode == code, r.stderr
    one_error_line(r.stderr)
    assert not os.path.lexists(tmp_path / "pulled")


def test_cli_ls_lists_names(server: LiveServer, src: str) -> None:
    tb5sync.sync(src + "/", server.url("listed"))
    os.symlink("a.txt", os.path.join(server.root, "listed", "alink"))
    r = run_cli("ls", server.url("listed"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    names = sorted(ln.split()[-1] if "->" not in ln else ln.split()[-3] for ln in lines)
    assert names == ["a.txt", "alink", "sub"]
    assert any(ln.startswith("l") and ln.endswith("alink -> a.txt") for ln in lines)
    assert any(ln.startswith("d") and ln.endswith(" sub") for ln in lines)
    assert ".tb5sync" not in r.stdout


def test_cli_json_stats(server: LiveServer, src: str) -> None:
    r = run_cli("sync", "--json", src + "/", server.url("json"))
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stdout
    stats = json.loads(lines[0])
    fields = {
        "files_total", "bytes_total", "files_transferred", "bytes_transferred", "wire_bytes",
        "chunks_sent", "chunks_reused", "files_deleted", "seconds",
    }
    assert fields <= set(stats)
    assert all(isinstance(stats[k], int) for k in fields - {"seconds"})
    assert isinstance(stats["seconds"], float)
    assert stats["files_total"] == stats["files_transferred"] == 3
    assert stats["wire_bytes"] > 0
    assert snapshot(os.path.join(server.root, "json")) == snapshot(src)


def test_cli_output_is_complete_before_the_quick_exit(src: str, tmp_path: Path) -> None:
    """The console script ends with os._exit: what was printed must still arrive, into a file or a pipe."""
    out = tmp_path / "stats.txt"
    with open(out, "w") as f:
        r = subprocess.run(
            [sys.executable, "-m", "tb5sync.cli", "sync", "--stats", src + "/", str(tmp_path / "copy")],
            check=False, env={**os.environ, "PYTHONPATH": REPO}, stdout=f, stderr=subprocess.PIPE, text=True, timeout=60,
        )
    assert r.returncode == 0, r.stderr
    lines = out.read_text().splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["files", "bytes", "wire", "time"]
    # a reader that goes away early: the exit status says so, without a traceback
    with subprocess.Popen(
        [sys.executable, "-m", "tb5sync.cli", "sync", "--stats", src + "/", str(tmp_path / "copy2")],
        env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        err = proc.stderr.read()
        assert proc.wait(timeout=60) == 141, err
    assert b"Traceback" not in err


@pytest.mark.parametrize("typo", ["tb5:/127.0.0.1/x", "tb5:127.0.0.1/x", "TB5:/h/x"])
def test_mistyped_url_is_refused_not_made_a_local_path(tmp_path: Path, src: str, typo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match="mistyped URL"):
        tb5sync.sync(src + "/", typo)
    assert not any(p.lower().startswith("tb5:") for p in os.listdir(tmp_path))
    assert parse_url("./tb5:/x") is None  # the way to name such a local path


@pytest.mark.parametrize("spec", ["host:/tmp/x", "host:x", "user@host:x", "host::module/x"])
@pytest.mark.parametrize("side", ["dst", "src"])
def test_rsync_remote_shell_form_is_refused_not_made_a_local_path(tmp_path: Path, src: str, spec: str, side: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """rsync takes ``HOST:PATH`` (a colon before any slash) for a remote shell; tb5sync, which speaks
    only tb5://, says so in one line instead of creating a local directory named ``host:``."""
    monkeypatch.chdir(tmp_path)
    args = (src + "/", spec) if side == "dst" else (spec, str(tmp_path / "d"))
    with pytest.raises(UsageError, match=r"rsync's HOST:PATH .* write tb5://"):
        tb5sync.sync(*args)
    assert not [p for p in os.listdir(tmp_path) if ":" in p] and not os.path.exists(tmp_path / "d")
    assert parse_url("./host:x") is None and parse_url("a/b:c") is None  # local names with a colon
    tb5sync.sync(src + "/", "./host:x")
    assert os.path.isdir(tmp_path / "host:x")


def test_errors_do_not_reveal_the_server_root(server: LiveServer, src: str, tmp_path: Path) -> None:
    """Messages name paths relative to the served tree, never where it lives on the server."""
    with pytest.raises(RemoteNotFoundError) as info:
        ls_url(server.url("nope"))
    assert server.root not in str(info.value) and "nope" in str(info.value)
    os.makedirs(os.path.join(server.root, "dst"))
    with open(os.path.join(server.root, "dst", "new.txt"), "w") as f:
        f.write("a file where a directory is wanted")
    with pytest.raises(Tb5syncError) as info2:
        tb5sync.sync(os.path.join(src, "a.txt"), server.url("dst/new.txt/"))
    assert server.root not in str(info2.value) and "new.txt" in str(info2.value)


def test_cli_version_and_thread_options_after_the_command() -> None:
    from tb5sync.cli.command import build_parser

    r = run_cli("--version")
    from tb5sync import _cdc

    lines = r.stdout.splitlines()
    assert r.returncode == 0 and lines[0] == f"tb5sync {tb5sync.__version__}" and len(lines) == 2
    # the kernel the child process chose on first use (measured there, so not necessarily this process's)
    assert lines[1] in [f"Cython chunker (lane kernel {k})" for k in _cdc.lane_kernels() if k != "one"]
    p = build_parser()
    a = p.parse_args(["sync", "--chunk-threads", "2", "--hash-threads", "3", "a", "b"])
    assert (a.chunk_threads, a.hash_threads) == (2, 3)
    a = p.parse_args(["--chunk-threads", "4", "sync", "a", "b"])
    assert (a.chunk_threads, a.hash_threads) == (4, 0)
    a = p.parse_args(["--hash-threads", "5", "serve", "--hash-threads", "1", "root"])
    assert a.hash_threads == 1  # after the command wins


# ---- FIFOs and devices in the served tree ----------------------------------------------------


def _answers_within(fn: Callable[[], Any], seconds: float = 1.0) -> tuple[bool, Any]:
    """Run ``fn`` in a thread; ``(finished in time, its result or exception)``."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return (not t.is_alive()), (out[0] if out else None)


def _release_fifo(fifo: str) -> None:
    """Open ``fifo`` for both ends once, so that a thread blocked opening it is let go."""
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))


@pytest.mark.parametrize(
    "method,args",
    [
        ("chunk_list", {"path": "fifo"}),
        ("read_files", {"paths": ["fifo"]}),
        ("read_ranges", {"path": "fifo", "ranges": [[0, 1]], "size": 1, "mtime_ns": 0}),
        ("file_digests", {"paths": ["fifo"]}),
    ],
)
def test_pull_requests_for_a_fifo_answer_at_once(tmp_path: Path, method: str, args: dict[str, Any]) -> None:
    """A FIFO without a writer in ROOT: each request answers within a second (not a thread blocked
    in open() forever), with an error or the request's "not there" answer, even on --read-only."""
    from tb5sync.wire.rpc import call_direct

    root = tmp_path / "ro"
    (root / "d").mkdir(parents=True)
    fifo = str(root / "d" / "fifo")
    os.mkfifo(fifo)
    live = start_server(str(root), read_only=True)
    try:
        ch = connect("127.0.0.1", live.port, None)
        try:
            open_session(ch, {"op": "pull", "path": "d", "options": {}, "streams": 1})
            done, got = _answers_within(lambda: call_direct(ch, method, args))
        finally:
            _release_fifo(fifo)
            ch.close()
        assert done, f"{method} of a FIFO blocked the session's thread"
        if method in ("chunk_list", "read_ranges"):
            assert isinstance(got, UsageError) and "not a regular file" in str(got), repr(got)
        else:  # these answer None for a file they cannot read
            assert not isinstance(got, Exception), repr(got)
            body = got[0] if isinstance(got, tuple) else got
            assert list(body.values())[0] == [None], got
        serving_ok, _ = _answers_within(lambda: remote_ls(parse_url(live.url("")), token=None), 5)
        assert serving_ok
    finally:
        live.server.stop()


def test_sync_cli_pulling_a_tree_with_a_fifo_finishes(server: LiveServer, tmp_path: Path) -> None:
    src = os.path.join(server.root, "t")
    os.makedirs(src)
    write(os.path.join(src, "f"), b"data")
    os.mkfifo(os.path.join(src, "fifo"))
    dst = str(tmp_path / "dst")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    env.pop("TB5SYNC_TOKEN", None)
    try:
        r = subprocess.run([sys.executable, "-m", "tb5sync.cli", "sync", server.url("t/"), dst],
                           capture_output=True, text=True, env=env, timeout=30)
    finally:
        _release_fifo(os.path.join(src, "fifo"))
    assert r.returncode in (0, 23, 24), r.stderr  # rsync's partial-transfer codes are allowed
    assert Path(dst, "f").read_bytes() == b"data"
