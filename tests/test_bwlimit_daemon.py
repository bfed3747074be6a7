"""``--bwlimit`` on a server: a peer cannot hold its threads and buffers with a tiny rate.

rsync refuses a ``--bwlimit`` below 512 bytes per second (options.c, "too small"); the daemon
applies the same floor to a peer's options. A paced reply waits in slices: it ends when the
peer closes its connection, when the session ends, when the server stops, and no single wait
may last longer than the server's idle timeout.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import start_server, wait_for

from tb5sync._os.io import RateLimit
from tb5sync.remote.client import _connect
from tb5sync.errors import ConnectError, LinkTimeoutError, Tb5syncError, UsageError
from tb5sync.tree.options import MIN_BWLIMIT, SyncOptions, parse_rate
from tb5sync.wire.rpc import Requester, open_session
from tb5sync.wire.urls import parse_url

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("rate", [1, 100, 511])
def test_options_refuse_a_rate_below_rsyncs_floor(rate: int) -> None:
    with pytest.raises(UsageError, match="too small"):
        SyncOptions(bwlimit=rate)
    with pytest.raises(UsageError, match="too small"):
        SyncOptions.from_wire({"bwlimit": rate})  # a peer's options
    with pytest.raises(UsageError, match="too small"):
        parse_rate(f"{rate}b")  # the CLI's


@pytest.mark.parametrize("rate", [0, MIN_BWLIMIT, 10 * 1024 * 1024])
def test_options_accept_zero_and_rates_from_the_floor(rate: int) -> None:
    assert MIN_BWLIMIT == 512
    assert SyncOptions.from_wire({"bwlimit": rate}).bwlimit == rate


def _serve_big(tmp_path: Path, **kw: Any) -> Any:
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    (root / "d" / "big").write_bytes(os.urandom(1 << 20))
    return start_server(str(root), **kw)


def _open_pull(live: Any, rate: int) -> Requester:
    ch = _connect(parse_url(live.url()), None, 10, None)
    open_session(ch, {"op": "pull", "path": "d", "options": {"bwlimit": rate}, "streams": 1})
    return Requester([ch])


def test_server_refuses_a_peers_tiny_bwlimit(tmp_path: Path) -> None:
    live = _serve_big(tmp_path)
    try:
        ch = _connect(parse_url(live.url()), None, 10, None)
        try:
            with pytest.raises(Tb5syncError, match="too small"):
                open_session(ch, {"op": "pull", "path": "d", "options": {"bwlimit": 1}, "streams": 1})
        finally:
            ch.close()
        wait_for(lambda: live.server.threads == 0, 10, "the refused connection's thread to end")
    finally:
        live.server.stop()


def test_paced_wait_ends_when_the_peer_closes(tmp_path: Path) -> None:
    """1 MiB at 512 B/s is a wait of about 34 minutes: the client goes after 1 s, the server's thread follows."""
    live = _serve_big(tmp_path)
    try:
        req = _open_pull(live, MIN_BWLIMIT)
        fut = req.submit("read_files", {"paths": ["big"]})
        with pytest.raises(concurrent.futures.TimeoutError):
            fut.result(1.0)
        assert live.server.threads == 1  # the session's thread, asleep in the rate limit
        req.close(bye=False)
        waited = wait_for(lambda: live.server.threads == 0 and live.server.connections == 0, 5,
                          "the server's thread to leave the --bwlimit wait")
        assert waited < 5
    finally:
        live.server.stop()


def test_paced_wait_ends_when_the_server_stops(tmp_path: Path) -> None:
    live = _serve_big(tmp_path)
    stopped = False
    try:
        req = _open_pull(live, MIN_BWLIMIT)
        fut = req.submit("read_files", {"paths": ["big"]})
        with pytest.raises(concurrent.futures.TimeoutError):
            fut.result(1.0)
        t = time.monotonic()
        live.server.stop(timeout=10)
        stopped = True
        assert time.monotonic() - t < 5
        assert live.server.threads == 0
        req.close(bye=False)
    finally:
        if not stopped:
            live.server.stop()


def test_paced_wait_longer_than_the_idle_timeout_is_refused(tmp_path: Path) -> None:
    live = _serve_big(tmp_path, idle_timeout=5.0)
    try:
        req = _open_pull(live, MIN_BWLIMIT)
        try:
            t = time.monotonic()
            with pytest.raises(Tb5syncError, match="idle timeout"):
                req.call("read_files", {"paths": ["big"]}, timeout=20)
            assert time.monotonic() - t < 5
            # a reply that fits the idle timeout is still paced and served
            (Path(live.root) / "d" / "small").write_bytes(b"s" * 1024)
            meta = req.call("read_files", {"paths": ["small"]}, timeout=20)
            assert meta is not None
        finally:
            req.close()
    finally:
        live.server.stop()


def test_rate_limit_wait_stops_on_request() -> None:
    rl = RateLimit(MIN_BWLIMIT)
    calls = [0]

    def stop() -> str | None:
        calls[0] += 1
        return "the session ended" if calls[0] > 2 else None

    t = time.monotonic()
    with pytest.raises(ConnectError, match="the session ended"):
        rl.take(1 << 20, stop)
    assert time.monotonic() - t < 2
    with pytest.raises(LinkTimeoutError, match="idle timeout"):
        rl.take(1 << 20, None, max_wait=10)
    assert rl.take(1, None, max_wait=10) == 0.0  # the refused and the stopped bytes were given back


@pytest.mark.parametrize("portable", ["0", "1"])
def test_peer_closed_both_paths(portable: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """POLLRDHUP where the system has it (Linux) sees a close behind unread bytes; the portable
    peek (macOS) sees it once nothing is left to read."""
    import select
    import socket

    from tb5sync.wire.transport import peer_closed

    monkeypatch.setenv("TB5SYNC_PORTABLE", portable)
    a, b = socket.socketpair()
    try:
        assert not peer_closed(a)
        b.send(b"next request")
        assert not peer_closed(a)
        b.close()
        rdhup = portable == "0" and hasattr(select, "POLLRDHUP")
        assert peer_closed(a) is rdhup
        a.recv(100)
        assert peer_closed(a)
    finally:
        a.close()


def test_paced_wait_ends_when_the_peer_closes_behind_queued_requests(tmp_path: Path) -> None:
    """Requests sent ahead, then the close: the server's thread still leaves at once (Linux's
    POLLRDHUP; elsewhere each queued wait is bounded by the idle timeout)."""
    import select

    if not hasattr(select, "POLLRDHUP"):
        pytest.skip("no POLLRDHUP here (the portable path is covered by test_peer_closed_both_paths)")
    live = _serve_big(tmp_path)
    try:
        req = _open_pull(live, MIN_BWLIMIT)
        futs = [req.submit("read_files", {"paths": ["big"]}) for _ in range(3)]
        with pytest.raises(concurrent.futures.TimeoutError):
            futs[0].result(1.0)
        req.close(bye=False)
        wait_for(lambda: live.server.threads == 0 and live.server.connections == 0, 5,
                 "the server's thread to leave the --bwlimit waits")
    finally:
        live.server.stop()
