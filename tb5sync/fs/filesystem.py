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
    connections and the request layer, the writing calls, ``open``); it combines the reading
    half (:class:`tb5sync.fs.reading.ReadingMixin`: info, ls, find, cat, get).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import itertools
import logging
import os
import stat
import threading
import weakref
from collections.abc import Callable
from typing import Any

from fsspec.asyn import AsyncFileSystem, sync_wrapper
from fsspec.callbacks import DEFAULT_CALLBACK, Callback
from fsspec.utils import stringify_path

from tb5sync.wire.parts import FileRange, SharedFd
from tb5sync.errors import (
    ConnectError,
    ProtocolError,
    Tb5syncError,
    RemoteIsADirectoryError,
    SourceChangedError,
    UsageError,
)
from tb5sync.wire.messages import DEFAULT_PORT, FS_IDEMPOTENT
from tb5sync.wire.messages import FS_MAX_WRITE as MAX_WRITE
from tb5sync.tree.options import SyncOptions
from tb5sync.wire.rpc import Requester, call_direct, open_session
from tb5sync.fs.file import MIN_PIECE, TB5File
from tb5sync.fs.reading import ReadingMixin, _GET_DEPTH, _args_to_wire, _has_magic
from tb5sync.wire.transport import IO_TIMEOUT, dial
from tb5sync.wire.urls import Remote, parse_url, token_of, url_host

# Every name this module held before its reading half moved out stays importable from here
# (but a name patched here no longer reaches the code that moved: patch it in the module that
# uses it now, tb5sync.fs.reading).
import datetime, mmap  # noqa: E401, F401
from collections.abc import AsyncIterator  # noqa: F401
from fsspec.utils import isfilelike  # noqa: F401
from tb5sync._os.io import portable, preallocate, pwrite_all, unlink_quiet  # noqa: F401
from tb5sync._os.paths import temp_name  # noqa: F401
from tb5sync.tree.entry import path_from_wire, path_to_wire  # noqa: F401
from tb5sync.errors import RemoteProtocolError, error_from_remote  # noqa: F401
from tb5sync.wire.messages import FS_MAX_READ as MAX_READ  # noqa: F401
from tb5sync.wire.rpc import split_parts  # noqa: F401
from tb5sync.fs.file import SMALL_READ, as_bytes, check_piece, new_buffer, plan_pieces  # noqa: F401
from tb5sync.fs.reading import (  # noqa: F401
    MMAP_PORTABLE_ENV,
    _CAT_BATCH,
    _NEEDS_SIZE,
    _fsspec_range,
    _info_from_wire,
    _known_range,
)

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
        try:
            for _ in range(streams + 1):
                ch = dial(host, port, token, tls=tls, tls_ca=tls_ca, io_timeout=io_timeout, timeout=timeout)
                chans.append(ch)
                resp = open_session(ch, {"op": "fs"})
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
        self.closed = False

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


class TB5FileSystem(ReadingMixin, AsyncFileSystem):
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
            try:
                fut = link.requester.submit(method, _args_to_wire(args), channel=channel, into=into, owner=owner)
            except ConnectError:  # never sent (the stream was already closed): safe to send again
                self._drop(link)
                if attempt:
                    raise
                continue
            try:
                return await asyncio.wrap_future(fut)
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

    # ---- writing ------------------------------------------------------------------------
    async def _write_bytes(self, path: str, data: bytes | memoryview, mode: str = "overwrite") -> None:
        """Write ``data`` as file ``path`` atomically: over 4 MiB in pieces (:meth:`_put_bytes`) where
        the server takes them; else one request up to 16 MiB, and a pipelined write above."""
        if mode not in ("overwrite", "create"):
            raise ValueError(f"mode must be 'overwrite' or 'create', not {mode!r}")
        if len(data) > MIN_PIECE and (await self._link()).pieces:  # raw DATA frames, not msgpack bin
            await asyncio.to_thread(self._put_bytes, path, data, mode)
            return
        if len(data) <= MAX_WRITE:
            await self._call("put", {"path": path, "data": bytes(data), "mode": mode, "mkdirs": self.auto_mkdir})
            return
        handle, chan = await self._wopen(path, mode)
        try:
            await self._wwrite(handle, chan, data)
        except BaseException:
            await self._wclose(handle, chan, commit=False)
            raise
        await self._wclose(handle, chan, commit=True)

    async def _wopen(self, path: str, mode: str = "overwrite", append: bool = False) -> tuple[int, int]:
        """Open a server-side write; returns ``(handle, channel)`` (every later call must use that channel)."""
        handle = next(self._write_ids)
        chan = handle % self.streams
        await self._call("wopen", {"handle": handle, "path": path, "mode": mode, "append": append, "mkdirs": self.auto_mkdir}, channel=chan)
        return handle, chan

    async def _wwrite(self, handle: int, chan: int, data: bytes | memoryview) -> None:
        """Append ``data`` to the open write, in requests of at most 16 MiB sent back to back (in order)."""
        view = memoryview(data)
        pieces = [view[o : o + MAX_WRITE] for o in range(0, len(view), MAX_WRITE)]
        await asyncio.gather(*[self._call("wwrite", {"handle": handle, "data": bytes(p)}, channel=chan) for p in pieces])

    async def _wclose(self, handle: int, chan: int, commit: bool) -> None:
        """Commit or discard a server-side write; a discard never raises (it runs while another error is on its way)."""
        try:
            await self._call("wclose", {"handle": handle, "commit": commit}, channel=chan)
        except (Tb5syncError, OSError) as exc:
            if commit:
                raise
            # the server removes the temporary file of a lost connection or a failed write itself
            log.debug("discarding write %d: %s", handle, exc)

    async def _pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        await self._write_bytes(self._strip_protocol(path), value, mode)

    async def _put_file(self, lpath: Any, rpath: str, callback: Callback = DEFAULT_CALLBACK, mode: str = "overwrite", **kwargs: Any) -> None:
        """Copy local file ``lpath`` to remote path ``rpath`` (a local directory makes the remote directory).

        As fsspec's LocalFileSystem copies a file: an existing remote file is replaced (keeping its
        permission bits), a remote symlink is written through, a remote directory at ``rpath`` is
        ``IsADirectoryError``, a missing parent ``FileNotFoundError`` (unless ``auto_mkdir``);
        ``mode="create"`` refuses an existing ``rpath``. A symlink at ``lpath`` sends its file.
        Nothing partial ever sits at ``rpath``: the bytes go to a temporary name beside it,
        renamed into place once all arrived; a failed put leaves ``rpath`` as it was.

        A file over 4 MiB goes in 4 MiB pieces over all the connections (:meth:`put_pieces`), unless
        it is ``engine_threshold`` bytes or more onto an existing remote file (then the sync
        engine, which reuses the chunks that file already has) or the server predates pieces
        (then the sync engine from ``engine_threshold`` up, and ``put``/``wwrite`` requests below).
        A file up to 4 MiB is one ``put`` request.

        Raises
        ------
        SourceChangedError
            The local file changed while it was sent.
        QuotaError
            The server's session quota (``--max-session-bytes``/``--min-free-space``) refused the size.
        FileNotFoundError, IsADirectoryError, PermissionError, FileExistsError
            As above (remote ones are :class:`~tb5sync.errors.RemoteOSError` subclasses).
        """
        rpath = self._strip_protocol(rpath)
        lpath = os.fspath(lpath)
        if os.path.isdir(lpath):
            await self._makedirs(rpath, exist_ok=True)
            return
        size = os.path.getsize(lpath)
        callback.set_size(size)
        if mode not in ("overwrite", "create"):
            raise ValueError(f"mode must be 'overwrite' or 'create', not {mode!r}")
        if size > MIN_PIECE and (await self._link()).pieces:
            if size < self.engine_threshold or mode != "overwrite" or not await self._plain_file(rpath):
                await asyncio.to_thread(self.put_pieces, lpath, rpath, mode, callback)
                return
        if size >= self.engine_threshold and mode == "overwrite":
            await self._check_target(rpath)
            parent, _, name = rpath.rpartition("/")
            lpath = os.path.realpath(lpath)  # the engine would send a symlink as a link: send its file

            def progress(done: int, total: int) -> None:
                callback.absolute_update(done)

            from tb5sync.remote.client import push  # the sync engine, loaded on first use

            await asyncio.to_thread(
                push,
                lpath,
                Remote(self.host, self.port, parent + "/" if parent else "", tls=self.tls),
                SyncOptions(streams=self.streams),
                token=self.token,
                progress=progress,
                name=name,
                timeout=self.io_timeout,
                tls_ca=self.tls_ca,
            )
            callback.absolute_update(size)
            return
        with open(lpath, "rb") as f:
            data = f.read()
        await self._write_bytes(rpath, data, mode)
        callback.relative_update(len(data))

    def put_pieces(self, lpath: Any, rpath: str, mode: str = "overwrite", callback: Callback = DEFAULT_CALLBACK) -> None:
        """Send local file ``lpath`` as remote file ``rpath`` in pieces, the mirror of :meth:`get_file`
        (a synchronous method: it blocks the calling thread, never run it on the event loop's).

        ``put_open`` (on the direct connection when free) charges the session's quota the file's size and
        makes a preallocated temporary file beside ``rpath``; each 4 MiB piece
        (:data:`~tb5sync.fs.file.MIN_PIECE`) is one ``put_piece`` DATA frame (meta, then the raw
        bytes: ``sendfile`` from the local file where the channel allows it, a read and a send
        otherwise: TLS, ``$TB5SYNC_PORTABLE=1``), sent by one thread per connection, piece ``i``
        on connection ``i % streams``, ``_GET_DEPTH`` per connection on their way, and written by
        the server at its offset; ``put_close`` renames the file into place once every byte
        arrived, or (after any error) removes it. The local file must keep its size and mtime
        meanwhile. Semantics and errors: :meth:`_put_file`; a server without pieces:
        :class:`~tb5sync.errors.UsageError` (``unknown request``).
        """
        rpath = self._strip_protocol(rpath)
        fd = os.open(os.fspath(lpath), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "Is a directory", os.fspath(lpath))
            size = st.st_size
            callback.set_size(size)
            shared = SharedFd(fd)  # the parts never close it: the finally below does

            def check() -> None:
                now = os.fstat(fd)
                if (now.st_size, now.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
                    raise SourceChangedError(f"{os.fspath(lpath)!r} changed while it was sent; nothing written")

            self._put_whole(rpath, size, mode, lambda off, n: FileRange(shared, off, n, pad=False), callback, check)
        finally:
            os.close(fd)

    def _put_bytes(self, rpath: str, data: bytes | memoryview, mode: str = "overwrite") -> None:
        """Write ``data`` as remote file ``rpath`` in pieces (views of ``data``, no copy); as :meth:`put_pieces`."""
        view = memoryview(data).cast("B")
        self._put_whole(rpath, len(view), mode, lambda off, n: view[off : off + n], DEFAULT_CALLBACK, lambda: None)

    def _put_whole(self, rpath: str, size: int, mode: str, part: Callable[[int, int], Any], callback: Callback,
                   check: Callable[[], None]) -> None:
        """``put_open``, the pieces (``part(offset, length)`` gives each one's body), ``check()``, then
        ``put_close``: committed when all went well, discarded after any error."""
        pid = self._call_sync("put_open", {"path": rpath, "size": size, "mode": mode, "mkdirs": self.auto_mkdir})["id"]
        try:
            self._send_pieces(size, pid, part, callback)
            check()
            self._call_sync("put_close", {"id": pid, "commit": True})
        except BaseException:
            try:
                self._call_sync("put_close", {"id": pid, "commit": False})
            except (Tb5syncError, OSError) as exc:  # the server removes a lost connection's puts itself
                log.debug("discarding put %s: %s", pid, exc)
            raise

    def _send_pieces(self, size: int, pid: str, part: Callable[[int, int], Any], callback: Callback) -> None:
        """Send ``size`` bytes as ``put_piece`` frames of the put ``pid`` (``part(offset, length)``:
        a piece's body) over every connection (one sending thread each); returns once the server
        wrote them all."""
        if size <= 0:
            return
        link = self._holder.link
        if link is None or link.closed:
            link = self._connect()
        count = (size + MIN_PIECE - 1) // MIN_PIECE
        streams = min(self.streams, count)
        stop = threading.Event()
        lock = threading.Lock()

        def send(s: int) -> None:
            inflight: collections.deque[tuple[int, Any]] = collections.deque()
            try:
                for i in range(s, count, streams):
                    if stop.is_set():
                        return
                    off = i * MIN_PIECE
                    n = min(MIN_PIECE, size - off)
                    inflight.append((n, link.requester.submit_data("put_piece", {"id": pid, "offset": off}, [part(off, n)], channel=s)))
                    if len(inflight) >= _GET_DEPTH:
                        n, fut = inflight.popleft()
                        fut.result()
                        with lock:
                            callback.relative_update(n)
                while inflight:
                    n, fut = inflight.popleft()
                    fut.result()
                    with lock:
                        callback.relative_update(n)
            except BaseException:
                stop.set()
                raise

        try:
            if streams == 1:
                send(0)
                return
            errors: list[BaseException] = []

            def run(s: int) -> None:
                try:
                    send(s)
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=run, args=(s,), name=f"tb5-put-{s}", daemon=True) for s in range(1, streams)]
            for t in threads:
                t.start()
            run(0)
            for t in threads:
                t.join()
            if errors:
                # the cause, not its echoes: once one piece failed (ENOSPC) the server removed the
                # put, so the other streams' pieces come back "no open put" (UsageError), and a
                # dropped link fails them with ConnectError; each thread sees its own first
                raise min(errors, key=lambda e: (isinstance(e, ConnectError), not isinstance(e, OSError)))
        except ConnectError:
            self._drop(link)
            raise

    async def _plain_file(self, rpath: str) -> bool:
        """Whether ``rpath`` is a regular remote file, not reached through a symlink (the engine
        would replace a link by a file; a put writes through it, as LocalFileSystem)."""
        try:
            info = await self._info(rpath)
        except FileNotFoundError:
            return False
        return info["type"] == "file" and not info.get("islink")

    async def _check_target(self, rpath: str) -> None:
        """Before an engine push: the target must not be a directory, and its parent must exist unless ``auto_mkdir``."""
        try:
            info = await self._info(rpath)
        except FileNotFoundError:
            parent = self._parent(rpath)
            if parent and not self.auto_mkdir:
                pinfo = await self._info(parent)
                if pinfo["type"] != "directory":
                    raise NotADirectoryError(20, "Not a directory", parent) from None
            return
        if info["type"] == "directory":
            raise RemoteIsADirectoryError(f"Is a directory: {rpath!r}")

    async def _cp_file(self, path1: str, path2: str, _mkdirs: bool = False, **kwargs: Any) -> None:
        args = {"src": self._strip_protocol(path1), "dst": self._strip_protocol(path2), "mkdirs": self.auto_mkdir or _mkdirs}
        await self._call("copy", args)

    async def _copy(self, path1: Any, path2: Any, recursive: bool = False, **kwargs: Any) -> None:
        # fsspec copies a tree's files concurrently, so a file may come before its directory:
        # inside a recursive copy the server creates the parents a file needs.
        if isinstance(path1, str) and _has_magic(path1) and await self._isfile(self._strip_protocol(path1)):
            # an existing file whose name holds glob characters is that file, not a pattern
            src = self._strip_protocol(path1)
            dst = self._strip_protocol(path2)
            if path2.endswith("/") or await self._isdir(dst):
                dst = f"{dst.rstrip('/')}/{src.rsplit('/', 1)[-1]}"
            await self._cp_file(src, dst, _mkdirs=recursive)
            return
        await super()._copy(path1, path2, recursive=recursive, _mkdirs=recursive, **kwargs)

    async def _mv(self, path1: Any, path2: str, recursive: bool = True, maxdepth: int | None = None, **kwargs: Any) -> None:
        """Rename on the server (``shutil.move`` rules, as LocalFileSystem's ``mv``); a list moves into directory ``path2``."""
        dst = self._strip_protocol(path2)
        if isinstance(path1, (list, tuple)):
            for p in path1:
                await self._call("move", {"src": self._strip_protocol(p), "dst": dst, "mkdirs": self.auto_mkdir})
            return
        src = self._strip_protocol(path1)
        if src == dst:
            return
        await self._call("move", {"src": src, "dst": dst, "mkdirs": self.auto_mkdir})

    mv = sync_wrapper(_mv)

    async def _rm_file(self, path: str, **kwargs: Any) -> None:
        """Remove one file; a directory raises ``IsADirectoryError`` (as LocalFileSystem's ``rm_file``)."""
        p = self._strip_protocol(path)
        try:
            await self._call("rm", {"paths": [p], "recursive": False})
        except UsageError:
            if await self._isdir(p):
                err = RemoteIsADirectoryError(f"Is a directory: {p!r}")
                err.errno = errno.EISDIR
                raise err from None
            raise

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

    async def _rm(self, path: Any, recursive: bool = False, batch_size: int | None = None, maxdepth: int | None = None, **kwargs: Any) -> None:
        # maxdepth is accepted and ignored, as by LocalFileSystem.rm: a directory goes whole or not at all
        paths = [path] if isinstance(path, str) else list(path)
        literal: list[str] = []
        for p in paths:
            if _has_magic(p):
                literal.extend(await self._expand_path(p))
            else:
                literal.append(self._strip_protocol(p))
        await self._call("rm", {"paths": literal, "recursive": recursive})

    async def _mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        await self._call("mkdir", {"path": self._strip_protocol(path), "parents": create_parents, "exist_ok": False})

    async def _makedirs(self, path: str, exist_ok: bool = False) -> None:
        await self._call("mkdir", {"path": self._strip_protocol(path), "parents": True, "exist_ok": exist_ok})

    async def _rmdir(self, path: str) -> None:
        await self._call("rmdir", {"path": self._strip_protocol(path)})

    async def _touch(self, path: str, truncate: bool = True, **kwargs: Any) -> None:
        await self._call("touch", {"path": self._strip_protocol(path), "truncate": truncate, "mkdirs": self.auto_mkdir})

    rmdir = sync_wrapper(_rmdir)
    touch = sync_wrapper(_touch)

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
