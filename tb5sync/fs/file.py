"""The file object of the ``tb5://`` filesystem: ranged reads and buffered atomic writes.

:class:`TB5File` is what :meth:`TB5FileSystem.open <tb5sync.fs.filesystem.TB5FileSystem.open>` returns;
it reaches the server only through its filesystem's coroutines (the connections and the
request layer are :mod:`tb5sync.fs.filesystem`'s and :mod:`tb5sync.wire.rpc`'s).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Protocol

from fsspec.asyn import sync
from fsspec.spec import AbstractBufferedFile

from tb5sync.errors import InvalidSeekError, SourceChangedError
from tb5sync.wire.messages import FS_MAX_READ as MAX_READ
from tb5sync.wire.messages import FS_MAX_WRITE as MAX_WRITE


class FileHost(Protocol):
    """What a :class:`TB5File` needs of its filesystem (:class:`tb5sync.fs.filesystem.TB5FileSystem`
    provides it): the event loop it runs on, the coroutines of ranged reads and of the streamed
    write (``wopen`` / ``wwrite`` / ``wclose``: handle and channel, bytes), and fsspec's sync calls."""

    loop: asyncio.AbstractEventLoop
    auto_mkdir: bool

    def _parent(self, path: str) -> str: ...

    async def _cat_file(self, path: str, start: int | None = None, end: int | None = None,
                        expect: dict[str, Any] | None = None, **kwargs: Any) -> bytes: ...

    async def _write_bytes(self, path: str, data: bytes | memoryview, mode: str = "overwrite") -> None: ...

    async def _wopen(self, path: str, mode: str = "overwrite", append: bool = False) -> tuple[int, int]: ...

    async def _wwrite(self, handle: int, chan: int, data: bytes | memoryview) -> None: ...

    async def _wclose(self, handle: int, chan: int, commit: bool) -> None: ...

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]: ...

    def exists(self, path: str, **kwargs: Any) -> bool: ...

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes: ...

__all__ = ["TB5File", "new_buffer", "as_bytes", "plan_pieces", "check_piece", "MIN_PIECE"]

#: Smallest piece (bytes) a large read is split into across the connections.
MIN_PIECE = 4 * 1024 * 1024
#: Reads up to this many bytes (of a file of known size) are one request (the sync calls: on the direct connection).
SMALL_READ = 1024 * 1024

try:  # the Cython core: an uninitialised bytes object the reply is received into (no final copy)
    from tb5sync._bytes import empty_bytes as _empty_bytes
except ImportError:  # pragma: no cover - pure-Python installs
    _empty_bytes = None
if os.environ.get("TB5SYNC_PUREPYTHON") == "1":  # as the chunker and lister: the pure-Python twin
    _empty_bytes = None


def new_buffer(n: int, native: bool | None = None) -> tuple[Any, memoryview]:
    """A buffer of ``n`` bytes for a read's replies to be received into, and a writable view of it.

    With the Cython core (``tb5sync._bytes``) the buffer is a new, not yet filled ``bytes``
    object that :func:`as_bytes` hands out as it is (no copy); without it (or with
    ``native=False``) a ``bytearray``, copied once by :func:`as_bytes`. Nothing may see the
    owner before every reply has landed.
    """
    use = _empty_bytes is not None if native is None else native and _empty_bytes is not None
    if use:
        owner, view = _empty_bytes(n)
        return owner, view
    buf = bytearray(n)
    return buf, memoryview(buf)


def as_bytes(owner: Any) -> bytes:
    """The filled buffer of :func:`new_buffer` as ``bytes`` (itself when it already is)."""
    return owner if type(owner) is bytes else bytes(owner)


def plan_pieces(path: str, start: int, end: int, pin: dict[str, Any], streams: int) -> list[dict[str, Any]]:
    """``cat`` requests covering ``[start, end)`` of ``path`` (each pinned to ``pin``), split so
    that ``streams`` connections share them: pieces of ``(end - start) / streams`` bytes, at least
    :data:`MIN_PIECE` and at most :data:`~tb5sync.wire.messages.FS_MAX_READ`."""
    n = end - start
    size = max(MIN_PIECE, min(MAX_READ, -(-n // max(1, streams))))
    return [{"path": path, "start": o, "end": min(o + size, end), "expect": pin} for o in range(start, end, size)]


def check_piece(path: str, args: dict[str, Any], result: Any, view: memoryview) -> None:
    """Check that a ``cat`` reply received into ``view`` filled it whole.

    Raises
    ------
    SourceChangedError
        Fewer (or more) bytes came than asked for: the file changed meanwhile.
    """
    meta, body = result
    if len(body) != args["end"] - args["start"] or len(body) != len(view):
        raise SourceChangedError(path)


def _check_parent(fs: FileHost, path: str) -> None:
    """Raise as ``open(path, "wb")`` would when ``path``'s parent directory is missing or a file.

    Raises
    ------
    FileNotFoundError, NotADirectoryError
        The parent does not exist, or is not a directory.
    """
    parent = fs._parent(path)
    if not parent:
        return  # the server's ROOT
    try:
        kind = fs.info(parent)["type"]
    except FileNotFoundError:
        raise FileNotFoundError(2, "No such file or directory", path) from None
    if kind != "directory":
        raise NotADirectoryError(20, "Not a directory", path)


class TB5File(AbstractBufferedFile):
    """A file on a tb5sync server, opened through :class:`TB5FileSystem`.

    Read mode (``"rb"``): random access through ranged requests (default block
    8 MiB, fsspec's readahead cache); while reading sequentially the next block is
    fetched in the background. Every range is pinned to the size and mtime seen
    at open, so a file replaced meanwhile raises
    :class:`~tb5sync.errors.SourceChangedError` instead of mixing versions.

    Write modes (``"wb"``, ``"xb"``, ``"ab"``): buffered; the bytes go to a
    temporary file on the server, renamed into place on close (``autocommit``) or
    on :meth:`commit` inside an fsspec transaction. A ``with`` block left by an
    exception, a file dropped without ``close()``, or a lost connection leaves
    nothing at the final path (the old file, if any, stays).
    """

    DEFAULT_BLOCK_SIZE = 8 * 1024 * 1024

    def __init__(self, fs: FileHost, path: str, mode: str = "rb", block_size: int | None = None, autocommit: bool = True, cache_type: str = "readahead", cache_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self._handle: tuple[int, int] | None = None
        self._ahead: tuple[int, int, Any] | None = None
        if mode == "xb" and fs.exists(path):
            raise FileExistsError(17, "File exists", path)
        if mode in ("wb", "xb", "ab") and not fs.auto_mkdir:
            _check_parent(fs, path)  # fail at open, as LocalFileSystem does, not at close
        super().__init__(fs, path, mode, block_size or "default", autocommit, cache_type, cache_options, **kwargs)
        if mode == "rb" and self.details["type"] == "directory":
            raise IsADirectoryError(21, "Is a directory", path)
        if mode == "rb" and self.details["islink"] and self.details["type"] == "other":
            fs.cat_file(path, 0, 0)  # a link leading outside the root: the server refuses (PermissionError)

    # reading
    def seek(self, loc: int, whence: int = 0) -> int:
        """Set the read position (bytes) ``loc`` from the start (``whence`` 0), the current
        position (1) or the end (2); returns the new position. A position past the end is kept
        (reads there return ``b""``), as a local file's.

        Raises
        ------
        InvalidSeekError
            The position would be before the start (``OSError`` EINVAL, as a local file's, and
            ``ValueError``, as fsspec's files).
        ValueError
            ``whence`` is not 0, 1 or 2.
        OSError
            ESPIPE: the file is not open for reading (fsspec's rule).
        """
        if self.mode == "rb" and whence in (0, 1, 2):
            nloc = int(loc) + (0, self.loc, self.size)[whence]
            if nloc < 0:
                raise InvalidSeekError(f"Invalid argument: seek to {nloc} is before the start of {self.path}")
        elif self.mode == "rb":
            raise ValueError(f"whence value {whence} unsupported")
        return super().seek(loc, whence)  # type: ignore[no-any-return]

    def read(self, length: int | None = -1) -> bytes:
        """Up to ``length`` bytes from the position (all the rest when -1 or None).

        Raises
        ------
        ValueError
            ``length`` below -1 (as a local file's ``read``), or the file is not open for reading.
        """
        if length is not None and int(length) < -1:
            raise ValueError("read length must be non-negative or -1")
        return super().read(-1 if length is None else length)  # type: ignore[no-any-return]

    def _pin(self) -> dict[str, Any]:
        return {"size": self.details["size"], "mtime": self.details["mtime"]}

    def _fetch_range(self, start: int, end: int) -> bytes:
        end = min(end, self.size)
        if start >= end:
            return b""
        fs: FileHost = self.fs
        data = b""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            astart, aend, fut = ahead
            if astart == start:
                data = fut.result()[: end - start]
            else:
                fut.cancel()
        if len(data) < end - start:
            data += fs.cat_file(self.path, start + len(data), end, expect=self._pin())
        # sequential reading: fetch the next block of the same size in the background
        if end < self.size:
            nend = min(self.size, end + (end - start))
            coro = fs._cat_file(self.path, end, nend, expect=self._pin())
            self._ahead = (end, nend, asyncio.run_coroutine_threadsafe(coro, fs.loop))
        return data

    # writing
    def _initiate_upload(self) -> None:
        """Nothing to do yet: a small file is written in one request at close."""

    def _upload_chunk(self, final: bool = False) -> bool:
        fs: FileHost = self.fs
        data = self.buffer.getvalue()
        mode = "create" if self.mode == "xb" else "overwrite"
        if self._handle is None:
            if final and self.autocommit and self.mode != "ab" and len(data) <= MAX_WRITE:
                sync(fs.loop, fs._write_bytes, self.path, data, mode)
                return True
            self._handle = sync(fs.loop, fs._wopen, self.path, mode, self.mode == "ab")
        handle, chan = self._handle
        try:
            sync(fs.loop, fs._wwrite, handle, chan, data)
        except BaseException:
            self.discard()
            raise
        if final and self.autocommit:
            self.commit()
        return True

    def commit(self) -> None:
        """Rename the written bytes into place (called on close, or by an fsspec transaction)."""
        if self._handle is not None:
            handle, chan = self._handle
            self._handle = None
            sync(self.fs.loop, self.fs._wclose, handle, chan, True)

    def discard(self) -> None:
        """Throw the written bytes away; nothing appears at the final path."""
        if self._handle is not None:
            handle, chan = self._handle
            self._handle = None
            sync(self.fs.loop, self.fs._wclose, handle, chan, False)

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead[2].cancel()
            self._ahead = None
        super().close()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None and self.mode != "rb" and not self.closed:
            # the writer failed: throw its bytes away rather than commit half a file
            self.discard()
            self.closed = True
            return
        self.close()

    def __del__(self) -> None:
        # a writer dropped without close() never commits (fsspec's default would)
        if not self.closed and self.mode != "rb":
            try:
                self.discard()
            except Exception:  # interpreter shutdown, loop gone: the server drops the temp file anyway
                pass
            self.closed = True
        elif not self.closed:
            self.close()
