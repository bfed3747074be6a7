"""Admission of the HTTP build cache (issue 21): what an idle, slow or greedy client may hold.

nginx's rules and names: a request head must arrive within ``client_header_timeout`` (408 and
closed), an idle keep-alive connection is closed after ``keepalive_timeout``, a body must keep a
minimum rate (bytes per ``client_body_timeout`` window: one byte every 15 s is not progress), an
address may hold only so many connections and unfinished requests (``limit_conn``: 503), and a
request is authenticated before it takes a body slot. GET/HEAD never wait behind uploads. All
on loopback: the slow clients bind 127.0.0.2 and 127.0.0.3, the honest one 127.0.0.1.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tb5sync.cache.httpcache import HttpCache

pytestmark = pytest.mark.timeout(90)

_SOCKS: list[socket.socket] = []
_CACHES: list[HttpCache] = []


@pytest.fixture(autouse=True)
def _teardown() -> Iterator[None]:
    yield
    while _SOCKS:
        _SOCKS.pop().close()
    while _CACHES:
        _CACHES.pop().stop()


def start(tmp_path: Any, **kw: Any) -> HttpCache:
    c = HttpCache(tmp_path / "store", **kw).start()
    _CACHES.append(c)
    return c


def raw(c: HttpCache, source: str = "127.0.0.1", data: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", c.port), timeout=10, source_address=(source, 0))
    _SOCKS.append(s)
    if data:
        s.sendall(data)
    return s


def closed_within(s: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closes ``s`` within ``seconds``, and what it sent before."""
    s.settimeout(0.1)
    got = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            b = s.recv(4096)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return True, got
        if not b:
            return True, got
        got += b
    return False, got


def get(c: HttpCache, path: str, headers: dict[str, str] | None = None) -> tuple[int, float]:
    t0 = time.monotonic()
    h = http.client.HTTPConnection("127.0.0.1", c.port, timeout=10, source_address=("127.0.0.1", 0))
    try:
        h.request("GET", path, headers=headers or {})
        r = h.getresponse()
        r.read()
        return r.status, time.monotonic() - t0
    finally:
        h.close()


# ---- timeouts ----
@pytest.mark.parametrize("sent", [b"", b"GET /k HT", b"GET /k HTTP/1.1\r\nHost: x\r\n"], ids=["silent", "partial-line", "partial-head"])
def test_a_request_head_must_arrive_within_client_header_timeout(tmp_path: Any, sent: bytes) -> None:
    c = start(tmp_path, client_header_timeout=0.5)
    s = raw(c, data=sent)
    gone, _ = closed_within(s, 5)
    assert gone


def test_an_idle_keep_alive_connection_is_closed_after_keepalive_timeout(tmp_path: Any) -> None:
    c = start(tmp_path, keepalive_timeout=0.5)
    s = raw(c, data=b"GET /k HTTP/1.1\r\nHost: x\r\n\r\n")
    t0 = time.monotonic()
    gone, got = closed_within(s, 5)
    assert gone and got.startswith(b"HTTP/1.1 404")
    assert time.monotonic() - t0 < 4


@pytest.mark.parametrize("period", [0.2, 0.05])
def test_a_body_below_the_minimum_rate_is_cut_and_frees_its_slot(tmp_path: Any, period: float) -> None:
    """Each byte used to count as progress: a byte every ``period`` s held a slot for ever."""
    c = start(tmp_path, concurrency=1, client_body_timeout=0.5, client_body_min_rate=1000)
    s = raw(c, data=b"PUT /ccache/slow HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
    stop = threading.Event()

    def trickle() -> None:
        while not stop.is_set():
            try:
                s.sendall(b"x")
            except OSError:
                return
            stop.wait(period)

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        gone, got = closed_within(s, 5)
        assert gone and (got == b"" or got.startswith(b"HTTP/1.1 408"))
        h = http.client.HTTPConnection("127.0.0.1", c.port, timeout=10)
        h.request("PUT", "/ccache/fast", body=b"v" * 10000)
        assert h.getresponse().status == 200
        h.close()
        assert get(c, "/ccache/slow")[0] == 404
    finally:
        stop.set()
        t.join(5)


# ---- per-address caps ----
def test_connections_per_address_are_capped(tmp_path: Any) -> None:
    c = start(tmp_path, max_connections_per_address=4)
    held = [raw(c, source="127.0.0.2") for _ in range(4)]
    time.sleep(0.2)
    extra = raw(c, source="127.0.0.2", data=b"GET /k HTTP/1.1\r\nHost: x\r\n\r\n")
    gone, got = closed_within(extra, 5)
    assert gone and (got == b"" or got.startswith(b"HTTP/1.1 503"))
    assert get(c, "/k")[0] == 404  # another address is not affected
    held[0].close()
    time.sleep(0.2)
    again = raw(c, source="127.0.0.2", data=b"GET /k HTTP/1.1\r\nHost: x\r\n\r\n")
    assert again.recv(12).startswith(b"HTTP/1.1 404")


def test_unfinished_requests_per_address_are_capped(tmp_path: Any) -> None:
    """``limit_conn``: an address with 2 requests in progress gets 503 for a third, at once."""
    c = start(tmp_path, limit_conn=2)
    for _ in range(2):
        raw(c, source="127.0.0.2", data=b"PUT /ccache/x HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nab")
    time.sleep(0.3)
    t0 = time.monotonic()
    third = raw(c, source="127.0.0.2", data=b"PUT /ccache/y HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nz")
    third.settimeout(5)
    assert third.recv(12).startswith(b"HTTP/1.1 503")
    assert time.monotonic() - t0 < 2
    assert get(c, "/ccache/x")[0] == 404


def test_authentication_is_checked_before_a_body_slot_is_taken(tmp_path: Any) -> None:
    c = start(tmp_path, concurrency=1, bearer="tok")
    s = raw(c, source="127.0.0.2", data=b"PUT /ccache/x HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nab")
    s.settimeout(5)
    assert s.recv(12).startswith(b"HTTP/1.1 401")
    h = http.client.HTTPConnection("127.0.0.1", c.port, timeout=5)
    h.request("PUT", "/ccache/y", body=b"v", headers={"Authorization": "Bearer tok"})
    assert h.getresponse().status == 200
    h.close()


# ---- the load ----
@pytest.mark.timeout(120)
def test_honest_get_is_answered_within_a_second_under_silent_and_trickling_clients(tmp_path: Any) -> None:
    """300 silent connections (127.0.0.2) and 64 uploads trickling a byte every 15 s (127.0.0.3,
    each with a valid token), the default caps: an honest GET (127.0.0.1) answered in under 1 s."""
    c = start(tmp_path, bearer="tok")
    h = http.client.HTTPConnection("127.0.0.1", c.port, timeout=10)
    h.request("PUT", "/ccache/hit", body=b"value", headers={"Authorization": "Bearer tok"})
    assert h.getresponse().status == 200
    h.close()
    for _ in range(300):
        raw(c, source="127.0.0.2")
    tricklers = [raw(c, source="127.0.0.3", data=b"PUT /ccache/t HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok\r\n"
                     b"Content-Length: 1000000\r\n\r\nx") for _ in range(64)]
    time.sleep(1.0)
    for s in tricklers:  # the next byte of each, as at 15 s
        try:
            s.sendall(b"x")
        except OSError:
            pass
    times = []
    for _ in range(5):
        status, took = get(c, "/ccache/hit", {"Authorization": "Bearer tok"})
        assert status == 200
        times.append(took)
    assert max(times) < 1.0, times


@pytest.mark.parametrize("addr", ["127.0.0.1", "127.0.0.4"])
def test_readers_that_never_read_hold_no_slot(tmp_path: Any, addr: str) -> None:
    """Clients that send a GET of a large entry and never read the answer (a tiny receive buffer),
    as many as there are slots and more, from one address: an honest GET, from that address or
    another, is still answered within 1 s (a slot is held for store work, not while the socket
    waits for a reader), and a stalled reader is cut once its writes stop for a body window."""
    c = start(tmp_path, concurrency=4, client_body_timeout=2)
    h = http.client.HTTPConnection("127.0.0.1", c.port, timeout=10)
    h.request("PUT", "/k/big", body=b"\x01" * (8 << 20))
    r = h.getresponse()
    assert r.status == 200
    r.read()
    h.request("PUT", "/k/small", body=b"small")
    r = h.getresponse()
    assert r.status == 200
    r.read()
    h.close()
    stalled = []
    for _ in range(12):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.bind(("127.0.0.1", 0))
        s.connect(("127.0.0.1", c.port))
        s.sendall(b"GET /k/big HTTP/1.1\r\nHost: x\r\n\r\n")
        _SOCKS.append(s)
        stalled.append(s)
    time.sleep(1.0)
    times = []
    for _ in range(3):
        status, took = get_from(c, "/k/small", addr)
        assert status == 200
        times.append(took)
    assert max(times) < 1.0, times
    time.sleep(3.0)  # past the 2 s window with nothing read
    for s in stalled[:2]:  # cut: the body ends short of its 8 MiB, at EOF
        s.settimeout(5)
        got = 0
        while b := s.recv(1 << 16):
            got += len(b)
        assert got < 8 << 20


def get_from(c: HttpCache, path: str, source: str) -> tuple[int, float]:
    s = socket.create_connection(("127.0.0.1", c.port), timeout=10, source_address=(source, 0))
    _SOCKS.append(s)
    t0 = time.monotonic()
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    line = s.recv(64).split(b"\r\n")[0]
    return int(line.split()[1]), time.monotonic() - t0


@pytest.mark.parametrize("how", ["http-cache", "serve"])
def test_cli_takes_the_admission_options(tmp_path: Any, how: str) -> None:
    import signal
    import subprocess
    import sys

    from conftest import http_cache_port

    opts = ["--client-header-timeout", "0.5", "--keepalive-timeout", "5", "--client-body-timeout", "2",
            "--client-body-min-rate", "2K", "--http-max-connections-per-address", "8", "--limit-conn", "4",
            "--max-entry-size", "1M"]
    if how == "serve":
        (tmp_path / "root").mkdir()
        args = ["serve", str(tmp_path / "root"), "--bind", "127.0.0.1:0", "--no-auth", "--http-cache", "127.0.0.1:0"]
    else:
        args = ["http-cache", str(tmp_path / "store"), "--bind", "127.0.0.1:0"]
    p = subprocess.Popen([sys.executable, "-m", "tb5sync.cli", *args, *opts], stderr=subprocess.PIPE, text=True)
    try:
        assert p.stderr is not None
        port = http_cache_port(p.stderr)
        assert port
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        _SOCKS.append(s)
        gone, got = closed_within(s, 5)
        assert gone and got.startswith(b"HTTP/1.1 408")
        h = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        h.request("PUT", "/ccache/big", body=b"x" * (1024 * 1024 + 1))
        assert h.getresponse().status == 413
        h.close()
    finally:
        p.send_signal(signal.SIGTERM)
        err = p.communicate(timeout=30)[1]
        assert p.returncode == 0, err


@pytest.mark.parametrize("headers", [b"", b"Authorization: Bearer wrong\r\n"])
def test_expect_100_continue_is_not_answered_before_authentication(tmp_path: Any, headers: bytes) -> None:
    """A PUT with ``Expect: 100-continue`` and no (or a wrong) token is told 401 at once: the server
    never invites the body of a request it will refuse; with the token it is invited."""
    c = start(tmp_path, bearer="tok")
    s = raw(c, data=b"PUT /ccache/x HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n" + headers + b"\r\n")
    s.settimeout(5)
    first = s.recv(200)
    assert first.startswith(b"HTTP/1.1 401"), first
    ok = raw(c, data=b"PUT /ccache/x HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n"
                     b"Authorization: Bearer tok\r\n\r\n")
    ok.settimeout(5)
    assert ok.recv(200).startswith(b"HTTP/1.1 100 Continue")
    ok.sendall(b"hello")
    assert b"200" in ok.recv(200).split(b"\r\n")[0]
