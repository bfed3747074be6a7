"""The daemon's bench sessions (``tb5sync bench``): ping round trips, the link test's source and
sink (zeros over the wire, no disk, no hashing) and the disk test in the state directory.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from tb5sync.errors import BusyError, ConnectError, DestinationError, ReadOnlyError, RemoteProtocolError, UsageError
from tb5sync.wire.messages import BENCH_MAX_BYTES, BENCH_MAX_DISK, PING_METHODS
from tb5sync.wire.protocol import FrameType
from tb5sync.wire.rpc import serve
from tb5sync.wire.transport import Channel, hide_root
import tb5sync.wire.protocol as P

__all__ = ["SOURCE_BLOCK", "Ping", "disk", "ping", "sink", "source"]

SOURCE_BLOCK = 4 * 1024 * 1024


class Ping:
    """Handler for the link test's round trips."""

    def ping(self) -> dict[str, Any]:
        return {}


def ping(ch: Channel) -> None:
    """A ping session: answer the link test's round trips until BYE."""
    ch.send_control(FrameType.RESPONSE, 0, {})
    serve(ch, Ping(), PING_METHODS)


def source(ch: Channel, nbytes: object) -> None:
    """Link test: send ``nbytes`` of zeros in DATA frames (no disk, no hashing), then BYE."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes <= BENCH_MAX_BYTES:
        raise UsageError(f"source bytes must be 0..{BENCH_MAX_BYTES}")
    ch.send_control(FrameType.RESPONSE, 0, {})
    block = bytes(SOURCE_BLOCK)
    while nbytes > 0:
        n = min(nbytes, SOURCE_BLOCK)
        ch.send_data(0, {}, [memoryview(block)[:n]])
        nbytes -= n
    ch.send_control(FrameType.BYE, 0, {})


def sink(ch: Channel, nbytes: object) -> None:
    """Link test, client to server: read DATA frames carrying ``nbytes`` (their bodies, after
    the meta map) and drop them (no disk, no hashing); answer ``{"bytes": received}``. A frame other than DATA, or more bytes than
    announced, is a protocol error."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes <= BENCH_MAX_BYTES:
        raise UsageError(f"sink bytes must be 0..{BENCH_MAX_BYTES}")
    ch.send_control(FrameType.RESPONSE, 0, {})
    got = 0
    while got < nbytes:
        fr = ch.recv_frame()
        if fr is None:
            raise ConnectError(f"sink: the client closed after {got} of {nbytes} bytes")
        header, payload = fr
        if header.type is not FrameType.DATA:
            raise RemoteProtocolError(f"sink: expected DATA, got {header.type.name}")
        got += len(P.decode_data(payload, ch.max_decoded)[1])
    if got != nbytes:
        raise RemoteProtocolError(f"sink: {got} bytes sent, {nbytes} announced")
    ch.send_control(FrameType.RESPONSE, 0, {"bytes": got})


def disk(ch: Channel, nbytes: object, *, read_only: bool, lock: threading.Lock, state_dir: str, root: str,
         stopping: threading.Event) -> None:
    """Disk test (``tb5sync bench``): write, read back cold and remove a temporary file of
    ``nbytes`` in ``state_dir`` (:func:`tb5sync._os.diskbench.disk_rates`); answer its figures.
    Refused on a ``read_only`` server; one at a time (``lock``: ``BusyError`` for a second);
    ended when ``stopping`` is set or the client goes. Messages show no path under ``root``."""
    from tb5sync._os.diskbench import MIN_SIZE, disk_rates

    if read_only:
        raise ReadOnlyError("server is read-only; its disk test would write a file")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not MIN_SIZE <= nbytes <= BENCH_MAX_DISK:
        raise UsageError(f"disk test bytes must be {MIN_SIZE}..{BENCH_MAX_DISK}")
    if not lock.acquire(blocking=False):
        raise BusyError("server busy: another disk test is running; try again later")
    try:
        try:
            try:
                os.makedirs(state_dir, mode=0o700, exist_ok=True)
            except OSError as exc:
                raise DestinationError(f"disk test: cannot create {state_dir}: {exc.strerror or exc}") from exc
            res = disk_rates(state_dir, nbytes, alive=lambda: not (stopping.is_set() or ch.peer_closed()))
        except DestinationError as exc:  # the message would show the state directory's path
            raise DestinationError(hide_root(str(exc), root)) from None
    finally:
        lock.release()
    ch.send_control(FrameType.RESPONSE, 0, res)
