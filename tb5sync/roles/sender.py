"""The sender: owns a source tree and answers the receiver's requests.

The sender never decides what to send (rsync's split: the receiver plans).
Its methods take and return msgpack-friendly values so that the same object
serves an in-process receiver and, through :mod:`tb5sync.wire.transport`, a remote one.

Methods (the receiver's requests)::

    tree(start)                  -> {"root": [path, kind, mode, size, mtime_ns, target],
                                     "dirs": [[path, digest, files, bytes], ...], "total": n}
    entries(dirs, skip)          -> {"entries": [[path, kind, mode, size, mtime_ns, target], ...], "more": bool}
    chunk_list(path, fresh, start, limit)
                                 -> {"size", "mtime_ns", "start", "end", "chunks": [[digest, length], ...][, "digest"]}
    file_digests(paths)          -> {"digests": [digest or None, ...]}
    read_ranges(path, ranges, size, mtime_ns) -> (meta, parts)    # ranges: [[offset, length], ...]
    read_files(paths)            -> (meta, parts)                  # whole small files with their chunk lists
    sub_chunks(path, ranges, size, mtime_ns, params) -> {"subs": [[digests, lengths], ...]}   # see refine
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import lz4.block

import tb5sync.engine.chunking as chunking
import tb5sync.engine.refine as refine
from tb5sync._os.io import read_into
from tb5sync._os.paths import STATE_DIR, Jail, check_in_root, is_temp_name
from tb5sync.errors import PathError, RemoteNotFoundError, SourceChangedError, SourceError, Tb5syncError, UsageError
from tb5sync.engine.hashing import chunk_buffer, chunk_fd, file_digest, iter_chunk_fd
from tb5sync.tree.entry import DIR, FILE, LINK, Entry, check_relpath, path_from_wire, show_path
from tb5sync.tree.scan import Extras, Tree, max_path, scan_tree
from tb5sync.wire.messages import (
    CODEC_LZ4,
    CODEC_RAW,
    ChunkListPiece,
    DirSummary,
    EntriesPage,
    FileDigests,
    FileInfo,
    FilesMeta,
    READ_FILES_SLACK,
    RangesMeta,
    SubChunksReply,
    TreePage,
    paths_from_wire,
)
from tb5sync.wire.messages import SENDER_MAX_READ as MAX_READ
from tb5sync.tree.options import SyncOptions
from tb5sync._os.buffers import ReadBuffers
from tb5sync._os.io import RateLimit
from tb5sync.wire.parts import FileRange, SharedFd, close_parts

if TYPE_CHECKING:
    from tb5sync.tree.state import TreeState

# The one import site that picks the small-file reader (TB5SYNC_PUREPYTHON=1 forces Python): the
# Cython batch reader (ext/_read.pyx) or :meth:`Sender._read_one` once per file.
_cy_read_files: Callable[..., tuple[list[Any], int]] | None
try:
    from tb5sync._read import NO_ROOM as _NO_ROOM, read_files as _cy_read_files
except ImportError:
    _cy_read_files, _NO_ROOM = None, -3
if os.environ.get("TB5SYNC_PUREPYTHON") == "1":
    _cy_read_files = None
#: ``"cython"`` or ``"python"``: which reader :meth:`Sender.read_files` uses.
READ_IMPLEMENTATION = "cython" if _cy_read_files is not None else "python"
#: Bytes of one buffer the Cython reader fills with a ``read_files`` batch (reused, see
#: :class:`ReadBuffers`); a batch that does not fit goes on in another one.
READ_BUFFER = 8 * 1024 * 1024
#: Most directories whose descriptors one call of the Cython reader holds (duplicates).
_READ_DIRS = 256

__all__ = ["Sender", "ReadBuffers", "encode_part", "READ_IMPLEMENTATION"]

log = logging.getLogger(__name__)

#: Most manifest entries (or directory summaries) per page.
MAX_PAGE = 16384
#: Most path characters per page of entries or directory summaries (a page stops once past it):
#: keeps a page far below the control frame limit (:data:`tb5sync.wire.protocol.MAX_CONTROL`, 32 MiB)
#: whatever the path lengths.
PAGE_PATH_BYTES = 4 * 1024 * 1024
_SAMPLE = 4 * 1024


def encode_part(data: bytes | memoryview, mode: str) -> tuple[bytes | memoryview, int]:
    """Compress one chunk with lz4 when ``mode`` says so and it pays; returns ``(bytes, codec)``.

    ``"auto"`` compresses only when a 4 KiB sample shrinks to under 1/8 of its size;
    ``"lz4"`` whenever the result is smaller by at least 1/16; ``"none"`` never.

    Why 1/8: lz4 compresses text-like data (ratio about 1/2) at about 0.3 GB/s per core
    (measured in benches/), so halving the bytes only saves time on a link slower than
    about 0.15 GB/s; highly redundant data (zeros, repeated records) compresses at several
    GB/s to a few percent, and that pays even at link speed.
    """
    if mode == "none" or len(data) < 512:
        return data, CODEC_RAW
    if mode == "auto" and not _compressible(bytes(data[:_SAMPLE])):
        return data, CODEC_RAW
    packed = lz4.block.compress(data, store_size=False)
    if len(packed) + len(packed) // 16 >= len(data):
        return data, CODEC_RAW
    return packed, CODEC_LZ4


def _compressible(sample: bytes) -> bool:
    """Whether lz4 shrinks ``sample`` (the first 4 KiB of a range) below 1/8: ``--compress auto``'s test."""
    return len(lz4.block.compress(sample, store_size=False)) * 8 <= len(sample)


class Sender:
    """Serve one source: a directory tree, a single file or a symlink.

    Parameters
    ----------
    base : str
        Absolute local path of the source (already checked against any jail).
    options : SyncOptions
        Excludes and compression mode are used here.
    state : TreeState or None
        Scan cache for chunk lists; ``state_prefix`` maps base-relative paths to state paths.
    state_prefix : str
        Path of ``base`` relative to the state's root (``""`` when equal).
    params : ChunkParams
        Chunking format of the chunk lists it serves.
    zero_copy : bool, default False
        The replies go out through sockets only (a push client, a pull server): raw
        ``read_ranges`` parts are then :class:`~tb5sync.wire.parts.FileRange` s that the transport
        sends with ``sendfile(2)``. In process (local sync) replies hold bytes.
    root : str, optional
        A server's ROOT: with ``-L``/``--copy-unsafe-links`` no followed symlink may lead outside
        it (the scan names such a link as a failure, :meth:`_open` refuses it).
    at : tuple of (int, str), optional
        ``(dir_fd, name)`` from :meth:`tb5sync._os.paths.Jail.locate` (a server's pull, through its
        ROOT's jail): the source is the entry ``name`` of that open directory, and every lookup
        (the scan, the reads) goes through descriptors opened from it, never through ``base``
        again (``base`` is then only the path shown). The sender owns (closes) ``dir_fd``,
        also when it raises. None: ``base`` is opened by path (a local source).

    Raises
    ------
    RemoteNotFoundError
        ``base`` does not exist.
    PathError
        With ``at``: the source directory was swapped for a symlink.
    """

    def __init__(
        self,
        base: str,
        options: SyncOptions = SyncOptions(),
        state: TreeState | None = None,
        state_prefix: str = "",
        params: chunking.ChunkParams = chunking.DEFAULT_PARAMS,
        *,
        zero_copy: bool = False,
        root: str | None = None,
        at: tuple[int, str] | None = None,
    ) -> None:
        self.base = base
        self.root = root
        self._root_jail: Jail | None = None
        self.options = options
        self.params = params
        self.state = state
        self.state_prefix = state_prefix
        self._tree: Future[Tree] | None = None
        self._tree_lock = threading.Lock()
        self._acc: dict[str, tuple[tuple[int, int, int], int, list[tuple[bytes, int]]]] = {}
        self._acc_lock = threading.Lock()
        self._read_bufs = ReadBuffers(16)
        self.zero_copy = zero_copy
        self._rate = RateLimit(options.bwlimit) if options.bwlimit else None  # --bwlimit, all streams
        self._closed = threading.Event()  # close(): a --bwlimit wait in progress ends
        self._guards = threading.local()  # per serving thread: (stop check, longest wait) of its --bwlimit waits
        #: where the scan looks the base up: None (by path) or (dir_fd, name) of the jail's descriptors
        self._scan_at: tuple[int, str] | None = None
        if at is None:
            try:
                st = os.lstat(base)
            except FileNotFoundError:
                raise RemoteNotFoundError(f"source does not exist: {base}") from None
            self._single = not stat.S_ISDIR(st.st_mode)
            self._jail = Jail(os.path.dirname(base) if self._single else base)
            self._name = os.path.basename(base)
        else:
            self._jail, self._name, st = self._open_at(base, *at)
            self._single = self._name != "."
            self._scan_at = (self._jail.fd, self._name)
        self._kind = DIR if not self._single else LINK if stat.S_ISLNK(st.st_mode) else FILE

    @staticmethod
    def _open_at(base: str, dfd: int, name: str) -> tuple[Jail, str, os.stat_result]:
        """The jail of the source ``name`` in ``dfd`` (taking ``dfd`` over): ``dfd``'s own for a
        file or a symlink (``name`` kept), else the directory's, opened ``O_NOFOLLOW`` from
        ``dfd`` (``name`` then ``"."``)."""
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                bfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        except OSError as exc:
            os.close(dfd)
            if isinstance(exc, FileNotFoundError):
                raise RemoteNotFoundError(f"source does not exist: {base}") from None
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # swapped for a symlink (or a file) since the stat
                raise PathError(os.path.basename(base), "was replaced while opening it; not followed") from None
            raise
        except BaseException:
            os.close(dfd)
            raise
        if not stat.S_ISDIR(st.st_mode):
            return Jail(os.path.dirname(base), fd=dfd), name, st
        os.close(dfd)
        return Jail(base, fd=bfd), ".", os.fstat(bfd)

    @property
    def kind(self) -> str:
        """The source's kind when the sender was made: ``"d"``, ``"f"`` (anything but a directory
        or a symlink) or ``"l"`` (not followed)."""
        return self._kind

    def pace_guard(self, stop: Callable[[], str | None] | None, max_wait: float | None = None) -> None:
        """For the calling thread's requests: how a ``--bwlimit`` wait ends early.

        Parameters
        ----------
        stop : callable or None
            Checked every :attr:`RateLimit.SLICE <tb5sync._os.io.RateLimit.SLICE>` seconds of a
            wait; a str (why) ends it with ``ConnectError`` (a server: its peer closed this
            connection, the server is stopping). :meth:`close` ends every wait in any case.
        max_wait : float or None
            Longest wait for one reply, seconds (a server's idle timeout): a longer one is
            refused with ``LinkTimeoutError``. None: no limit.
        """
        self._guards.stop, self._guards.max_wait = stop, max_wait

    def close(self) -> None:
        """Release directory descriptors (a scan still running in the background is left to finish)
        and end any ``--bwlimit`` wait in progress (its request fails with ``ConnectError``)."""
        self._closed.set()
        self._jail.close()
        if self._root_jail is not None:
            self._root_jail.close()

    def _open_followed(self, path: str) -> int:
        """Open ``path`` following symlinks (``-L``, ``--copy-unsafe-links``: the scan listed what
        they point to); on a server only inside its ROOT, then through a jail of ROOT (no symlink
        swapped in after the check is followed).

        Raises
        ------
        OSError
            As :func:`os.open`; ``PermissionError`` for a path leading outside ROOT.
        """
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
        full = os.path.join(self.base, path) if path else self.base
        if self.root is None:
            return os.open(full, flags)
        real = os.path.realpath(full)
        try:
            check_in_root(self.root, real, path)
        except PathError:
            raise PermissionError(errno.EACCES, "symlink leads outside the served root (or into its state)", path) from None
        if is_temp_name(os.path.basename(real)):
            raise RemoteNotFoundError(f"not a source file: {path}")
        rel = os.path.relpath(real, self.root)
        if self._root_jail is None:
            self._root_jail = Jail(self.root)
        return self._root_jail.open_file(rel, flags | os.O_NOFOLLOW)

    # ---- helpers --------------------------------------------------------------------
    def _open(self, path: str) -> int:
        """Open the source file ``path`` for reading; only a regular file is opened.

        Opened ``O_NONBLOCK`` (no effect on a regular file's reads), so a FIFO without a
        writer (or a device) does not block the session's thread in ``open()``.

        Raises
        ------
        FileNotFoundError
            It vanished.
        UsageError
            It is not a regular file (a FIFO, a device, a socket, a directory).
        SourceError
            It cannot be opened for another reason (``"PATH: reason"``, e.g. permission denied).
        """
        check_relpath(path)
        if ".tb5" in path and any(c == STATE_DIR or is_temp_name(c) for c in path.split("/")):
            # never listed (see scan), so never asked for by an honest receiver: files being
            # written, partial files and the state are not served
            raise RemoteNotFoundError(f"not a source file: {path}")
        if self._single:
            if path:
                raise RemoteNotFoundError(f"no such file in a single-file source: {path}")
            name = self._name
        elif not path:
            raise UsageError("the source base is a directory, not a file")
        else:
            name = path
        try:
            if self.options.copy_links or self.options.copy_unsafe_links:
                fd = self._open_followed(path)
            else:
                fd = self._jail.open_cached(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise
        except IsADirectoryError:
            raise UsageError(f"not a regular file: {path}") from None
        except OSError as exc:
            if isinstance(exc, Tb5syncError):
                raise
            err = SourceError(f"{show_path(path)}: {exc.strerror or exc}" + (f" ({exc.errno})" if exc.errno else ""))
            err.errno = exc.errno
            raise err from exc
        try:
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
        except BaseException:
            os.close(fd)
            raise
        if not regular:
            os.close(fd)
            raise UsageError(f"not a regular file: {path}")
        return fd

    def _state_path(self, path: str) -> str:
        return "/".join(p for p in (self.state_prefix, path) if p)

    def _chunks(self, fd: int, path: str, st: os.stat_result, fresh: bool = False) -> tuple[bytes, list[tuple[bytes, int]]]:
        if self.state is not None:
            return self.state.chunks_of(fd, self._state_path(path), st, fresh=fresh)
        refs = chunk_fd(fd, st.st_size, self.params, where=path)
        return file_digest(d for d, _ in refs), refs

    # ---- requests ---------------------------------------------------------------------
    def prepare(self) -> None:
        """Start scanning the source in a background thread, if not started yet.

        A push calls this as soon as its session is open, and the server as soon as a
        pull's session is, so that the scan overlaps the other streams' set-up and the
        destination's scan on the other side; :meth:`tree` waits for the scan in any case.
        """
        with self._tree_lock:
            if self._tree is not None:
                return
            fut: Future[Tree] = Future()
            self._tree = fut
        threading.Thread(target=self._scan_into, args=(fut,), name="tb5-src-scan", daemon=True).start()

    def _scan_into(self, fut: Future[Tree]) -> None:
        try:
            root = self.options.exclude_root  # rsync's paths start at its transfer root: "src/..." without a slash
            tree = scan_tree(self.base, self.options.rules, extras=Extras.from_options(self.options, self.root), max_path=max_path(root),
                             at=self._scan_at)
            tree.digests()  # here, off the request path
            fut.set_result(tree)
        except BaseException as exc:  # delivered to whoever asks for the tree
            fut.set_exception(exc)

    def scanned(self) -> Tree:
        """The source tree, scanned once per session (waits for :meth:`prepare`'s scan).

        Raises
        ------
        RemoteNotFoundError
            The source vanished before it was scanned.
        PermissionError
            A directory cannot be listed.
        """
        self.prepare()
        assert self._tree is not None
        return self._tree.result()

    def tree(self, start: int = 0) -> dict[str, Any]:
        """The source's root entry and a page of its directory summaries.

        Parameters
        ----------
        start : int
            Index of the first directory summary (0, then the previous page's end).

        Returns
        -------
        dict
            ``{"root": entry, "dirs": [[path, digest, files, bytes], ...], "total": n}``:
            ``root`` is the base's own entry (wire form); ``dirs`` a page of
            :meth:`Tree.summary <tb5sync.tree.scan.Tree.summary>` from ``start`` (at most
            :data:`MAX_PAGE` directories and about :data:`PAGE_PATH_BYTES` of paths, at
            least one), in depth-first order; ``total`` the number of directories
            (0 when the base is a file or a symlink).
        """
        t = self.scanned()
        if not t.entries:
            raise RemoteNotFoundError(f"source does not exist: {self.base}")
        start = max(0, int(start))
        summary = t.summary() if start < len(t.children) else []
        page: list[DirSummary] = []
        nbytes = 0
        for row in summary[start:]:
            if page and (len(page) >= MAX_PAGE or nbytes >= PAGE_PATH_BYTES):
                break
            page.append(DirSummary(*row))
            nbytes += len(row[0])
        first = start == 0
        return TreePage(t.entries[0], page, len(t.children), t.errors if first else [], t.skipped if first else [],
                        t.xattrs.get("", [])).to_wire()

    def entries(self, dirs: list[str], skip: int = 0) -> dict[str, Any]:
        """The children of the named directories, concatenated in the order asked, one page at a time.

        Parameters
        ----------
        dirs : list of str
            Directory paths from :meth:`tree`.
        skip : int
            Entries of the concatenation already received (0, then the sum of the pages so far).

        Returns
        -------
        dict
            ``{"entries": [[path, kind, mode, size, mtime_ns, target], ...], "more": bool}``;
            at most :data:`MAX_PAGE` entries and about :data:`PAGE_PATH_BYTES` of paths;
            ``more`` says that entries remain past this page.

        Raises
        ------
        UsageError
            A path that is not a directory of the scanned source, or a bad ``skip``.
        """
        dirs = paths_from_wire(dirs, "dirs")
        if not isinstance(skip, int) or skip < 0:
            raise UsageError("entries needs a list of directories and a non-negative skip")
        tree = self.scanned()
        kids = tree.children
        out: list[Entry] = []
        nbytes = 0

        def page(more: bool) -> dict[str, Any]:
            hl = {i: tree.hardlinks[e.path] for i, e in enumerate(out) if e.path in tree.hardlinks} if tree.hardlinks else {}
            xa = {i: tree.xattrs[e.path] for i, e in enumerate(out) if e.path in tree.xattrs} if tree.xattrs else {}
            return EntriesPage(out, more, hl, xa).to_wire()

        for d in dirs:
            listing = kids.get(d) if isinstance(d, str) else None
            if listing is None:
                raise UsageError(f"not a directory of the source: {d!r:.200}")
            if skip >= len(listing):
                skip -= len(listing)
                continue
            for e in listing[skip:]:
                if len(out) >= MAX_PAGE or nbytes >= PAGE_PATH_BYTES:
                    return page(True)
                out.append(e)
                nbytes += len(e.path) + (sum(len(n) + len(v) for n, v in tree.xattrs.get(e.path, ())) if tree.xattrs else 0)
            skip = 0
        return page(False)

    def chunk_list(self, path: str, fresh: bool = False, start: int = 0, limit: int = 0) -> dict[str, Any]:
        """FastCDC chunk list of a regular file, whole or one piece at a time.

        Parameters
        ----------
        path : str
            File relative to the source base.
        fresh : bool
            Ignore the scan cache and re-read the file (``--checksum``).
        start : int
            First byte of the piece; must be 0 or an ``end`` returned by an earlier piece
            of the same file (a cut point), else the chunks differ from the file's own.
        limit : int
            0: the whole list from ``start``. Otherwise the piece ends at the first cut
            point at or after ``start + limit`` bytes (or at the end of the file), so that
            the receiver can fetch one piece while the next one is cut and hashed.

        Returns
        -------
        dict
            ``{"size", "mtime_ns", "start", "end", "chunks": [[digest, length], ...]}``, plus
            ``"digest"`` (the file digest) when the piece is the whole file. A cache hit is
            sliced; computed pieces are recorded in the scan cache once the whole file has
            been listed in order in this session.

        Raises
        ------
        RemoteNotFoundError
            The file is gone.
        SourceChangedError
            The file changed while it was read.
        UsageError
            Not a regular file, or ``start``/``limit`` out of range.
        """
        path = path_from_wire(path)
        if not (isinstance(start, int) and isinstance(limit, int)) or start < 0 or limit < 0:
            raise UsageError("start and limit must be non-negative ints")
        try:
            fd = self._open(path)
        except FileNotFoundError:
            raise RemoteNotFoundError(f"source file vanished: {path}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UsageError(f"not a regular file: {path}")
            if start > st.st_size:
                # an earlier piece's end: the file was replaced or shrank since
                raise SourceChangedError(path)
            digest: bytes | None = None
            if start == 0 and limit == 0:
                digest, refs = self._chunks(fd, path, st, fresh)
            else:
                refs = self._piece(fd, path, st, fresh, start, limit)
            st2 = os.fstat(fd)
            if (st2.st_size, st2.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
                raise SourceChangedError(path)
            end = start + sum(n for _, n in refs)
            if start == 0 and end == st.st_size and digest is None:
                digest = file_digest(d for d, _ in refs)
            whole = start == 0 and end == st.st_size
            return ChunkListPiece(st.st_size, st.st_mtime_ns, start, end, refs, digest if whole else None).to_wire()
        finally:
            os.close(fd)

    def _piece(self, fd: int, path: str, st: os.stat_result, fresh: bool, start: int, limit: int) -> list[tuple[bytes, int]]:
        """Chunks from ``start`` to the first cut at or past ``start + limit`` (0: to the end)."""
        stop = st.st_size if limit == 0 else start + limit
        key = (st.st_size, st.st_mtime_ns, st.st_ino)
        if self.state is not None and not fresh:
            hit = self.state.lookup(self._state_path(path), *key)
            if hit is not None:
                out = []
                off = 0
                aligned = start == 0
                for d, n in hit[1]:
                    if off == start:
                        aligned = True
                    if off >= start:
                        if off >= stop:
                            break
                        out.append((d, n))
                    off += n
                if not (aligned or start == off):
                    # ``start`` is an earlier piece's end, so the file the cache row lists is
                    # another version than the one those pieces came from
                    raise SourceChangedError(path)
                return out
        refs: list[tuple[bytes, int]] = []
        for window in iter_chunk_fd(fd, st.st_size, self.params, start, stop=stop, where=path):
            refs += window
        if self.state is not None:
            self._remember(path, key, start, refs)
        return refs

    def _remember(self, path: str, key: tuple[int, int, int], start: int, refs: list[tuple[bytes, int]]) -> None:
        """Collect pieces listed in order; record the whole list in the scan cache when complete."""
        with self._acc_lock:
            acc = self._acc.get(path)
            if start == 0:
                acc = (key, 0, [])
            if acc is None or acc[0] != key or acc[1] != start:
                self._acc.pop(path, None)
                return
            end = start + sum(n for _, n in refs)
            acc = (key, end, acc[2] + refs)
            if end < key[0]:
                self._acc[path] = acc
                return
            self._acc.pop(path, None)
        assert self.state is not None
        self.state.record(self._state_path(path), key[0], key[1], key[2], acc[2])

    def file_digests(self, paths: list[str]) -> dict[str, Any]:
        """File digests (BLAKE3 over the chunk list) of ``paths``, re-read from disk; None for a file that is gone."""
        paths = paths_from_wire(paths, "paths")
        out: list[bytes | None] = []
        for p in paths:
            try:
                out.append(self.chunk_list(p, fresh=True)["digest"])
            except (RemoteNotFoundError, SourceChangedError, SourceError, UsageError):
                out.append(None)
        return FileDigests(out).to_wire()

    def read_ranges(self, path: str, ranges: list[list[int]], size: int, mtime_ns: int) -> tuple[dict[str, Any], list[Any]]:
        """Read byte ranges of a file whose chunk list the receiver holds.

        Parameters
        ----------
        path : str
            File relative to the source base.
        ranges : list of [offset, length]
            Byte ranges, each at most one chunk; total at most :data:`MAX_READ` bytes.
        size, mtime_ns : int
            What the chunk list was made from; a file that no longer matches is refused.

        Returns
        -------
        (meta, parts)
            ``meta["parts"]`` lists ``[raw length, wire length, codec]`` per range; ``parts`` the bytes.

        Raises
        ------
        SourceChangedError
            The file's size or mtime changed.
        UsageError
            Ranges out of bounds or too large in total.
        """
        path = path_from_wire(path)
        if self.zero_copy and self.options.compress != "lz4":
            return self._read_ranges_sendfile(path, ranges, size, mtime_ns)
        fd, views = self._read_checked(path, ranges, size, mtime_ns)
        try:
            parts = []
            meta_parts: list[tuple[int, int, int]] = []
            for data in views:
                wire, codec = encode_part(data, self.options.compress)
                parts.append(wire)
                meta_parts.append((len(data), len(wire), codec))
            self._check_unchanged(fd, path, size, mtime_ns)
            self._pace(meta_parts)
            return RangesMeta(meta_parts).to_wire(), parts
        finally:
            os.close(fd)

    def _read_ranges_sendfile(self, path: str, ranges: list[list[int]], size: int, mtime_ns: int) -> tuple[dict[str, Any], list[Any]]:
        """:meth:`read_ranges` for a reply that goes out through a socket: raw ranges become
        :class:`FileRange` parts sent with sendfile (no read into user space); only ranges that
        ``--compress auto`` finds worth compressing are read and compressed here.

        A file changed after the check below is caught by the receiver's digest check, and its
        re-request of the range then sees the new size or mtime.
        """
        fd = self._open_checked(path, ranges, size, mtime_ns)
        shared = SharedFd(fd)
        parts: list[Any] = []
        meta_parts: list[tuple[int, int, int]] = []
        try:
            for off, n in ranges:
                if self.options.compress == "auto" and n >= 512 and _compressible(os.pread(fd, min(n, _SAMPLE), off)):
                    data = os.pread(fd, n, off)
                    if len(data) != n:
                        raise SourceChangedError(path)
                    wire, codec = encode_part(data, "auto")
                    parts.append(wire)
                    meta_parts.append((n, len(wire), codec))
                else:
                    parts.append(FileRange(shared, off, n))
                    meta_parts.append((n, n, CODEC_RAW))
        except BaseException:
            close_parts(parts)  # the last FileRange to let go closes fd
            raise
        finally:
            if shared.users == 0 and shared.fd >= 0:  # no FileRange ever took it
                os.close(fd)
                shared.fd = -1
        try:
            self._pace(meta_parts)
        except BaseException:
            close_parts(parts)
            raise
        return RangesMeta(meta_parts).to_wire(), parts

    def sub_chunks(self, path: str, ranges: list[list[int]], size: int, mtime_ns: int, params: list[int]) -> dict[str, Any]:
        """Sub-chunk lists of byte ranges (normally chunks the receiver lacks); see :mod:`tb5sync.engine.refine`.

        Parameters
        ----------
        path : str
            File relative to the source base.
        ranges : list of [offset, length]
            As for :meth:`read_ranges` (each at most one chunk, at most :data:`MAX_READ` in all).
        size, mtime_ns : int
            What the chunk list was made from; a file that no longer matches is refused.
        params : [min_size, avg_size, max_size, normalization]
            Sub-chunk parameters (bytes; 256 B .. 1 MiB).

        Returns
        -------
        dict
            ``{"subs": [[digests, lengths], ...]}``, one :func:`refine.encode_subs` list per range.

        Raises
        ------
        SourceChangedError
            The file's size or mtime changed.
        UsageError
            Bad ranges or parameters.
        """
        path = path_from_wire(path)
        prm = refine.params_from_wire(params)
        fd, views = self._read_checked(path, ranges, size, mtime_ns)
        try:
            subs = [refine.encode_subs(refine.sub_chunk_list(v, prm)) for v in views]
            self._check_unchanged(fd, path, size, mtime_ns)
            return SubChunksReply(subs).to_wire()
        finally:
            os.close(fd)

    def _read_checked(self, path: str, ranges: list[list[int]], size: int, mtime_ns: int) -> tuple[int, list[memoryview]]:
        """Open ``path``, check it still has ``size``/``mtime_ns``, read ``ranges`` into a reused buffer.

        Returns the open descriptor (the caller closes it) and one view per range.
        """
        fd = self._open_checked(path, ranges, size, mtime_ns)
        try:
            buf = self._read_bufs.get(sum(n for _, n in ranges))
            views = []
            pos = 0
            for off, n in ranges:
                data = buf[pos : pos + n]
                pos += n
                got = 0
                while got < n:
                    k = read_into(fd, data[got:], off + got)
                    if k <= 0:
                        raise SourceChangedError(path)
                    got += k
                views.append(data)
            return fd, views
        except BaseException:
            os.close(fd)
            raise

    def _open_checked(self, path: str, ranges: list[list[int]], size: int, mtime_ns: int) -> int:
        """Check ``ranges`` (list of [offset, length], at most :data:`MAX_READ` bytes in all, within
        ``size``), open ``path`` and check it still has ``size``/``mtime_ns``; the caller closes the fd.

        Raises
        ------
        UsageError
            Malformed or out-of-bounds ranges, or too many bytes.
        SourceChangedError
            The file is gone or changed.
        """
        total = 0
        for r in ranges:
            if not (isinstance(r, (list, tuple)) and len(r) == 2 and all(isinstance(x, int) and x >= 0 for x in r)):
                raise UsageError("each range must be [offset, length] with non-negative ints")
            if r[0] + r[1] > size:
                raise UsageError(f"range [{r[0]}, {r[0] + r[1]}) beyond end of {path} ({size} bytes)")
            total += r[1]
        if total > MAX_READ:
            raise UsageError(f"read of {total} bytes exceeds the limit of {MAX_READ}")
        try:
            fd = self._open(path)
        except FileNotFoundError:
            raise SourceChangedError(path) from None
        try:
            self._check_unchanged(fd, path, size, mtime_ns)
        except BaseException:
            os.close(fd)
            raise
        return fd

    @staticmethod
    def _check_unchanged(fd: int, path: str, size: int, mtime_ns: int) -> None:
        st = os.fstat(fd)
        if (st.st_size, st.st_mtime_ns) != (size, mtime_ns):
            raise SourceChangedError(path)

    def read_files(self, paths: list[str]) -> tuple[dict[str, Any], list[Any]]:
        """Read whole small files in one reply, with each file's chunk list for verification.

        Returns
        -------
        (meta, parts)
            ``meta["files"]`` has one entry per path:
            ``[size, mtime_ns, mode, [[digest, length], ...], wire length, codec]``, or
            ``None`` for a file that vanished or kept changing; ``parts`` holds one
            bytes object per present file.

        Raises
        ------
        UsageError
            More than :data:`MAX_READ` bytes in total.
        """
        paths = paths_from_wire(paths, "paths")
        files: list[FileInfo | None] = []
        failed: dict[int, str] = {}
        parts: list[Any] = []
        total = 0
        batch = self._read_batch(paths)
        for i, path in enumerate(paths):
            item: tuple[int, int, int, Any] | None = batch[i]
            if item is None:
                try:
                    one = self._read_one(path, limit=MAX_READ + READ_FILES_SLACK - total)
                    if one is not None:
                        st, data = one
                        item = (st.st_size, st.st_mtime_ns, st.st_mode, data)
                except SourceError as exc:
                    failed[len(files)] = str(exc).removeprefix(f"{show_path(path)}: ")
                except OSError as exc:  # a read error (EIO, ...): this file only
                    failed[len(files)] = f"{exc.strerror or exc} ({exc.errno})"
            if item is None:
                files.append(None)
                continue
            size, mtime_ns, st_mode, data = item
            total += size
            if total > MAX_READ + READ_FILES_SLACK:
                raise UsageError(f"read_files of more than {MAX_READ} bytes")
            refs = chunk_buffer(data, self.params)
            wire, codec = encode_part(data, self.options.compress)
            files.append(FileInfo(size, mtime_ns, stat.S_IMODE(st_mode), refs, len(wire), codec))
            parts.append(wire)
        self._pace([(0, len(p), 0) for p in parts])
        return FilesMeta(files, failed).to_wire(), parts

    def _pace(self, meta_parts: list[tuple[int, int, int]]) -> None:
        """``--bwlimit``: wait until the wire bytes of a reply (``[raw, wire, codec]`` per part) are due."""
        if self._rate is not None:
            stop = getattr(self._guards, "stop", None)

            def ended() -> str | None:
                if self._closed.is_set():
                    return "the session ended"
                return stop() if stop is not None else None

            self._rate.take(sum(m[1] for m in meta_parts), ended, max_wait=getattr(self._guards, "max_wait", None))

    def _read_batch(self, paths: list[str]) -> list[tuple[int, int, int, memoryview] | None]:
        """Read the plain files of ``paths`` with the Cython reader (:data:`READ_IMPLEMENTATION`).

        Per path, in order: ``(size, mtime_ns, st_mode, bytes)`` of a regular file read whole
        and unchanged (its bytes a view of a reused :data:`READ_BUFFER` buffer, free again once
        every view of it is gone), or ``None``: the caller reads that path on the Python path
        (:meth:`_read_one`), which checks, names and retries it exactly as it always did. All
        ``None`` without the Cython reader, for a single-file source and with ``-L`` /
        ``--copy-unsafe-links`` (symlinks followed). Each file is opened ``O_NOFOLLOW``
        relative to the jail's descriptor of its directory (a duplicate held for the call), as
        :meth:`Jail.open_cached <tb5sync._os.paths.Jail.open_cached>` does; the GIL is released
        while the batch is read, so the other streams' threads run meanwhile.
        """
        out: list[tuple[int, int, int, memoryview] | None] = [None] * len(paths)
        if _cy_read_files is None or self._single or self.options.copy_links or self.options.copy_unsafe_links:
            return out
        budget = MAX_READ + READ_FILES_SLACK  # read_files' own limit: what is past it is refused there
        todo: list[int] = []
        files: list[tuple[int, bytes]] = []
        fds: dict[str, int] = {}
        try:
            for i, path in enumerate(paths):
                if not path or ".tb5" in path:
                    continue  # the Python path refuses the base, the state and temporary names
                try:
                    check_relpath(path)
                    parent, _, name = path.rpartition("/")
                    dfd = fds.get(parent)
                    if dfd is None:
                        if len(fds) >= _READ_DIRS:
                            budget = self._read_into(todo, files, out, budget)
                            todo, files = [], []
                            for fd in fds.values():
                                os.close(fd)
                            fds.clear()
                        # a duplicate: the jail's per-thread cache may close its own while
                        # this batch's other directories are opened
                        dfd = fds[parent] = os.dup(self._jail.dir_fd(parent))
                except (OSError, UsageError):
                    continue  # the Python path meets (and names) the same error
                todo.append(i)
                files.append((dfd, os.fsencode(name)))
            self._read_into(todo, files, out, budget)
        finally:
            for fd in fds.values():
                os.close(fd)
        return out

    def _read_into(self, todo: list[int], files: list[tuple[int, bytes]], out: list[Any], budget: int) -> int:
        """Read ``files`` (``(dir_fd, name)``, for the paths ``todo`` index) with the Cython reader
        into :data:`READ_BUFFER` buffers, one after another while each takes at least one file and
        ``budget`` bytes are left; results into ``out``. Returns what is left of ``budget``."""
        while files and budget > 0 and _cy_read_files is not None:
            buf = self._read_bufs.get(READ_BUFFER)
            results, used = _cy_read_files(files, buf)
            budget -= used
            later: list[int] = []
            for j, (i, res) in enumerate(zip(todo, results)):
                if isinstance(res, tuple):
                    off, size, mtime_ns, st_mode = res
                    out[i] = (size, mtime_ns, st_mode, buf[off : off + size])
                elif res == _NO_ROOM and used > 0:
                    later.append(j)  # a fresh buffer may hold it (else: the Python path)
            del buf
            todo, files = [todo[j] for j in later], [files[j] for j in later]
        return budget

    def _read_one(self, path: str, tries: int = 3, limit: int | None = None) -> tuple[os.stat_result, bytes] | None:
        """Read the whole file ``path``: ``(stat, bytes)`` with size and mtime the same before
        and after (up to ``tries`` attempts), or ``None`` when it vanished, is not a regular
        file or kept changing; other errors raise as :meth:`_open` and ``os.pread`` do.

        ``limit`` (bytes): a file larger is refused before anything is read (``UsageError``),
        and no read asks for more than ``limit + 1`` bytes, so a peer naming a large file in
        ``read_files`` never makes this side allocate it."""
        for _ in range(tries):
            try:
                fd = self._open(path)
            except (FileNotFoundError, UsageError):  # gone, or not a regular file
                return None
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    return None
                if limit is not None and st.st_size > limit:
                    raise UsageError(f"read_files of more than {MAX_READ} bytes ({show_path(path)} has {st.st_size})")
                data = os.pread(fd, st.st_size + 1, 0)  # within limit, checked above
                st2 = os.fstat(fd)
            finally:
                os.close(fd)
            if len(data) == st.st_size and (st2.st_size, st2.st_mtime_ns) == (st.st_size, st.st_mtime_ns):
                return st, data
        log.warning("source file kept changing while read: %s", path)
        return None

