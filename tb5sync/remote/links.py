"""Links: how a receiver reaches its sender, in the same process or across the wire.

A link has one method that matters, ``submit(method, **args) -> Future``, with the
sender's request vocabulary (:data:`tb5sync.wire.messages.SENDER_METHODS`); ``recycle(parts)``
gives a DATA reply's receive buffer back, ``streams`` and ``wire_bytes`` describe it, and
``close()`` ends it. :class:`LocalLink` calls an in-process :class:`~tb5sync.roles.sender.Sender`
on a small thread pool (local sync); :class:`RemoteLink` sends the requests through a
:class:`~tb5sync.wire.rpc.Requester` (push on the server, pull on the client). The receiver is
the same code over both.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from tb5sync.errors import RemoteProtocolError
from tb5sync.wire.messages import CODEC_RAW, DATA_METHODS, READ_METHODS, args_to_wire
from tb5sync.wire.parts import InFile
from tb5sync.wire.rpc import Requester, split_parts
from tb5sync.roles.sender import Sender

if TYPE_CHECKING:  # typing only: the links reach sockets through the requester
    from tb5sync.wire.transport import Channel

__all__ = ["Link", "LocalLink", "RemoteLink"]

T = TypeVar("T")
#: A reply whose caller cancelled it before its body was taken into the file (then never runs).
_CANCELLED = object()


class Link(Protocol):
    """What a :class:`~tb5sync.roles.receiver.Receiver` needs of the way to its sender."""

    streams: int

    @property
    def wire_bytes(self) -> int:
        """Bytes sent and received so far, frames included (0 in process)."""
        ...

    def submit(self, method: str, **args: Any) -> Future[Any]:
        """Send one sender request; the future settles with its reply (a dict, or ``(meta, parts)`` for DATA)."""
        ...

    def recycle(self, parts: list[Any]) -> None:
        """Give back the buffer under a DATA reply's ``parts`` once nothing reads them again."""
        ...

    def submit_then(self, method: str, then: Callable[[dict[str, Any], Any], T], *,
                    into_file: tuple[int, list[int], list[int]] | None = None, **args: Any) -> Future[T]:
        """:meth:`submit` a DATA request; ``then(meta, parts)`` runs as soon as its reply is in, on
        the thread that received it (a stream's reader), and the future settles with its result.

        ``into_file=(fd, offsets, lengths)`` (a ``read_ranges`` of those lengths): where the link can
        (a stream that splices: Linux, plain TCP, not ``$TB5SYNC_SPLICE_PORTABLE=1``), a reply whose
        parts are all raw and of those lengths is received straight into file ``fd``,
        part ``i`` at ``offsets[i]`` (its page cache, no buffer), and ``parts`` is then an
        :class:`~tb5sync.wire.parts.InFile` naming them, not yet checked; otherwise a list as from
        :meth:`submit`.

        ``then`` owns ``parts`` (it gives them back, or returns them for the caller to). A future
        cancelled before ``then`` started never runs it (its reply's buffer is given back); once
        ``then`` runs, ``cancel()`` returns False and the caller must wait for it. Optional: the
        receiver falls back to :meth:`submit` for a link without it (:func:`submit_then`).
        """
        ...

    def close(self) -> None:
        """End the link (an in-process sender is closed with it)."""
        ...


class LocalLink:
    """Link to an in-process :class:`Sender`; requests run on a small thread pool (overlap with writes)."""

    wire_bytes = 0

    def __init__(self, sender: Sender, threads: int = 2) -> None:
        self.sender = sender
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tb5-local")
        self.streams = threads

    def submit(self, method: str, **args: Any) -> Future[Any]:
        return self._pool.submit(getattr(self.sender, method), **args)

    def submit_then(self, method: str, then: Callable[[dict[str, Any], Any], T], *,
                    into_file: tuple[int, list[int], list[int]] | None = None, **args: Any) -> Future[T]:
        """See :meth:`Link.submit_then`: ``then`` runs on the pool thread that called the sender
        (``into_file`` is not used: the reply's bytes are in memory already)."""
        call = getattr(self.sender, method)
        return self._pool.submit(lambda: then(*call(**args)))

    def recycle(self, parts: list[Any]) -> None:
        """Nothing to give back: in-process replies own their bytes."""

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.sender.close()


class RemoteLink:
    """Link to a sender across the wire through a :class:`Requester`.

    Control requests go on stream 0; chunk and file reads are spread over the other streams
    (over all of them when there is only one), so that a read never queues behind a
    ``chunk_list`` piece that the sender is still cutting and hashing.
    """

    def __init__(self, requester: Requester) -> None:
        self.requester = requester
        self.streams = len(requester.channels)
        self._data_streams = itertools.cycle(range(1, self.streams) if self.streams > 1 else [0])

    @property
    def wire_bytes(self) -> int:
        return self.requester.wire_bytes

    @property
    def splices(self) -> bool:
        """Whether every data stream (those :meth:`submit_then` uses) receives an ``into_file``
        reply of raw parts with ``splice`` straight into the file, taking no receive buffer
        (:attr:`tb5sync.wire.transport.Channel.can_splice`: Linux, plain TCP, not
        ``$TB5SYNC_SPLICE_PORTABLE=1``)."""
        chans = self.requester.channels
        return all(ch.can_splice for ch in (chans[1:] if len(chans) > 1 else chans))

    def recycle(self, parts: list[Any]) -> None:
        """Give the receive buffer under a DATA reply's ``parts`` back to the pool.

        Call only when nothing will read ``parts`` (or any view of the same reply) again.
        """
        if isinstance(parts, list) and parts and isinstance(parts[0], memoryview):
            self.requester.pool.give_back(parts[0].obj)

    def submit(self, method: str, **args: Any) -> Future[Any]:
        args = args_to_wire(args)  # a name that is not valid UTF-8 goes as bytes
        if method not in DATA_METHODS:
            channel = next(self._data_streams) if method in READ_METHODS else 0
            return self.requester.submit(method, args, channel=channel)
        return self._submit_data(method, args, None)

    def submit_then(self, method: str, then: Callable[[dict[str, Any], Any], T], *,
                    into_file: tuple[int, list[int], list[int]] | None = None, **args: Any) -> Future[T]:
        """See :meth:`Link.submit_then`: ``then`` runs on the stream's reader thread (``tb5-rx-N``)
        right after the reply's last byte came in, so each stream receives, verifies and writes its
        own replies (no hand-over to another thread, one wake-up of the caller per reply). With
        ``into_file``, the reader takes the body off the socket straight into the file
        (:meth:`~tb5sync.wire.transport.Channel.recv_body_to_file`: ``splice`` on Linux)."""
        if method not in DATA_METHODS:
            raise RemoteProtocolError(f"{method} is not answered with DATA")
        return self._submit_data(method, args_to_wire(args), then, into_file)

    def _file_sink(self, into_file: tuple[int, list[int], list[int]], outer: Future[Any]) -> Callable[["Channel", dict[str, Any], int], Any]:
        """The reader's sink for a reply that may go straight into a file (see :meth:`submit_then`).

        The file is written only while ``outer`` runs (marked so first): once the caller cancelled
        it, it may have closed ``fd``, and the body is received and dropped instead."""
        fd, offsets, lengths = into_file

        def sink(ch: "Channel", meta: dict[str, Any], nbody: int) -> Any:
            parts, wire = meta.get("parts"), meta.get("wire")
            if (ch.can_splice and isinstance(parts, list) and wire == lengths and len(parts) == len(lengths) and nbody == sum(lengths)
                    and all(p == [n, n, CODEC_RAW] for p, n in zip(parts, lengths))):
                if not outer.set_running_or_notify_cancel():
                    scratch = memoryview(bytearray(min(nbody, 1 << 20) or 1))
                    left = nbody
                    while left:
                        k = min(left, len(scratch))
                        ch.recv_body_into(scratch[:k])
                        left -= k
                    return meta, _CANCELLED
                return meta, InFile(fd, offsets, lengths, ch.recv_body_to_file(fd, list(zip(offsets, lengths))))
            # no splice here (the portable twin: verified in the buffer, then written, as without
            # into_file), compressed parts, another shape: into a buffer
            pool = self.requester.pool
            body = memoryview(pool.get(nbody))[:nbody] if nbody >= pool.min_size else memoryview(bytearray(nbody))
            ch.recv_body_into(body)
            return meta, body

        return sink

    def _submit_data(self, method: str, args: dict[str, Any], then: Callable[[dict[str, Any], Any], Any] | None,
                     into_file: tuple[int, list[int], list[int]] | None = None) -> Future[Any]:
        outer: Future[Any] = Future()
        sink = self._file_sink(into_file, outer) if into_file is not None else None
        inner = self.requester.submit(method, args, channel=next(self._data_streams), sink=sink)

        def done(f: Future[Any]) -> None:
            parts: Any = None
            try:
                res = f.result()
                if not isinstance(res, tuple):
                    raise RemoteProtocolError(f"{method} must be answered with DATA")
                meta, body = res
                if body is _CANCELLED:
                    return
                if isinstance(body, InFile):  # the sink marked outer running already
                    assert then is not None
                    outer.set_result(then(meta, body))
                    return
                wire = meta.get("wire")
                if not isinstance(wire, list):
                    raise RemoteProtocolError("DATA meta lacks part lengths")
                parts = split_parts(body, wire)
                if then is None:
                    outer.set_result((meta, parts))
                    return
                if not outer.set_running_or_notify_cancel():  # the caller gave up on it
                    self.recycle(parts)
                    return
                outer.set_result(then(meta, parts))  # then owns parts from here
            except BaseException as exc:  # delivered to the waiting receiver
                try:
                    outer.set_exception(exc)
                except InvalidStateError:  # cancelled meanwhile: nobody waits for it
                    pass

        inner.add_done_callback(done)
        return outer

