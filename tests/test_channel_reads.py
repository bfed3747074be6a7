"""A channel's read-ahead buffer and its timeouts (the kernel's SO_RCVTIMEO/SO_SNDTIMEO, or Python's).

Frames sent back to back, split anywhere, or with a large DATA body, come out of the channel
whole and in order; a stalled frame, a silent peer and a peer that stops reading end in
:class:`LinkTimeoutError` after the timeouts set, on both timeout paths.
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import tb5sync.wire.protocol as P
from tb5sync.errors import LinkTimeoutError
from tb5sync.wire.protocol import FrameType
from tb5sync.wire.transport import READ_AHEAD, Channel


@pytest.fixture(params=["kernel", "portable"])
def timeouts(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both timeout paths: the kernel's socket options, and Python's (forced by $TB5SYNC_PORTABLE=1)."""
    if request.param == "portable":
        monkeypatch.setenv("TB5SYNC_PORTABLE", "1")
    return str(request.param)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected TCP pair on 127.0.0.1: (ours, the peer's); both closed at teardown."""
    lsock = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(lsock.getsockname(), timeout=10)
    b, _ = lsock.accept()
    lsock.close()
    a.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    b.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _data_frame(rid: int, meta: dict[str, Any], body: bytes) -> bytes:
    return P.encode_data_prefix(rid, meta, len(body)) + body


def test_the_timeout_path_is_the_one_chosen(timeouts: str, pair: tuple[socket.socket, socket.socket]) -> None:
    ch = Channel(pair[0], io_timeout=2.5)
    assert ch.kernel_timeouts == (timeouts == "kernel")
    assert pair[0].gettimeout() == (None if timeouts == "kernel" else 2.5)
    ch.set_io_timeout(2.5, kernel=False)  # what a socket about to be wrapped in TLS gets
    assert not ch.kernel_timeouts and pair[0].gettimeout() == 2.5
    assert pair[0].getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16) == bytes(16)  # the kernel's is off again


def test_frames_back_to_back_split_anywhere(timeouts: str, pair: tuple[socket.socket, socket.socket]) -> None:
    ours, peer = pair
    ch = Channel(ours, io_timeout=10)
    rng = random.Random(5)
    big = os.urandom(3 * READ_AHEAD + 17)
    frames = [P.encode_control(FrameType.RESPONSE, i, {"i": i, "pad": "x" * rng.randrange(0, 3000)}) for i in range(1, 40)]
    frames.insert(7, _data_frame(99, {"n": len(big)}, big))
    frames.insert(20, _data_frame(100, {"n": 5}, b"small"))
    wire = b"".join(frames)

    def send() -> None:
        off = 0
        while off < len(wire):  # pieces of every size, from 1 byte to more than the read-ahead
            n = rng.choice([1, 2, 15, 16, 17, 300, READ_AHEAD - 1, READ_AHEAD + 1, 100_000])
            peer.sendall(wire[off : off + n])
            off += n
            if rng.random() < 0.1:
                time.sleep(0.002)

    t = threading.Thread(target=send, daemon=True)
    t.start()
    got = []
    for _ in range(len(frames)):
        header = ch.recv_header()
        assert header is not None
        if header.type is FrameType.DATA and header.rid == 99:
            into = memoryview(bytearray(len(big)))
            meta, body = ch.recv_data_into(header, into)
            assert P.decode_control(meta) == {"n": len(big)} and body.obj is into.obj and bytes(body) == big
            got.append(99)
        elif header.type is FrameType.DATA:
            meta_, body_ = P.decode_data(ch.recv_payload(header))
            assert bytes(body_) == b"small"
            got.append(100)
        else:
            got.append(P.decode_control(ch.recv_payload(header))["i"])
    t.join(10)
    assert got == [int(P.HEADER.unpack(f[:16])[4]) for f in frames]
    assert ch.bytes_received == len(wire)
    peer.close()
    assert ch.recv_frame() is None  # a clean end of stream after the last frame


def test_a_frame_read_ahead_means_the_peer_sent_something_unasked(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, peer = pair
    ch = Channel(ours, io_timeout=10)
    peer.sendall(P.encode_control(FrameType.RESPONSE, 1, {}) + P.encode_control(FrameType.ERROR, 0, {"kind": "X", "message": "m"}))
    assert ch.recv_frame() is not None
    assert ch.peer_closed()  # the ERROR is in the read-ahead, not in the socket


def test_a_stalled_frame_times_out(timeouts: str, pair: tuple[socket.socket, socket.socket]) -> None:
    ours, peer = pair
    ch = Channel(ours, io_timeout=0.5)
    peer.sendall(P.encode_control(FrameType.RESPONSE, 1, {"a": "b" * 100})[:20])
    t0 = time.monotonic()
    with pytest.raises(LinkTimeoutError, match="no progress for 0.5 s"):
        ch.recv_frame()
    assert 0.4 < time.monotonic() - t0 < 3


def test_the_idle_wait_outlasts_the_progress_timeout(timeouts: str, pair: tuple[socket.socket, socket.socket]) -> None:
    """idle_timeout longer than io_timeout: a frame that starts after io_timeout but within the
    idle timeout is received; silence for the idle timeout ends in its error."""
    ours, peer = pair
    ch = Channel(ours, io_timeout=0.3, idle_timeout=1.2)
    frame = P.encode_control(FrameType.RESPONSE, 1, {"late": True})
    timer = threading.Timer(0.7, peer.sendall, (frame,))
    timer.start()
    got = ch.recv_frame()
    timer.join()
    assert got is not None and P.decode_control(got[1]) == {"late": True}
    t0 = time.monotonic()
    with pytest.raises(LinkTimeoutError, match="idle timeout"):
        ch.recv_frame()
    assert 1.1 < time.monotonic() - t0 < 3


def test_no_idle_timeout_waits_past_the_progress_timeout(timeouts: str, pair: tuple[socket.socket, socket.socket]) -> None:
    ours, peer = pair
    ch = Channel(ours, io_timeout=0.2, idle_timeout=None)  # a client waiting for a reply being computed
    timer = threading.Timer(0.7, peer.sendall, (P.encode_control(FrameType.RESPONSE, 3, {}),))
    timer.start()
    got = ch.recv_frame()
    timer.join()
    assert got is not None and got[0].rid == 3


def test_a_peer_that_stops_reading_times_the_send_out(timeouts: str, pair: tuple[socket.socket, socket.socket]) -> None:
    ours, _peer = pair
    ch = Channel(ours, io_timeout=0.5)
    body = bytes(48 << 20)  # more than both sides' socket buffers hold
    t0 = time.monotonic()
    with pytest.raises(LinkTimeoutError, match="no progress for 0.5 s while sending"):
        ch.send_data(1, {}, [body])
    assert time.monotonic() - t0 < 10
