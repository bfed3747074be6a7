"""Sockets: framed channels, the client/server handshake, receive buffers and sendfile parts.

Thin by design: it reads the socket, feeds :mod:`tb5sync.wire.protocol`, and writes
frames. One :class:`Channel` is one TCP stream. Requests and replies over
channels (pipelining, the serving loop) are :mod:`tb5sync.wire.rpc`'s.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import ssl

import tb5sync.wire.protocol as P
from tb5sync._os.buffers import BufferPool
from tb5sync._os.io import HAVE_SPLICE, portable, pwrite_all, read_into, splice_to_file
from tb5sync.wire.parts import FileRange, SharedFd, close_parts
from tb5sync.errors import (
    ConnectError,
    LinkTimeoutError,
    RemoteProtocolError,
    Tb5syncError,
)

__all__ = [
    "BufferPool", "FileRange", "SharedFd", "Channel", "client_handshake", "server_handshake", "connect",
    "close_parts", "hide_root", "tune_socket", "set_keepalive", "client_tls", "dial", "SOCK_BUF", "IO_TIMEOUT",
    "KEEPALIVE", "peer_closed",
]

log = logging.getLogger(__name__)

#: Socket send/receive buffer asked for, bytes.
SOCK_BUF = 4 * 1024 * 1024
_IOV_MAX = 512
#: Default progress timeout, seconds: the longest a started frame may go without a byte moving
#: (either direction), and the longest sent data may stay unacknowledged (``TCP_USER_TIMEOUT``).
IO_TIMEOUT = 60.0
#: Default TCP keepalive idle time, seconds: an idle connection is probed after this long, then
#: every third of it; three unanswered probes end it (a dead peer is found in about 2x this).
KEEPALIVE = 15.0
#: errno values that mean "the link timed out" (keepalive probes or TCP_USER_TIMEOUT expired).
_TIMEOUT_ERRNOS = frozenset({errno.ETIMEDOUT})
_TLS_SEND_BLOCK = 1 << 20
#: Read-ahead buffer of a channel, bytes: a small frame (a request, an ``info`` reply, a 4 KiB read)
#: and its header arrive in one ``recv``; a read of at least this many bytes goes straight into
#: its destination instead.
READ_AHEAD = 32 * 1024
#: Bytes of a channel's splice pipe (``F_SETPIPE_SZ``; Linux's default limit for it, 1 MiB):
#: what one ``splice`` moves from the socket before the pipe is emptied into the file.
SPLICE_PIPE = 1024 * 1024
_F_SETPIPE_SZ = 1031
#: ``struct timeval`` as ``SO_RCVTIMEO``/``SO_SNDTIMEO`` take it (``time_t`` and ``suseconds_t`` in
#: two longs: Linux; on 64-bit macOS the 4-byte ``tv_usec`` sits first in its padded 8, little-endian)
_TIMEVAL = struct.Struct("@ll")
#: sendfile errors after which a channel sends its file parts by pread + send instead
_NO_SENDFILE = frozenset(e for e in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", None)) if e is not None)


class _Span:
    """Consecutive :class:`FileRange` parts of one file joined: sent with one ``sendfile`` loop."""

    __slots__ = ("fd", "offset", "length", "pad", "sendfile")

    def __init__(self, first: FileRange) -> None:
        self.fd, self.offset, self.length, self.pad, self.sendfile = first.fd, first.offset, first.length, first.pad, first.sendfile

    def __len__(self) -> int:
        return self.length


def _joined_ranges(parts: list[Any]) -> list[Any]:
    """``parts`` with each run of :class:`FileRange` s that continue one another in the same file
    (same flags) joined into one :class:`_Span` (a reply of a cold file's chunks: one ``sendfile``
    per reply instead of one per chunk). The bytes sent are the same; a file that ends early is
    padded the same way (zeros to the end of what was announced)."""
    out: list[Any] = []
    for p in parts:
        if isinstance(p, FileRange) and out and isinstance(out[-1], (FileRange, _Span)):
            last = out[-1]
            if (last.fd is p.fd and last.offset + last.length == p.offset and last.pad == p.pad
                    and last.sendfile == p.sendfile and (p.length > READ_AHEAD or last.length > READ_AHEAD)):
                if isinstance(last, FileRange):
                    last = out[-1] = _Span(last)
                last.length += p.length
                continue
        out.append(p)
    return out


def host_port(host: str, port: int | str) -> str:
    """``host:port`` as messages print it: an IPv6 address in brackets (``[::1]:7000``,
    ``[fe80::1%bridge0]:8873``; RFC 3986's authority form), other hosts as they are."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def tune_socket(sock: socket.socket) -> None:
    """Disable Nagle and enlarge kernel buffers for bulk transfer."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        except OSError:
            pass


def set_keepalive(sock: socket.socket, idle: float | None, user_timeout: float | None = None) -> list[str]:
    """Turn on TCP keepalive on ``sock`` and bound how long sent data may stay unacknowledged.

    Parameters
    ----------
    sock : socket.socket
        A TCP socket.
    idle : float or None
        Seconds of silence before the first probe (then one every ``idle / 3`` s, 3 probes);
        None leaves keepalive off.
    user_timeout : float or None
        Seconds sent data may stay unacknowledged before the kernel drops the connection
        (``TCP_USER_TIMEOUT``, RFC 5482; Linux only, skipped elsewhere).

    Returns
    -------
    list of str
        The socket options set, for logs and tests.

    Notes
    -----
    Portable: the option names are looked up at run time. Linux has ``TCP_KEEPIDLE``;
    macOS names the same option ``TCP_KEEPALIVE``; where neither exists only
    ``SO_KEEPALIVE`` is set (the system's default timings then apply). ``$TB5SYNC_PORTABLE=1``
    looks up only the macOS names and sets no ``TCP_USER_TIMEOUT``.
    """
    done: list[str] = []
    if idle is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        done.append("SO_KEEPALIVE")
        secs = max(1, int(idle))
        idle_names = ("TCP_KEEPALIVE",) if portable() else ("TCP_KEEPIDLE", "TCP_KEEPALIVE")  # macOS's name only
        for names, value in ((idle_names, secs), (("TCP_KEEPINTVL",), max(1, secs // 3)), (("TCP_KEEPCNT",), 3)):
            for name in names:
                opt = getattr(socket, name, None)
                if opt is None:
                    continue
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, opt, value)
                    done.append(name)
                except OSError:
                    pass
                break
    opt = None if portable() else getattr(socket, "TCP_USER_TIMEOUT", None)  # Linux only
    if user_timeout is not None and opt is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, opt, max(1, int(user_timeout * 1000)))
            done.append("TCP_USER_TIMEOUT")
        except OSError:
            pass
    return done


def _wait_fd(fd: int, write: bool, timeout: float | None) -> bool:
    """Wait until ``fd`` is readable (or writable); False when ``timeout`` seconds passed first.

    ``poll(2)`` where the platform has it, ``select(2)`` otherwise. A hang-up or error counts as
    ready: the next call on the socket reports it.
    """
    if hasattr(select, "poll"):
        p = select.poll()
        p.register(fd, (select.POLLOUT if write else select.POLLIN | select.POLLPRI))
        return bool(p.poll(None if timeout is None else max(0, int(timeout * 1000))))
    r, w, _ = select.select([] if write else [fd], [fd] if write else [], [], timeout)
    return bool(r or w)


def peer_closed(sock: socket.socket) -> bool:
    """True when the peer of ``sock`` has closed (or reset) the connection, without reading anything.

    Looks without waiting. Where ``poll`` has ``POLLRDHUP`` (Linux) the peer's close is seen even
    behind bytes not read yet (requests it sent before closing). Elsewhere (macOS, the portable
    path; forced with ``$TB5SYNC_PORTABLE=1``): a socket with nothing to read is open; one whose
    next read is the end of stream (a ``MSG_PEEK`` of one byte gives nothing) or fails
    (``ECONNRESET``) is closed; bytes waiting mean open. A TLS socket is peeked at below TLS.
    """
    try:
        fd = sock.fileno()
        if fd < 0:
            return True
        rdhup = getattr(select, "POLLRDHUP", 0) if hasattr(select, "poll") and not portable() else 0
        if rdhup:
            p = select.poll()
            p.register(fd, rdhup)
            return any(ev & (rdhup | select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, ev in p.poll(0))
        if not _wait_fd(fd, False, 0):
            return False
        return socket.socket.recv(sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except (OSError, ValueError):
        return True


def _timeout_error(exc: OSError, what: str, timeout: float | None) -> OSError:
    """``exc`` as a :class:`LinkTimeoutError` when it is a timeout; otherwise ``exc`` itself."""
    if isinstance(exc, LinkTimeoutError):
        return exc
    if exc.errno in _TIMEOUT_ERRNOS:  # from the kernel (an OSError with ETIMEDOUT is a TimeoutError too)
        return LinkTimeoutError(f"the link is dead: keepalive probes or sent data went unanswered while {what}")
    if isinstance(exc, (TimeoutError, BlockingIOError)) and not isinstance(exc, Tb5syncError):
        # the socket timeout: Python's (TimeoutError), or the kernel's SO_RCVTIMEO/SO_SNDTIMEO on a
        # blocking socket (EAGAIN, a BlockingIOError)
        return LinkTimeoutError(f"no progress for {timeout:g} s while {what}: the peer stalled or the link is down")
    return exc


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


def _is_tls(sock: object) -> bool:
    """Whether ``sock`` is an ``ssl.SSLSocket``. ``ssl`` (~4 ms of a client's start-up) is imported
    only where TLS is set up: while it is not imported, no socket can be one."""
    mod = sys.modules.get("ssl")
    return mod is not None and isinstance(sock, mod.SSLSocket)


class Channel:
    """One framed TCP (or TLS) stream. Sends are serialized by a lock; receives belong to one thread.

    Receives go through a read-ahead buffer of :data:`READ_AHEAD` bytes: one ``recv`` brings a
    small frame's header and payload together (and whatever follows it); the rest of a larger
    payload is received straight into its destination.

    Parameters
    ----------
    sock : socket.socket or ssl.SSLSocket
        A connected socket; its timeout is set to ``io_timeout``.
    io_timeout : float or None
        Progress timeout, seconds: once a frame has started (sending or receiving), each
        socket call must move bytes within this time, else :class:`LinkTimeoutError`.
        None waits forever; by default the socket's own timeout is kept. On a plain TCP socket
        it is the kernel's ``SO_RCVTIMEO``/``SO_SNDTIMEO`` of a blocking socket (no ``poll``
        before each call); over TLS, with ``$TB5SYNC_PORTABLE=1`` or where the options cannot be
        set, Python's socket timeout (a ``poll`` before each call).
    idle_timeout : float or None
        Seconds :meth:`recv_frame` waits for the first byte of the next frame; None waits
        forever (a dead peer is then found by TCP keepalive, see :func:`set_keepalive`).
        When it is longer than ``io_timeout`` on a socket with the kernel's timeouts, the wait
        ends at the first multiple of ``io_timeout`` not shorter than it.

    Attributes
    ----------
    bytes_sent, bytes_received : int
        Wire bytes including frame headers.
    max_payload : int
        Largest payload :meth:`recv_frame` accepts, bytes (checked before allocating); a server
        keeps it at :data:`tb5sync.wire.protocol.MAX_HANDSHAKE` until the peer is authenticated.
    max_decoded : int
        Most bytes a control payload (or DATA meta) received here may hold once decoded
        (:func:`tb5sync.wire.protocol.decode_control`, checked before decoding):
        :data:`tb5sync.wire.protocol.MAX_DECODED`, a server's :data:`tb5sync.wire.protocol.SERVER_MAX_DECODED`.
    """

    def __init__(self, sock: socket.socket, *, io_timeout: float | None | str = "keep", idle_timeout: float | None = None) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0
        self._hdr = bytearray(P.HEADER.size)
        #: read-ahead buffer (allocated on the first receive) and the unread bytes in it: [_rpos, _rend)
        self._rview: memoryview | None = None
        self._rpos = self._rend = 0
        #: the progress timeout is the kernel's (SO_RCVTIMEO/SO_SNDTIMEO), the socket blocking
        self._kernel_timeouts = False
        #: When set, large payloads are received into this pool's buffers (see :meth:`recv_frame`).
        self.pool: BufferPool | None = None
        self.closed = False
        self._error_sent = False
        #: A server's root directory: error messages sent on this channel name paths under it
        #: relative to it (a client never learns where the server's tree lives).
        self.hide_root: str | None = None
        self.max_payload = P.MAX_PAYLOAD
        self.max_decoded = P.MAX_DECODED
        self.tls = _is_tls(sock)
        #: file parts go out by pread + send (no os.sendfile here, $TB5SYNC_PORTABLE, or a file
        #: system that refused it once)
        self._no_sendfile = not hasattr(os, "sendfile") or portable()
        #: the reused block of file parts sent by read + send (under the send lock)
        self._copy_buf: memoryview | None = None
        #: :meth:`recv_body_to_file`'s pipe (made on first use) and buffer (its portable twin's)
        self._pipe: tuple[int, int] | None = None
        #: splice may be used (the environment is read once, when the channel is made)
        self._splice_ok = HAVE_SPLICE and not self.tls and not portable("TB5SYNC_SPLICE_PORTABLE")
        self._pipe_lock = threading.Lock()
        self._splicing = False
        self._rxbuf: bytearray | None = None
        self.idle_timeout = idle_timeout
        if io_timeout == "keep":
            self.io_timeout: float | None = sock.gettimeout()
        else:
            assert not isinstance(io_timeout, str)
            self.set_io_timeout(io_timeout)

    def set_io_timeout(self, seconds: float | None, *, kernel: bool = True) -> None:
        """Change the progress timeout (see the class docstring), seconds or None (none).

        ``kernel=False`` keeps it as Python's socket timeout (a socket about to be wrapped in TLS,
        whose library expects that); otherwise a plain TCP socket gets the kernel's, unless
        ``$TB5SYNC_PORTABLE=1``.
        """
        self.io_timeout = seconds
        want = (kernel and not self.tls and not portable() and (seconds is None or seconds > 0)
                and hasattr(socket, "SO_RCVTIMEO") and hasattr(socket, "SO_SNDTIMEO"))
        if want or self._kernel_timeouts:
            usecs = 0 if not want or seconds is None else max(1, round(seconds * 1e6))  # 0: none
            tv = _TIMEVAL.pack(usecs // 1_000_000, usecs % 1_000_000)
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            except OSError:  # refused (or a closed socket): Python's timeout then
                want = False
            self._kernel_timeouts = want
        self.sock.settimeout(None if want else seconds)

    @property
    def kernel_timeouts(self) -> bool:
        """True when the progress timeout is the kernel's ``SO_RCVTIMEO``/``SO_SNDTIMEO`` on a
        blocking socket, False when it is Python's socket timeout (a ``poll`` before each call)."""
        return self._kernel_timeouts

    # ---- sending ----------------------------------------------------------------------
    def _sendall_parts(self, parts: list[Any]) -> None:
        if len(parts) == 1 and type(parts[0]) is bytes:  # a control frame: one sendall
            with self._send_lock:
                try:
                    self.sock.sendall(parts[0])
                except OSError as exc:
                    raise _timeout_error(exc, "sending", self.io_timeout) from exc
                self.bytes_sent += len(parts[0])
            return
        total = sum(len(p) for p in parts)
        with self._send_lock:
            try:
                views: list[memoryview] = []
                for p in _joined_ranges(parts):
                    if isinstance(p, (FileRange, _Span)) and p.length <= READ_AHEAD and not (p.sendfile and not self._no_sendfile and not self.tls):
                        views.append(self._read_small(p))  # read now: one sendmsg for the frame
                    elif isinstance(p, (FileRange, _Span)):
                        if views:
                            self._send_views(views, socket.MSG_MORE)
                            views = []
                        self._send_file(p)
                    elif len(p):
                        views.append(memoryview(p).cast("B"))
                if views:
                    self._send_views(views, 0)
            except OSError as exc:
                raise _timeout_error(exc, "sending", self.io_timeout) from exc
            self.bytes_sent += total

    def _send_views(self, views: list[memoryview], flags: int) -> None:
        if self.tls:  # an SSLSocket has no sendmsg: one record stream, block by block
            for v in views:
                for off in range(0, len(v), _TLS_SEND_BLOCK):
                    block = v[off : off + _TLS_SEND_BLOCK]
                    while block:
                        block = block[self.sock.send(block) :]
            return
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

    def _read_small(self, part: FileRange | _Span) -> memoryview:
        """The bytes of a small file part (at most :data:`READ_AHEAD`), read into a new buffer so
        the frame goes out in one ``sendmsg``. A file that ends early fails as :meth:`_send_file`
        fails (``part.pad``: zeros; else ``OSError`` ``EIO``), before any of the frame is sent."""
        view = memoryview(bytearray(part.length))
        got = 0
        while got < part.length:
            k = read_into(part.fd.fd, view[got:], part.offset + got)
            if k <= 0:
                if not part.pad:
                    raise OSError(errno.EIO, f"file ended {part.length - got} bytes early while being sent; ending the connection")
                log.info("file ended %d bytes early while being sent; padding the frame", part.length - got)
                break  # the rest stays zeros
            got += k
        return view

    def _send_file(self, part: FileRange | _Span) -> None:
        """Send ``part`` with sendfile (read and send over TLS); if the file shrank meanwhile, pad
        the frame with zeros.

        The frame's length was announced before, so it must be completed; the zeros fail the
        receiver's digest check, whose re-request then finds the file changed.
        """
        off, left = part.offset, part.length
        while left:
            if self.tls or self._no_sendfile or not part.sendfile:  # sendfile would bypass the TLS record layer
                if self._copy_buf is None:
                    self._copy_buf = memoryview(bytearray(_TLS_SEND_BLOCK))
                k = read_into(part.fd.fd, self._copy_buf[: min(left, _TLS_SEND_BLOCK)], off)
                if k:
                    self._send_views([self._copy_buf[:k]], 0)  # sent whole before the buffer is reused
            else:
                try:
                    k = os.sendfile(self.sock.fileno(), part.fd.fd, off, left)
                except BlockingIOError:  # the socket has a timeout, so it is non-blocking
                    if not _wait_fd(self.sock.fileno(), True, self.io_timeout):
                        raise TimeoutError("sendfile made no progress") from None
                    continue
                except OSError as exc:  # a file (system) sendfile cannot read: nothing was sent
                    if exc.errno not in _NO_SENDFILE:
                        raise
                    self._no_sendfile = True
                    continue
            if k <= 0 and not part.pad:
                raise OSError(errno.EIO, f"file ended {left} bytes early while being sent; ending the connection")
            if k <= 0:
                log.info("file ended %d bytes early while being sent; padding the frame", left)
                self._send_views([memoryview(bytes(min(left, 1 << 20)))], 0)
                k = min(left, 1 << 20)
            off += k
            left -= k

    def send_control(self, ftype: P.FrameType, rid: int, msg: dict[str, Any]) -> None:
        """Send one control frame."""
        self._sendall_parts([P.encode_control(ftype, rid, msg)])

    def send_encoded(self, parts: list[Any]) -> None:
        """Send frames already encoded (:func:`~tb5sync.wire.protocol.encode_control`, or a DATA
        prefix from :func:`~tb5sync.wire.protocol.encode_data_prefix` followed by its body parts)."""
        self._sendall_parts(parts)

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
    def _take(self, view: memoryview) -> int:
        """Copy read-ahead bytes into ``view``; returns how many (at most ``len(view)``)."""
        k = min(self._rend - self._rpos, len(view))
        if k:
            assert self._rview is not None
            view[:k] = self._rview[self._rpos : self._rpos + k]
            self._rpos += k
        return k

    def _recv_exact(self, buf: bytearray | memoryview, *, start: bool = False) -> bool:
        """Fill ``buf`` from the read-ahead buffer, then the socket. False at a clean end of stream
        (nothing of ``buf`` received); ``start``: ``buf`` begins a frame (the idle wait applies)."""
        view = memoryview(buf)
        n = len(view)
        got = self._take(view) if self._rend > self._rpos else 0
        waited: float | None = None
        try:
            while got < n:
                left = n - got
                try:
                    if left >= READ_AHEAD:  # large: straight into its destination
                        k = self.sock.recv_into(view[got:], left)
                    else:  # small: one recv for it and what follows (the read-ahead is empty here)
                        if self._rview is None:
                            self._rview = memoryview(bytearray(READ_AHEAD))
                        k = self.sock.recv_into(self._rview, READ_AHEAD)
                        self._rpos, self._rend = 0, k
                        k = self._take(view[got:]) if k else 0
                except BlockingIOError:  # the kernel's timeout passed with nothing received
                    if not (start and got == 0 and self._idle_wait_goes_on(waited)):
                        raise
                    waited = time.monotonic() if waited is None else waited
                    continue
                if k == 0:
                    if got == 0:
                        return False
                    raise RemoteProtocolError("connection closed inside a frame")
                got += k
        except OSError as exc:
            raise _timeout_error(exc, "receiving a frame", self.io_timeout) from exc
        self.bytes_received += n
        return True

    def _idle_wait_goes_on(self, since: float | None) -> bool:
        """Whether the wait for a frame's first byte goes on after the kernel's timeout passed
        (``since``: when the first one passed). Raises :class:`LinkTimeoutError` once the idle
        timeout is over; False when the progress timeout is the one that applies."""
        idle, io = self.idle_timeout, self.io_timeout
        if idle is not None and (io is None or idle <= io):
            return False  # the progress timeout is the idle one (or polled for, see _wait_first_byte)
        assert io is not None
        if idle is not None and since is not None and time.monotonic() - since + io >= idle:
            raise LinkTimeoutError(f"the peer sent nothing for {idle:g} s (idle timeout)")
        return True

    def _wait_first_byte(self) -> None:
        """Wait up to :attr:`idle_timeout` for the next frame to start."""
        if self.idle_timeout == self.io_timeout or self._rend > self._rpos:
            return  # the socket's own timeout (or none) applies to the header's first recv
        if self._kernel_timeouts and (self.idle_timeout is None or (self.io_timeout is not None and self.idle_timeout > self.io_timeout)):
            return  # the header's first recv waits (_idle_wait_goes_on): no poll
        if self.tls and self.sock.pending():  # type: ignore[attr-defined]
            return
        try:
            ready = _wait_fd(self.sock.fileno(), False, self.idle_timeout)
        except (OSError, ValueError):  # closed meanwhile: recv reports it
            return
        if not ready:
            raise LinkTimeoutError(f"the peer sent nothing for {self.idle_timeout:g} s (idle timeout)")

    def recv_frame(self) -> tuple[P.Header, bytearray | memoryview] | None:
        """Receive one frame; None at a clean end of stream.

        With :attr:`pool` set, a payload of at least ``pool.min_size`` bytes is a memoryview of
        a pooled buffer (its ``obj``), which the consumer may give back with ``pool.put``.

        Raises
        ------
        RemoteProtocolError, VersionMismatchError
            Malformed frame, or longer than :attr:`max_payload` (checked before the payload
            is allocated).
        LinkTimeoutError
            Nothing arrived within :attr:`idle_timeout`, a started frame stalled for
            :attr:`io_timeout`, or keepalive found the link dead.
        OSError
            Other socket errors.
        """
        header = self.recv_header()
        if header is None:
            return None
        return header, self.recv_payload(header)

    def recv_header(self) -> P.Header | None:
        """Receive the next frame's header only (None at a clean end of stream); its payload must
        be read next, with :meth:`recv_payload` or :meth:`recv_data_into`.

        Raises
        ------
        As :meth:`recv_frame`.
        """
        pos = self._rpos
        if self._rend - pos >= P.HEADER.size:  # already read ahead
            assert self._rview is not None
            self._rpos = pos + P.HEADER.size
            self.bytes_received += P.HEADER.size
            return P.parse_header(self._rview[pos : self._rpos], max_payload=self.max_payload)
        self._wait_first_byte()
        if not self._recv_exact(self._hdr, start=True):
            return None
        return P.parse_header(self._hdr, max_payload=self.max_payload)

    def recv_payload(self, header: P.Header) -> bytearray | memoryview:
        """Receive the payload of ``header`` (see :meth:`recv_frame` for the pooled buffers).

        Raises
        ------
        As :meth:`recv_frame`.
        """
        pool = self.pool
        payload: bytearray | memoryview
        pos, n = self._rpos, header.length
        if self._rend - pos >= n and (pool is None or n < pool.min_size):  # read ahead whole: one copy
            assert self._rview is not None or n == 0
            self._rpos = pos + n
            self.bytes_received += n
            return bytearray(self._rview[pos : pos + n]) if n else bytearray()
        if pool is not None and header.length >= pool.min_size:
            payload = memoryview(pool.get(header.length))[: header.length]
        else:
            payload = bytearray(header.length)
        if header.length and not self._recv_exact(payload):
            raise RemoteProtocolError("connection closed inside a frame")
        return payload

    def recv_data_into(self, header: P.Header, into: memoryview) -> tuple[bytes, memoryview]:
        """Receive a DATA payload whose raw body goes straight into ``into`` (no copy after the socket).

        Returns ``(meta bytes, body)``: the msgpack meta, undecoded, and a view of ``into`` holding
        the body (its first ``len(body)`` bytes). A body longer than ``into`` is received into a
        buffer of its own instead (the returned view is then not of ``into``).

        Raises
        ------
        RemoteProtocolError
            ``header`` is not DATA, or its meta length does not fit the frame.
        LinkTimeoutError, OSError
            As :meth:`recv_frame`.
        """
        meta, n = self.recv_data_meta(header)
        body = into[:n] if n <= len(into) else memoryview(bytearray(n))
        if n and not self._recv_exact(body):
            raise RemoteProtocolError("connection closed inside a frame")
        return meta, body

    def recv_data_meta(self, header: P.Header) -> tuple[bytes, int]:
        """Receive a DATA payload's meta only: ``(meta bytes, body length)``; the body's bytes must be
        read next, all of them, with :meth:`recv_body_into`.

        Raises
        ------
        As :meth:`recv_data_into`.
        """
        if header.type is not P.FrameType.DATA or header.length < 4:
            raise RemoteProtocolError(f"expected a DATA frame of at least 4 bytes, got {header.type.name} of {header.length}")
        head = bytearray(4)
        if not self._recv_exact(head):
            raise RemoteProtocolError("connection closed inside a frame")
        mlen = int.from_bytes(head, "big")
        if mlen > min(header.length - 4, P.MAX_CONTROL):
            raise RemoteProtocolError(f"DATA meta length {mlen} exceeds frame payload {header.length}")
        meta = bytearray(mlen)
        if mlen and not self._recv_exact(meta):
            raise RemoteProtocolError("connection closed inside a frame")
        return bytes(meta), header.length - 4 - mlen

    def recv_body_into(self, view: memoryview) -> None:
        """Receive the next ``len(view)`` bytes of a DATA body announced by :meth:`recv_data_meta` into ``view``.

        Raises
        ------
        RemoteProtocolError, LinkTimeoutError, OSError
            The connection closed, stalled or broke inside the frame.
        """
        if len(view) and not self._recv_exact(view):
            raise RemoteProtocolError("connection closed inside a frame")

    @property
    def can_splice(self) -> bool:
        """Whether :meth:`recv_body_to_file` moves bytes with ``splice`` here: Linux, plain TCP, a
        blocking socket (the kernel's timeouts, or none), not ``$TB5SYNC_SPLICE_PORTABLE=1`` or
        ``$TB5SYNC_PORTABLE=1`` when the channel was made (then it receives into a buffer and
        ``pwrite``s it: the portable twin)."""
        return self._splice_ok and not self.closed and self.sock.gettimeout() is None

    def _splice_pipe(self) -> tuple[int, int]:
        if self._pipe is None:
            r, w = os.pipe2(os.O_CLOEXEC) if hasattr(os, "pipe2") else os.pipe()
            try:
                import fcntl
                fcntl.fcntl(w, _F_SETPIPE_SZ, SPLICE_PIPE)
            except OSError:
                pass  # the default 64 KiB: more calls, the same bytes
            self._pipe = (r, w)
        return self._pipe

    def _drop_pipe(self, closing: bool = False) -> None:
        """Close the splice pipe. ``closing`` (from :meth:`close`, any thread): only when no splice
        is using it; otherwise the receiving thread closes it when its splice returns."""
        with self._pipe_lock:
            if closing and self._splicing:
                return
            pipe, self._pipe = self._pipe, None
        if pipe is not None:
            for fd in pipe:
                os.close(fd)

    def recv_body_to_file(self, fd: int, spans: list[tuple[int, int]]) -> OSError | None:
        """Receive the next bytes of a DATA body announced by :meth:`recv_data_meta` straight into the
        file ``fd``: ``spans`` ``(offset, length)`` in order, their lengths summing to what is taken.

        With :attr:`can_splice`, each span goes socket -> pipe -> the file's page cache with
        ``splice`` (``tb5sync._os.io.splice_to_file``, GIL released): no copy into user space;
        otherwise it is received into a buffer and written (``pwrite``). The bytes are not checked
        here: the caller hashes them in the file. A failed write of the file does not end the
        frame: the rest of the body is received and dropped (the stream goes on) and the error is
        returned; None when every byte was written.

        Raises
        ------
        RemoteProtocolError, LinkTimeoutError, OSError
            The connection closed, stalled or broke inside the frame (the channel is then unusable).
        """
        err: OSError | None = None
        merged: list[tuple[int, int]] = []
        for off, n in spans:  # consecutive ranges (a cold file's chunks) in one splice call
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            elif n:
                merged.append((off, n))
        splice = self.can_splice
        for off, n in merged:
            k = min(n, self._rend - self._rpos)
            if k:  # read ahead with the meta: written from the buffer
                assert self._rview is not None
                if err is None:
                    try:
                        pwrite_all(fd, self._rview[self._rpos : self._rpos + k], off)
                    except OSError as exc:
                        err = exc
                self._rpos += k
                self.bytes_received += k
                off, n = off + k, n - k
            if not n:
                continue
            if err is None and splice:
                with self._pipe_lock:
                    if self.closed:
                        raise RemoteProtocolError("connection closed inside a frame")
                    pr, pw = self._splice_pipe()
                    self._splicing = True
                try:
                    taken, written, code, side = splice_to_file(self.sock.fileno(), pr, pw, fd, off, n, SPLICE_PIPE)
                finally:
                    with self._pipe_lock:
                        self._splicing = False
                    if self.closed:
                        self._drop_pipe()
                self.bytes_received += taken
                if side == 0 or side == 2:
                    self._drop_pipe()  # it may hold bytes of this frame
                    if side == 2:
                        raise RemoteProtocolError("connection closed inside a frame")
                    exc0 = BlockingIOError(code, os.strerror(code)) if code in (errno.EAGAIN, errno.EWOULDBLOCK) else OSError(code, os.strerror(code))
                    raise _timeout_error(exc0, "receiving a frame", self.io_timeout) from None
                if side == 1:
                    err = OSError(code, os.strerror(code))
                    self._drop_pipe()  # what the file refused stays in it: a fresh pipe next time
                    off, n = off + taken, n - taken  # the rest of this span is dropped below
                else:
                    continue
            if err is None:  # the portable twin: a buffer, then pwrite
                view = memoryview(self._scratch(min(n, SPLICE_PIPE)))
                while n:
                    k = min(n, len(view))
                    if not self._recv_exact(view[:k]):
                        raise RemoteProtocolError("connection closed inside a frame")
                    if err is None:
                        try:
                            pwrite_all(fd, view[:k], off)
                        except OSError as exc:
                            err = exc
                    off, n = off + k, n - k
            else:
                view = memoryview(self._scratch(min(n, SPLICE_PIPE)))
                while n:
                    k = min(n, len(view))
                    if not self._recv_exact(view[:k]):
                        raise RemoteProtocolError("connection closed inside a frame")
                    n -= k
        return err

    def _scratch(self, n: int) -> bytearray:
        """This channel's reused buffer of at least ``n`` bytes (the portable twin's, the dropped bytes')."""
        if self._rxbuf is None or len(self._rxbuf) < n:
            self._rxbuf = bytearray(max(n, 1))
        return self._rxbuf

    def peer_closed(self) -> bool:
        """True when the peer has closed the stream or sent something unasked (checked without
        blocking): the channel then cannot carry a new request safely."""
        if self.closed or self._rend > self._rpos:
            return True
        try:
            if not _wait_fd(self.sock.fileno(), False, 0):
                return False
        except (OSError, ValueError):
            return True
        if not self.tls:
            return True  # readable between requests: an end of stream, a BYE or an ERROR
        # TLS: the readable bytes may be a record that carries no data (a session ticket, a key
        # update); read without blocking to tell. Data or an end of stream means the channel is done.
        timeout = self.sock.gettimeout()
        try:
            self.sock.settimeout(0)
            self.sock.recv(1)
            return True
        except sys.modules["ssl"].SSLWantReadError:  # self.tls: ssl is imported
            return False
        except OSError:
            return True
        finally:
            self.sock.settimeout(timeout)

    @property
    def buffered(self) -> int:
        """Bytes received and read ahead but not yet taken (a frame's start past the last one read)."""
        return self._rend - self._rpos

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
        self._drop_pipe(closing=True)


def client_handshake(ch: Channel, token: bytes | None) -> None:
    """Run the client side of the handshake on ``ch`` (see :mod:`tb5sync.wire.protocol`).

    Raises
    ------
    AuthError, VersionMismatchError, RemoteProtocolError, ConnectError
    """
    hs = P.ClientHandshake(token, os.urandom(P.NONCE_SIZE))
    limit, ch.max_payload = ch.max_payload, P.MAX_HANDSHAKE  # nor does an unproven server pin our memory
    ch._sendall_parts([hs.start()])
    while not hs.done:
        got = ch.recv_frame()
        if got is None:
            raise ConnectError("server closed the connection during the handshake")
        out = hs.on_frame(P.Frame(*got))
        if out:
            ch._sendall_parts([out])
    ch.max_payload = limit


def server_handshake(ch: Channel, token: bytes | None,
                     gate: Callable[[], Callable[[], None] | None] | None = None) -> None:
    """Run the server side of the handshake on ``ch``.

    Until the client is authenticated, frames longer than :data:`tb5sync.wire.protocol.MAX_HANDSHAKE`
    are refused before anything is allocated; the caller sets :attr:`Channel.max_payload` for
    what follows. On failure an ERROR frame is sent to the client before the error is re-raised.
    ``gate`` is :class:`tb5sync.wire.protocol.ServerHandshake`'s: called right before the MAC is
    checked, it may refuse with ``AuthError``.

    Raises
    ------
    AuthError, VersionMismatchError, RemoteProtocolError, ConnectError
    """
    hs = P.ServerHandshake(token, os.urandom(P.NONCE_SIZE), gate)
    ch.max_payload = P.MAX_HANDSHAKE
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


#: The address families a client may be limited to: family -> (name, rsync's flag).
FAMILIES = {socket.AF_INET: ("IPv4", "-4"), socket.AF_INET6: ("IPv6", "-6")}


def _open_tcp(host: str, port: int, timeout: float, family: int = 0) -> socket.socket:
    """A TCP connection to ``host:port``: each address ``getaddrinfo`` gives (of ``family`` only,
    when not 0) tried in turn, as ``socket.create_connection`` does.

    Raises
    ------
    ConnectError
        The name does not resolve (to an address of ``family``: the message says which family was
        asked and what the name does resolve to), or no address accepted the connection.
    """
    where = host_port(host, port)
    try:
        infos = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        if family not in FAMILIES:
            raise ConnectError(f"cannot connect to {where}: {why}") from exc
        name, flag = FAMILIES[family]
        try:  # what the name does resolve to, to say why the family asked for fails
            others = sorted({FAMILIES.get(i[0], ("?", ""))[0] for i in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)})
        except (OSError, UnicodeError):
            others = []
        has = f"{host} has only {' and '.join(others)} addresses" if others else f"{host} does not resolve ({why})"
        raise ConnectError(f"cannot connect to {where} over {name} ({flag} asked): {has}") from exc
    last: OSError | None = None
    for fam, kind, proto, _, addr in infos:
        sock = socket.socket(fam, kind, proto)
        try:
            sock.settimeout(timeout)
            sock.connect(addr)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
    asked = f" over {FAMILIES[family][0]}" if family in FAMILIES else ""
    why = (last.strerror or str(last)) if last is not None else "no address"
    raise ConnectError(f"cannot connect to {where}{asked}: {why}") from last


def connect(
    host: str,
    port: int,
    token: bytes | None,
    timeout: float = 10.0,
    *,
    io_timeout: float | None = IO_TIMEOUT,
    keepalive: float | None = KEEPALIVE,
    tls: ssl.SSLContext | None = None,
    family: int = 0,
) -> Channel:
    """Open a TCP connection to a tb5sync server (TLS when ``tls`` is given) and authenticate.

    Parameters
    ----------
    host, port
        Server address.
    token : bytes or None
        Shared secret.
    timeout : float
        Seconds allowed for connecting and for the handshake (TLS's included).
    io_timeout : float or None
        Progress timeout of the returned channel, seconds (see :class:`Channel`); also
        ``TCP_USER_TIMEOUT``. None: no timeout.
    keepalive : float or None
        TCP keepalive idle time, seconds (see :func:`set_keepalive`); None: off.
    tls : ssl.SSLContext or None
        Wrap the connection in TLS with this client context (its CA and hostname checks).
    family : int
        ``socket.AF_INET`` or ``socket.AF_INET6`` to use only that address family (rsync's ``-4``,
        ``-6``); 0 (``AF_UNSPEC``): any, in the resolver's order.

    Raises
    ------
    ConnectError
        Unreachable host, refused connection, a host with no address of the asked ``family``, or
        a failed TLS handshake (naming the address).
    BusyError
        The server is at its connection or session cap.
    AuthError, VersionMismatchError, RemoteProtocolError
        From the handshake.
    """
    sock = _open_tcp(host, port, timeout, family)
    tune_socket(sock)
    set_keepalive(sock, keepalive, io_timeout)
    if tls is not None:
        import ssl

        try:
            sock = tls.wrap_socket(sock, server_hostname=host)
        except (ssl.SSLError, ssl.CertificateError, OSError) as exc:
            sock.close()
            why = getattr(exc, "reason", None) or str(exc)
            detail = getattr(exc, "verify_message", None)
            raise ConnectError(f"TLS handshake with {host_port(host, port)} failed: {why}{f' ({detail})' if detail else ''}") from exc
    ch = Channel(sock)
    try:
        client_handshake(ch, token)
    except Tb5syncError:
        ch.close()
        raise
    except OSError as exc:
        ch.close()
        raise ConnectError(f"connection to {host_port(host, port)} failed during the handshake: {exc}") from exc
    except BaseException:
        ch.close()
        raise
    ch.set_io_timeout(io_timeout)
    return ch


def client_tls(cafile: str | os.PathLike[str] | None = None) -> ssl.SSLContext:
    """A TLS client context: the system's CAs, or only ``cafile``'s; hostname checked; TLS >= 1.2.

    Raises
    ------
    UsageError
        ``cafile`` cannot be read or holds no certificate.
    """
    import ssl

    from tb5sync.errors import UsageError

    try:
        ctx = ssl.create_default_context(cafile=None if cafile is None else os.fspath(cafile))
    except (OSError, ssl.SSLError) as exc:
        raise UsageError(f"cannot load TLS CA file {os.fspath(cafile or '')}: {getattr(exc, 'strerror', None) or exc}") from exc
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def dial(
    host: str,
    port: int,
    token: bytes | None,
    *,
    tls: bool = False,
    tls_ca: str | os.PathLike[str] | None = None,
    io_timeout: float | None = IO_TIMEOUT,
    timeout: float = 10.0,
    family: int = 0,
) -> Channel:
    """:func:`connect` with the client's defaults: TLS when ``tls`` (CAs from ``tls_ca`` or the
    system), keepalive a quarter of ``io_timeout`` (at most :data:`KEEPALIVE`; a dead link is then
    found within about ``io_timeout / 2``).

    Raises
    ------
    ConnectError, BusyError, AuthError, VersionMismatchError, RemoteProtocolError, UsageError
        As :func:`connect`; ``UsageError`` for an unreadable ``tls_ca``.
    """
    keepalive = KEEPALIVE if io_timeout is None else max(1.0, min(KEEPALIVE, io_timeout / 4))
    ctx = client_tls(tls_ca) if tls or tls_ca is not None else None
    return connect(host, port, token, timeout, io_timeout=io_timeout, keepalive=keepalive, tls=ctx, family=family)
