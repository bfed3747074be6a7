"""Server side of the file-system session (op ``fs``) behind :mod:`tb5sync.fs.filesystem`.

One :class:`FsOps` serves one connection: each request is a method call with
request paths relative to the served root (POSIX, no ``..``, no leading
``/``; ``""`` is the root itself). Results are plain dicts, or ``(meta,
parts)`` for file contents (a DATA frame, no copy into msgpack).

Safety
    Every path goes through a :class:`tb5sync._os.paths.Jail` of the root: resolved
    inside the root (:meth:`~tb5sync._os.paths.Jail.resolve`), then opened from a
    descriptor of the root without following any symlink, so a symlink swapped in
    between the check and the use cannot lead outside. A final symlink is followed
    for reads only when its target is inside the root (otherwise
    :class:`~tb5sync.errors.PathError`, a ``PermissionError``; ``info`` and
    listings then describe the link itself, type ``"other"``, size 0); writes go
    through such a symlink to its target, as
    ``open(path, "w")`` does, while ``rm`` and ``move`` act on the link itself.
    The state directory ``.tb5sync`` is neither listed nor reachable.

Names
    A path that is not valid UTF-8 (Python holds it with surrogate escapes) travels as
    the bytes :func:`~tb5sync.tree.entry.path_to_wire` gives, in requests
    (:func:`args_from_wire`) and in replies' ``name``/``destination``.

Atomicity
    File contents are written to ``.NAME.XXXXXXXX.tb5tmp`` in the target's
    directory and renamed over the final name on commit (``create`` mode links
    instead, so an existing file is never replaced). Writes still open when the
    connection ends are removed.

Errors
    ``OSError`` from the operating system comes back as the matching
    :class:`~tb5sync.errors.RemoteOSError` subclass (``FileNotFoundError``,
    ``FileExistsError``, ``IsADirectoryError``, ``NotADirectoryError``,
    ``PermissionError``) naming the request path; a read-only server answers every
    write with :class:`~tb5sync.errors.ReadOnlyError`.
"""

from __future__ import annotations

import bisect
import errno
import functools
import os
import secrets
import shutil
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from tb5sync._os.io import copy_range, preallocate, pwrite_all, read_into, write_all
from tb5sync.wire.parts import FileRange, SharedFd
from tb5sync._os.paths import STATE_DIR, Jail, claim_temp, is_temp_name, release_temp, split_request_path, temp_name
from tb5sync.errors import (
    shown,
    PathError,
    ReadOnlyError,
    RemoteExistsError,
    RemoteIsADirectoryError,
    SourceChangedError,
    Tb5syncError,
    UsageError,
    remote_os_error,
)
from tb5sync.tree.entry import path_from_wire, path_to_wire
from tb5sync.wire.messages import CAT_MANY_BUDGET
from tb5sync.wire.messages import FS_MAX_READ as MAX_READ
from tb5sync.wire.messages import FS_MAX_WRITE as MAX_WRITE
from tb5sync.tree.state import TreeState
from tb5sync.tree.quota import WriteQuota

__all__ = ["FsOps", "Pages", "PAGE_BYTES"]

#: Largest byte range one ``cat`` request returns (bytes); clients split larger reads.
#: Size budget of one page of an ``ls``/``find`` reply (bytes of msgpack, estimated).
PAGE_BYTES = 8 * 1024 * 1024
#: Most entries of long listings a server keeps waiting for their ``more`` requests, all its
#: connections together (~1 KB each held: ~2.5 GB); past it the oldest listings are dropped. One
#: whole ``find`` (at most 2,000,000 entries) always fits.
PAGES_MAX_ENTRIES = 2_500_000
_MAX_WRITES = 1024
#: ``put_piece`` receives its body in slices of this many bytes, each written before the next
#: arrives (a slice small enough to be still in the CPU's cache when ``pwrite`` copies it)
PIECE_SLICE = 1024 * 1024
_MAX_FIND = 2_000_000
#: Deepest level ``find`` descends to below its top (deeper: one UsageError).
MAX_FIND_DEPTH = 1024
#: Directory descriptors ``find`` keeps open along the current branch (the ancestors'
#: below this depth are reopened from the deepest held one): its descriptors are bounded.
_FIND_HELD = 16

#: A ``cat`` of at most this many bytes is read with one ``pread`` while the request is answered
#: and sent as bytes (a larger one: a FileRange the transport reads block by block while sending);
#: the transport's own threshold for reading a file part before sending it. Measured on the
#: development VM (``bench_fs.py --small-only``): 4 KiB ``cat`` with many in flight, server CPU
#: per request 25.5 us as a FileRange, 20.0 us read here.
INLINE_READ = 32 * 1024

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO must not block open()
_TMP_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC



F = TypeVar("F", bound=Callable[..., Any])


def _translating(arg: str = "path") -> Callable[[F], F]:
    """Turn plain ``OSError`` raised by the wrapped method into :func:`remote_os_error` for argument ``arg``."""

    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(self: FsOps, *args: Any, **kw: Any) -> Any:
            try:
                return fn(self, *args, **kw)
            except Tb5syncError:
                raise
            except OSError as exc:
                where = kw.get(arg, args[0] if args else "")
                raise remote_os_error(exc, where if isinstance(where, str) else "") from exc

        return wrapper  # type: ignore[return-value]

    return deco


def _writes(fn: F) -> F:
    """Refuse the wrapped method on a read-only server."""

    @functools.wraps(fn)
    def wrapper(self: FsOps, *args: Any, **kw: Any) -> Any:
        if self.read_only:
            raise ReadOnlyError(f"server is read-only; {fn.__name__} refused")
        return fn(self, *args, **kw)

    return wrapper  # type: ignore[return-value]


def _type_of(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISREG(mode):
        return "file"
    return "other"


def _info(name: str, st: os.stat_result, *, islink: bool = False, size: int | None = None, destination: str | None = None, kind_mode: int | None = None) -> dict[str, Any]:
    """An fsspec info dict with the fields fsspec's LocalFileSystem gives."""
    out: dict[str, Any] = {
        "name": name,
        "size": st.st_size if size is None else size,
        "type": _type_of(st.st_mode if kind_mode is None else kind_mode),
        "created": st.st_ctime,
        "islink": islink,
        "mode": st.st_mode,
        "uid": st.st_uid,
        "gid": st.st_gid,
        "mtime": st.st_mtime,
        "ino": st.st_ino,
        "nlink": st.st_nlink,
    }
    if destination is not None:
        out["destination"] = destination
    return out


def _join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def _wire_info(info: dict[str, Any]) -> dict[str, Any]:
    """``info`` as it travels: ``name`` and ``destination`` in :func:`~tb5sync.tree.entry.path_to_wire`
    form (bytes for a name that is not valid UTF-8; msgpack cannot carry surrogate escapes)."""
    name, dest = info["name"], info.get("destination")
    if name.isascii() and (dest is None or dest.isascii()):
        return info
    out = dict(info)
    out["name"] = path_to_wire(name)
    if dest is not None:
        out["destination"] = path_to_wire(dest)
    return out


def _safe_text(text: str) -> str:
    """``text`` fit for a msgpack str: surrogate escapes (bytes of a non-UTF-8 name) as ``\\xNN``."""
    if text.isascii():
        return text
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


#: Request arguments of the fs session holding a path: str, or bytes (path_to_wire) for a name
#: that is not valid UTF-8.
_PATH_KEYS = ("path", "src", "dst")


def args_from_wire(method: str, args: dict[str, Any]) -> dict[str, Any]:
    """An fs request's arguments with their wire paths (bytes for non-UTF-8 names) as Python
    holds them (surrogate escapes, :func:`~tb5sync.tree.entry.path_from_wire`); others untouched."""
    out = None
    for k in _PATH_KEYS:
        if isinstance(args.get(k), bytes):
            out = out or dict(args)
            out[k] = path_from_wire(args[k])
    paths = args.get("paths")
    if isinstance(paths, list) and any(isinstance(p, bytes) for p in paths):
        out = out or dict(args)
        out["paths"] = [path_from_wire(p) if isinstance(p, bytes) else p for p in paths]
    items = args.get("items")
    if method == "cat_many" and isinstance(items, list) and any(isinstance(i, list) and i and isinstance(i[0], bytes) for i in items):
        out = out or dict(args)
        out["items"] = [[path_from_wire(i[0]), *i[1:]] if isinstance(i, list) and i and isinstance(i[0], bytes) else i for i in items]
    return args if out is None else out


class _Write:
    """A file being written under a temporary name in its final directory (no descriptor held)."""

    __slots__ = ("dir_parts", "tmp", "name", "exclusive", "path")

    def __init__(self, dir_parts: list[str], tmp: str, name: str, exclusive: bool, path: str) -> None:
        self.dir_parts, self.tmp, self.name, self.exclusive, self.path = dir_parts, tmp, name, exclusive, path


#: The least bytes of a ``put_piece`` but the file's last (clients send 4 MiB pieces): bounds the
#: received ranges a put keeps to one per 64 KiB of the file.
MIN_PUT_PIECE = 64 * 1024


class _Put:
    """A file being received in pieces (``put_open``/``put_piece``/``put_close``): its temporary
    file (preallocated to ``size`` bytes; no descriptor held between pieces, as ``wopen``) and the
    ranges received so far."""

    __slots__ = ("dir_parts", "tmp", "name", "exclusive", "path", "size", "got", "active", "owner")

    def __init__(self, dir_parts: list[str], tmp: str, name: str, exclusive: bool, path: str, size: int, owner: object) -> None:
        self.dir_parts, self.tmp, self.name, self.exclusive, self.path = dir_parts, tmp, name, exclusive, path
        self.size, self.owner = size, owner
        self.got: list[tuple[int, int]] = []  # (start, end) of the bytes written, merged, sorted
        self.active = 0  # pieces being written now

    def add(self, offset: int, n: int) -> None:
        """Count bytes ``offset`` .. ``offset + n`` as written, merged with their neighbours (a
        peer's pieces, however many, keep at most one range per gap between them)."""
        if n <= 0:
            return
        start, end = offset, offset + n
        i = bisect.bisect_left(self.got, (start, start))
        if i > 0 and self.got[i - 1][1] >= start:
            i -= 1
        j = i
        while j < len(self.got) and self.got[j][0] <= end:
            start, end = min(start, self.got[j][0]), max(end, self.got[j][1])
            j += 1
        self.got[i:j] = [(start, end)]

    def complete(self) -> bool:
        """Whether the pieces received cover every byte of the file."""
        return self.size == 0 or self.got == [(0, self.size)]


class Puts:
    """Files being received in pieces, shared by a server's connections: the connection that
    opened one (``put_open``) owns it, and any connection may carry its pieces (``put_piece``,
    named by the random id ``put_open`` answered). Thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: dict[str, _Put] = {}



class Pages:
    """Pages of long listings waiting for the client, shared by a server's connections.

    A listing larger than :data:`PAGE_BYTES` is answered with its first page and a
    cursor; ``more(cursor)`` hands out the next ones. At most ``limit`` (64) listings and
    :data:`PAGES_MAX_ENTRIES` entries wait (the oldest listing is dropped first, never the one
    just put); an unknown or dropped cursor is a :class:`~tb5sync.errors.UsageError`.
    """

    def __init__(self, limit: int = 64) -> None:
        self._lock = threading.Lock()
        self._waiting: OrderedDict[str, list[list[dict[str, Any]]]] = OrderedDict()
        self._limit = limit
        self._entries = 0

    def waiting_entries(self) -> int:
        """Entries of the listings waiting now."""
        with self._lock:
            return self._entries

    def put(self, pages: list[list[dict[str, Any]]]) -> str:
        """Keep ``pages`` (in order); returns their cursor."""
        cursor = secrets.token_hex(12)
        with self._lock:
            self._waiting[cursor] = pages
            self._entries += sum(len(p) for p in pages)
            while len(self._waiting) > 1 and (len(self._waiting) > self._limit or self._entries > PAGES_MAX_ENTRIES):
                _, dropped = self._waiting.popitem(last=False)
                self._entries -= sum(len(p) for p in dropped)
        return cursor

    def take(self, cursor: str) -> tuple[list[dict[str, Any]], str | None]:
        """The next page of ``cursor`` and the cursor for the rest (None when it was the last)."""
        with self._lock:
            pages = self._waiting.pop(cursor, None)
            if pages is None:
                raise UsageError("listing cursor unknown or expired; list again")
            page = pages.pop(0)
            self._entries -= len(page)
            if not pages:
                return page, None
            self._waiting[cursor] = pages
            return page, cursor


def discard_temp(jail: Jail, dir_parts: Sequence[str], tmp: str) -> None:
    """Release the claim on temporary file ``tmp`` and remove it from the directory ``dir_parts``
    of ``jail`` (looked up through the jail again; gone already, with its directory, is fine)."""
    release_temp(tmp, dir_parts)
    try:
        dfd = jail.open_dir(list(dir_parts))
    except (OSError, Tb5syncError):
        return  # the directory went away (and the temporary file with it)
    try:
        os.unlink(tmp, dir_fd=dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


class FsOps:
    """File-system requests on one connection, confined to ``root``.

    Parameters
    ----------
    root : str
        Absolute, resolved root directory of the server.
    state : TreeState
        The root's scan cache and chunk index (for content digests).
    read_only : bool
        Refuse every write with :class:`~tb5sync.errors.ReadOnlyError`.

    pages : Pages or None
        Where long listings wait to be fetched; a server shares one among its
        connections (so any connection may fetch the next page). None: a private one.

    Raises
    ------
    OSError
        ``root`` cannot be opened.
    """

    def __init__(self, root: str, state: TreeState, read_only: bool = False, pages: Pages | None = None,
                 quota: WriteQuota | None = None, puts: Puts | None = None) -> None:
        self.root = root
        #: files being received in pieces, shared with the server's other connections
        self.puts = puts if puts is not None else Puts()
        self._my_puts: set[str] = set()
        self._slice: memoryview | None = None  # put_piece's receive buffer
        #: the session's write limits (a server's ``--max-session-bytes``/``--min-free-space``):
        #: ``put``, ``wwrite``, ``copy`` and an appending ``wopen`` charge their bytes before writing
        self.quota = quota
        self.state = state
        self.read_only = read_only
        self.pages = pages if pages is not None else Pages()
        self.jail = Jail(root)
        self._writes: dict[int, _Write] = {}

    def close(self) -> None:
        """Abort every unfinished write (removing its temporary file) and close the root. Safe to call twice."""
        for handle in list(self._writes):
            self._abort(handle)
        for pid in list(self._my_puts):
            self._put_abort(pid)
        self.jail.close()

    def _charge(self, nbytes: int, path: str) -> None:
        """Count ``nbytes`` about to be written to ``path`` against :attr:`quota` (QuotaError past it)."""
        if self.quota is not None:
            self.quota.charge(nbytes, path)

    # ---- path resolution ----------------------------------------------------------------
    def _stat(self, path: str) -> dict[str, Any]:
        """fsspec info of ``path``; a symlink is followed (inside the root) and reported with ``islink``."""
        parts = self.jail.literal(path)
        if not parts:
            return _info("", os.fstat(self.jail.fd))
        name = "/".join(parts)
        if len(parts) == 1:  # in the root: looked up relative to its descriptor
            dfd = os.dup(self.jail.fd)
        else:
            dfd, parts = self.jail.locate_request(path, parts)
        try:
            lst = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
            if not stat.S_ISLNK(lst.st_mode):
                return _info(name, lst)
            dest = os.readlink(parts[-1], dir_fd=dfd)
        finally:
            os.close(dfd)
        try:
            fd, _ = self.jail.open_read(path)  # FileNotFoundError for a dangling link, as LocalFileSystem
        except PathError:  # leads outside the root: describe the link itself, never its target
            return _info(name, lst, islink=True, size=0, destination=dest)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        return _info(name, st, islink=True, destination=dest)

    def _entry_info(self, dfd: int, parent: str, de: os.DirEntry[str]) -> dict[str, Any]:
        """Listing entry like LocalFileSystem's for a scandir entry: a symlink is type "other"."""
        name = _join(parent, de.name)
        st = de.stat(follow_symlinks=False)
        if not stat.S_ISLNK(st.st_mode):
            return _info(name, st)
        dest = os.readlink(de.name, dir_fd=dfd)
        size = 0
        try:
            fd, _ = self.jail.open_read(name)
            try:
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
        except (OSError, Tb5syncError):
            pass
        return _info(name, st, islink=True, size=size, destination=dest)

    def _listdir(self, dfd: int, parent: str, at_root: bool) -> list[dict[str, Any]]:
        """Entries of directory ``dfd`` named under ``parent``; ``at_root``: it is the root (hide the state dir)."""
        out = []
        with os.scandir(dfd) as it:
            for de in it:
                if at_root and de.name == STATE_DIR or is_temp_name(de.name):
                    continue  # tb5sync's state, and files being written (not there until committed)
                try:
                    out.append(self._entry_info(dfd, parent, de))
                except FileNotFoundError:
                    continue  # removed while listing
        out.sort(key=lambda i: i["name"])
        return out

    def _paged(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        """``{"entries": first page, "more": cursor or None}``; the rest waits in :attr:`pages`."""
        pages: list[list[dict[str, Any]]] = [[]]
        size = 0
        for e in entries:
            n = 160 + 2 * (len(e["name"]) + len(e.get("destination", "")))  # msgpack bytes, generously
            if size + n > PAGE_BYTES and pages[-1]:
                pages.append([])
                size = 0
            pages[-1].append(_wire_info(e))
            size += n
        first = pages.pop(0)
        return {"entries": first, "more": self.pages.put(pages) if pages else None}

    def more(self, cursor: str) -> dict[str, Any]:
        """The next page of a long ``ls``/``find`` reply: ``{"entries", "more"}``."""
        if not isinstance(cursor, str):
            raise UsageError("more: cursor must be a string")
        page, nxt = self.pages.take(cursor)
        return {"entries": page, "more": nxt}

    # ---- reading ------------------------------------------------------------------------
    @_translating()
    def info(self, path: str) -> dict[str, Any]:
        """``{"info": info dict}`` of ``path`` (fields as fsspec's LocalFileSystem: name, size, type, created, islink, mode, uid, gid, mtime, ino, nlink[, destination])."""
        return {"info": _wire_info(self._stat(path))}

    @_translating()
    def ls(self, path: str) -> dict[str, Any]:
        """``{"entries": [info, ...]}``: the directory's entries sorted by name, or ``[info]`` of a file."""
        info = self._stat(path)
        if info["islink"]:
            self.jail.resolve(path, follow=True)  # listing through a link leading outside: PathError
        if info["type"] != "directory":
            return {"entries": [_wire_info(info)]}
        dfd, parts = self.jail.open_request_dir(path)  # as written first: no realpath without a link
        try:
            return self._paged(self._listdir(dfd, info["name"], not parts))
        finally:
            os.close(dfd)

    @_translating()
    def find(self, path: str, maxdepth: int | None = None, withdirs: bool = False) -> dict[str, Any]:
        """``{"entries": [info, ...]}`` of everything below ``path`` (files; directories too if ``withdirs``).

        Symlinks are listed, not followed (as fsspec's ``walk`` over LocalFileSystem).
        ``maxdepth`` 1 means the directory's own entries. A file ``path`` gives
        ``[its info]``; a missing one gives ``[]``. At most 2,000,000 entries and
        :data:`MAX_FIND_DEPTH` levels (more: UsageError); the walk holds at most
        ``_FIND_HELD + 2`` descriptors (:meth:`_walk`).
        """
        if maxdepth is not None and (not isinstance(maxdepth, int) or maxdepth < 1):
            raise UsageError("maxdepth must be at least 1")
        try:
            top = self._stat(path)
        except FileNotFoundError:
            return {"entries": []}
        if top["type"] != "directory":
            return {"entries": [_wire_info(top)]}
        out: list[dict[str, Any]] = []
        if withdirs and top["name"]:
            out.append(top)
        top_fd, top_parts = self.jail.open_request_dir(path)  # as written first: no realpath without a link
        self._walk(top_fd, top["name"], not top_parts, maxdepth, withdirs, out, path)
        out.sort(key=lambda i: i["name"])
        return self._paged(out)

    def _walk(self, top_fd: int, top_name: str, at_root: bool, maxdepth: int | None, withdirs: bool,
              out: list[dict[str, Any]], path: str) -> None:
        """Depth first below ``top_fd`` (closed here), entries appended to ``out``.

        A directory's descriptor is closed once it is listed, except along the current branch's
        first :data:`_FIND_HELD` levels; a deeper directory is opened from the deepest held
        ancestor by its relative path (each component without following a symlink). So one walk
        holds at most ``_FIND_HELD + 2`` descriptors whatever the tree's width or depth.
        """
        # a frame: [held descriptor or -1, its name below top, depth, parts from the deepest held
        # ancestor, subdirectories still to visit (names, reversed)]
        frames: list[list[Any]] = []

        def enter(dfd: int, rel: str, depth: int, parts: list[str]) -> None:
            pending: list[str] = []
            try:
                for info in self._listdir(dfd, rel, at_root and depth == 1):
                    if info["type"] == "directory":
                        if withdirs:
                            out.append(info)
                        if maxdepth is None or depth < maxdepth:
                            pending.append(info["name"].rpartition("/")[2])
                    else:
                        out.append(info)
                    if len(out) > _MAX_FIND:
                        raise UsageError(f"find {shown(path)}: more than {_MAX_FIND} entries")
            except BaseException:
                os.close(dfd)
                raise
            if pending and depth >= MAX_FIND_DEPTH:
                os.close(dfd)
                raise UsageError(f"find {shown(path)}: deeper than {MAX_FIND_DEPTH} levels")
            pending.reverse()
            if pending and len(frames) < _FIND_HELD:
                frames.append([dfd, rel, depth, parts, pending])
            else:
                os.close(dfd)
                if pending:
                    frames.append([-1, rel, depth, parts, pending])

        try:
            enter(top_fd, top_name, 1, [])
            while frames:
                frame = frames[-1]
                held, rel, depth, parts, pending = frame
                if not pending:
                    frames.pop()
                    if held >= 0:
                        os.close(held)
                    continue
                name = pending.pop()
                if held >= 0:
                    start, sub = held, [name]
                else:  # reopened from the deepest ancestor holding its descriptor (the first levels hold theirs)
                    base = next(f for f in reversed(frames) if f[0] >= 0)
                    start, sub = base[0], [*parts[len(base[3]) :], name]
                try:
                    dfd = self._open_below(start, sub)
                except OSError:
                    continue  # vanished or swapped for a symlink while walking
                enter(dfd, _join(rel, name), depth + 1, [*parts, name])
        finally:
            for f in frames:
                if f[0] >= 0:
                    os.close(f[0])

    def _open_below(self, start: int, parts: list[str]) -> int:
        """Directory ``parts`` below descriptor ``start``: one open when the relative path is short,
        else component by component (a deep path may pass PATH_MAX; each step holds one descriptor)."""
        if len(parts) == 1 or sum(len(p) + 1 for p in parts) < 2048:
            return self.jail.open_dir(parts, start=start)
        fd = self.jail.open_dir(parts[:1], start=start)
        for name in parts[1:]:
            try:
                nfd = self.jail.open_dir([name], start=fd)
            finally:
                os.close(fd)
            fd = nfd
        return fd

    @staticmethod
    def _range(size: int, start: int | None, end: int | None) -> tuple[int, int]:
        """Python-slice semantics of ``[start:end]`` over ``size`` bytes, clamped."""
        if start is not None and not isinstance(start, int) or end is not None and not isinstance(end, int):
            raise UsageError("start and end must be integers or None")
        s, e, _ = slice(start, end).indices(size)
        return s, max(s, e)

    def _open_range(self, path: str, start: int | None, end: int | None, expect: dict[str, Any] | None) -> tuple[int, os.stat_result, int, int]:
        """Open ``path`` for reading ``[start:end]``: ``(fd, stat, s, e)`` (the caller closes ``fd``).

        Raises
        ------
        IsADirectoryError, UsageError, SourceChangedError
            A directory; bad ``expect``/range types; a file whose size or mtime is not ``expect``'s.
        """
        fd, _ = self.jail.open_read(path)
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "Is a directory")
            if expect is not None and not isinstance(expect, dict):
                raise UsageError("expect must be a map {size, mtime} or None")
            if expect and (st.st_size != expect.get("size", st.st_size) or st.st_mtime != expect.get("mtime", st.st_mtime)):
                raise SourceChangedError(path)
            s, e = self._range(st.st_size, start, end)
        except BaseException:
            os.close(fd)
            raise
        return fd, st, s, e

    def _read(self, path: str, start: int | None, end: int | None, expect: dict[str, Any] | None, limit: int) -> tuple[bytes | memoryview, os.stat_result, int, int]:
        """Read ``[start:end]`` (at most ``limit`` bytes) into a new buffer (a view of it is returned)."""
        fd, st, s, e = self._open_range(path, start, end, expect)
        try:
            n = min(e - s, limit)
            view = memoryview(bytearray(n))
            got = 0
            while got < n:  # preadv may return short (a slow filesystem); 0 means the file shrank
                k = read_into(fd, view[got:], s + got)
                if k == 0:
                    raise SourceChangedError(path)
                got += k
            return view, st, s, e
        finally:
            os.close(fd)

    @_translating()
    def cat(self, path: str, start: int | None = None, end: int | None = None, expect: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[Any]]:
        """Bytes ``[start:end]`` of a file (Python slice semantics, negative from the end), as a DATA reply.

        At most :data:`MAX_READ` bytes come back; ``meta`` = ``{"size", "mtime", "start",
        "end"}`` gives the file's size (bytes) and mtime (seconds) and the whole range
        asked for, so the client fetches the rest (with ``expect``) in parallel.
        ``expect`` = ``{"size": bytes, "mtime": seconds}`` makes a changed file an error
        (:class:`~tb5sync.errors.SourceChangedError`), so a reader never mixes versions.

        Up to :data:`INLINE_READ` bytes are read at once (one ``pread``, the descriptor closed
        before the reply goes out; a file that shrank since its ``fstat``:
        :class:`~tb5sync.errors.SourceChangedError`). Larger, the bytes are one
        :class:`~tb5sync.wire.parts.FileRange` part, read by the transport in
        1 MiB blocks into one reused buffer and sent block by block (``sendfile=False``: faster
        on loopback than ``sendfile``, see :class:`~tb5sync.wire.parts.FileRange`), so reading
        overlaps sending and the server holds no 16 MiB buffer per connection.
        A file that shrinks while being sent ends the connection rather than pad the reply
        (``pad=False``): the client sees the read fail, never bytes the file did not hold.
        """
        fd, st, s, e = self._open_range(path, start, end, expect)
        n = min(e - s, MAX_READ)
        meta = {"size": st.st_size, "mtime": st.st_mtime, "start": s, "end": e}
        if n <= INLINE_READ:  # small: read here, the descriptor closed before the reply is sent
            try:
                data = os.pread(fd, n, s) if n else b""
                while len(data) < n:  # short (a slow filesystem), or 0: the file shrank since fstat
                    more = os.pread(fd, n - len(data), s + len(data))
                    if not more:
                        raise SourceChangedError(path)
                    data += more
            finally:
                os.close(fd)
            return meta, [data] if n else []
        shared = SharedFd(fd)
        parts = [FileRange(shared, s, n, pad=False, sendfile=False)]
        return meta, parts

    def cat_many(self, items: list[Any]) -> tuple[dict[str, Any], list[bytes | memoryview]]:
        """Several reads in one reply: ``items`` = ``[[path, start, end], ...]``.

        The reply's ``meta["items"]`` has, per item, ``[nbytes]`` (its bytes follow in
        order), ``["E", kind, message, errno]`` for an error, or ``["M"]`` when the
        reply's :data:`CAT_MANY_BUDGET` is spent (ask again).
        """
        if not isinstance(items, list) or len(items) > 100_000:
            raise UsageError("cat_many: items must be a list of at most 100000 [path, start, end]")
        meta: list[list[Any]] = []
        parts: list[bytes | memoryview] = []
        budget = CAT_MANY_BUDGET
        for item in items:
            if not isinstance(item, (list, tuple)) or len(item) != 3:
                raise UsageError("cat_many: each item is [path, start, end]")
            path, start, end = item
            if budget <= 0:
                meta.append(["M"])
                continue
            try:
                try:
                    data, _, s, e = self._read(path, start, end, None, MAX_READ)
                except Tb5syncError:
                    raise
                except OSError as exc:
                    raise remote_os_error(exc, path if isinstance(path, str) else "") from exc
            except Tb5syncError as exc:
                meta.append(["E", type(exc).__name__, _safe_text(str(exc)), getattr(exc, "errno", None)])
                continue
            if e - s > len(data):  # longer than one request may carry
                meta.append(["M"])
                continue
            if len(data) > budget and parts:
                meta.append(["M"])
                budget = 0
                continue
            budget -= len(data)
            meta.append([len(data)])
            parts.append(data)
        return {"items": meta}, parts

    @_translating()
    def digest(self, path: str) -> dict[str, Any]:
        """``{"digest": 32 bytes, "size": bytes, "mtime": seconds}``: the file's content digest.

        The digest is BLAKE3 over the BLAKE3-256 digests of the file's FastCDC chunks
        (see :func:`tb5sync.engine.hashing.file_digest`), served from the scan cache when
        the file is unchanged.
        """
        fd, rel = self.jail.open_read(path)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "Is a directory") if stat.S_ISDIR(st.st_mode) else UsageError(f"not a regular file: {shown(path)}")
            fdigest, _ = self.state.chunks_of(fd, rel, st)
            return {"digest": fdigest, "size": st.st_size, "mtime": st.st_mtime}
        finally:
            os.close(fd)

    # ---- writing ------------------------------------------------------------------------
    def _discard_temp(self, dir_parts: list[str], tmp: str) -> None:
        """Release the claim on temporary file ``tmp`` and remove it from the directory ``dir_parts``
        (:func:`discard_temp` through this session's jail)."""
        discard_temp(self.jail, dir_parts, tmp)

    def _commit_in(self, dir_parts: list[str], tmp: str, name: str, exclusive: bool, path: str) -> None:
        """Release the claim on temporary file ``tmp`` and rename it to ``name`` in the directory
        ``dir_parts`` (looked up through the jail again), as :meth:`_commit`; an OSError becomes the
        remote error naming ``path``."""
        release_temp(tmp, dir_parts)
        try:
            dfd = self.jail.open_dir(dir_parts)
            try:
                self._commit(dfd, tmp, name, exclusive)
            finally:
                os.close(dfd)
        except Tb5syncError:
            raise
        except OSError as exc:
            raise remote_os_error(exc, path) from exc

    def _commit(self, dfd: int, tmp: str, name: str, exclusive: bool) -> None:
        try:
            if exclusive:
                os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                os.unlink(tmp, dir_fd=dfd)
            else:
                os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise

    def _write_file(self, dfd: int, name: str, fill: Callable[[int], None], exclusive: bool) -> None:
        """Create ``name`` in ``dfd`` atomically: ``fill(fd)`` writes a temporary file, then it is committed.

        On any error the temporary file is removed and nothing appears at ``name``.
        """
        tmp = temp_name(name)
        fd = os.open(tmp, _TMP_FLAGS, 0o666, dir_fd=dfd)
        try:
            fill(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp, dir_fd=dfd)
            raise
        os.close(fd)
        self._commit(dfd, tmp, name, exclusive)

    @staticmethod
    def _check_mode(mode: str) -> bool:
        if mode not in ("overwrite", "create"):
            raise UsageError(f"mode must be 'overwrite' or 'create', not {shown(mode)}")
        return mode == "create"

    @_writes
    @_translating()
    def put(self, path: str, data: bytes, mode: str = "overwrite", mkdirs: bool = False) -> dict[str, Any]:
        """Write ``data`` (at most :data:`MAX_WRITE` bytes) as file ``path``, atomically.

        ``mode="create"`` refuses an existing path (``FileExistsError``); ``mkdirs``
        creates missing parent directories (else ``FileNotFoundError``).
        """
        exclusive = self._check_mode(mode)
        if not isinstance(data, bytes) or len(data) > MAX_WRITE:
            raise UsageError(f"put: data must be at most {MAX_WRITE} bytes")
        self._charge(len(data), path)
        with self.jail.parent(path, create=mkdirs, follow=True) as (dfd, name, _):
            self._write_file(dfd, name, lambda fd: write_all(fd, data), exclusive)
        return {}

    @_writes
    @_translating()
    def wopen(self, handle: int, path: str, mode: str = "overwrite", append: bool = False, mkdirs: bool = False) -> dict[str, Any]:
        """Start writing ``path`` under ``handle`` (an int the client picks, unique on this connection).

        The bytes go to a temporary file; :meth:`wclose` commits or discards it.
        ``append`` starts from a copy of the existing file's contents (if any). No
        descriptor stays open between requests (a transaction of thousands of
        files costs the server none), at most 1024 open writes per connection.
        """
        exclusive = self._check_mode(mode)
        if not isinstance(handle, int) or handle in self._writes or len(self._writes) >= _MAX_WRITES:
            raise UsageError("wopen: bad, duplicate or too many write handles")
        with self.jail.parent(path, create=mkdirs, follow=True) as (dfd, name, rel):
            if exclusive:
                try:
                    os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    pass
                else:
                    raise RemoteExistsError(f"File exists: {shown(path)}")
            tmp = temp_name(name)
            fd = os.open(tmp, _TMP_FLAGS, 0o666, dir_fd=dfd)
            claim_temp(tmp, rel.split("/")[:-1])  # no descriptor stays open: a sync's stale-file cleanup must know it is live
            self._writes[handle] = _Write(rel.split("/")[:-1], tmp, name, exclusive, path)
            try:
                if append:
                    try:
                        self._charge(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_size, path)
                    except FileNotFoundError:
                        pass
                    self._copy_existing(dfd, name, fd)
            except BaseException:
                os.close(fd)
                self._abort(handle)
                raise
            os.close(fd)
        return {}

    @_writes
    @_translating()
    def put_open(self, path: str, size: int, mode: str = "overwrite", mkdirs: bool = False) -> dict[str, Any]:
        """Start receiving file ``path`` of ``size`` bytes in pieces (:meth:`put_piece`, from any
        connection of this server); answers ``{"id": str}`` (32 hex digits, random).

        The session's quota is charged ``size`` bytes first; then a temporary name is created
        beside ``path`` (through the jail; a final symlink is written through, as ``put``), given
        the permission bits of the file it replaces, and its ``size`` bytes reserved on disk
        (``posix_fallocate`` where the platform has it: a full disk fails here). Nothing appears at
        ``path`` until :meth:`put_close` commits a file whose every byte arrived.

        Raises
        ------
        QuotaError
            ``size`` exceeds what the session may still write.
        RemoteIsADirectoryError, RemoteExistsError, FileNotFoundError (remote)
            ``path`` is a directory; exists with ``mode="create"``; its parent is missing (without ``mkdirs``).
        UsageError
            A bad size or mode, or too many writes open on this connection.
        """
        exclusive = self._check_mode(mode)
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise UsageError(f"put_open: size must be a non-negative int, not {shown(size)}")
        if len(self._my_puts) + len(self._writes) >= _MAX_WRITES:
            raise UsageError("put_open: too many writes open on this connection")
        self._charge(size, path)
        with self.jail.parent(path, create=mkdirs, follow=True) as (dfd, name, rel):
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and exclusive:
                raise RemoteExistsError(f"File exists: {shown(path)}")
            if st is not None and stat.S_ISDIR(st.st_mode):
                raise RemoteIsADirectoryError(f"Is a directory: {shown(path)}")
            tmp = temp_name(name)
            fd = os.open(tmp, _TMP_FLAGS, 0o666, dir_fd=dfd)
            try:
                if st is not None and stat.S_ISREG(st.st_mode):
                    os.fchmod(fd, stat.S_IMODE(st.st_mode))  # as copyfile into an existing file
                preallocate(fd, size)
            except BaseException:
                os.unlink(tmp, dir_fd=dfd)
                raise
            finally:
                os.close(fd)
            claim_temp(tmp, rel.split("/")[:-1])
            pid = secrets.token_hex(16)
            with self.puts.lock:
                self.puts.open[pid] = _Put(rel.split("/")[:-1], tmp, name, exclusive, path, size, self)
            self._my_puts.add(pid)
        return {"id": pid}

    def put_piece(self, id: str, offset: int, data: Any) -> dict[str, Any]:
        """Write ``data`` (a DATA request's raw body, :class:`~tb5sync.wire.rpc.DataBody`, still on the
        connection; or bytes) at ``offset`` of the file being received as ``id``: received in
        slices of :data:`PIECE_SLICE` (1 MiB) into one reused buffer, each written with ``pwrite``
        while still in the CPU's cache.

        Raises
        ------
        UsageError
            ``id`` is not open (unknown, or already closed), or the piece reaches past the size
            given to :meth:`put_open`.
        RemoteOSError
            The write failed (the whole put is then aborted, its temporary file removed).
        """
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise UsageError(f"put_piece: bad offset {shown(offset)}")
        n = len(data)
        with self.puts.lock:
            put = self.puts.open.get(id) if isinstance(id, str) else None
            if put is None:
                raise UsageError(f"put_piece: no open put {shown(id)}")
            if offset + n > put.size:
                raise UsageError(f"put_piece: {n} bytes at {offset} reach past the file's {put.size} bytes ({shown(put.path)})")
            if n < MIN_PUT_PIECE and offset + n != put.size:
                # bounds the ranges kept per put (a peer's stream of empty or one-byte pieces grew them without end)
                raise UsageError(f"put_piece: {n} bytes at {offset}: every piece but the file's last must be at least {MIN_PUT_PIECE} bytes ({shown(put.path)})")
            put.active += 1
        try:
            fd = self.jail.open_file([*put.dir_parts, put.tmp], os.O_WRONLY | os.O_NONBLOCK, shown=put.path)
            try:
                readinto = getattr(data, "readinto", None)
                if readinto is None:
                    pwrite_all(fd, data, offset)
                else:
                    if self._slice is None:
                        self._slice = memoryview(bytearray(PIECE_SLICE))
                    off = offset
                    while k := readinto(self._slice):
                        pwrite_all(fd, self._slice[:k], off)
                        off += k
            finally:
                os.close(fd)
        except BaseException as exc:
            with self.puts.lock:
                put.active -= 1
            self._put_abort(id)
            if isinstance(exc, OSError) and not isinstance(exc, Tb5syncError) and getattr(data, "failed", None) is None:
                raise remote_os_error(exc, put.path) from exc
            raise
        with self.puts.lock:
            put.active -= 1
            put.add(offset, n)
        return {}

    def put_close(self, id: str, commit: bool = True) -> dict[str, Any]:
        """Finish the put ``id`` (opened on any connection of this server: the id is its key):
        rename it into place (``commit``) when every byte arrived, or remove it. Discarding a put
        that is not open is not an error.

        Raises
        ------
        UsageError
            ``id`` is not open, or (``commit``) bytes are missing: the put is then removed.
        RemoteOSError
            The rename failed (the temporary file is removed).
        """
        if not commit:
            if isinstance(id, str):
                self._put_abort(id)
            return {}
        with self.puts.lock:
            put = self.puts.open.get(id) if isinstance(id, str) else None
            if put is None:
                raise UsageError(f"put_close: no open put {shown(id)}")
            whole = put.active == 0 and put.complete()
            if whole:
                del self.puts.open[id]
        if not whole:
            self._put_abort(id)
            raise UsageError(f"put_close: bytes of {shown(put.path)} are missing; nothing written")
        if isinstance(put.owner, FsOps):
            put.owner._my_puts.discard(id)
        self._commit_in(put.dir_parts, put.tmp, put.name, put.exclusive, put.path)
        return {}

    def _put_abort(self, pid: str) -> None:
        """Remove the put ``pid`` and its temporary file (idempotent)."""
        with self.puts.lock:
            put = self.puts.open.pop(pid, None)
            if put is None:
                return
        if isinstance(put.owner, FsOps):
            put.owner._my_puts.discard(pid)
        self._discard_temp(put.dir_parts, put.tmp)

    @staticmethod
    def _copy_existing(dfd: int, name: str, out: int) -> None:
        try:
            src = os.open(name, _READ_FLAGS, dir_fd=dfd)
        except FileNotFoundError:
            return
        try:
            n = os.fstat(src).st_size
            while n > 0:
                k = copy_range(src, out, n)
                if k == 0:
                    break
                n -= k
        finally:
            os.close(src)

    def _handle(self, handle: int) -> _Write:
        w = self._writes.get(handle) if isinstance(handle, int) else None
        if w is None:
            raise UsageError(f"no open write with handle {shown(handle)}")
        return w

    def wwrite(self, handle: int, data: bytes) -> dict[str, Any]:
        """Append ``data`` (at most :data:`MAX_WRITE` bytes) to the open write ``handle``."""
        w = self._handle(handle)
        if not isinstance(data, bytes) or len(data) > MAX_WRITE:
            raise UsageError(f"wwrite: data must be at most {MAX_WRITE} bytes")
        try:
            self._charge(len(data), w.path)  # refused: the write is aborted, its temporary file removed
            fd = self.jail.open_file([*w.dir_parts, w.tmp], os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK, shown=w.path)
            try:
                write_all(fd, data)
            finally:
                os.close(fd)
        except (OSError, Tb5syncError) as exc:
            self._abort(handle)
            if isinstance(exc, Tb5syncError):
                raise
            raise remote_os_error(exc, w.path) from exc
        return {}

    def wclose(self, handle: int, commit: bool = True) -> dict[str, Any]:
        """Finish the write ``handle``: rename it into place (``commit``) or remove it.

        Removing a write that is not open (already removed after a failed ``wwrite``) is not
        an error, so a client's cleanup never hides the error that made it clean up.
        """
        if not commit:
            if isinstance(handle, int) and handle in self._writes:
                self._abort(handle)
            return {}
        w = self._handle(handle)
        del self._writes[handle]
        self._commit_in(w.dir_parts, w.tmp, w.name, w.exclusive, w.path)
        return {}

    def _abort(self, handle: int) -> None:
        w = self._writes.pop(handle)
        self._discard_temp(w.dir_parts, w.tmp)

    @_writes
    def rm(self, paths: list[str], recursive: bool = False) -> dict[str, Any]:
        """Remove each of ``paths`` (a symlink itself, never its target).

        A directory needs ``recursive`` (else :class:`~tb5sync.errors.UsageError`, a
        ``ValueError``, as fsspec's LocalFileSystem). Stops at the first error.
        """
        if not isinstance(paths, list):
            raise UsageError("rm: paths must be a list")
        for path in paths:
            try:
                self._rm_one(path, bool(recursive))
            except Tb5syncError:
                raise
            except OSError as exc:
                raise remote_os_error(exc, path) from exc
        return {}

    def _rm_one(self, path: str, recursive: bool) -> None:
        with self.jail.parent(path) as (dfd, name, _):
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                if not recursive:
                    raise UsageError(f"cannot delete directory {shown(path)}: set recursive=True")
                shutil.rmtree(name, dir_fd=dfd)
            else:
                os.unlink(name, dir_fd=dfd)

    @_writes
    @_translating()
    def mkdir(self, path: str, parents: bool = True, exist_ok: bool = False) -> dict[str, Any]:
        """Create directory ``path``; ``parents`` creates missing parents; ``exist_ok`` accepts an existing directory."""
        with self.jail.parent(path, create=parents) as (dfd, name, _):
            try:
                os.mkdir(name, 0o777, dir_fd=dfd)
            except FileExistsError:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):  # a directory only if it leads to one inside the root
                    is_dir = exist_ok and self._stat(path)["type"] == "directory"
                else:
                    is_dir = stat.S_ISDIR(st.st_mode)
                if not (exist_ok and is_dir):
                    raise
        return {}

    @_writes
    @_translating()
    def rmdir(self, path: str) -> dict[str, Any]:
        """Remove the empty directory ``path`` (``OSError`` ENOTEMPTY otherwise)."""
        with self.jail.parent(path) as (dfd, name, _):
            os.rmdir(name, dir_fd=dfd)
        return {}

    @_writes
    @_translating("src")
    def move(self, src: str, dst: str, mkdirs: bool = False) -> dict[str, Any]:
        """Rename ``src`` to ``dst`` on the server (no bytes move), with ``shutil.move``'s rule:
        into ``dst/<name of src>`` when ``dst`` is an existing directory (``FileExistsError``
        if that exists already). Same filesystem only (``OSError`` EXDEV otherwise).
        ``mkdirs`` creates ``dst``'s missing parent directories.
        """
        with self.jail.parent(src) as (sfd, sname, srel):
            os.stat(sname, dir_fd=sfd, follow_symlinks=False)
            try:
                dst_is_dir = self._stat(dst)["type"] == "directory"
            except FileNotFoundError:
                dst_is_dir = False
            if dst_is_dir:
                dst = _join(self._stat(dst)["name"], sname)
                try:
                    self._stat(dst)
                except FileNotFoundError:
                    pass
                else:
                    raise RemoteExistsError(f"Destination path {shown(dst)} already exists")
            with self.jail.parent(dst, create=mkdirs) as (dfd, dname, drel):
                if drel == srel:
                    return {}
                if drel.startswith(srel + "/"):
                    raise UsageError(f"cannot move {shown(src)} into itself ({shown(dst)})")
                try:
                    os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
                except OSError as exc:
                    raise remote_os_error(exc, dst) from exc
        return {}

    @_writes
    @_translating("src")
    def copy(self, src: str, dst: str, mkdirs: bool = False) -> dict[str, Any]:
        """Copy file ``src`` to ``dst`` on the server (``copy_file_range``: no bytes through the client).

        ``dst`` is written atomically. A directory ``src`` creates directory ``dst``
        (as fsspec's LocalFileSystem ``cp_file``). ``mkdirs`` creates ``dst``'s parents.
        """
        fd, _ = self.jail.open_read(src)
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                return self.mkdir(path=dst, parents=True, exist_ok=True)
            if not stat.S_ISREG(st.st_mode):
                raise UsageError(f"not a regular file: {shown(src)}")
            self._charge(st.st_size, dst)

            def fill(out: int) -> None:
                off = 0
                while off < st.st_size:
                    k = copy_range(fd, out, st.st_size - off, off, off)
                    if k == 0:  # the source shrank under us: never commit a short copy
                        raise SourceChangedError(src)
                    off += k

            try:
                with self.jail.parent(dst, create=mkdirs, follow=True) as (dfd, name, _):
                    self._write_file(dfd, name, fill, False)
            except Tb5syncError:
                raise
            except OSError as exc:
                raise remote_os_error(exc, dst) from exc
        finally:
            os.close(fd)
        return {}

    @_writes
    @_translating()
    def touch(self, path: str, truncate: bool = True, mkdirs: bool = False) -> dict[str, Any]:
        """Create ``path`` empty, or set its times to now; ``truncate`` also empties an existing file.

        ``mkdirs`` creates missing parent directories. Opened ``O_NONBLOCK``, so a FIFO
        (without a reader) or a device does not block the open.

        Raises
        ------
        UsageError
            ``path`` exists and is not a regular file (a FIFO, a device, a socket).
        """
        with self.jail.parent(path, create=mkdirs, follow=True) as (dfd, name, _):
            flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | (os.O_TRUNC if truncate else 0)
            try:
                fd = os.open(name, flags, 0o666, dir_fd=dfd)
            except IsADirectoryError:
                if truncate:
                    raise
                os.utime(name, dir_fd=dfd, follow_symlinks=False)
                return {}
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # a FIFO without a reader
                    raise UsageError(f"not a regular file: {shown(path)}") from None
                raise
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise UsageError(f"not a regular file: {shown(path)}")
                os.utime(fd)
            finally:
                os.close(fd)
        return {}
