"""Sockets: framed channels, the client/server handshake, pipelined requests, and a serving loop.

Thin by design: it reads the socket, feeds :mod:`tb5sync.protocol`, and writes
replies. One :class:`Channel` is one TCP stream. :class:`Requester` sends
requests over one or more channels without waiting for replies (pipelining)
and resolves a :class:`concurrent.futures.Future` per request; :func:`serve`
answers requests on a channel by calling a handler object's methods.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import socket
import threading
from concurrent.futures import Future, InvalidStateError
from typing import Any

from . import protocol as P
from .errors import (
    ConnectError,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    Tb5syncError,
    UsageError,
    error_from_remote,
)

__all__ = ["BufferPool", "FileRange", "Channel", "Requester", "serve", "client_handshake", "server_handshake", "connect", "SOCK_BUF"]

log = logging.getLogger(__name__)

#: Socket send/receive buffer asked for, bytes.
SOCK_BUF = 4 * 1024 * 1024
_IOV_MAX = 512


def tune_socket(sock: socket.socket) -> None:
    """Disable Nagle and enlarge kernel buffers for bulk transfer."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        except OSError:
            pass


class BufferPool:
    """Reusable receive buffers for large frames, so that each frame does not allocate and zero
    a fresh buffer (page faults and memset cost about as much as the copy from the socket).

    Parameters
    ----------
    max_buffers : int
        Most buffers kept for reuse; more are left to the garbage collector.
    min_size : int
        Frames with smaller payloads (bytes) are not pooled: allocating them is cheap.

    Notes
    -----
    Thread-safe. A buffer handed out by :meth:`get` must be given back with :meth:`put`
    only once nothing reads it any more; one that is never given back is simply freed.
    """

    def __init__(self, max_buffers: int = 16, min_size: int = 1024 * 1024) -> None:
        self.max_buffers = max_buffers
        self.min_size = min_size
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def get(self, n: int) -> bytearray:
        """A buffer of at least ``n`` bytes (rounded up to whole MiB when new); contents undefined."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if n <= len(buf) <= 2 * n:
                    return self._free.pop(i)
        return bytearray(-(-n // 1048576) * 1048576)

    def put(self, buf: bytearray) -> None:
        """Give ``buf`` back for reuse; the caller must hold no views into it that are still read."""
        with self._lock:
            if len(self._free) < self.max_buffers:
                self._free.append(buf)


class FileRange:
    """A part of a DATA reply that is sent straight from a file with ``sendfile(2)``.

    The bytes go from the page cache to the socket without a copy through user space (on
    loopback and on NICs with scatter-gather, without any copy at the sender). The reply's
    ``parts`` may mix these with bytes-like parts; :func:`serve` closes them once sent.

    Parameters
    ----------
    fd : SharedFd
        The open file (shared by the parts of one reply; closed with the last of them).
    offset, length : int
        Byte range of the file.
    """

    __slots__ = ("fd", "offset", "length", "_open")

    def __init__(self, fd: SharedFd, offset: int, length: int) -> None:
        self.fd = fd
        self.offset = offset
        self.length = length
        self._open = True
        fd.users += 1

    def __len__(self) -> int:
        return self.length

    def close(self) -> None:
        """Release this part's hold on the file (idempotent)."""
        if self._open:
            self._open = False
            self.fd.release()


class SharedFd:
    """A file descriptor closed when its last :class:`FileRange` is closed (or at once if none took it)."""

    __slots__ = ("fd", "users")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.users = 0

    def release(self) -> None:
        """Drop one user; close the descriptor when none is left."""
        self.users -= 1
        if self.users <= 0 and self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


def hide_root(message: str, root: str) -> str:
    """``message`` with paths under ``root`` made relative to it (``root`` itself becomes ``.``).

    A root of ``/`` leaves messages as they are (absolute paths are then what clients name).
    ``/srv/data2`` is not taken for a path under ``/srv/data``.
    """
    root = root.rstrip(os.sep)
    if not root:
        return message
    message = message.replace(root + os.sep, "")
    return re.sub(re.escape(root) + r"(?![\w.\-])", ".", message)


def close_parts(parts: list[Any]) -> None:
    """Close the :class:`FileRange` parts of a reply (after sending it, or when it is dropped)."""
    for p in parts:
        if isinstance(p, FileRange):
            p.close()


class Channel:
    """One framed TCP stream. Sends are serialized by a lock; receives belong to one thread.

    Attributes
    ----------
    bytes_sent, bytes_received : int
        Wire bytes including frame headers.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0
        self._hdr = bytearray(P.HEADER.size)
        #: When set, large payloads are received into this pool's buffers (see :meth:`recv_frame`).
        self.pool: BufferPool | None = None
        self.closed = False
        self._error_sent = False
        #: A server's root directory: error messages sent on this channel name paths under it
        #: relative to it (a client never learns where the server's tree lives).
        self.hide_root: str | None = None

    # ---- sending ----------------------------------------------------------------------
    def _sendall_parts(self, parts: list[Any]) -> None:
        total = sum(len(p) for p in parts)
        with self._send_lock:
            views: list[memoryview] = []
            for p in parts:
                if isinstance(p, FileRange):
                    if views:
                        self._send_views(views, socket.MSG_MORE)
                        views = []
                    self._send_file(p)
                elif len(p):
                    views.append(memoryview(p).cast("B"))
            if views:
                self._send_views(views, 0)
            self.bytes_sent += total

    def _send_views(self, views: list[memoryview], flags: int) -> None:
        while views:
            sent = self.sock.sendmsg(views[:_IOV_MAX], (), flags if len(views) <= _IOV_MAX else socket.MSG_MORE)
            while sent and views:
                n = len(views[0])
                if sent >= n:
                    sent -= n
                    views.pop(0)
                else:
                    views[0] = views[0][sent:]
                    sent = 0

    def _send_file(self, part: FileRange) -> None:
        """Send ``part`` with sendfile; if the file shrank meanwhile, pad the frame with zeros.

        The frame's length was announced before, so it must be completed; the zeros fail the
        receiver's digest check, whose re-request then finds the file changed.
        """
        off, left = part.offset, part.length
        while left:
            k = os.sendfile(self.sock.fileno(), part.fd.fd, off, left)
            if k <= 0:
                log.info("file ended %d bytes early while being sent; padding the frame", left)
                self._send_views([memoryview(bytes(min(left, 1 << 20)))], 0)
                k = min(left, 1 << 20)
            off += k
            left -= k

    def send_control(self, ftype: P.FrameType, rid: int, msg: dict[str, Any]) -> None:
        """Send one control frame."""
        self._sendall_parts([P.encode_control(ftype, rid, msg)])

    def send_data(self, rid: int, meta: dict[str, Any], parts: list[Any]) -> None:
        """Send one DATA frame: ``meta`` then the raw ``parts`` (scatter/gather, no copy)."""
        body = sum(len(p) for p in parts)
        self._sendall_parts([P.encode_data_prefix(rid, meta, body), *parts])

    def send_error(self, rid: int, exc: BaseException) -> None:
        """Send an ERROR frame naming ``exc``; errors while sending are ignored.

        A session-level error (``rid`` 0) is sent at most once per channel.
        """
        if rid == 0:
            if self._error_sent:
                return
            self._error_sent = True
        message = str(exc) if self.hide_root is None else hide_root(str(exc), self.hide_root)
        try:
            self._sendall_parts([P.error_frame(rid, exc, message)])
        except OSError:
            pass

    # ---- receiving --------------------------------------------------------------------
    def _recv_exact(self, buf: bytearray | memoryview) -> bool:
        view = memoryview(buf)
        got = 0
        n = len(view)
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                if got == 0:
                    return False
                raise RemoteProtocolError("connection closed inside a frame")
            got += k
        self.bytes_received += n
        return True

    def recv_frame(self) -> tuple[P.Header, bytearray | memoryview] | None:
        """Receive one frame; None at a clean end of stream.

        With :attr:`pool` set, a payload of at least ``pool.min_size`` bytes is a memoryview of
        a pooled buffer (its ``obj``), which the consumer may give back with ``pool.put``.

        Raises
        ------
        RemoteProtocolError, VersionMismatchError
            Malformed frame (checked before the payload is allocated).
        OSError
            Socket errors.
        """
        if not self._recv_exact(self._hdr):
            return None
        header = P.parse_header(bytes(self._hdr))
        pool = self.pool
        payload: bytearray | memoryview
        if pool is not None and header.length >= pool.min_size:
            payload = memoryview(pool.get(header.length))[: header.length]
        else:
            payload = bytearray(header.length)
        if header.length and not self._recv_exact(payload):
            raise RemoteProtocolError("connection closed inside a frame")
        return header, payload

    def close(self) -> None:
        """Shut down and close the socket. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def client_handshake(ch: Channel, token: bytes | None) -> None:
    """Run the client side of the handshake on ``ch`` (see :mod:`tb5sync.protocol`).

    Raises
    ------
    AuthError, VersionMismatchError, RemoteProtocolError, ConnectError
    """
    hs = P.ClientHandshake(token, os.urandom(P.NONCE_SIZE))
    ch._sendall_parts([hs.start()])
    while not hs.done:
        got = ch.recv_frame()
        if got is None:
            raise ConnectError("server closed the connection during the handshake")
        out = hs.on_frame(P.Frame(*got))
        if out:
            ch._sendall_parts([out])


def server_handshake(ch: Channel, token: bytes | None) -> None:
    """Run the server side of the handshake on ``ch``.

    On failure an ERROR frame is sent to the client before the error is re-raised.

    Raises
    ------
    AuthError, VersionMismatchError, RemoteProtocolError, ConnectError
    """
    hs = P.ServerHandshake(token, os.urandom(P.NONCE_SIZE))
    try:
        while not hs.done:
            got = ch.recv_frame()
            if got is None:
                raise ConnectError("client closed the connection during the handshake")
            out = hs.on_frame(P.Frame(*got))
            if out:
                ch._sendall_parts([out])
    except (Tb5syncError, OSError) as exc:
        if isinstance(exc, Tb5syncError) and not isinstance(exc, ConnectError):
            ch.send_error(0, exc)
        raise


def connect(host: str, port: int, token: bytes | None, timeout: float = 10.0) -> Channel:
    """Open a TCP connection to a tb5sync server and authenticate.

    Parameters
    ----------
    host, port
        Server address.
    token : bytes or None
        Shared secret.
    timeout : float
        Seconds allowed for connecting and for the handshake.

    Raises
    ------
    ConnectError
        Unreachable host or refused connection (naming the address).
    AuthError, VersionMismatchError, RemoteProtocolError
        From the handshake.
    """
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise ConnectError(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from exc
    tune_socket(sock)
    ch = Channel(sock)
    try:
        client_handshake(ch, token)
    except Tb5syncError:
        ch.close()
        raise
    except OSError as exc:
        ch.close()
        raise ConnectError(f"connection to {host}:{port} failed during the handshake: {exc}") from exc
    except BaseException:
        ch.close()
        raise
    sock.settimeout(None)
    return ch


def open_session(ch: Channel, msg: dict[str, Any]) -> dict[str, Any]:
    """Send OPEN with ``msg`` and wait for its RESPONSE (or raise the peer's ERROR)."""
    ch.send_control(P.FrameType.OPEN, 0, msg)
    got = ch.recv_frame()
    if got is None:
        raise ConnectError("server closed the connection instead of answering OPEN")
    header, payload = got
    body = P.decode_control(payload)
    if header.type is P.FrameType.ERROR:
        raise error_from_remote(str(body.get("kind")), str(body.get("message")), body.get("errno"))
    if header.type is not P.FrameType.RESPONSE:
        raise RemoteProtocolError(f"expected RESPONSE to OPEN, got {header.type.name}")
    return body


class Requester:
    """Pipelined requests over one or more channels; one reader thread per channel.

    ``submit`` returns at once with a future; control replies resolve to a dict,
    DATA replies to ``(meta, parts)`` where ``parts`` are memoryviews cut from
    the frame by ``meta``'s wire lengths (see :meth:`split_parts`).

    Parameters
    ----------
    channels : list of Channel
        The session's streams; channel 0 carries control requests by default.
    """

    def __init__(self, channels: list[Channel]) -> None:
        if not channels:
            raise UsageError("a requester needs at least one channel")
        self.channels = channels
        #: Receive buffers shared by the channels; DATA bodies are views into them.
        self.pool = BufferPool(max_buffers=16)
        for ch in channels:
            ch.pool = self.pool
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: list[dict[int, Future[Any]]] = [{} for _ in channels]
        self._rr = itertools.cycle(range(len(channels)))
        self._dead: list[BaseException | None] = [None] * len(channels)
        self._threads = []
        for i in range(len(channels)):
            t = threading.Thread(target=self._reader, args=(i,), name=f"tb5-rx-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    @property
    def wire_bytes(self) -> int:
        """Bytes sent and received on all channels, frames included."""
        return sum(c.bytes_sent + c.bytes_received for c in self.channels)

    def submit(self, method: str, args: dict[str, Any], *, channel: int | None = None) -> Future[Any]:
        """Send a request and return its future. ``channel=None`` picks streams round-robin.

        Raises
        ------
        ConnectError
            The chosen channel is already dead.
        """
        idx = next(self._rr) if channel is None else channel
        fut: Future[Any] = Future()
        with self._lock:
            if self._dead[idx] is not None:
                raise ConnectError(f"stream {idx} is closed: {self._dead[idx]}")
            rid = next(self._ids) & 0xFFFFFFFF
            self._pending[idx][rid] = fut
        try:
            self.channels[idx].send_control(P.FrameType.REQUEST, rid, {"m": method, "a": args})
        except OSError as exc:
            with self._lock:
                self._pending[idx].pop(rid, None)
            raise ConnectError(f"connection lost while sending {method}: {exc}") from exc
        return fut

    def call(self, method: str, args: dict[str, Any], *, channel: int = 0, timeout: float | None = None) -> Any:
        """Send a request and wait for its reply."""
        return self.submit(method, args, channel=channel).result(timeout)

    def _reader(self, idx: int) -> None:
        ch = self.channels[idx]
        pending = self._pending[idx]
        err: BaseException = ConnectError("peer closed the connection")
        try:
            while True:
                got = ch.recv_frame()
                if got is None:
                    break
                header, payload = got
                with self._lock:
                    fut = pending.pop(header.rid, None)
                if header.type is P.FrameType.ERROR:
                    body = P.decode_control(payload)
                    exc = error_from_remote(str(body.get("kind")), str(body.get("message")), body.get("errno"))
                    if fut is None:  # session-level error
                        err = exc
                        break
                    _resolve(fut, exc=exc)
                    continue
                if header.type is P.FrameType.BYE:
                    break
                if fut is None:
                    raise RemoteProtocolError(f"reply to unknown request id {header.rid}")
                if header.type is P.FrameType.RESPONSE:
                    _resolve(fut, P.decode_control(payload))
                elif header.type is P.FrameType.DATA:
                    meta, body = P.decode_data(payload)
                    _resolve(fut, (meta, body))
                else:
                    raise RemoteProtocolError(f"unexpected {header.type.name} frame in reply")
        except (ProtocolError, OSError) as exc:
            err = exc if isinstance(exc, ProtocolError) else ConnectError(f"connection lost: {exc}")
        with self._lock:
            self._dead[idx] = err
            left = list(pending.values())
            pending.clear()
        for fut in left:
            _resolve(fut, exc=err)

    def close(self, bye: bool = True) -> None:
        """Send BYE on every channel (when ``bye``), then close them."""
        for ch in self.channels:
            if bye:
                try:
                    ch.send_control(P.FrameType.BYE, 0, {})
                except OSError:
                    pass
            ch.close()
        for t in self._threads:
            t.join(timeout=5)


def _resolve(fut: Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
    """Settle ``fut`` unless the caller cancelled it meanwhile (its reply is then dropped)."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


def split_parts(body: memoryview, lengths: list[int]) -> list[memoryview]:
    """Cut a DATA body into consecutive parts of the given wire lengths.

    Raises
    ------
    RemoteProtocolError
        The lengths do not add up to the body's size.
    """
    out = []
    off = 0
    for n in lengths:
        if not isinstance(n, int) or n < 0 or off + n > len(body):
            raise RemoteProtocolError("DATA part lengths exceed the frame body")
        out.append(body[off : off + n])
        off += n
    if off != len(body):
        raise RemoteProtocolError("DATA part lengths do not cover the frame body")
    return out


def serve(ch: Channel, handler: Any, methods: frozenset[str]) -> None:
    """Answer requests on ``ch`` by calling ``handler.<method>(**args)`` until BYE or end of stream.

    A method returning a dict is answered with RESPONSE; one returning
    ``(meta, parts)`` with a DATA frame. A :class:`Tb5syncError`, ``OSError`` or
    bad arguments become an ERROR reply for that request and serving goes on;
    a protocol violation ends the loop (after an ERROR frame) but never raises
    past it except as the returned exception's re-raise.

    Raises
    ------
    RemoteProtocolError, VersionMismatchError
        The peer broke the protocol (an ERROR frame was sent first).
    """
    while True:
        try:
            got = ch.recv_frame()
        except ProtocolError as exc:
            ch.send_error(0, exc)
            raise
        if got is None:
            return
        header, payload = got
        if header.type is P.FrameType.BYE:
            return
        if header.type is P.FrameType.ERROR:
            body = P.decode_control(payload)
            raise error_from_remote(str(body.get("kind")), str(body.get("message")), body.get("errno"))
        if header.type is not P.FrameType.REQUEST:
            exc = RemoteProtocolError(f"expected REQUEST, got {header.type.name}")
            ch.send_error(0, exc)
            raise exc
        try:
            msg = P.decode_control(payload)
        except RemoteProtocolError as exc:
            ch.send_error(0, exc)
            raise
        method = msg.get("m")
        args = msg.get("a", {})
        try:
            if method not in methods or not isinstance(args, dict):
                raise UsageError(f"unknown request {method!r}")
            try:
                result = getattr(handler, method)(**args)
            except TypeError as exc:
                raise UsageError(f"bad arguments for {method}: {exc}") from exc
        except (Tb5syncError, OSError, ValueError) as exc:
            if isinstance(exc, OSError) and not isinstance(exc, Tb5syncError):
                log.info("request %s failed: %s", method, exc)
            ch.send_error(header.rid, exc)
            continue
        if isinstance(result, tuple):
            meta, parts = result
            try:
                ch.send_data(header.rid, meta, parts)
            finally:
                close_parts(parts)
        elif isinstance(result, dict):
            ch.send_control(P.FrameType.RESPONSE, header.rid, result)
        else:
            raise LocalProtocolError(f"handler {method} returned {type(result).__name__}")
