"""The destination of one sync: where entries land, the scan cache's new rows, the counters.

One :class:`Destination` per :class:`~tb5sync.roles.receiver.Receiver`. The generator
(:mod:`tb5sync.roles.generator`), the small-file path (:mod:`tb5sync.roles.receiver`) and each large-file
job (:mod:`tb5sync.roles.largefile`) share it instead of each keeping its own copy of the
destination's paths, state and statistics.

Every change the receiving side makes to the destination goes through this class, and every
one of them is made relative to a directory descriptor of a :class:`~tb5sync._os.paths.Jail`
rooted at the destination's root (the server's ROOT, or the directory the user named): create,
open, rename, chmod, utime, unlink, mkdir, rmdir and symlink. No path is looked up from ``/``,
so neither a crafted listing nor a directory swapped for a symlink during the run can lead
outside the root: a symlink where a directory is expected is a
:class:`~tb5sync.errors.PathError`.

Temporary files (``.NAME.XXXXXXXX.tb5tmp``) and private work files are created ``O_EXCL``
and held under an exclusive ``flock`` while they are written, so the next run can tell a
stale one (its writer is gone: the lock is free) from a live one, and removes only the
stale ones (:meth:`Destination.remove_stale`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import os
import stat
import threading
import time
import unicodedata
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from tb5sync._os.io import durable_sync, read_into, usable_cpus, write_all
from tb5sync._os.sparse import copy_sparse, has_zero_blocks, write_sparse
from tb5sync._os.paths import STATE_DIR, Jail, is_temp_name, temp_is_claimed, temp_name, temp_tags
from tb5sync.tree.entry import show_path
from tb5sync.errors import DestinationError, PathError, Tb5syncError, UsageError
from tb5sync.tree.options import Failure
from tb5sync.tree.quota import WriteQuota
from tb5sync.tree.state import TreeState

__all__ = ["Destination", "ProgressFn", "STAT_COUNTERS", "STALE_GRACE", "FATAL_ERRNOS", "WRITE_IMPLEMENTATION", "Committed"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: errno values after which no other entry can be written either: the run stops (rsync's exit 11).
FATAL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO})

#: ProgressFn(bytes_done, bytes_total) is called as files and chunks are committed.
ProgressFn = Callable[[int, int], None]

#: The :class:`~tb5sync.tree.options.SyncStats` fields a :class:`Destination` counts.
STAT_COUNTERS = ("files_transferred", "bytes_transferred", "chunks_sent", "chunks_reused", "bytes_matched", "files_deleted")

#: Seconds a temporary file's status must have been unchanged (``st_ctime``) before a later run
#: may remove it as stale. A sync's own temporary files are locked from the instant after their
#: creation (this covers that instant with a wide margin); a streamed fs write of another
#: process (no descriptor, no lock between its requests) changes it with every piece, so it
#: is only at risk when idle that long.
STALE_GRACE = 10.0

#: Directory descriptors kept open per destination (the directories files are written into).
_DIR_CACHE = 64

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)

# The one import site that picks the small-file writer (TB5SYNC_PUREPYTHON=1 forces Python):
# the Cython batch writer (ext/_write.pyx) or :meth:`Destination.write_file` once per file.
_cy_write_files: Callable[..., list[Any]] | None
try:
    from tb5sync._write import write_files as _cy_write_files
except ImportError:
    _cy_write_files = None
if os.environ.get("TB5SYNC_PUREPYTHON") == "1":
    _cy_write_files = None
#: ``"cython"`` or ``"python"``: which writer :meth:`Destination.write_files` uses.
WRITE_IMPLEMENTATION = "cython" if _cy_write_files is not None else "python"

#: Set to ``1`` to keep the Cython writer off its unnamed path (Linux ``O_TMPFILE`` + ``linkat``):
#: every file then takes the named, portable path (a temporary name, renamed), as on macOS.
NO_TMPFILE_ENV = "TB5SYNC_NO_TMPFILE"


def use_tmpfile() -> bool:
    """Whether the Cython writer may write new files unnamed and link them once whole (Linux
    ``O_TMPFILE``; the writer itself falls back to the named path where the kernel, the file
    system or ``/proc`` refuses it). False when ``$TB5SYNC_NO_TMPFILE`` is set (but ``0``)."""
    return os.environ.get(NO_TMPFILE_ENV, "") in ("", "0")

#: Threads writing one small-file batch by default (``$TB5SYNC_WRITE_THREADS``, 1..16, sets it):
#: its directories are shared out among them, so that no two threads create files in one
#: directory (they would contend on its lock). Two (one on a one-CPU machine): a cold push of
#: 2,000 files was 16-20% faster with two than with one on the 2-core VM, of 20,000 files 0-10%
#: (benches/README.md, p16s).
WRITE_THREADS = 2 if usable_cpus() > 1 else 1
_MIN_SPLIT = 64  # files: smaller batches are written by one thread
#: Fewest files in one unit of work of a shared batch (whole directories, packed): what a writer
#: thread takes from the batch at a time (:func:`_write_split`).
_UNIT_FILES = 16


def write_threads() -> int:
    """Threads that write one small-file batch: ``$TB5SYNC_WRITE_THREADS``, else :data:`WRITE_THREADS`.

    Raises
    ------
    UsageError
        ``$TB5SYNC_WRITE_THREADS`` is set to something else than an integer in 1..16.
    """
    raw = os.environ.get("TB5SYNC_WRITE_THREADS", "").strip()
    if not raw:
        return WRITE_THREADS
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if not 1 <= n <= 16:
        raise UsageError(f"TB5SYNC_WRITE_THREADS must be an integer in 1..16, not {raw!r}")
    return n


def _write_split(batch: list[Any], heads: list[str], fsync: bool, tmpfile: bool = False) -> list[Any]:
    """The Cython writer over ``batch`` (one result per file, in order), its directories
    (``heads``, one per file) shared out among :func:`write_threads` threads as they go: the
    directories, largest first, are packed into units of at least :data:`_UNIT_FILES` files (a
    directory is never split: two threads creating files in one directory contend on its lock),
    and each thread takes the next unit when it has written its last, so a thread whose
    directories are slower to create files in (ext4: an inode group full of recently deleted
    inodes) does not hold the others up at the end of the batch. This thread writes too; the
    others are started for the call and always joined (a ``KeyboardInterrupt`` waits for them,
    then is raised), so every file of the batch is committed or its temporary name removed
    before this returns."""
    assert _cy_write_files is not None
    n = min(write_threads(), len(batch) // _MIN_SPLIT + 1)
    groups: dict[str, list[int]] = {}
    for i, h in enumerate(heads):
        groups.setdefault(h, []).append(i)
    if n <= 1 or len(groups) <= 1:
        return _cy_write_files(batch, fsync, tmpfile)
    units: list[list[int]] = []
    unit: list[int] = []
    for g in sorted(groups.values(), key=len, reverse=True):
        unit.extend(g)
        if len(unit) >= _UNIT_FILES:
            units.append(unit)
            unit = []
    if unit:
        units.append(unit)
    out: list[Any] = [None] * len(batch)
    failed: list[BaseException] = []
    take = iter(units).__next__  # under the lock: one unit to one thread
    lock = threading.Lock()

    def write() -> None:
        while not failed:
            with lock:
                u = take()
            try:
                res = _cy_write_files([batch[i] for i in u], fsync, tmpfile)
            except BaseException as exc:  # delivered to the caller below
                failed.append(exc)
                return
            for i, r in zip(u, res):
                out[i] = r

    def write_caught() -> None:
        with contextlib.suppress(StopIteration):
            write()

    threads = [threading.Thread(target=write_caught, name=f"tb5-write-{k}", daemon=True) for k in range(1, min(n, len(units)))]
    started: list[threading.Thread] = []
    interrupted: BaseException | None = None
    try:
        for t in threads:
            try:
                t.start()
            except RuntimeError:  # no thread to be had: the others take its units
                continue
            started.append(t)
        write_caught()
    finally:
        for t in started:  # the batch is finished whatever happens here
            while t.is_alive():
                try:
                    t.join()
                except KeyboardInterrupt as exc:
                    interrupted = exc
    if interrupted is not None:
        raise interrupted
    if failed:
        raise failed[0]
    return out


#: ``(st_size, st_mtime_ns, st_ino)`` of a file just committed (what its scan-cache row keeps).
Committed = tuple[int, int, int]
_NEW_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC


def lock_file(fd: int, wait: bool = False) -> bool:
    """Take an exclusive ``flock`` on ``fd``; False when another open file holds it (and not ``wait``).

    The lock goes with the open file description: the kernel drops it when the last
    descriptor of it is closed, so a killed writer's lock is free at once.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        return True
    except BlockingIOError:
        return False


_F = TypeVar("_F", bound=Callable[..., Any])


def _names_path(fn: _F) -> _F:
    """Make an ``OSError`` of the method ``fn(self, rel, ...)`` name the entry's path (not the bare name it used relative to a descriptor)."""

    @functools.wraps(fn)
    def wrapper(self: Destination, rel: str, *args: Any, **kw: Any) -> Any:
        try:
            return fn(self, rel, *args, **kw)
        except OSError as exc:
            if not isinstance(exc, Tb5syncError):
                exc.filename = self.path(rel)
                exc.filename2 = None
            raise

    return wrapper  # type: ignore[return-value]


def _unlink_at(dfd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dfd)
    except OSError:
        pass


def _chmod_at(dfd: int, name: str, mode: int, shown: str) -> None:
    """``chmod`` the entry ``name`` of ``dfd`` to ``mode`` without following a symlink.

    Through a descriptor opened ``O_NOFOLLOW`` (``fchmod``); when it cannot be opened (no
    read permission for a non-root user), ``fchmodat(AT_SYMLINK_NOFOLLOW)``; where the C
    library has no such call, a check that it is not a symlink, then ``fchmodat``.

    Raises
    ------
    PathError
        ``name`` is a symlink.
    OSError
        The chmod failed.
    """
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.ELOOP, errno.ENXIO, errno.EMLINK):
            raise
    else:
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        return
    if stat.S_ISLNK(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
        raise PathError(shown, "is a symlink; not followed")
    try:
        os.chmod(name, mode, dir_fd=dfd, follow_symlinks=False)
    except (NotImplementedError, ValueError):
        os.chmod(name, mode, dir_fd=dfd)  # checked above; the parent is held by its descriptor


#: Forces what the destination is taken to ignore (``case``, ``unicode``, both, ``none``): :meth:`Destination.folding`.
FOLD_ENV = "TB5SYNC_DEST_FOLD"


def _same_entry(dir_fd: int, names: Sequence[str], other: Callable[[str], str]) -> bool:
    """True when, for the first of ``names`` that ``other`` changes, both forms name one entry."""
    for name in names:
        alt = other(name)
        if alt != name:
            try:
                return os.path.samestat(os.stat(name, dir_fd=dir_fd, follow_symlinks=False),
                                        os.stat(alt, dir_fd=dir_fd, follow_symlinks=False))
            except FileNotFoundError:
                return False
    return False


def _check_not_state(rel: str) -> None:
    """Refuse an entry path ``rel`` that has a component named :data:`~tb5sync._os.paths.STATE_DIR`.

    Scans never list one (at any depth), so a sync never writes one; a forged listing could
    otherwise write into a server's own state (its scan cache, partial files, ``--store``). The
    state's own ``partial/`` directory is opened by :meth:`Destination._partial_dir`, not here.

    Raises
    ------
    PathError
        Naming ``rel``.
    """
    if STATE_DIR in rel and STATE_DIR in rel.split("/"):
        raise PathError(rel, f"{STATE_DIR} is tb5sync's own state; never written by a sync")


class Destination:
    """Where a sync writes, and what it has written so far.

    Parameters
    ----------
    base : str
        Absolute destination base path (where the source's ``""`` entry lands), without a
        trailing slash (``"/"`` for the root).
    state : TreeState or None
        Destination scan cache and chunk index. Its ``root`` is the jail's root; without a
        state the jail's root is ``base``'s parent directory.
    state_prefix : str
        ``base`` relative to the state's root (``""`` when they are the same).
    progress : ProgressFn, optional
        Told ``(bytes_done, bytes_total)`` after each :meth:`tick`.
    fsync : bool
        Make each commit durable: the file's data is ``fsync``-ed before its rename, and its
        directory after it (see :meth:`sync_dirs`).
    sparse : bool
        rsync ``-S``: aligned 4 KiB blocks of zeros in written files are left as holes
        (:mod:`tb5sync._os.sparse`; a large file holding some is copied sparsely at its commit).

    Attributes
    ----------
    stats : dict of str to int
        The counters of :data:`STAT_COUNTERS`, all starting at 0, for the run's
        :class:`~tb5sync.tree.options.SyncStats`.
    done_bytes, total_bytes : int
        Bytes committed so far, and bytes the plan will write (set once the plan is made).
    changed : list of str
        Relative paths of files that vanished or kept changing at the source (not synced);
        they end in :attr:`failures` (``vanished=True``).
    failures : list of Failure
        Entries that could not be synced, in the order met (see :meth:`fail`).
    failed_dirs : set of str
        Directories that could not be made: nothing is written below them.
    specials : list of (str, str)
        ``(path, what)`` of the source's special files, left out (the sender names them).
    unlocked : dict of str to (int, int)
        Absolute paths of directories given ``u+w`` to write in them (see :meth:`writable`) or
        ``u+rx`` to list them (the destination's scan), to ``(mode before, mode given)``; the
        mode before is restored by :meth:`relock` unless the mode was set since.

    Notes
    -----
    Not thread-safe, and with no lock: only the thread that runs
    :meth:`tb5sync.roles.receiver.Receiver.run` updates it (commits small files, settles reused
    chunks, writes fetched and rebuilt chunks), or the receiver's one writer thread running
    :meth:`write_files` while the run thread calls nothing here but :meth:`record`,
    :meth:`fail`, :meth:`tick`, :attr:`stats`, :attr:`changed` and :meth:`flush_records` (the
    counts, failures and kept rows of the batch before, which :meth:`write_files` does not
    touch). The other threads of a large-file job do not touch it: the planner thread only
    builds chunks from basis sub-chunks (the run thread verifies, writes and counts them), the
    chunk-list helper only asks for pieces,
    the hash pool only runs checked copies. :attr:`state` (a
    :class:`~tb5sync.tree.state.TreeState`) locks on its own.
    """

    def __init__(
        self, base: str, state: TreeState | None = None, state_prefix: str = "", progress: ProgressFn | None = None, *, fsync: bool = False,
        sparse: bool = False, quota: WriteQuota | None = None,
    ) -> None:
        self.base = base
        #: a server session's write limits (``--max-session-bytes``, ``--min-free-space``),
        #: charged with each file's size before any byte of it is written
        self.quota = quota
        self.state = state
        self.state_prefix = state_prefix
        self.progress = progress
        self.fsync = fsync
        self.sparse = sparse
        self.stats: dict[str, int] = dict.fromkeys(STAT_COUNTERS, 0)
        self.done_bytes = 0
        self.total_bytes = 0
        self.changed: list[str] = []
        self.failures: list[Failure] = []
        self.failed_dirs: set[str] = set()
        self.unlocked: dict[str, tuple[int, int]] = {}
        self.specials: list[tuple[str, str]] = []
        #: large files are assembled in the state's partial/ directory (resumable); else under a
        #: temporary name beside their final path (the state is in memory or on another file system)
        self.partials = state is not None and state.partials_for(base)
        self._records: list[tuple[str, int, int, int, Sequence[tuple[bytes, int]]]] = []
        if state is not None:
            self.root, self._prefix = state.root, state_prefix
        else:
            self.root, self._prefix = os.path.dirname(base) or "/", os.path.basename(base)
        self._jail: Jail | None = None
        self._base: list[str] = []
        self._dirs: OrderedDict[str, int] = OrderedDict()
        self._partial_fd = -1
        self._dirty: set[str] = set()

    # ---- the jail -----------------------------------------------------------------------
    @property
    def jail(self) -> Jail:
        """The :class:`~tb5sync._os.paths.Jail` of the destination's root (opened on first use).

        The root is created when missing (the directory the user named, as rsync creates
        its destination) and resolved once (``realpath``); the base's place under it is
        resolved once too (symlinks in its parents, inside the root only). Below the base
        nothing is followed.

        Raises
        ------
        PathError
            The base's parents lead outside the root.
        OSError
            The root cannot be created or opened.
        """
        if self._jail is None:
            os.makedirs(self.root, exist_ok=True)
            jail = Jail(os.path.realpath(self.root))
            try:
                self._base = jail.resolve(self._prefix)
            except BaseException:
                jail.close()
                raise
            self._jail = jail
        return self._jail

    def parts(self, rel: str) -> list[str]:
        """Jail components of the entry ``rel`` (relative to :attr:`base`; ``""`` is the base).

        Raises
        ------
        PathError
            ``rel`` has a component named :data:`~tb5sync._os.paths.STATE_DIR` (tb5sync's state is
            never a sync's entry: see :func:`_check_not_state`).
        """
        _check_not_state(rel)
        self.jail  # opened (and the base resolved) on first use
        return self._base + rel.split("/") if rel else list(self._base)

    def dir_fd(self, rel: str) -> int:
        """Descriptor of the destination directory ``rel`` (``""``: the base), kept open and owned here.

        Looked up through the jail (no symlink on the way); kept until a directory is removed
        or renamed by this destination (:meth:`remove`) or :meth:`close`. A directory swapped
        for a symlink after it was opened is still reached through its descriptor, inside the
        root.

        Raises
        ------
        PathError
            A component is a symlink.
        OSError
            ``FileNotFoundError``, ``NotADirectoryError``, ...
        """
        fd = self._dirs.get(rel)
        if fd is not None:
            self._dirs.move_to_end(rel)
            return fd
        fd = self.jail.open_dir(self.parts(rel))
        self._dirs[rel] = fd
        if len(self._dirs) > _DIR_CACHE:
            os.close(self._dirs.popitem(last=False)[1])
        return fd

    def parent(self, rel: str) -> tuple[int, str]:
        """``(dir_fd, name)`` of the entry ``rel``: its directory's descriptor (owned here) and its name.

        The base's own parent is the one directory above the base (``rel == ""``).

        Raises
        ------
        PathError
            ``rel`` is the jail's root itself, or a directory on the way is a symlink.
        OSError
            The directory cannot be opened.
        """
        if rel:
            _check_not_state(rel)
            head, _, name = rel.rpartition("/")
            return self.dir_fd(head), name
        parts = self.parts("")
        if not parts:
            raise PathError(self.base, "the destination root itself cannot be replaced")
        key = "\0.."  # not a path: the base's parent
        fd = self._dirs.get(key)
        if fd is None:
            fd = self._dirs[key] = self.jail.open_dir(parts[:-1], create=True)
        return fd, parts[-1]

    def _forget_dirs(self, rel: str) -> None:
        """Close the kept descriptors of ``rel`` and everything below it (removed or replaced)."""
        if not rel:
            keys = [k for k in self._dirs if k != "\0.."]
        else:
            keys = [k for k in self._dirs if k == rel or k.startswith(rel + "/")]
        for k in keys:
            os.close(self._dirs.pop(k))

    def close(self) -> None:
        """Close every descriptor this destination holds. Safe to call twice."""
        for fd in self._dirs.values():
            os.close(fd)
        self._dirs.clear()
        if self._partial_fd >= 0:
            os.close(self._partial_fd)
            self._partial_fd = -1
        if self._jail is not None:
            self._jail.close()
            self._jail = None

    # ---- paths ------------------------------------------------------------------------
    def path(self, rel: str) -> str:
        """The absolute path of the entry ``rel`` (relative to :attr:`base`; ``""`` is the base), for messages."""
        return os.path.join(self.base, rel) if rel else self.base

    def spath(self, rel: str) -> str:
        """The entry ``rel``'s path in the scan cache (relative to the state's root)."""
        return "/".join(p for p in (self.state_prefix, rel) if p)

    @staticmethod
    def temp_path(final: str) -> str:
        """A temporary name beside the absolute path ``final``: ``.NAME.XXXXXXXX.tb5tmp`` in the same directory."""
        d, name = os.path.split(final)
        return os.path.join(d, temp_name(name))

    def skipped(self, rel: str) -> bool:
        """Whether ``rel`` lies below a directory that could not be made (:attr:`failed_dirs`)."""
        if not self.failed_dirs:
            return False
        parts = rel.split("/")
        return any("/".join(parts[:k]) in self.failed_dirs for k in range(1, len(parts)))

    def fail(self, rel: str, side: str, exc: BaseException | str) -> None:
        """Name the entry ``rel`` as not synced, and why; the run goes on without it.

        Parameters
        ----------
        rel : str
            Path relative to :attr:`base`.
        side : str
            ``"source"`` or ``"destination"``.
        exc : exception or str
            The error (its ``strerror``, else its message) or the reason itself.

        Raises
        ------
        DestinationError
            ``exc`` is a destination error after which nothing else can be written either
            (:data:`FATAL_ERRNOS`: disk full, quota, read-only file system, I/O error).
        PathError
            ``exc`` itself: a directory on the way is a symlink (see :attr:`jail`).
        """
        if isinstance(exc, PathError):
            raise exc  # a symlink where the jail expects a directory: the run stops, nothing is written through it
        if isinstance(exc, OSError) and side == "destination" and exc.errno in FATAL_ERRNOS:
            raise DestinationError(f"cannot write destination {exc.filename or self.path(rel)}: {exc.strerror}") from exc
        if isinstance(exc, OSError) and exc.strerror:
            reason = f"{exc.strerror} ({exc.errno})" if exc.errno else exc.strerror
        else:
            reason = str(exc)
            if reason.startswith("remote: "):
                reason = reason[len("remote: "):]
            shown = show_path(rel)
            if rel and reason.startswith(f"{shown}: "):
                reason = reason[len(shown) + 2:]
        log.info("not synced: %s %r: %s", side, rel, reason)
        self.failures.append(Failure(rel, side, reason.splitlines()[0] if reason else "failed"))

    def vanished(self) -> list[Failure]:
        """:attr:`changed` as failures (``vanished=True``, side ``"source"``)."""
        return [Failure(p, "source", "vanished or kept changing while it was read", vanished=True) for p in self.changed]

    def writable(self, rel: str, op: Callable[[], T]) -> T:
        """Run ``op`` (which creates, renames or removes the entry ``rel``); if it is refused
        because ``rel``'s directory lacks ``u+w``, give the directory ``u+w`` and run ``op`` again.

        rsync does the same for a non-root user: a directory of mode 0555 is made writable
        while entries in it are written, and gets its mode back at the end (:meth:`relock`;
        the generator's last pass sets the source's modes anyway). Only a directory this
        process owns is changed; root needs none of it. The directory is changed through its
        descriptor (:meth:`parent`), never by path.

        Raises
        ------
        OSError
            What ``op`` raises otherwise (or again).
        """
        try:
            return op()
        except PermissionError as exc:
            if isinstance(exc, Tb5syncError):
                raise
            dfd, _name = self.parent(rel)
            st = os.fstat(dfd)
            if st.st_mode & stat.S_IWUSR or st.st_uid != os.geteuid():
                raise
            mode = stat.S_IMODE(st.st_mode)
            given = mode | stat.S_IWUSR | stat.S_IXUSR
            os.fchmod(dfd, given)
            key = self.path(rel.rpartition("/")[0]) if rel else os.path.dirname(self.base)
            self.unlocked.setdefault(key, (mode, given))
            return op()

    def _unlocked_dir(self, path: str) -> int:
        """The descriptor (owned here) of the directory ``path`` (absolute: the base, below it, or the base's parent)."""
        if path == self.base:
            return self.dir_fd("")
        if path.startswith(self.base.rstrip("/") + "/"):
            return self.dir_fd(path[len(self.base.rstrip("/")) + 1 :])
        if path == os.path.dirname(self.base):
            return self.parent("")[0]
        raise PathError(path, "is not under the destination")

    def relock(self) -> None:
        """Give each directory :meth:`writable` (or the destination's scan) unlocked its mode
        back, unless its mode was set since (by the generator's metadata pass, to the source's).
        Through the directories' descriptors of the jail."""
        for d, (mode, given) in self.unlocked.items():
            try:
                fd = self._unlocked_dir(d)
                if stat.S_IMODE(os.fstat(fd).st_mode) == given:
                    os.fchmod(fd, mode)
            except OSError as exc:
                log.info("cannot restore the mode of %s: %s", d, exc)
        self.unlocked.clear()

    def _rename_over(self, rel: str, src_dfd: int, src_name: str, dfd: int, name: str) -> None:
        """Rename ``src_name`` of ``src_dfd`` to ``name`` of ``dfd`` (the entry ``rel``); an empty
        directory at ``rel`` (an entry of another type being replaced) is removed first, only
        now that its replacement exists.

        Raises
        ------
        OSError
            The rename failed (``ENOTEMPTY``/``EISDIR`` for a directory that is not empty).
        """
        try:
            os.rename(src_name, name, src_dir_fd=src_dfd, dst_dir_fd=dfd)
        except OSError as exc:
            if exc.errno not in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                raise exc from None
            if not stat.S_ISDIR(st.st_mode):
                raise
            self._forget_dirs(rel)
            os.rmdir(name, dir_fd=dfd)
            os.rename(src_name, name, src_dir_fd=src_dfd, dst_dir_fd=dfd)

    # ---- the tree's shape ---------------------------------------------------------------
    def folding(self, write: bool = True) -> tuple[bool, bool]:
        """``(ignores case, ignores Unicode normalization)`` of the destination's directory (APFS
        by default: both; ext4 ``casefold`` directories: both; most Linux file systems: neither).

        Probed at run time in the deepest existing directory of the base (the base, its parent,
        or the jail's root): a temporary file is made (``write``, not in a dry run) and its
        case-swapped and NFD names looked up; without writing, the directory's existing names
        are looked up so. ``$TB5SYNC_DEST_FOLD`` (``case``, ``unicode``, ``case,unicode`` or
        ``none``) skips the probe and says what to assume (the planner's simulation, for tests).

        Raises
        ------
        UsageError
            A ``$TB5SYNC_DEST_FOLD`` word other than those.
        """
        forced = os.environ.get(FOLD_ENV)
        if forced is not None:
            words = {w.strip() for w in forced.split(",") if w.strip()}
            if words - {"case", "unicode", "none"}:
                raise UsageError(f"${FOLD_ENV} takes case, unicode, case,unicode or none, not {forced!r}")
            return "case" in words, "unicode" in words
        if not write and self._jail is None and not os.path.isdir(self.root):
            # a dry run into a root that does not exist yet: look in its deepest existing
            # ancestor, creating nothing (opening the jail would create the root)
            up = os.path.abspath(self.root)
            while not os.path.isdir(up) and os.path.dirname(up) != up:
                up = os.path.dirname(up)
            try:
                fd = os.open(up, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                return False, False
            try:
                return self._probe_folding(fd, False)
            finally:
                os.close(fd)
        try:
            parts = self.parts("")
        except (OSError, PathError):
            return False, False
        fd = -1
        for k in range(len(parts), -1, -1):  # the deepest existing directory (nothing is created)
            try:
                fd = self.jail.open_dir(parts[:k]) if k else os.dup(self.jail.fd)
                break
            except (OSError, PathError):
                continue
        if fd < 0:
            return False, False
        try:
            return self._probe_folding(fd, write)
        finally:
            os.close(fd)

    @staticmethod
    def _probe_folding(fd: int, write: bool) -> tuple[bool, bool]:
        names: list[str] = []
        probe = temp_name("tb5probe\u00e9")
        if write:
            try:
                before = os.fstat(fd)
                os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=fd))
                names = [probe]
            except OSError:
                pass
        try:
            names = names or os.listdir(fd)
            return _same_entry(fd, names, str.swapcase), _same_entry(fd, names, lambda n: unicodedata.normalize(
                "NFC" if unicodedata.is_normalized("NFD", n) else "NFD", n))
        except OSError:
            return False, False
        finally:
            if names and names[0] == probe:
                os.unlink(probe, dir_fd=fd)
                with contextlib.suppress(OSError):  # the directory's mtime as it was (a no-change run changes nothing)
                    os.utime(fd, ns=(before.st_atime_ns, before.st_mtime_ns))

    def make_base_parent(self) -> None:
        """Create the directories above the base when missing (rsync creates its destination's parent)."""
        self.parent("")

    @_names_path
    def mkdir(self, rel: str, mode: int = 0o700) -> None:
        """Create the directory ``rel``; one that another run made meanwhile is taken as it is.

        Raises
        ------
        PathError
            A directory on the way is a symlink.
        FileExistsError
            Something that is not a directory is there.
        """
        if not self.parts(rel):
            return  # the jail's root: it exists
        dfd, name = self.parent(rel)
        try:
            os.mkdir(name, mode, dir_fd=dfd)
        except FileExistsError:
            if not stat.S_ISDIR(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                raise
        self._dirty.add(rel.rpartition("/")[0] if rel else "\0..")

    @_names_path
    def remove(self, rel: str, is_dir: bool) -> None:
        """Remove the entry ``rel`` (``rmdir`` when ``is_dir`` and it still is one, else ``unlink``); never follows a symlink.

        Raises
        ------
        FileNotFoundError
            It is not there.
        OSError
            ``ENOTEMPTY`` for a directory with entries left, ...
        """
        dfd, name = self.parent(rel)
        self._forget_dirs(rel)
        if is_dir:
            try:
                os.rmdir(name, dir_fd=dfd)
                return
            except NotADirectoryError:
                pass  # replaced by a symlink or a file meanwhile: remove that
        os.unlink(name, dir_fd=dfd)

    @_names_path
    def chmod(self, rel: str, mode: int) -> None:
        """Set the permission bits of ``rel`` (a file or directory; a symlink is refused, not followed)."""
        if not self.parts(rel):
            os.fchmod(self.jail.fd, mode)
            return
        dfd, name = self.parent(rel)
        _chmod_at(dfd, name, mode, self.path(rel))

    @_names_path
    def utime(self, rel: str, mtime_ns: int) -> None:
        """Set the access and modification times of ``rel`` to ``mtime_ns`` (a symlink's own, not its target's)."""
        if not self.parts(rel):
            os.utime(self.jail.fd, ns=(mtime_ns, mtime_ns))
            return
        dfd, name = self.parent(rel)
        os.utime(name, ns=(mtime_ns, mtime_ns), dir_fd=dfd, follow_symlinks=False)

    def open_read(self, rel: str) -> int:
        """A new read-only descriptor of the file ``rel``, not through a symlink (``O_NONBLOCK``: a FIFO does not block).

        Raises
        ------
        OSError
            Missing, a symlink (``ELOOP``), ...
        """
        dfd, name = self.parent(rel)
        return os.open(name, _READ_FLAGS, dir_fd=dfd)

    def open_in_root(self, spath: str) -> int:
        """A new read-only descriptor of ``spath`` (a scan-cache path, relative to the root), no symlink on the way."""
        return self.jail.open_file(spath, _READ_FLAGS)

    # ---- new files ----------------------------------------------------------------------
    def write_files(self, files: Sequence[tuple[str, bytes | bytearray | memoryview, int, int]]) -> list[Committed | OSError]:
        """Write a batch of small files, each as :meth:`write_file` does (through :meth:`writable`).

        Parameters
        ----------
        files : sequence of (str, bytes-like, int, int)
            ``(rel, data, mode, mtime_ns)`` per file: its path relative to :attr:`base`, its bytes
            (already verified), its permission bits and its mtime (ns).

        Returns
        -------
        list of Committed or OSError
            Per file, in order: ``(st_size, st_mtime_ns, st_ino)`` as committed, or the error that
            kept it from being written (its path named; the caller decides: :meth:`fail`).

        Notes
        -----
        With the Cython writer (:data:`WRITE_IMPLEMENTATION`) the whole batch is one call with the
        GIL released (the network threads receive the next batches meanwhile), every call relative
        to the jail's directory descriptors (``openat`` ``O_CREAT|O_EXCL|O_NOFOLLOW``, ``write``,
        ``fchmod``, ``futimens``, ``renameat``). A file it cannot write (any errno: a read-only
        directory, an empty directory in the way, a full disk) is taken again by the Python path,
        which makes the directory writable, replaces the empty directory or raises exactly as
        before. ``-S`` (sparse) writes take the Python path.

        Raises
        ------
        PathError
            A directory on the way is a symlink (the run stops; nothing is written through it).
        QuotaError
            The batch passes :attr:`quota` (the run stops; nothing of the batch is written).
        Tb5syncError
            Raised by the Python path (not returned).
        """
        if self.quota is not None:  # before any byte of the batch: a refusal leaves nothing behind
            for rel, data, _mode, _mtime in files:
                self.quota.charge(len(data), rel)
        out: list[Committed | OSError | None] = [None] * len(files)
        redo: list[int] = []
        if _cy_write_files is not None and not self.sparse:
            batch: list[tuple[int, bytes, bytes, Any, int, int]] = []
            where: list[tuple[int, str]] = []
            fds: dict[str, int] = {}
            tags = temp_tags(len(files))
            try:
                for i, (rel, data, mode, mtime_ns) in enumerate(files):
                    head = rel.rpartition("/")[0] if rel else "\0.."
                    dfd = fds.get(head)
                    try:
                        if dfd is None:
                            # a duplicate: the destination's descriptor cache may close its own
                            # (least recently used) while this batch's directories are opened
                            dfd = fds[head] = os.dup(self.parent(rel)[0])
                        name = rel.rpartition("/")[2] if rel else self.parent(rel)[1]
                    except OSError as exc:
                        if isinstance(exc, Tb5syncError):
                            raise
                        redo.append(i)  # the Python path meets (and names) the same error
                        continue
                    bname = os.fsencode(name)
                    batch.append((dfd, os.fsencode(temp_name(name, tags[i])), bname, data, mode & 0o7777, mtime_ns))
                    where.append((i, head))
                results = _write_split(batch, [w[1] for w in where], self.fsync, use_tmpfile())
            finally:
                for fd in fds.values():
                    os.close(fd)
            for (i, head), res in zip(where, results):
                if isinstance(res, int):
                    redo.append(i)
                else:
                    out[i] = res
                    self._dirty.add(head)
            redo.sort()
        else:
            redo = list(range(len(files)))
        for i in redo:
            rel, data, mode, mtime_ns = files[i]
            try:
                st = self.writable(rel, lambda rel=rel, data=data, mode=mode, mtime_ns=mtime_ns: self.write_file(rel, data, mode, mtime_ns))
            except OSError as exc:
                if isinstance(exc, Tb5syncError):
                    raise
                out[i] = exc
                continue
            out[i] = (st.st_size, st.st_mtime_ns, st.st_ino)
        return out  # type: ignore[return-value]

    @_names_path
    def write_file(self, rel: str, data: bytes | bytearray | memoryview, mode: int, mtime_ns: int) -> os.stat_result:
        """Write ``data`` to a temporary file beside ``rel``, give it ``mode`` and ``mtime_ns``, rename it over ``rel``.

        Returns
        -------
        os.stat_result
            Of the file as committed.

        Raises
        ------
        PathError
            A directory on the way is a symlink.
        OSError
            The file cannot be written or renamed (the temporary file is removed).
        """
        dfd, name = self.parent(rel)
        tmp = temp_name(name)
        try:
            fd = os.open(tmp, _NEW_FLAGS, 0o600, dir_fd=dfd)
            try:
                lock_file(fd)
                if self.sparse:
                    write_sparse(fd, data)
                    os.ftruncate(fd, len(data))
                else:
                    write_all(fd, data)
                os.fchmod(fd, mode & 0o7777)
                os.utime(fd, ns=(mtime_ns, mtime_ns))
                if self.fsync:
                    durable_sync(fd)
                st = os.fstat(fd)
            finally:
                os.close(fd)
            self._rename_over(rel, dfd, tmp, dfd, name)
        except FileExistsError:
            raise  # O_EXCL: not ours
        except BaseException:
            _unlink_at(dfd, tmp)
            raise
        self._dirty.add(rel.rpartition("/")[0])
        return st

    @_names_path
    def make_link(self, rel: str, target: str, mtime_ns: int) -> None:
        """Make the symlink ``rel -> target`` under a temporary name, give it its mtime, rename it into place."""
        dfd, name = self.parent(rel)
        tmp = temp_name(name)
        try:
            os.symlink(target, tmp, dir_fd=dfd)
            os.utime(tmp, ns=(mtime_ns, mtime_ns), dir_fd=dfd, follow_symlinks=False)
            self._rename_over(rel, dfd, tmp, dfd, name)
        except FileExistsError:
            raise
        except BaseException:
            _unlink_at(dfd, tmp)
            raise
        self._dirty.add(rel.rpartition("/")[0])

    @_names_path
    def link_from(self, rel: str, src_dfd: int, src_name: str) -> bool:
        """Make ``rel`` a hard link to ``src_name`` of the directory ``src_dfd`` (``--link-dest``,
        ``-H``): linked under a temporary name beside ``rel`` and renamed over it.

        Returns
        -------
        bool
            True when ``rel`` is (now, or already was) that inode; False when no hard link can be
            made there (another file system, a file system without hard links, the link limit):
            the caller copies instead.

        Raises
        ------
        PathError
            A directory on the way is a symlink.
        OSError
            The link or the rename failed otherwise (the temporary name is removed).
        """
        dfd, name = self.parent(rel)
        src = os.stat(src_name, dir_fd=src_dfd, follow_symlinks=False)
        if not stat.S_ISREG(src.st_mode):
            return False  # replaced meanwhile: only a regular file is linked
        try:
            have = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if (have.st_dev, have.st_ino) == (src.st_dev, src.st_ino):
                return True  # a rename onto the same inode would do nothing and leave the temporary name
        except FileNotFoundError:
            pass
        tmp = temp_name(name)
        try:
            os.link(src_name, tmp, src_dir_fd=src_dfd, dst_dir_fd=dfd, follow_symlinks=False)
        except OSError as exc:
            if exc.errno in (errno.EXDEV, errno.EMLINK, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                return False
            raise
        try:
            self._rename_over(rel, dfd, tmp, dfd, name)
        except BaseException:
            _unlink_at(dfd, tmp)
            raise
        self._dirty.add(rel.rpartition("/")[0])
        return True

    @_names_path
    def set_xattrs(self, rel: str, is_dir: bool, want: list[tuple[bytes, bytes]]) -> bool:
        """``-X``: make the copied extended attributes of the file or directory ``rel`` exactly
        ``want`` (:func:`tb5sync._os.fsmeta.set_xattrs`), through a descriptor opened with
        ``O_NOFOLLOW`` from its directory's. True when something changed.

        Raises
        ------
        PathError
            A directory on the way is a symlink.
        OSError
            It cannot be opened, or an attribute cannot be set or removed.
        """
        from tb5sync._os.fsmeta import copied_name, set_xattrs

        want = [(n, v) for n, v in want if copied_name(n)]  # a peer sets no other namespace (trusted., security.)
        if is_dir:
            return set_xattrs(self.dir_fd(rel), want)
        dfd, name = self.parent(rel)
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, dir_fd=dfd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return False
            return set_xattrs(fd, want)
        finally:
            os.close(fd)

    @_names_path
    def get_xattrs(self, rel: str, is_dir: bool) -> list[tuple[bytes, bytes]]:
        """``-X -i``: the copied extended attributes of the file or directory ``rel`` now, as
        ``(name, value)`` sorted by name (``[]`` for an entry that is not a regular file or directory).

        Raises
        ------
        PathError
            A directory on the way is a symlink.
        OSError
            It cannot be opened or listed.
        """
        from tb5sync._os.fsmeta import list_xattrs

        if is_dir:
            return list_xattrs(self.dir_fd(rel))
        dfd, name = self.parent(rel)
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, dir_fd=dfd)
        try:
            return list_xattrs(fd) if stat.S_ISREG(os.fstat(fd).st_mode) else []
        finally:
            os.close(fd)

    # ---- large files' work files --------------------------------------------------------
    def _partial_dir(self) -> int:
        """Descriptor of the state's ``partial/`` directory: through the jail when the state lives
        in the root (``ROOT/.tb5sync``), else (the user's cache directory, ``--state-dir``) the
        state's own private directory, opened without following a symlink."""
        if self._partial_fd < 0:
            sd = self.state.state_dir if self.state is not None else None
            if sd is None or os.path.realpath(sd) == os.path.join(os.path.realpath(self.root), STATE_DIR):
                self._partial_fd = self.jail.open_dir([STATE_DIR, "partial"], create=True)
            else:
                self._partial_fd = os.open(os.path.join(sd, "partial"), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC)
        return self._partial_fd

    @_names_path
    def open_work(self, rel: str, key: bytes | None) -> tuple[int, int, str, bool]:
        """Open the work file of the large file ``rel``: ``(fd, dir_fd, name, kept)``, locked for this run.

        With ``key`` (a persistent state), the work file is the partial file
        ``.tb5sync/partial/<key hex>`` (``kept``: it survives a failed run and the next one
        resumes from it) unless another live run holds it locked (two runs writing the same
        version of the same path), or it lies on another file system than ``rel``'s directory;
        otherwise, and without ``key``, it is a new temporary file beside ``rel`` (not kept).
        ``dir_fd`` is owned by the destination; close ``fd`` and commit with
        :meth:`commit_work`, or give up with :meth:`drop_work`.

        Raises
        ------
        PathError
            A directory on the way is a symlink.
        OSError
            The file cannot be created.
        """
        dfd, name = self.parent(rel)
        if key is not None:
            pfd = self._partial_dir()
            if os.fstat(pfd).st_dev == os.fstat(dfd).st_dev:
                # O_NONBLOCK: a FIFO planted in the partial store does not block the open
                fd = os.open(key.hex(), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, 0o600, dir_fd=pfd)
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    os.close(fd)
                    raise OSError(errno.EINVAL, f"partial file {key.hex()} is not a regular file")
                if lock_file(fd):
                    return fd, pfd, key.hex(), True
                os.close(fd)
                log.info("%s: another run is writing the same version; using a work file of our own", rel)
        tmp = temp_name(name)
        try:
            fd = os.open(tmp, _NEW_FLAGS, 0o600, dir_fd=dfd)
            lock_file(fd)
        except FileExistsError:
            raise
        except BaseException:
            _unlink_at(dfd, tmp)
            raise
        return fd, dfd, tmp, False

    @staticmethod
    def drop_work(wdir: int, wname: str) -> None:
        """Remove a work file that is not kept (a failed attempt's temporary file)."""
        _unlink_at(wdir, wname)

    @_names_path
    def commit_work(self, rel: str, fd: int, wdir: int, wname: str) -> None:
        """Rename the work file ``wname`` of ``wdir`` (still open as ``fd``) over ``rel``; errors name ``rel``'s path.

        ``fd`` is ``fsync``-ed first when :attr:`fsync`. Across file systems (a bind mount
        the rename cannot cross) the bytes are copied to a temporary file beside ``rel``,
        which is renamed into place (and removed if the copy fails), then the work file is
        removed.

        Raises
        ------
        OSError
            The rename or the copy failed (``ENOSPC``, ...); nothing is left at ``rel``'s
            temporary name.
        """
        dfd, name = self.parent(rel)
        if self.fsync:
            durable_sync(fd)
        try:
            if self.sparse and has_zero_blocks(fd, os.fstat(fd).st_size):  # -S: holes made by a sparse copy
                raise OSError(errno.EXDEV, "sparse copy")
            self._rename_over(rel, wdir, wname, dfd, name)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            st = os.fstat(fd)
            tmp = temp_name(name)
            try:
                out = os.open(tmp, _NEW_FLAGS, 0o600, dir_fd=dfd)
                try:
                    lock_file(out)
                    (copy_sparse if self.sparse else _copy_fd)(fd, out, st.st_size)
                    os.fchmod(out, stat.S_IMODE(st.st_mode))
                    os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
                    if self.fsync:
                        durable_sync(out)
                finally:
                    os.close(out)
                self._rename_over(rel, dfd, tmp, dfd, name)
            except FileExistsError:
                raise
            except BaseException:
                _unlink_at(dfd, tmp)
                raise
            _unlink_at(wdir, wname)
        self._dirty.add(rel.rpartition("/")[0])

    # ---- durability and leftovers --------------------------------------------------------
    def sync_dirs(self) -> None:
        """``fsync`` every directory this run created entries in (when :attr:`fsync`), so the renames survive a power cut."""
        dirty, self._dirty = self._dirty, set()
        if not self.fsync:
            return
        for rel in sorted(dirty):
            try:
                fd = self.parent("")[0] if rel == "\0.." else self.dir_fd(rel)
                durable_sync(fd)
            except OSError as exc:
                log.info("fsync of directory %s: %s", rel, exc)

    def remove_stale(self, temps: Iterable[str]) -> int:
        """Remove the temporary files ``temps`` (paths relative to the base) left by runs that are gone.

        Only names made by :func:`~tb5sync._os.paths.temp_name`, and only when no live run owns
        them: not claimed by a write of this process that holds no descriptor between requests
        (:func:`~tb5sync._os.paths.claim_temp`, the fs session's streamed writes), a regular file
        whose ``flock`` can be taken (its writer's lock died with it) and whose status has not
        changed for :data:`STALE_GRACE` seconds (a streamed write of another process changes
        it with every piece); a symlink (made and renamed at once) older than that. Returns
        how many were removed.
        """
        removed = 0
        now = time.time()
        for rel in temps:
            head, _, name = rel.rpartition("/")
            if not is_temp_name(name) or temp_is_claimed(name):
                continue
            try:
                dfd = self.dir_fd(head)
                try:
                    fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
                except OSError as exc:
                    if exc.errno not in (errno.ELOOP, errno.EMLINK):
                        raise
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    if stat.S_ISLNK(st.st_mode) and now - st.st_ctime >= STALE_GRACE:
                        os.unlink(name, dir_fd=dfd)
                        removed += 1
                    continue
                try:
                    st = os.fstat(fd)
                    if stat.S_ISREG(st.st_mode) and now - st.st_ctime >= STALE_GRACE and lock_file(fd):
                        os.unlink(name, dir_fd=dfd)
                        removed += 1
                finally:
                    os.close(fd)
            except (OSError, PathError) as exc:
                log.debug("stale temporary file %s left: %s", rel, exc)
        if removed:
            log.info("removed %d temporary file(s) left by interrupted runs under %s", removed, self.base)
        return removed

    # ---- progress ---------------------------------------------------------------------
    def tick(self, n: int) -> None:
        """Count ``n`` more bytes committed and tell :attr:`progress`."""
        self.done_bytes += n
        if self.progress is not None:
            self.progress(self.done_bytes, self.total_bytes)

    # ---- scan cache -------------------------------------------------------------------
    def record(self, rel: str, st: os.stat_result | Committed, refs: Sequence[tuple[bytes, int]]) -> None:
        """Keep the scan-cache row of the file ``rel`` just committed (``st`` from its fd) until :meth:`flush_records`.

        Parameters
        ----------
        rel : str
            Path relative to :attr:`base`.
        st : os.stat_result or Committed
            The committed file's size, mtime and inode (a stat result, or the tuple
            ``(st_size, st_mtime_ns, st_ino)`` :meth:`write_files` gives).
        refs : sequence of (bytes, int)
            Its chunk list ``(digest, length)``, in order.
        """
        if isinstance(st, tuple) and not isinstance(st, os.stat_result):
            size, mtime_ns, ino = st
        else:
            size, mtime_ns, ino = st.st_size, st.st_mtime_ns, st.st_ino
        self._records.append((self.spath(rel), size, mtime_ns, ino, refs))

    def flush_records(self, min_rows: int = 0) -> None:
        """Write the kept rows to the scan cache if at least ``min_rows`` are waiting (all, by default).

        Without a state the rows are dropped.
        """
        if len(self._records) < min_rows:
            return
        if self.state is not None and self._records:
            self.state.record_many(self._records)
        self._records = []


def _copy_fd(src: int, dst: int, n: int) -> None:
    """Copy the first ``n`` bytes of ``src`` to ``dst`` (both at offset 0), in 8 MiB reads.

    Raises
    ------
    OSError
        A read or write failed, or ``src`` is shorter than ``n``.
    """
    buf = bytearray(min(n, 8 * 1024 * 1024) or 1)
    mv = memoryview(buf)
    off = 0
    while off < n:
        k = read_into(src, mv[: min(len(buf), n - off)], off)
        if k <= 0:
            raise OSError(errno.EIO, f"work file shorter than {n} bytes")
        pos = 0
        while pos < k:
            pos += os.pwrite(dst, mv[pos:k], off + pos)
        off += k
