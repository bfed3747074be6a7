"""fsspec filesystem for ``tb5://HOST[:PORT]/PATH`` URLs, served by ``tb5sync serve``.

``fsspec.open("tb5://node-b:8873/models/model.safetensors", "rb")`` and every other
fsspec call work against a tb5sync daemon as they do on fsspec's LocalFileSystem.
Paths are relative to the server's root (``""`` is the root; a leading ``/`` is
ignored), and info dicts carry the same fields as LocalFileSystem's.

How calls travel
    One :class:`TB5FileSystem` keeps ``streams`` authenticated TCP connections in a
    file-system session (server side: :class:`tb5sync.daemon.fsops.FsOps`). Requests are
    pipelined: many concurrent fsspec calls share the connections without waiting
    for each other's round trips. ``find``/``walk``/``glob``/``du`` take one round
    trip for the whole tree, ``cat`` of many files one round trip per 32 MiB, ``rm``
    of many paths one. Large reads are split into pieces of ``size / streams`` bytes
    (4 to 16 MiB) spread over the connections and received straight into the
    returned ``bytes`` (no copy after the socket). ``put_file`` of files of
    ``engine_threshold`` bytes or more, and ``get_file`` of such a file onto an
    existing local file, go through the sync engine (FastCDC chunks,
    BLAKE3-verified, reuse of the chunks the destination already has, several
    streams); ``get_file`` into a new file streams ranged reads over all the
    connections; smaller ``put_file`` are one request each. ``cp_file`` and ``mv`` run on the server: no bytes through the client.

Atomicity
    Files written with ``pipe``, ``put``, ``cp`` or ``open(..., "wb")`` appear at
    their final path only when complete (temporary name, then rename on close);
    a writer that fails or is abandoned leaves the old file as it was. ``"xb"``
    and ``pipe_file(mode="create")`` never replace an existing file. Writes go
    through a symlink whose target is inside the root, as on a local disk;
    ``rm`` and ``mv`` act on the link itself. A symlink leading outside the root
    is listed and described (type ``"other"``, size 0) but never followed.

Errors
    ``FileNotFoundError``, ``FileExistsError``, ``IsADirectoryError``,
    ``NotADirectoryError`` and ``PermissionError`` (a read-only server, a path
    outside the root) as the matching :mod:`tb5sync.errors` classes, which all
    derive from :class:`~tb5sync.errors.Tb5syncError`; a directory removed without
    ``recursive`` is a ``ValueError`` as on LocalFileSystem.

Where the code is
    This module holds :class:`TB5FileSystem` itself (its settings, URLs and paths, the
    connections and the request layer, ``open``); it combines the reading half
    (:class:`tb5sync.fs.reading.ReadingMixin`: info, ls, find, cat, get) and the writing half
    (:class:`tb5sync.fs.writing.WritingMixin`: pipe, put, the streamed write, cp, mv, rm, mkdir).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import threading
import weakref
from typing import Any

from fsspec.asyn import AsyncFileSystem
from fsspec.utils import stringify_path

from tb5sync.errors import (
    ConnectError,
    ProtocolError,
    Tb5syncError,
    UsageError,
)
from tb5sync.wire.messages import DEFAULT_PORT, FS_IDEMPOTENT
from tb5sync.wire.rpc import LoopReplies, Requester, call_direct, open_session
from tb5sync.fs.file import TB5File
from tb5sync.fs.reading import ReadingMixin, _args_to_wire, _has_magic
from tb5sync.fs.writing import WritingMixin
from tb5sync.wire.transport import IO_TIMEOUT, dial
from tb5sync.wire.urls import parse_url, token_of, url_host

# Every name this module held before its reading and writing halves moved out stays importable
# from here (but a name patched here no longer reaches the code that moved: patch it in the
# module that uses it now, tb5sync.fs.reading or tb5sync.fs.writing).
import collections, datetime, errno, mmap, os, stat  # noqa: E401, F401
from collections.abc import AsyncIterator, Callable  # noqa: F401
from fsspec.asyn import sync_wrapper  # noqa: F401
from fsspec.callbacks import DEFAULT_CALLBACK, Callback  # noqa: F401
from fsspec.utils import isfilelike  # noqa: F401
from tb5sync.wire.parts import FileRange, SharedFd  # noqa: F401
from tb5sync._os.io import portable, preallocate, pwrite_all, unlink_quiet  # noqa: F401
from tb5sync._os.paths import temp_name  # noqa: F401
from tb5sync.tree.entry import path_from_wire, path_to_wire  # noqa: F401
from tb5sync.errors import RemoteIsADirectoryError, RemoteProtocolError, SourceChangedError, error_from_remote  # noqa: F401
from tb5sync.wire.messages import FS_MAX_READ as MAX_READ  # noqa: F401
from tb5sync.wire.messages import FS_MAX_WRITE as MAX_WRITE  # noqa: F401
from tb5sync.tree.options import SyncOptions  # noqa: F401
from tb5sync.wire.rpc import split_parts  # noqa: F401
from tb5sync.fs.file import MIN_PIECE, SMALL_READ, as_bytes, check_piece, new_buffer, plan_pieces  # noqa: F401
from tb5sync.fs.reading import (  # noqa: F401
    MMAP_PORTABLE_ENV,
    _CAT_BATCH,
    _GET_DEPTH,
    _NEEDS_SIZE,
    _fsspec_range,
    _info_from_wire,
    _known_range,
)
from tb5sync.wire.urls import Remote  # noqa: F401

__all__ = ["TB5FileSystem", "TB5File"]  # TB5File is fsfile's, re-exported

log = logging.getLogger(__name__)

#: Files at least this large (bytes) travel through the sync engine in put_file/get_file.
ENGINE_THRESHOLD = 32 * 1024 * 1024

_BUSY = object()
_STALE = object()


class _Link:
    """The authenticated connections of one filesystem instance.

    ``streams`` connections carry pipelined requests (a :class:`Requester` with a
    reader thread each); one more, ``direct``, serves blocking calls from one
    thread at a time without any thread hop: the caller sends and reads the reply
    itself, which roughly halves a small call's latency.
    """

    def __init__(
        self, host: str, port: int, token: bytes | None, streams: int, timeout: float,
        tls: bool = False, tls_ca: str | None = None, io_timeout: float | None = IO_TIMEOUT,
    ) -> None:
        chans = []
        # one id on all the connections: a server with fs workers serves them in one process,
        # which then holds this client's puts in pieces and listing pages (servers before: ignored)
        group = secrets.token_hex(8)
        try:
            for _ in range(streams + 1):
                ch = dial(host, port, token, tls=tls, tls_ca=tls_ca, io_timeout=io_timeout, timeout=timeout)
                chans.append(ch)
                resp = open_session(ch, {"op": "fs", "group": group})
        except BaseException:
            for ch in chans:
                ch.close()
            raise
        self.read_only = bool(resp.get("read_only"))
        #: the server takes a file in pieces (``put_open``/``put_piece``/``put_close``); older ones do not
        self.pieces = bool(resp.get("pieces"))
        self.direct = chans.pop()
        self.direct_lock = threading.Lock()
        self.requester = Requester(chans)
        self.direct.pool = self.requester.pool
        #: the event loop's reply queue of the async calls (made on first use, on the loop they run on)
        self.replies: LoopReplies | None = None
        #: a :meth:`flush_deferred` is due on the event loop (the async calls' requests are deferred)
        self.flush_scheduled = False
        self.closed = False

    def flush_deferred(self) -> None:
        """Send the async calls' deferred requests (called once per turn of the event loop that made them)."""
        self.flush_scheduled = False
        self.requester.flush()

    def release(self, views: list[Any]) -> None:
        """Give the receive buffers behind ``views`` (already copied out) back for the next replies."""
        pool = self.requester.pool
        for v in views:
            pool.give_back(getattr(v, "obj", None))

    def call_direct(self, method: str, args: dict[str, Any]) -> Any:
        """Send one request on the direct connection and read its reply here; ``_BUSY`` if another thread is using it.

        Raises
        ------
        ConnectError
            The connection broke (the link is then closed).
        Tb5syncError
            The server's error for this request.
        """
        if not self.direct_lock.acquire(blocking=False):
            return _BUSY
        # the server may have ended the idle connection: a request with effects is sent only on a
        # connection seen open (nothing sent yet); one without is sent at once and, should the
        # connection turn out closed, sent again on a new one (_call_sync): no poll per small op
        if method not in FS_IDEMPOTENT and self.direct.peer_closed():
            self.direct_lock.release()
            self.close()
            return _STALE
        clean = False
        try:
            result = call_direct(self.direct, method, args)
            clean = True
            return result
        except Tb5syncError as exc:
            # the server's error for this request leaves the stream fine; a broken one does not
            clean = not isinstance(exc, (ConnectError, ProtocolError))
            raise
        finally:
            self.direct_lock.release()
            if not clean:  # interrupted mid-exchange: the stream's state is unknown
                self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.requester.close(bye=True)
            self.direct.close()


class _Holder:
    """Mutable slot for the link, so the finalizer does not keep the filesystem alive."""

    def __init__(self) -> None:
        self.link: _Link | None = None
        self.lock = threading.Lock()

    def close(self) -> None:
        with self.lock:
            link, self.link = self.link, None
        if link is not None:
            link.close()


class TB5FileSystem(ReadingMixin, WritingMixin, AsyncFileSystem):
    """fsspec filesystem over a ``tb5sync serve`` daemon (protocol ``"tb5"``).

    Parameters
    ----------
    host : str
        Server address (from the URL ``tb5://HOST[:PORT]/...`` when opened by URL).
    port : int
        Server port, default 8873.
    token : str or bytes or None
        Shared secret; None reads ``TB5SYNC_TOKEN`` from the environment (unset: no auth).
    streams : int
        TCP connections to keep open (1..64), default 4.
    engine_threshold : int
        ``put_file`` moves files of at least this many bytes (default 32 MiB) through the
        sync engine instead of single requests; so does ``get_file`` when the local file
        exists (the engine reuses its chunks; into a new file parallel reads are faster).
    auto_mkdir : bool
        Create missing parent directories when writing (as LocalFileSystem's
        ``auto_mkdir``); default False: writing into a missing directory is a
        ``FileNotFoundError``.
    timeout : float
        Seconds allowed to connect and authenticate.
    tls : bool
        Connect over TLS (``tb5s://`` URLs set it); the server runs with ``--tls-cert``.
    tls_ca : str or None
        CA certificates to check the server against (default: the system's).
    io_timeout : float or None
        I/O timeout, seconds: a stalled server or a dead link fails the call with
        :class:`~tb5sync.errors.LinkTimeoutError` after this long (default 60; None: never).
    **kwargs
        fsspec's own (``asynchronous``, ``loop``, ``batch_size``, ...).

    Raises
    ------
    UsageError
        Bad ``port``/``streams`` (a ``ValueError``).
    ConnectError, AuthError, VersionMismatchError
        On the first call that needs the server, if it cannot be reached or refuses us.

    Notes
    -----
    Instances are cached by fsspec (same arguments, same instance) and keep
    their connections; a lost connection is reopened on the next call, and a
    read (info, ls, find, cat, checksum) interrupted by it is retried once.
    """

    protocol = ("tb5", "tb5s")
    root_marker = ""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        token: str | bytes | None = None,
        streams: int = 4,
        engine_threshold: int = ENGINE_THRESHOLD,
        auto_mkdir: bool = False,
        timeout: float = 10.0,
        tls: bool = False,
        tls_ca: str | None = None,
        io_timeout: float | None = IO_TIMEOUT,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not isinstance(port, int) or not 0 < port < 65536:
            raise UsageError(f"port must be 1..65535, not {port!r}")
        if not isinstance(streams, int) or not 1 <= streams <= 64:
            raise UsageError(f"streams must be 1..64, not {streams!r}")
        self.host = host
        self.port = port
        self.token = token_of(token)
        self.streams = streams
        self.engine_threshold = engine_threshold
        self.auto_mkdir = auto_mkdir
        self.timeout = timeout
        self.tls = bool(tls or tls_ca)
        self.tls_ca = tls_ca
        self.io_timeout = io_timeout
        self._holder = _Holder()
        self._write_ids = itertools.count(1)
        weakref.finalize(self, _Holder.close, self._holder)

    # ---- URLs and paths ---------------------------------------------------------------
    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        """``tb5://host:port/a/b/`` -> ``a/b``; ``/a/b`` -> ``a/b``; lists element-wise."""
        if type(path) is str and ":" not in path:  # a plain path (no scheme, no chain): the common case
            return path.strip("/")
        if isinstance(path, (list, tuple)):
            return type(path)(cls._strip_protocol(p) for p in path)
        path = stringify_path(path)
        for scheme in ("tb5://", "tb5s://"):
            if path.startswith(scheme):
                path = path[len(scheme) :].partition("/")[2]
                break
        else:
            for chain in ("tb5::", "tb5s::"):
                if path.startswith(chain):
                    path = path[len(chain) :]
                    break
        return path.strip("/")

    @staticmethod
    def _get_kwargs_from_urls(path: str) -> dict[str, Any]:
        """``host``, ``port``, ``tls`` (``tb5s://``) and (from ``tb5://TOKEN@host`` or
        ``tb5://user:TOKEN@host``) ``token``: :func:`tb5sync.wire.urls.parse_url`'s reading, the
        CLI's and the API's too."""
        if not isinstance(path, str) or not path.startswith(("tb5://", "tb5s://")):
            return {}
        remote = parse_url(path)
        assert remote is not None
        out: dict[str, Any] = {"host": remote.host, "port": remote.port}
        if remote.tls:
            out["tls"] = True
        if remote.token:
            out["token"] = remote.token.decode()
        return out

    def unstrip_protocol(self, name: str) -> str:
        """Full URL of ``name``: ``tb5://HOST:PORT/name``."""
        return f"{'tb5s' if self.tls else 'tb5'}://{url_host(self.host)}:{self.port}/{self._strip_protocol(name)}"

    @classmethod
    def _parent(cls, path: str) -> str:
        path = cls._strip_protocol(path)
        return path.rpartition("/")[0]

    async def _expand_path(
        self, path: Any, recursive: bool = False, maxdepth: int | None = None, assume_literal: bool = False
    ) -> list[str]:
        """fsspec's expansion of ``path`` (a str or a list), except that a path holding glob
        characters (``*``, ``?``, ``[``) that exists is taken literally, with what is below it
        when ``recursive``; only a path that does not exist is a pattern."""
        if assume_literal:
            return await super()._expand_path(path, recursive=recursive, maxdepth=maxdepth, assume_literal=True)
        paths = [path] if isinstance(path, str) else list(path)
        literal: list[str] = []
        patterns: list[Any] = []
        for p in paths:
            sp = self._strip_protocol(p)
            if _has_magic(sp) and await self._exists(sp):
                literal.append(sp)
            else:
                patterns.append(p)
        if not literal:
            return await super()._expand_path(path, recursive=recursive, maxdepth=maxdepth)
        out: set[str] = set(await super()._expand_path(literal, recursive=recursive, maxdepth=maxdepth, assume_literal=True))
        if patterns:
            out.update(await super()._expand_path(patterns, recursive=recursive, maxdepth=maxdepth))
        return sorted(out)

    # ---- requests ---------------------------------------------------------------------
    def _connect(self) -> _Link:
        h = self._holder
        with h.lock:
            if h.link is None or h.link.closed:
                h.link = _Link(self.host, self.port, self.token, self.streams, self.timeout, self.tls, self.tls_ca, self.io_timeout)
            return h.link

    def _drop(self, link: _Link) -> None:
        with self._holder.lock:
            if self._holder.link is link:
                self._holder.link = None
        link.close()

    async def _link(self) -> _Link:
        link = self._holder.link
        if link is not None and not link.closed:
            return link
        return await asyncio.to_thread(self._connect)

    async def _call(self, method: str, args: dict[str, Any], *, channel: int | None = None,
                    into: memoryview | None = None, owner: Any = None) -> Any:
        """One request; a lost connection is reopened, and an idempotent request retried once.
        ``into``/``owner``: a DATA reply's body is received into ``into`` (:meth:`Requester.submit`)."""
        for attempt in (0, 1):
            link = await self._link()
            replies, loop = link.replies, asyncio.get_running_loop()
            if replies is None or replies.loop is not loop:
                replies = link.replies = LoopReplies(loop)
            afut, settle = replies.future()
            try:
                # sent with the others made in this turn of the loop (one sendall per connection)
                link.requester.submit(method, _args_to_wire(args), channel=channel, into=into, owner=owner, future=settle,
                                      defer=True)
            except ConnectError:  # never sent (the stream was already closed): safe to send again
                self._drop(link)
                if attempt:
                    raise
                continue
            if not link.flush_scheduled:
                link.flush_scheduled = True
                loop.call_soon(link.flush_deferred)
            try:
                return await afut
            except ConnectError:  # lost after sending: only a request without effects is sent again
                self._drop(link)
                if attempt or method not in FS_IDEMPOTENT:
                    raise
        raise AssertionError("unreachable")

    def _call_sync(self, method: str, args: dict[str, Any]) -> Any:
        """:meth:`_call` for the calling thread: no hop through fsspec's event loop (small ops' latency)."""
        args = _args_to_wire(args)
        attempt = stale = 0
        while True:
            link = self._holder.link
            if link is None or link.closed:
                link = self._connect()
            try:
                res = link.call_direct(method, args)
                if res is _STALE:  # closed by the server while idle, before anything was sent
                    self._drop(link)
                    stale += 1
                    if stale > 2:
                        raise ConnectError("the server closes every new connection at once")
                    continue
                return link.requester.submit(method, args).result() if res is _BUSY else res
            except ConnectError:
                self._drop(link)
                if attempt or method not in FS_IDEMPOTENT:
                    raise
                attempt += 1

    # ---- files --------------------------------------------------------------------------
    def _open(
        self,
        path: str,
        mode: str = "rb",
        block_size: int | None = None,
        autocommit: bool = True,
        cache_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> TB5File:
        return TB5File(self, self._strip_protocol(path), mode, block_size, autocommit, cache_options=cache_options, **kwargs)
