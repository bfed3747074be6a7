"""Requests and replies over channels: one pipelined client, one direct call, one serving loop.

:class:`Requester` sends requests over one or more :class:`~tb5sync.wire.transport.Channel`
without waiting for replies (pipelining) and resolves a
:class:`concurrent.futures.Future` per request; :func:`call_direct` sends one request on a
channel and reads its reply in the caller's thread (the fsspec face's small-op path);
:func:`serve` answers requests on a channel by calling a handler object's methods. Every
reply frame is turned into a result or an error by one function, :func:`reply_of`.
"""

from __future__ import annotations

import itertools
import logging
import threading
from concurrent.futures import Future, InvalidStateError
from collections.abc import Callable
from typing import Any

import tb5sync.wire.protocol as P
from tb5sync.errors import (
    shown,
    SHOWN_LIMIT,
    ConnectError,
    ConnectionClosedError,
    LocalProtocolError,
    ProtocolError,
    RemoteOSError,
    RemoteProtocolError,
    Tb5syncError,
    UsageError,
    closed_mid_transfer,
)
from tb5sync._os.io import populated_buffer
from tb5sync.wire.parts import close_parts
from tb5sync.wire.transport import BufferPool, Channel

__all__ = ["DataBody", "Requester", "call_direct", "open_session", "serve", "split_parts", "reply_of"]

log = logging.getLogger(__name__)


def reply_of(header: P.Header, payload: bytes | bytearray | memoryview, max_decoded: int = P.MAX_DECODED) -> Any:
    """The result a reply frame carries: a dict (RESPONSE) or ``(meta, body)`` (DATA).

    ``max_decoded``: the decode limit (bytes) of the channel it came on (``Channel.max_decoded``).

    Raises
    ------
    Tb5syncError
        The peer's error, for an ERROR frame (see :func:`tb5sync.wire.protocol.error_from_body`).
    RemoteProtocolError
        Any other frame type.
    """
    if header.type is P.FrameType.RESPONSE:
        return P.decode_control(payload, max_decoded=max_decoded)
    if header.type is P.FrameType.DATA:
        return P.decode_data(payload, max_decoded)
    if header.type is P.FrameType.ERROR:
        raise P.error_from_body(P.decode_control(payload, max_decoded=max_decoded))
    raise RemoteProtocolError(f"unexpected {header.type.name} frame in reply")


def call_direct(ch: Channel, method: str, args: dict[str, Any], into: memoryview | None = None) -> Any:
    """Send one request on ``ch`` and read its reply in this thread.

    The caller owns ``ch`` for the exchange (no reader thread runs on it). Returns what
    :func:`reply_of` returns; with ``into``, a DATA reply's body is received straight into that
    buffer (see :meth:`Requester.submit`).

    Raises
    ------
    ConnectError
        The connection broke or closed (the channel's state is then unknown: close it).
    Tb5syncError
        The server's error for this request.
    """
    try:
        ch.send_control(P.FrameType.REQUEST, 1, {"m": method, "a": args})
        header = ch.recv_header()
        if header is None:
            raise closed_mid_transfer("server")
        if into is not None and header.type is P.FrameType.DATA:
            meta, body = ch.recv_data_into(header, into)
            return P.decode_control(meta, P.DATA_META_PER_CONTAINER, ch.max_decoded), body
        payload = ch.recv_payload(header)
    except OSError as exc:
        if isinstance(exc, Tb5syncError):
            raise
        raise closed_mid_transfer("server", exc) from exc
    return reply_of(header, payload, ch.max_decoded)


def open_session(ch: Channel, msg: dict[str, Any]) -> dict[str, Any]:
    """Send OPEN with ``msg`` and wait for its RESPONSE (or raise the peer's ERROR)."""
    ch.send_control(P.FrameType.OPEN, 0, msg)
    got = ch.recv_frame()
    if got is None:
        raise ConnectError("server closed the connection instead of answering OPEN")
    header, payload = got
    if header.type not in (P.FrameType.ERROR, P.FrameType.RESPONSE):
        raise RemoteProtocolError(f"expected RESPONSE to OPEN, got {header.type.name}")
    body: dict[str, Any] = reply_of(header, payload, ch.max_decoded)
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
    peer : str
        Who is at the other end (``"server"``, or ``"client"`` on the server's side): a connection
        it closes mid-session fails the pending and later requests with
        :class:`~tb5sync.errors.ConnectionClosedError` naming it.
    """

    def __init__(self, channels: list[Channel], peer: str = "server") -> None:
        if not channels:
            raise UsageError("a requester needs at least one channel")
        self.channels = channels
        self.peer = peer
        #: Receive buffers shared by the channels; DATA bodies are views into them.
        self.pool = BufferPool(max_buffers=16, make=populated_buffer)
        for ch in channels:
            ch.pool = self.pool
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: list[dict[int, Future[Any]]] = [{} for _ in channels]
        #: per channel, request id -> (buffer a DATA reply's body goes into, the buffer's owner)
        self._into: list[dict[int, tuple[memoryview, Any]]] = [{} for _ in channels]
        #: per channel, request id -> what takes a DATA reply's body off the channel (see submit)
        self._sinks: list[dict[int, Callable[[Channel, dict[str, Any], int], Any]]] = [{} for _ in channels]
        self._rr = itertools.cycle(range(len(channels)))
        #: per channel, frames of deferred requests (``submit(defer=True)``) and their ids, sent by :meth:`flush`
        self._held: list[list[tuple[int, bytes]]] = [[] for _ in channels]
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

    def submit(self, method: str, args: dict[str, Any], *, channel: int | None = None,
               into: memoryview | None = None, owner: Any = None,
               sink: Callable[[Channel, dict[str, Any], int], Any] | None = None,
               future: Any = None, defer: bool = False) -> Any:
        """Send a request and return its future. ``channel=None`` picks streams round-robin.

        ``defer``: the request is encoded and registered now but sent by the next :meth:`flush`,
        with every other deferred one of its channel in one ``sendall`` (many requests made
        together cost one system call per channel on each side, not one each); should that send
        fail, their futures fail with :class:`~tb5sync.errors.ConnectError` as a lost reply does.

        ``future``: what the reply settles instead of a new :class:`concurrent.futures.Future`,
        any object with ``set_result(value)`` and ``set_exception(exc)`` called once on a reader
        thread (:meth:`LoopReplies.future`: an event loop's future, no thread hop per reply).

        With ``into`` (a writable byte view), a DATA reply's raw body is received straight into it
        (no copy after the socket): the future's result is ``(meta, view)`` with ``view`` the first
        ``len(body)`` bytes of ``into`` (a body longer than ``into`` gets a buffer of its own).
        ``owner`` (the object behind ``into``) is kept alive until the reply has been read, even
        when the future is cancelled; nothing else may read ``into`` before the future is done.

        With ``sink``, a DATA reply is handed to ``sink(channel, meta, body_length)`` on the reader
        thread once its meta is in: it must take exactly ``body_length`` bytes from the channel
        (``recv_body_into``, ``recv_body_to_file``) and return the future's result; it raises only
        for a broken stream (``ProtocolError``, ``OSError``), which fails the stream.

        Raises
        ------
        ConnectError
            The chosen channel is already dead.
        """
        idx = next(self._rr) if channel is None else channel
        fut: Any = Future() if future is None else future
        with self._lock:
            dead = self._dead[idx]
            if dead is not None:
                if isinstance(dead, ConnectionClosedError):  # one line: the peer went away
                    raise ConnectionClosedError(str(dead))
                raise ConnectError(f"stream {idx} is closed: {dead}")
            rid = next(self._ids) & 0xFFFFFFFF
            self._pending[idx][rid] = fut
            if into is not None:
                self._into[idx][rid] = (into, owner)
            if sink is not None:
                self._sinks[idx][rid] = sink
        if defer:
            try:
                frame = P.encode_control(P.FrameType.REQUEST, rid, {"m": method, "a": args})
            except BaseException:
                with self._lock:
                    self._pending[idx].pop(rid, None)
                    self._into[idx].pop(rid, None)
                    self._sinks[idx].pop(rid, None)
                raise
            with self._lock:
                self._held[idx].append((rid, frame))
            return fut
        try:
            self.channels[idx].send_control(P.FrameType.REQUEST, rid, {"m": method, "a": args})
        except OSError as exc:
            with self._lock:
                self._pending[idx].pop(rid, None)
                self._into[idx].pop(rid, None)
                self._sinks[idx].pop(rid, None)
            raise closed_mid_transfer(self.peer, exc) from exc
        return fut

    def flush(self) -> None:
        """Send every deferred request (``submit(defer=True)``), one ``sendall`` per channel. A
        channel that fails to send fails those requests' futures (:class:`ConnectError`); never raises."""
        for idx, ch in enumerate(self.channels):
            with self._lock:
                held, self._held[idx] = self._held[idx], []
            if not held:
                continue
            frames = [f for _, f in held]
            try:
                # small frames joined (one buffer); large ones (wwrite bodies) sent as they are, no copy
                ch.send_encoded([b"".join(frames)] if sum(map(len, frames)) <= 1 << 20 else frames)
            except OSError as exc:
                err = closed_mid_transfer(self.peer, exc)
                with self._lock:
                    futs = [self._pending[idx].pop(rid, None) for rid, _ in held]
                    for rid, _ in held:
                        self._into[idx].pop(rid, None)
                        self._sinks[idx].pop(rid, None)
                for fut in futs:
                    if fut is not None:
                        _resolve(fut, exc=err)

    def submit_data(self, method: str, args: dict[str, Any], parts: list[Any], *, channel: int) -> Future[Any]:
        """Send a request as a DATA frame (meta ``{"m": method, "a": args}``, then the raw ``parts``:
        bytes-like or :class:`~tb5sync.wire.parts.FileRange`, the latter sent with ``sendfile`` where the
        channel allows, read and sent otherwise) on ``channel``; returns its future. The call
        returns once the frame is sent (the calling thread sends it). A server takes such requests
        only for its data methods (``serve(data_methods=)``).

        Raises
        ------
        ConnectError
            The channel is dead, or broke while sending.
        """
        fut: Future[Any] = Future()
        with self._lock:
            if self._dead[channel] is not None:
                raise ConnectError(f"stream {channel} is closed: {self._dead[channel]}")
            rid = next(self._ids) & 0xFFFFFFFF
            self._pending[channel][rid] = fut
        try:
            self.channels[channel].send_data(rid, {"m": method, "a": args}, parts)
        except OSError as exc:
            with self._lock:
                self._pending[channel].pop(rid, None)
            raise ConnectError(f"connection lost while sending {method}: {exc}") from exc
        return fut

    def call(self, method: str, args: dict[str, Any], *, channel: int = 0, timeout: float | None = None) -> Any:
        """Send a request and wait for its reply."""
        return self.submit(method, args, channel=channel).result(timeout)

    def _reader(self, idx: int) -> None:
        ch = self.channels[idx]
        pending = self._pending[idx]
        intos = self._into[idx]
        sinks = self._sinks[idx]
        err: BaseException = closed_mid_transfer(self.peer)
        try:
            while True:
                header = ch.recv_header()
                if header is None:
                    break
                # the request stays pending until its whole reply is in: a connection lost inside
                # the frame must fail its future too (below, with the others)
                with self._lock:
                    into = intos.get(header.rid)
                    sink = sinks.get(header.rid)
                if sink is not None and header.type is P.FrameType.DATA:
                    raw_meta, nbody = ch.recv_data_meta(header)
                    meta = P.decode_control(raw_meta, P.DATA_META_PER_CONTAINER, ch.max_decoded)
                    result = sink(ch, meta, nbody)
                    with self._lock:
                        fut = pending.pop(header.rid, None)
                        sinks.pop(header.rid, None)
                    if fut is not None:
                        _resolve(fut, result)
                    del sink, result, fut
                    continue
                if into is not None and header.type is P.FrameType.DATA:
                    raw_meta, body = ch.recv_data_into(header, into[0])
                    meta = P.decode_control(raw_meta, P.DATA_META_PER_CONTAINER, ch.max_decoded)
                    with self._lock:
                        fut = pending.pop(header.rid, None)
                        intos.pop(header.rid, None)
                    if fut is not None:
                        _resolve(fut, (meta, body))
                    # hold no view of the caller's buffer while waiting for the next frame: its owner
                    # (a mapping of a file) may be closed as soon as every reply is in
                    del into, body, fut
                    continue
                payload = ch.recv_payload(header)
                with self._lock:
                    fut = pending.pop(header.rid, None)
                    intos.pop(header.rid, None)
                    sinks.pop(header.rid, None)
                if header.type is P.FrameType.BYE:
                    break
                if fut is None and header.type is not P.FrameType.ERROR:
                    raise RemoteProtocolError(f"reply to unknown request id {header.rid}")
                try:
                    result = reply_of(header, payload, ch.max_decoded)
                except ProtocolError:
                    raise
                except Tb5syncError as exc:
                    if fut is None:  # session-level error
                        err = exc
                        break
                    _resolve(fut, exc=exc)
                    continue
                _resolve(fut, result)
        except (ProtocolError, OSError) as exc:
            err = exc if isinstance(exc, Tb5syncError) else closed_mid_transfer(self.peer, exc)
        with self._lock:
            self._dead[idx] = err
            left = list(pending.values())
            pending.clear()
            intos.clear()
            sinks.clear()
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


class LoopReplies:
    """Replies to requests made from one asyncio event loop, settled on that loop in batches.

    A reader thread settling each reply through :func:`asyncio.wrap_future` pays for a
    :class:`concurrent.futures.Future` (with its lock and condition), a callback chain and one
    ``call_soon_threadsafe`` (a write to the loop's wake-up pipe) per reply. Here a reply is
    appended to a queue, and the loop is woken only when the queue was empty: a burst of replies
    (many requests in flight) is settled by one callback on the loop. A future the caller
    cancelled meanwhile is skipped (its reply is dropped, as :func:`_resolve` drops it).

    ``loop``: the event loop (only its ``call_soon_threadsafe`` is used). Thread-safe.
    """

    __slots__ = ("loop", "_queue", "_lock", "_scheduled")

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self._queue: list[tuple[Any, Any, BaseException | None]] = []
        self._lock = threading.Lock()
        self._scheduled = False

    def future(self) -> tuple[Any, _LoopSettle]:
        """``(awaitable, settle)``: a new future of the loop, and the object to pass as
        :meth:`Requester.submit`'s ``future`` (it settles the awaitable on the loop)."""
        afut = self.loop.create_future()
        return afut, _LoopSettle(self, afut)

    def settle(self, afut: Any, result: Any, exc: BaseException | None) -> None:
        """Queue ``afut``'s outcome (from any thread); wake the loop if nothing was queued."""
        with self._lock:
            self._queue.append((afut, result, exc))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody waits any more
            with self._lock:
                self._queue.clear()
                self._scheduled = False

    def _drain(self) -> None:
        with self._lock:
            items, self._queue = self._queue, []
            self._scheduled = False
        for afut, result, exc in items:
            if afut.done():  # cancelled by its caller
                continue
            if exc is not None:
                afut.set_exception(exc)
            else:
                afut.set_result(result)


class _LoopSettle:
    """What a reader thread settles for a request of :class:`LoopReplies`."""

    __slots__ = ("replies", "afut")

    def __init__(self, replies: LoopReplies, afut: Any) -> None:
        self.replies = replies
        self.afut = afut

    def set_result(self, result: Any) -> None:
        self.replies.settle(self.afut, result, None)

    def set_exception(self, exc: BaseException) -> None:
        self.replies.settle(self.afut, None, exc)


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


def _unsendable(ch: Channel, rid: int, method: Any, exc: BaseException) -> None:
    """Answer request ``rid`` whose reply could not be encoded with one ERROR (and one log line)."""
    log.warning("request %s: reply cannot be sent: %s: %s", method, type(exc).__name__, exc)
    ch.send_error(rid, RemoteOSError(f"{method}: the reply cannot be sent ({type(exc).__name__}: {exc})"))


class DataBody:
    """The raw body of a DATA request, still on its connection: the handler receives it in slices
    (:meth:`readinto`), straight into where it goes; :func:`serve` discards whatever the handler left.

    ``len(body)`` is its length in bytes. A connection that breaks inside it is recorded in
    :attr:`failed` (and raised), which ends the serving loop instead of answering the request.
    """

    __slots__ = ("_ch", "length", "left", "failed")

    def __init__(self, ch: Channel, length: int) -> None:
        self._ch, self.length, self.left = ch, length, length
        self.failed: BaseException | None = None

    def __len__(self) -> int:
        return self.length

    def readinto(self, view: memoryview) -> int:
        """Receive the next ``min(len(view), bytes left)`` bytes into ``view``; returns how many (0 at the end).

        Raises
        ------
        RemoteProtocolError, LinkTimeoutError, OSError
            The connection broke inside the body (recorded in :attr:`failed`).
        """
        n = min(len(view), self.left)
        if n:
            try:
                self._ch.recv_body_into(view[:n])
            except BaseException as exc:
                self.failed = exc
                raise
            self.left -= n
        return n

    def discard(self, scratch: memoryview) -> None:
        """Receive and drop the bytes the handler did not read."""
        while self.left:
            self.readinto(scratch)



def serve(ch: Channel, handler: Any, methods: frozenset[str],
          args_from_wire: Callable[[str, dict[str, Any]], dict[str, Any]] | None = None,
          data_methods: frozenset[str] = frozenset()) -> None:
    """Answer requests on ``ch`` by calling ``handler.<method>(**args)`` until BYE or end of stream.

    A method returning a dict is answered with RESPONSE; one returning
    ``(meta, parts)`` with a DATA frame. A :class:`Tb5syncError`, ``OSError`` or
    bad arguments become an ERROR reply for that request and serving goes on;
    so does a reply that cannot be encoded (a value msgpack cannot carry, or too
    large): that request gets an ERROR naming why, logged on one line.
    ``args_from_wire(method, args)``: the arguments as the handler takes them;
    ``data_methods``: methods (also in ``methods``) that arrive as a DATA frame instead of a
    REQUEST (meta ``{"m", "a"}``, then the raw body, passed as ``data=``, a :class:`DataBody` the
    method receives in slices straight into their destination during the call);
    a protocol violation ends the loop (after an ERROR frame) but never raises
    past it except as the returned exception's re-raise.

    Raises
    ------
    RemoteProtocolError, VersionMismatchError
        The peer broke the protocol (an ERROR frame was sent first).
    """
    scratch: memoryview | None = None
    while True:
        body: DataBody | None = None
        try:
            header = ch.recv_header()
            if header is None:
                return
            if header.type is P.FrameType.DATA and data_methods:
                raw_meta, nbody = ch.recv_data_meta(header)
                body = DataBody(ch, nbody)
                if scratch is None:
                    scratch = memoryview(bytearray(1 << 16))
                msg = P.decode_control(raw_meta, P.DATA_META_PER_CONTAINER, ch.max_decoded)
                payload: Any = b""
            else:
                payload = ch.recv_payload(header)
        except ProtocolError as exc:
            ch.send_error(0, exc)
            raise
        if header.type is P.FrameType.BYE:
            return
        if header.type is P.FrameType.ERROR:
            raise P.error_from_body(P.decode_control(payload, max_decoded=ch.max_decoded))
        if header.type is not P.FrameType.REQUEST and body is None:
            exc = RemoteProtocolError(f"expected REQUEST, got {header.type.name}")
            ch.send_error(0, exc)
            raise exc
        if body is None:
            try:
                msg = P.decode_control(payload, max_decoded=ch.max_decoded)
            except RemoteProtocolError as exc:
                ch.send_error(0, exc)
                raise
        method = msg.get("m")
        args = msg.get("a", {})
        try:
            if not isinstance(method, str) or method not in methods or not isinstance(args, dict):
                raise UsageError(f"unknown request {shown(method)}")
            if (body is not None) != (method in data_methods):
                raise UsageError(f"request {shown(method)} {'must not' if body is not None else 'must'} come as a DATA frame")
            if args_from_wire is not None:
                args = args_from_wire(method, args)
            if body is not None:
                args = {**args, "data": body}
            try:
                result = getattr(handler, method)(**args)
            except TypeError as exc:
                raise UsageError(f"bad arguments for {method}: {str(exc)[:SHOWN_LIMIT]}") from exc
        except (Tb5syncError, OSError, ValueError) as exc:
            if body is not None:
                if body.failed is not None:  # the connection broke inside the body
                    raise body.failed from None
                assert scratch is not None
                body.discard(scratch)  # the stream goes on at the next frame
            if isinstance(exc, OSError) and not isinstance(exc, Tb5syncError):
                log.info("request %s failed: %s", method, exc)
            ch.send_error(header.rid, exc)
            continue
        if body is not None:
            assert scratch is not None
            body.discard(scratch)
        if isinstance(result, tuple):
            meta, parts = result
            del result
            try:
                try:
                    prefix = P.encode_data_prefix(header.rid, meta, sum(len(p) for p in parts))
                except (ValueError, TypeError, OverflowError, LocalProtocolError) as exc:
                    _unsendable(ch, header.rid, method, exc)
                    continue
                ch.send_encoded([prefix, *parts])
            finally:
                close_parts(parts)
                # no reference to a sent reply while the next request is answered: its parts may
                # be views of a reused buffer (the sender's ReadBuffers), free again once unviewed
                del meta, parts
        elif isinstance(result, dict):
            try:
                frame = P.encode_control(P.FrameType.RESPONSE, header.rid, result)
            except (ValueError, TypeError, OverflowError, LocalProtocolError) as exc:
                _unsendable(ch, header.rid, method, exc)
                continue
            ch.send_encoded([frame])
        else:
            raise LocalProtocolError(f"handler {method} returned {type(result).__name__}")
