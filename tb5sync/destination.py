"""The destination of one sync: where entries land, the scan cache's new rows, the counters.

One :class:`Destination` per :class:`~tb5sync.receiver.Receiver`. The generator
(:mod:`tb5sync.generator`), the small-file path (:mod:`tb5sync.receiver`) and each large-file
job (:mod:`tb5sync.largefile`) share it instead of each keeping its own copy of the
destination's paths, state and statistics.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable, Sequence
from typing import TypeVar

from ._paths import temp_name
from .entry import show_path
from .errors import DestinationError
from .options import Failure
from .state import TreeState

log = logging.getLogger(__name__)

T = TypeVar("T")

#: errno values after which no other entry can be written either: the run stops (rsync's exit 11).
FATAL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO})

__all__ = ["Destination", "ProgressFn", "STAT_COUNTERS"]

#: ProgressFn(bytes_done, bytes_total) is called as files and chunks are committed.
ProgressFn = Callable[[int, int], None]

#: The :class:`~tb5sync.options.SyncStats` fields a :class:`Destination` counts.
STAT_COUNTERS = ("files_transferred", "bytes_transferred", "chunks_sent", "chunks_reused", "bytes_matched", "files_deleted")


class Destination:
    """Where a sync writes, and what it has written so far.

    Parameters
    ----------
    base : str
        Absolute destination base path (where the source's ``""`` entry lands), without a
        trailing slash (``"/"`` for the root).
    state : TreeState or None
        Destination scan cache and chunk index.
    state_prefix : str
        ``base`` relative to the state's root (``""`` when they are the same).
    progress : ProgressFn, optional
        Told ``(bytes_done, bytes_total)`` after each :meth:`tick`.

    Attributes
    ----------
    stats : dict of str to int
        The counters of :data:`STAT_COUNTERS`, all starting at 0, for the run's
        :class:`~tb5sync.options.SyncStats`.
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
    :meth:`tb5sync.receiver.Receiver.run` updates it (commits small files, settles reused
    chunks, writes fetched and rebuilt chunks). The other threads of a large-file job do
    not touch it: the planner thread only builds chunks from basis sub-chunks (the run
    thread verifies, writes and counts them), the chunk-list helper only asks for pieces,
    the hash pool only runs checked copies. :attr:`state` (a
    :class:`~tb5sync.state.TreeState`) locks on its own.
    """

    def __init__(self, base: str, state: TreeState | None = None, state_prefix: str = "", progress: ProgressFn | None = None) -> None:
        self.base = base
        self.state = state
        self.state_prefix = state_prefix
        self.progress = progress
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

    # ---- paths ------------------------------------------------------------------------
    def path(self, rel: str) -> str:
        """The absolute path of the entry ``rel`` (relative to :attr:`base`; ``""`` is the base)."""
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
        """
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

    def writable(self, path: str, op: Callable[[], T]) -> T:
        """Run ``op`` (which creates, renames or removes ``path``); if it is refused because
        ``path``'s directory lacks ``u+w``, give the directory ``u+w`` and run ``op`` again.

        rsync does the same for a non-root user: a directory of mode 0555 is made writable
        while entries in it are written, and gets its mode back at the end (:meth:`relock`;
        the generator's last pass sets the source's modes anyway). Only a directory this
        process owns is changed; root needs none of it.

        Raises
        ------
        OSError
            What ``op`` raises otherwise (or again).
        """
        try:
            return op()
        except PermissionError:
            d = os.path.dirname(path)
            st = os.stat(d)
            if st.st_mode & stat.S_IWUSR or st.st_uid != os.geteuid():
                raise
            mode = stat.S_IMODE(st.st_mode)
            os.chmod(d, mode | stat.S_IWUSR | stat.S_IXUSR)
            self.unlocked.setdefault(d, (mode, mode | stat.S_IWUSR | stat.S_IXUSR))
            return op()

    def relock(self) -> None:
        """Give each directory :meth:`writable` (or the destination's scan) unlocked its mode
        back, unless its mode was set since (by the generator's metadata pass, to the source's)."""
        for d, (mode, given) in self.unlocked.items():
            try:
                if stat.S_IMODE(os.stat(d).st_mode) == given:
                    os.chmod(d, mode)
            except OSError as exc:
                log.info("cannot restore the mode of %s: %s", d, exc)
        self.unlocked.clear()

    @staticmethod
    def rename_into_place(tmp: str, final: str) -> None:
        """Rename ``tmp`` to ``final``; an empty directory at ``final`` (an entry of another type
        being replaced) is removed first, only now that its replacement exists.

        Raises
        ------
        OSError
            The rename failed (``ENOTEMPTY``/``EISDIR`` for a directory that is not empty).
        """
        try:
            os.rename(tmp, final)
        except OSError as exc:
            if exc.errno not in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise
            try:
                st = os.lstat(final)
            except OSError:
                raise exc from None
            if not stat.S_ISDIR(st.st_mode):
                raise
            os.rmdir(final)
            os.rename(tmp, final)

    # ---- progress ---------------------------------------------------------------------
    def tick(self, n: int) -> None:
        """Count ``n`` more bytes committed and tell :attr:`progress`."""
        self.done_bytes += n
        if self.progress is not None:
            self.progress(self.done_bytes, self.total_bytes)

    # ---- scan cache -------------------------------------------------------------------
    def record(self, rel: str, st: os.stat_result, refs: Sequence[tuple[bytes, int]]) -> None:
        """Keep the scan-cache row of the file ``rel`` just committed (``st`` from its fd) until :meth:`flush_records`.

        Parameters
        ----------
        rel : str
            Path relative to :attr:`base`.
        st : os.stat_result
            The committed file's size, mtime and inode.
        refs : sequence of (bytes, int)
            Its chunk list ``(digest, length)``, in order.
        """
        self._records.append((self.spath(rel), st.st_size, st.st_mtime_ns, st.st_ino, refs))

    def flush_records(self, min_rows: int = 0) -> None:
        """Write the kept rows to the scan cache if at least ``min_rows`` are waiting (all, by default).

        Without a state the rows are dropped.
        """
        if len(self._records) < min_rows:
            return
        if self.state is not None and self._records:
            self.state.record_many(self._records)
        self._records = []
