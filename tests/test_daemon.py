"""Nothing a peer does kills the server: caps, timeouts, keepalive, failed authentications.

Each test drives a live server on 127.0.0.1 port 0 (in process, or `tb5sync serve` as its own
process where the process's limits or memory are what is measured) and checks the expected
behaviour from the outside: the error the peer reads, how long it took, what the server still
holds afterwards, and that it keeps serving.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import joined, start_server, wait_for

import tb5sync.wire.protocol as P
import tb5sync.wire.transport as transport
from tb5sync.remote.client import ls, parse_url
from tb5sync.errors import AuthError, BusyError, LinkTimeoutError, RemoteProtocolError, UsageError
from tb5sync.wire.protocol import FrameType
from tb5sync.wire.rpc import open_session
from tb5sync.daemon.admission import AuthLimiter, peer_key
from tb5sync.daemon.server import Server
from tb5sync.wire.transport import Channel, connect, set_keepalive

TOKEN = b"daemon-token"
REPO = str(Path(__file__).resolve().parent.parent)


def hello() -> bytes:
    return P.encode_control(FrameType.HELLO, 0, {"nonce": os.urandom(32)})


def read_all_frames(sock: socket.socket, timeout: float = 5.0) -> tuple[list[P.Frame], float]:
    """Every frame until the server closes; also the seconds until the close."""
    t0 = time.monotonic()
    sock.settimeout(timeout)
    reader = P.FrameReader()
    frames: list[P.Frame] = []
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            data = b""
        reader.receive_data(data)
        while True:
            ev = reader.next_event()
            if ev is P.NEED_DATA:
                break
            assert isinstance(ev, P.Frame)
            frames.append(ev)
        if not data:
            return frames, time.monotonic() - t0


def error_body(frames: list[P.Frame]) -> dict[str, Any]:
    assert frames, "the server closed without an ERROR frame"
    assert frames[-1].header.type is FrameType.ERROR, [f.header.type for f in frames]
    return P.decode_control(frames[-1].payload)


def serving(live: Any, token: bytes | None = None) -> None:
    """The server still answers a real client."""
    r = parse_url(live.url(""))
    assert r is not None
    entries = ls(r, token=token)
    assert entries and entries[0].kind == "d"


# ---- frames before authentication ------------------------------------------------------------


@pytest.mark.parametrize("ftype", [FrameType.HELLO, FrameType.DATA, FrameType.REQUEST])
def test_unauthenticated_peer_cannot_announce_a_big_frame(tmp_path: Path, ftype: FrameType) -> None:
    """Before authentication a header announcing more than MAX_HANDSHAKE bytes is refused at once
    (nothing allocated, no 30 s wait for the payload): the issue's 26-byte memory pin."""
    live = start_server(str(tmp_path / "root"), token=TOKEN)
    try:
        with socket.create_connection(("127.0.0.1", live.port), timeout=5) as s:
            s.sendall(P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, int(ftype), 0, 0, 64 * 1024 * 1024 - 16) + b"xx")
            frames, secs = read_all_frames(s)
        body = error_body(frames)
        assert body["kind"] == "RemoteProtocolError"
        assert f"exceeds limit {P.MAX_HANDSHAKE}" in body["message"]
        assert secs < 2
        serving(live, TOKEN)
    finally:
        live.server.stop()


def test_a_handshake_frame_at_the_limit_is_read(tmp_path: Path) -> None:
    """The cap refuses only what is over it: a HELLO padded to exactly MAX_HANDSHAKE is parsed."""
    import msgpack

    live = start_server(str(tmp_path / "root"), token=TOKEN)
    try:
        body = {"nonce": os.urandom(32), "pad": b""}
        over = len(msgpack.packb(body, use_bin_type=True))
        body["pad"] = b"p" * (P.MAX_HANDSHAKE - over - 1)  # bin8 grows by a byte of length
        payload = msgpack.packb(body, use_bin_type=True)
        assert len(payload) == P.MAX_HANDSHAKE
        with socket.create_connection(("127.0.0.1", live.port), timeout=5) as s:
            s.sendall(P.encode_frame(FrameType.HELLO, 0, len(payload)) + payload)
            ch = Channel(s)
            got = ch.recv_frame()
            assert got is not None and got[0].type is FrameType.CHALLENGE
    finally:
        live.server.stop()


def _status_kib(pid: int, field: str) -> int:
    """The ``field`` line (``VmRSS``, ``VmHWM``) of ``/proc/PID/status``, KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field}")


def rss_kib(pid: int) -> int:
    """Resident set size of process ``pid``, KiB."""
    return _status_kib(pid, "VmRSS")


def start_serve_process(root: str, *args: str, preexec: Any = None) -> tuple[subprocess.Popen[str], int]:
    """`tb5sync serve ROOT --bind 127.0.0.1:0 ARGS` as its own process; returns it and its port."""
    os.makedirs(root, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "TB5SYNC_TOKEN"}
    env["PYTHONPATH"] = REPO
    proc = subprocess.Popen(
        [sys.executable, "-m", "tb5sync.cli", "-v", "serve", root, "--bind", "127.0.0.1:0", *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=preexec,
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()
    assert "serving" in line, line
    return proc, int(line.rsplit(":", 1)[1].split()[0])


def stop_serve_process(proc: subprocess.Popen[str]) -> tuple[int, str]:
    """SIGTERM a :func:`start_serve_process` server; returns its exit code and the rest of its stderr."""
    proc.terminate()
    code = proc.wait(10)
    assert proc.stderr is not None
    err = proc.stderr.read()
    proc.stderr.close()
    return code, err


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the server's RSS from /proc")
def test_forty_announced_payloads_pin_no_memory(tmp_path: Path) -> None:
    """The issue's case: 40 connections announcing 64 MiB each used to cost 2.6 GiB of RSS."""
    proc, port = start_serve_process(str(tmp_path / "root"), "--token-file", str(_token_file(tmp_path)))
    socks = []
    try:
        before = rss_kib(proc.pid)
        for _ in range(40):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, int(FrameType.DATA), 0, 0, P.MAX_PAYLOAD))
            socks.append(s)
        time.sleep(0.5)
        grown = rss_kib(proc.pid) - before
        assert grown < 32 * 1024, f"RSS grew by {grown} KiB for 40 announced payloads"
    finally:
        for s in socks:
            s.close()
        code, err = stop_serve_process(proc)
    assert code == 0, err


def _token_file(tmp_path: Path) -> Path:
    p = tmp_path / "token"
    p.write_bytes(TOKEN)
    return p


# ---- caps ------------------------------------------------------------------------------------


def test_connection_cap_refuses_with_busy_and_recovers(tmp_path: Path) -> None:
    live = start_server(str(tmp_path / "root"), max_connections=3, handshake_timeout=30)
    idle = [socket.create_connection(("127.0.0.1", live.port), timeout=5) for _ in range(3)]
    try:
        wait_for(lambda: live.server.connections == 3, 5, "three connections counted")
        for _ in range(5):  # every refused client reads the reason, never a reset
            with pytest.raises(BusyError, match="busy: 3 connections"):
                connect("127.0.0.1", live.port, None)
        assert live.server.threads <= 3
    finally:
        for s in idle:
            s.close()
    wait_for(lambda: live.server.connections == 0, 5, "idle connections released")
    serving(live)
    live.server.stop()


def test_one_address_cannot_take_every_connection_slot(tmp_path: Path) -> None:
    """40 idle connections from 127.0.0.2 (never authenticating) against max_connections=20: at
    most 16 are held (max_unauthenticated_per_address), the rest refused as busy, and a token
    holder from 127.0.0.1 is still served."""
    probe = socket.socket()
    try:
        probe.bind(("127.0.0.2", 0))
    except OSError:
        pytest.skip("127.0.0.2 is not a local address here (macOS without an alias)")
    finally:
        probe.close()
    live = start_server(str(tmp_path / "root"), token=TOKEN, max_connections=20, handshake_timeout=30)
    idle: list[socket.socket] = []
    try:
        for _ in range(40):
            s = socket.socket()
            idle.append(s)
            s.bind(("127.0.0.2", 0))
            s.connect(("127.0.0.1", live.port))
        assert live.server.max_unauthenticated_per_address == 16
        wait_for(lambda: live.server.connections == 16, 5, "16 pending connections held")
        body = error_body(read_all_frames(idle[-1])[0])
        assert body["kind"] == "BusyError" and "not authenticated yet" in body["message"], body
        serving(live, TOKEN)  # ls with the token succeeds
        wait_for(lambda: live.server.connections == 16, 5, "the ls connection released")
    finally:
        for s in idle:
            s.close()
        live.server.stop()


def test_authenticated_connections_do_not_count_as_pending(tmp_path: Path) -> None:
    live = start_server(str(tmp_path / "root"), token=TOKEN, max_unauthenticated_per_address=2)
    chans = []
    try:
        for _ in range(4):  # authenticated ones leave the pending count at once
            chans.append(connect("127.0.0.1", live.port, TOKEN))
        wait_for(lambda: live.server._pending == {}, 5, "no connection pending")
        serving(live, TOKEN)
    finally:
        for ch in chans:
            ch.close()
        live.server.stop()
    with pytest.raises(UsageError, match="max_unauthenticated_per_address"):
        Server(str(tmp_path / "root"), port=0, max_unauthenticated_per_address=0)


def test_handshake_timeouts_are_logged_rate_limited(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    live = start_server(str(tmp_path / "root"), token=TOKEN, handshake_timeout=0.3)
    try:
        with caplog.at_level(logging.WARNING, logger="tb5sync.daemon.server"):
            idle = [socket.create_connection(("127.0.0.1", live.port), timeout=5) for _ in range(3)]
            for s in idle:
                read_all_frames(s)  # closed by the server at the deadline
                s.close()
            wait_for(lambda: live.server.threads == 0, 5, "the connection threads ended")
        lines = [r for r in caplog.records if "handshake not done within" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in lines]
        assert "127.0.0.1" in lines[0].getMessage()
        serving(live, TOKEN)
    finally:
        live.server.stop()


def test_thread_start_failure_refuses_and_keeps_serving(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At the process's thread limit Thread.start() raises: the connection is refused, the server lives."""
    live = start_server(str(tmp_path / "root"))
    try:
        real_start = threading.Thread.start

        def start(self: threading.Thread) -> None:
            if self.name.startswith("tb5-conn-"):
                raise RuntimeError("can't start new thread")
            real_start(self)

        monkeypatch.setattr(threading.Thread, "start", start)
        with pytest.raises(BusyError, match="cannot start a thread"):
            connect("127.0.0.1", live.port, None)
        monkeypatch.undo()
        assert live.server.connections == 0
        serving(live)
    finally:
        live.server.stop()


def test_session_cap_refuses_with_busy_but_joins_do_not_count(tmp_path: Path) -> None:
    from tb5sync.api.sync import sync

    live = start_server(str(tmp_path / "root"), max_sessions=1)
    try:
        src = tmp_path / "src"
        (src / "d").mkdir(parents=True)
        (src / "d" / "f").write_bytes(os.urandom(10_000))
        first = connect("127.0.0.1", live.port, None)
        try:
            open_session(first, {"op": "fs"})
            second = connect("127.0.0.1", live.port, None)
            with pytest.raises(BusyError, match="1 sessions open"):
                open_session(second, {"op": "fs"})
            second.close()
        finally:
            first.close()
        wait_for(lambda: live.server.threads == 0, 5, "the fs session ended")
        stats = sync(str(src) + "/", live.url("dst/"), streams=4)  # one session, four streams
        assert stats.files_transferred == 1
    finally:
        live.server.stop()


class _EmfileSocket:
    """A listening socket whose accept() always fails with EMFILE (counted)."""

    def __init__(self) -> None:
        self.calls = 0

    def accept(self) -> Any:
        self.calls += 1
        raise OSError(errno.EMFILE, "Too many open files")

    def shutdown(self, how: int) -> None:
        pass

    def close(self) -> None:
        pass


def test_accept_backs_off_on_emfile(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """accept() failing with EMFILE is retried after 50 ms doubling to 1 s, not in a busy loop."""
    srv = Server(str(tmp_path), port=0)
    fake = _EmfileSocket()
    srv._sock = fake  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, logger="tb5sync.daemon.server"):
        t = threading.Thread(target=srv.serve_forever, daemon=True)
        t.start()
        time.sleep(1.6)
        srv.stop()
        joined(t, 5)
    # 50+100+200+400+800 ms = 1.55 s: about 6 calls, where a spin makes millions
    assert 3 <= fake.calls <= 8, fake.calls
    assert "backing off" in caplog.text and "Too many open files" in caplog.text


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads the server's CPU time from /proc")
def test_out_of_descriptors_server_does_not_spin_and_recovers(tmp_path: Path) -> None:
    """`tb5sync serve` with 64 descriptors: idle connections past the limit do not make it spin
    (macOS's default is 256), and once they are gone a real client is served."""

    def cpu_seconds(pid: int) -> float:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    proc, port = start_serve_process(str(tmp_path / "root"), "--max-connections", "1000", "--handshake-timeout", "3",
                                     preexec=limit)
    socks = []
    try:
        for _ in range(90):  # past the limit: the rest wait in the backlog
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.5)
        c0 = cpu_seconds(proc.pid)
        time.sleep(2.0)
        used = cpu_seconds(proc.pid) - c0
        assert used < 0.5, f"the server used {used:.2f} s of CPU in 2 s while out of descriptors"
        for s in socks:
            s.close()
        socks = []
        r = parse_url(f"tb5://127.0.0.1:{port}/")
        assert r is not None
        t0 = time.monotonic()
        while True:  # the freed descriptors are taken back within the 1 s backoff
            try:
                assert ls(r, timeout=5)[0].kind == "d"
                break
            except (BusyError, OSError):
                assert time.monotonic() - t0 < 15
                time.sleep(0.2)
    finally:
        for s in socks:
            s.close()
        code, err = stop_serve_process(proc)
    assert code == 0, err
    assert "backing off" in err and "Traceback" not in err


# ---- timeouts --------------------------------------------------------------------------------


def test_handshake_deadline_is_not_stretched_byte_by_byte(tmp_path: Path) -> None:
    live = start_server(str(tmp_path / "root"), handshake_timeout=1.0)
    try:
        with socket.create_connection(("127.0.0.1", live.port), timeout=5) as s:
            data = hello()
            t0 = time.monotonic()
            closed_after = None
            for b in data:  # one byte every 0.2 s: each read makes progress, the whole does not
                try:
                    s.sendall(bytes([b]))
                except OSError:
                    closed_after = time.monotonic() - t0
                    break
                s.settimeout(0.2)
                try:
                    if s.recv(1) == b"":
                        closed_after = time.monotonic() - t0
                        break
                except TimeoutError:
                    pass
        assert closed_after is not None and closed_after < 2.5, closed_after
        wait_for(lambda: live.server.connections == 0 and live.server.threads == 0, 3, "released")
    finally:
        live.server.stop()


def test_request_stalled_mid_frame_ends_the_session(tmp_path: Path) -> None:
    """A peer that starts a frame and stops is dropped after io_timeout (the issue: 75 s and more)."""
    live = start_server(str(tmp_path / "root"), io_timeout=1.0)
    try:
        ch = connect("127.0.0.1", live.port, None)
        open_session(ch, {"op": "fs"})
        frame = P.encode_control(FrameType.REQUEST, 1, {"m": "info", "a": {"path": ""}})
        ch.sock.sendall(frame[:20])  # the header and 4 of its payload bytes
        frames, secs = read_all_frames(ch.sock, timeout=10)
        body = error_body(frames)
        assert body["kind"] == "LinkTimeoutError" and "no progress for 1 s" in body["message"]
        assert 0.8 < secs < 3, secs
        ch.close()
        wait_for(lambda: live.server.connections == 0 and live.server.threads == 0, 3, "released")
        serving(live)
    finally:
        live.server.stop()


def test_idle_session_is_ended_after_idle_timeout(tmp_path: Path) -> None:
    live = start_server(str(tmp_path / "root"), idle_timeout=1.0)
    try:
        ch = connect("127.0.0.1", live.port, None)
        open_session(ch, {"op": "fs"})
        frames, secs = read_all_frames(ch.sock, timeout=10)
        body = error_body(frames)
        assert body["kind"] == "LinkTimeoutError" and "idle" in body["message"]
        assert 0.8 < secs < 3, secs
        ch.close()
        wait_for(lambda: live.server.threads == 0, 3, "released")
    finally:
        live.server.stop()


def test_fs_client_reconnects_after_the_server_closed_an_idle_connection(tmp_path: Path) -> None:
    """A non-idempotent call after the server ended an idle connection is not lost: the client
    sees the close before sending and reconnects."""
    from conftest import tb5fs

    live = start_server(str(tmp_path / "root"), idle_timeout=0.5)
    try:
        fs = tb5fs(live, streams=1)
        fs.pipe_file("a.txt", b"one")
        wait_for(lambda: live.server.threads == 0, 5, "idle connections ended by the server")
        fs.pipe_file("b.txt", b"two")  # `put`: not retried after a send, so it must not be sent on a dead one
        fs.mv("b.txt", "c.txt")
        assert (Path(live.root) / "c.txt").read_bytes() == b"two"
        for _ in range(2):  # info and cat go out without a check first: sent again on a new connection
            wait_for(lambda: live.server.threads == 0, 5, "idle connections ended by the server")
            assert fs.info("c.txt")["size"] == 3
            wait_for(lambda: live.server.threads == 0, 5, "idle connections ended by the server")
            assert fs.cat_file("c.txt") == b"two"
    finally:
        live.server.stop()


def _stalling_server(send_after_open: bytes) -> tuple[socket.socket, threading.Thread, list[Any]]:
    """A peer that completes the handshake and OPEN properly, then sends ``send_after_open`` and stalls."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    held: list[Any] = []

    def run() -> None:
        conn, _ = lsock.accept()
        ch = Channel(conn, io_timeout=10)
        transport.server_handshake(ch, None)
        ch.max_payload = P.MAX_PAYLOAD
        ch.recv_frame()
        conn.sendall(send_after_open)
        held.append(conn)  # keep it open, silent

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return lsock, t, held


@pytest.mark.parametrize("stall", ["mid-frame", "before-reply"])
def test_client_gives_up_on_a_stalled_server(stall: str) -> None:
    reply = P.encode_control(FrameType.RESPONSE, 0, {"entries": []})
    lsock, t, held = _stalling_server(reply[:20] if stall == "mid-frame" else b"")
    try:
        ch = connect("127.0.0.1", lsock.getsockname()[1], None, io_timeout=1.0)
        t0 = time.monotonic()
        if stall == "mid-frame":
            with pytest.raises(LinkTimeoutError, match="no progress for 1 s"):
                open_session(ch, {"op": "ls", "path": ""})
            assert time.monotonic() - t0 < 3
        else:
            # waiting for a reply is not a stall (the server may be computing): keepalive decides
            ch.set_io_timeout(None)
            ch.idle_timeout = 1.0
            with pytest.raises(LinkTimeoutError, match="idle timeout"):
                open_session(ch, {"op": "ls", "path": ""})
        ch.close()
        joined(t, 5)
    finally:
        for c in held:
            c.close()
        lsock.close()


# ---- keepalive -------------------------------------------------------------------------------


def test_client_connections_have_keepalive_and_user_timeout(server: Any) -> None:
    ch = transport.dial("127.0.0.1", server.port, None, io_timeout=20.0)
    try:
        s = ch.sock
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        if hasattr(socket, "TCP_KEEPIDLE"):
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 5  # a quarter of 20 s
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 20_000
        if ch.kernel_timeouts:  # the progress timeout as the kernel's, on a blocking socket
            assert s.gettimeout() is None
            for opt in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
                sec, usec = struct.unpack("@ll", s.getsockopt(socket.SOL_SOCKET, opt, struct.calcsize("@ll")))
                assert sec + usec / 1e6 == 20.0
        else:
            assert s.gettimeout() == 20.0
    finally:
        ch.close()


def test_keepalive_portable_path_without_linux_option_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where TCP_KEEPIDLE and TCP_USER_TIMEOUT do not exist (macOS, BSD) only what exists is set."""
    for name in ("TCP_KEEPIDLE", "TCP_USER_TIMEOUT", "TCP_KEEPALIVE"):
        monkeypatch.delattr(socket, name, raising=False)
    with socket.socket() as s:
        done = set_keepalive(s, 10, 30)
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    assert "SO_KEEPALIVE" in done and "TCP_KEEPIDLE" not in done and "TCP_USER_TIMEOUT" not in done
    monkeypatch.setattr(socket, "TCP_KEEPALIVE", getattr(socket, "TCP_KEEPINTVL", 5), raising=False)  # macOS's name
    with socket.socket() as s:
        assert "TCP_KEEPALIVE" in set_keepalive(s, 10, 30)


def test_wait_fd_portable_path_without_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = socket.socketpair()
    with a, b:
        monkeypatch.delattr(transport.select, "poll")
        assert transport._wait_fd(a.fileno(), False, 0.05) is False
        b.sendall(b"x")
        assert transport._wait_fd(a.fileno(), False, 1.0) is True


# ---- failed authentications ------------------------------------------------------------------


def test_failed_authentications_are_logged_and_rate_limited(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    live = start_server(str(tmp_path / "root"), token=TOKEN, auth_limit=3, auth_window=4.0)
    try:
        kinds = []
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="tb5sync.daemon.server"):
            for _ in range(30):
                with pytest.raises(AuthError) as ei:
                    connect("127.0.0.1", live.port, b"wrong")
                kinds.append("wrong" if "wrong token" in str(ei.value) else "limited" if "too many" in str(ei.value) else str(ei.value))
            # while the window holds three failures even the right token is refused
            with pytest.raises(AuthError, match="too many failed authentications"):
                connect("127.0.0.1", live.port, TOKEN)
        assert time.monotonic() - t0 < 4.0, "the loop outlasted the window: the count below means nothing"
        assert kinds == ["wrong"] * 3 + ["limited"] * 27
        failed = [r for r in caplog.records if "authentication failed from 127.0.0.1" in r.getMessage()]
        assert len(failed) == 3
        assert all(r.levelno == logging.WARNING for r in failed)
        refusals = [r for r in caplog.records if "too many failed authentications" in r.getMessage()]
        assert len(refusals) == 1, "28 refusals must not flood the log"
        assert "b'wrong'" not in caplog.text and "daemon-token" not in caplog.text
        wait_for(lambda: live.server._auth.blocked_for("127.0.0.1") == 0, 5, "the window passed")
        serving(live, TOKEN)
    finally:
        live.server.stop()


def read_one_frame(sock: socket.socket, timeout: float = 5.0) -> P.Frame:
    sock.settimeout(timeout)
    reader = P.FrameReader()
    while True:
        ev = reader.next_event()
        if ev is not P.NEED_DATA:
            assert isinstance(ev, P.Frame)
            return ev
        data = sock.recv(65536)
        assert data, "the server closed before answering"
        reader.receive_data(data)


def test_parallel_handshakes_cannot_bypass_the_auth_limit(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """40 connections from one address all pass the accept-time check (none has failed yet),
    then all send a wrong AUTH at once: the limiter is consulted again before each MAC check."""
    checked = []
    real_mac = P.client_mac
    monkeypatch.setattr(P, "client_mac", lambda *a: checked.append(1) or real_mac(*a))
    live = start_server(str(tmp_path / "root"), token=TOKEN, auth_limit=5, auth_window=30.0,
                        max_unauthenticated_per_address=64)
    socks: list[socket.socket] = []
    try:
        with caplog.at_level(logging.WARNING, logger="tb5sync.daemon.server"):
            for _ in range(40):
                s = socket.create_connection(("127.0.0.1", live.port), timeout=5)
                socks.append(s)
                s.sendall(hello())
            for s in socks:
                assert read_one_frame(s).header.type is FrameType.CHALLENGE
            auth = P.encode_control(FrameType.AUTH, 0, {"mac": os.urandom(32)})
            for s in socks:
                s.sendall(auth)
            messages = [error_body(read_all_frames(s)[0])["message"] for s in socks]
        wrong = [m for m in messages if "wrong token" in m]
        limited = [m for m in messages if "too many failed authentications" in m]
        assert len(wrong) + len(limited) == 40, messages
        assert 1 <= len(wrong) <= 5 and len(checked) == len(wrong), (len(wrong), len(checked))
        failed = [r for r in caplog.records if "authentication failed from 127.0.0.1" in r.getMessage()]
        assert len(failed) == len(wrong)
        refusals = [r for r in caplog.records if "too many failed authentications" in r.getMessage()]
        assert len(refusals) == 1, "35 refusals must not flood the log"
        assert live.server._auth.blocked_for("127.0.0.1") > 0
    finally:
        for s in socks:
            s.close()
        live.server.stop()


def test_auth_limiter_charge_is_refunded_for_a_right_mac() -> None:
    lim = AuthLimiter(limit=2, window=60)
    assert lim.charge("10.0.0.1") == (1, 0.0)
    lim.refund("10.0.0.1")  # the MAC was right: nothing counted
    assert lim.charge("10.0.0.1") == (1, 0.0) and lim.charge("10.0.0.1") == (2, 0.0)
    n, wait = lim.charge("10.0.0.1")
    assert n == 0 and 59 < wait <= 60
    assert AuthLimiter(limit=0, window=60).charge("10.0.0.1") == (0, 0.0)


def test_auth_limiter_keys_ipv6_by_64_and_forgets_the_stalest() -> None:
    assert peer_key("2001:db8::1") == peer_key("2001:db8::ffff:1") == "2001:db8::/64"
    assert peer_key("::ffff:10.0.0.1") == "10.0.0.1"
    lim = AuthLimiter(limit=2, window=60, max_peers=3)
    for ip in ("10.0.0.1", "10.0.0.1"):
        lim.failed(ip)
    assert 59 < lim.blocked_for("10.0.0.1") <= 60
    assert lim.blocked_for("10.0.0.2") == 0
    for ip in ("10.0.0.3", "10.0.0.4", "10.0.0.5"):
        lim.failed(ip)
    assert lim.blocked_for("10.0.0.1") == 0  # forgotten: the table stays at max_peers
    assert AuthLimiter(limit=0, window=60).failed("10.0.0.1") == 0


# ---- security defaults -----------------------------------------------------------------------


def test_no_token_on_a_network_address_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="without a token.*--no-auth"):
        Server(str(tmp_path), host="0.0.0.0", port=0).bind()
    for kw in ({"no_auth": True}, {"token": TOKEN}):
        srv = Server(str(tmp_path), host="0.0.0.0", port=0, **kw)  # type: ignore[arg-type]
        srv.bind()
        srv.stop()
    srv = Server(str(tmp_path), host="localhost", port=0)  # loopback by name is fine
    srv.bind()
    srv.stop()


def test_cli_refuses_network_bind_without_token(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TB5SYNC_TOKEN"}
    env["PYTHONPATH"] = REPO
    r = subprocess.run([sys.executable, "-m", "tb5sync.cli", "serve", str(tmp_path), "--bind", "0.0.0.0:0"],
                       capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 2
    assert r.stderr.startswith("tb5sync: error: refusing to serve 0.0.0.0 without a token") and r.stderr.count("\n") == 1


@pytest.mark.parametrize("bad", [{"max_connections": 0}, {"max_sessions": -1}, {"io_timeout": 0}, {"handshake_timeout": -1.0}])
def test_bad_caps_are_usage_errors(tmp_path: Path, bad: dict[str, Any]) -> None:
    with pytest.raises(UsageError, match=next(iter(bad))):
        Server(str(tmp_path), port=0, **bad)


def test_stop_waits_for_connection_threads(tmp_path: Path) -> None:
    live = start_server(str(tmp_path / "root"))
    chans = [connect("127.0.0.1", live.port, None) for _ in range(4)]
    for ch in chans:
        open_session(ch, {"op": "fs"})
    wait_for(lambda: live.server.threads == 4, 5, "four sessions")
    live.server.stop()
    assert live.server.threads == 0 and live.server.connections == 0
    for ch in chans:
        with pytest.raises((RemoteProtocolError, OSError, AssertionError)):
            got = ch.recv_frame()
            assert got is not None
        ch.close()


def test_refused_addresses_get_no_thread_and_one_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    live = start_server(str(tmp_path / "root"), allow=["10.0.0.0/8"])
    try:
        with caplog.at_level(logging.WARNING, logger="tb5sync.daemon.server"):
            for _ in range(20):
                with pytest.raises(AuthError, match="127.0.0.1 is not allowed"):
                    connect("127.0.0.1", live.port, None)
                assert live.server.threads == 0
        assert len([r for r in caplog.records if "not in --allow" in r.getMessage()]) == 1
    finally:
        live.server.stop()


# ---- what one control frame may make the server build ------------------------------------------


def _peak_rss_while(fn: Any) -> tuple[Any, int]:
    """Run ``fn()``; return its result and this process's peak VmRSS growth meanwhile, KiB."""
    base = rss_kib(os.getpid())
    peak = [base]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_kib(os.getpid()))
            time.sleep(0.005)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        out = fn()
    finally:
        done.set()
        t.join()
    return out, peak[0] - base


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RSS from /proc")
@pytest.mark.parametrize("item", [b"\x90", b"\x80", b"\x91\xc0", b"\x81\xa1k\xc0"], ids=["arrays", "maps", "arrays1", "maps1"])
@pytest.mark.parametrize("ftype", [FrameType.OPEN, FrameType.REQUEST])
def test_frame_of_empty_containers_is_refused_with_bounded_memory(tmp_path: Path, ftype: FrameType, item: bytes) -> None:
    """attacker6's amplify.py: a frame of N bytes of one-byte arrays used to become ~90 N bytes of
    Python lists (28.6 MiB -> 2.5 GB) and an error quoting their 120 MB repr. Now the decode stops
    at its container budget: the session ends with a one-line error, the server's RSS grows by a
    small multiple of N, and it goes on serving."""
    n = 4 * 1024 * 1024 // len(item)
    body = b"\x82\xa1m\xa4info\xa1a\x81\xa4path" + b"\xdd" + struct.pack("!I", n) + item * n
    if ftype is FrameType.OPEN:
        body = b"\x81\xa2op" + b"\xdd" + struct.pack("!I", n) + item * n
    live = start_server(str(tmp_path / "root"), io_timeout=10.0)
    try:
        ch = connect("127.0.0.1", live.port, None)
        if ftype is FrameType.REQUEST:
            open_session(ch, {"op": "fs"})
        frame = P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, int(ftype), 0, 1 if ftype is FrameType.REQUEST else 0, len(body)) + body

        def attack() -> dict[str, Any]:
            ch.sock.sendall(frame)
            got = ch.recv_frame()
            assert got is not None and got[0].type is FrameType.ERROR
            return P.decode_control(got[1])

        reply, grown = _peak_rss_while(attack)
        print(f"{ftype.name} {item!r}: {len(body) >> 10} KiB frame, RSS +{grown} KiB")
        assert reply["kind"] == "RemoteProtocolError", reply
        assert ("too many arrays and maps" in reply["message"] or "once decoded, over the limit" in reply["message"]), reply
        assert "\n" not in reply["message"], reply
        assert len(reply["message"]) < 300, len(reply["message"])
        assert grown < 40 * len(body) // 1024, f"RSS grew by {grown} KiB for a {len(body) >> 10} KiB frame"
        ch.close()
        wait_for(lambda: live.server.connections == 0, 5, "the session ended")
        serving(live)
    finally:
        live.server.stop()


def hwm_kib(pid: int) -> int:
    """Peak RSS (VmHWM) of process ``pid``, KiB."""
    return _status_kib(pid, "VmHWM")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the server's peak RSS from /proc")
def test_a_dense_control_frame_pins_little_more_than_itself(tmp_path: Path) -> None:
    """A 32 MiB REQUEST of one-byte -32s (each a new 32-byte int), of 3-byte strings (~56 bytes
    each) or of empty arrays used to raise a separate server's peak RSS by 1476, 866 and 674 MiB;
    its decoded size is now bounded before msgpack builds anything (SERVER_MAX_DECODED), so the
    peak grows by about the frame itself, and the server goes on serving."""
    proc, port = start_serve_process(str(tmp_path / "root"))
    try:
        for item in (b"\xe0", b"\xa2ab", b"\x90"):
            ch = connect("127.0.0.1", port, None)
            open_session(ch, {"op": "fs"})
            before = hwm_kib(proc.pid)
            n = (P.MAX_CONTROL - 64) // len(item)
            body = b"\x82\xa1m\xa4info\xa1a\x81\xa4path\xdd" + struct.pack("!I", n) + item * n
            ch.sock.sendall(P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, int(FrameType.REQUEST), 0, 1, len(body)) + body)
            got = ch.recv_frame()
            assert got is not None and got[0].type is FrameType.ERROR
            reply = P.decode_control(got[1])
            ch.close()
            grown = hwm_kib(proc.pid) - before
            print(f"{item!r}: {len(body) >> 20} MiB frame, peak RSS +{grown >> 10} MiB: {reply['message']}")
            assert reply["kind"] == "RemoteProtocolError" and len(reply["message"]) < 300
            assert grown < (P.MAX_CONTROL + P.SERVER_MAX_DECODED) // 1024, f"peak RSS grew by {grown} KiB"
        ch = connect("127.0.0.1", port, None)
        assert open_session(ch, {"op": "ls", "path": ""})["entries"] is not None
        ch.close()
    finally:
        code, err = stop_serve_process(proc)
    assert code == 0, err


def test_error_quotes_at_most_a_bounded_repr_of_a_peer_value(tmp_path: Path) -> None:
    """A request whose path is a big nested value (under the container budget) is answered with a
    short error: its repr is neither built whole nor sent (the issue: a 120 MB repr)."""
    live = start_server(str(tmp_path / "root"))
    try:
        ch = connect("127.0.0.1", live.port, None)
        open_session(ch, {"op": "fs"})
        for path in (["x" * 1000] * 20_000, [[["deep"] * 50] * 50] * 50, "a/" + "b" * 3_000_000):
            ch.send_control(FrameType.REQUEST, 1, {"m": "info", "a": {"path": path}})
            got = ch.recv_frame()
            assert got is not None and got[0].type is FrameType.ERROR
            msg = P.decode_control(got[1])["message"]
            assert len(msg) < 400, (len(msg), msg[:100])
        for bad in ({"m": ["x" * 1000] * 10_000, "a": {}}, {"m": "info", "a": {"k" * 100_000: 1}}):
            ch.send_control(FrameType.REQUEST, 2, bad)
            got = ch.recv_frame()
            assert got is not None and got[0].type is FrameType.ERROR
            assert len(P.decode_control(got[1])["message"]) < 400
        ch.close()
    finally:
        live.server.stop()
