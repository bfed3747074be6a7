"""Sockets: framed channels, the client/server handshake, receive buffers and sendfile parts.

Thin by design: it reads the socket, feeds :mod:`tb5sync.protocol`, and writes
frames. One :class:`Channel` is one TCP stream. Requests and replies over
channels (pipelining, the serving loop) are :mod:`tb5sync.rpc`'s.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
from typing import Any

from . import protocol as P
from ._buffers import BufferPool
from ._parts import FileRange, SharedFd, close_parts
from .errors import (
    ConnectError,
    RemoteProtocolError,
    Tb5syncError,
)

__all__ = ["BufferPool", "FileRange", "SharedFd", "Channel", "client_handshake", "server_handshake", "connect", "close_parts", "hide_root", "tune_socket", "SOCK_BUF"]

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
