"""The writing half of :class:`~tb5sync.fs.filesystem.TB5FileSystem` (:class:`WritingMixin`):
``pipe``, ``put_file`` (one request, pieces over all the connections, or the sync engine), the
streamed write behind ``open(..., "wb")`` (``wopen``/``wwrite``/``wclose``), copy, move, ``rm``,
``mkdir`` and ``touch``.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import os
import stat
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from fsspec.asyn import sync_wrapper
from fsspec.callbacks import DEFAULT_CALLBACK, Callback

from tb5sync.wire.parts import FileRange, SharedFd
from tb5sync.errors import (
    ConnectError,
    Tb5syncError,
    RemoteIsADirectoryError,
    SourceChangedError,
    UsageError,
)
from tb5sync.wire.messages import FS_MAX_WRITE as MAX_WRITE
from tb5sync.tree.options import SyncOptions
from tb5sync.fs.file import MIN_PIECE
from tb5sync.fs.reading import _GET_DEPTH, _has_magic
from tb5sync.wire.urls import Remote

__all__ = ["WritingMixin"]

log = logging.getLogger("tb5sync.fs.filesystem")  # the logger these messages always had


class WritingMixin:
    """The writing calls of :class:`~tb5sync.fs.filesystem.TB5FileSystem`, which combines this
    class with :class:`~tb5sync.fs.reading.ReadingMixin` before fsspec's ``AsyncFileSystem``
    (so the ``super()`` calls here reach fsspec's). Its methods use what TB5FileSystem sets up:
    the settings and connection holder of its ``__init__``, its request layer and the reading
    half's ``_info``, declared here.
    """

    # set by TB5FileSystem.__init__
    host: str
    port: int
    token: bytes | None
    streams: int
    engine_threshold: int
    auto_mkdir: bool
    tls: bool
    tls_ca: str | None
    io_timeout: float | None
    _holder: Any  # its _Holder: ``.link``, the open _Link or None
    _write_ids: Iterator[int]
    # TB5FileSystem's request layer
    _call: Callable[..., Awaitable[Any]]
    _call_sync: Callable[[str, dict[str, Any]], Any]
    _connect: Callable[[], Any]
    _drop: Callable[[Any], None]
    _link: Callable[[], Awaitable[Any]]
    # the reading half's
    _info: Callable[..., Awaitable[dict[str, Any]]]

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
