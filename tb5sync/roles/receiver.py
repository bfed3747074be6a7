"""The receiver: owns a destination tree, runs the sync, fetches what is missing, commits atomically.

It is the same code whether the sender is in-process (local sync), behind a
client connection (pull) or behind the server's connection (push): it talks to
the sender through a *link* with one method, ``submit(method, **args) -> Future``
(:mod:`tb5sync.remote.links`); no module of the receiving side imports the sockets.

The receiving side is split as rsync splits it:

* :mod:`tb5sync.roles.generator` fetches the source's listing where it differs, plans, and
  shapes the destination tree (deletions, directories, symlinks, modes and mtimes);
* this module runs the whole sync (:meth:`Receiver.run`) and writes the small files
  (below :data:`SMALL_FILE`), whole and in batches;
* :mod:`tb5sync.roles.largefile` fetches each large file, one
  :class:`~tb5sync.roles.largefile.LargeFileJob` per file and attempt;
* :mod:`tb5sync.roles.destination` is what they share: the destination's paths and temporary
  names, the scan cache's new rows, the counters and the progress.

Invariants kept here (see docs/ARCHITECTURE.md):

* every chunk is verified against its BLAKE3 digest before it is written
  (:func:`tb5sync.engine.hashing.verify_chunks`): chunks that arrive (small files here, large
  files in :mod:`tb5sync.roles.largefile`), chunks rebuilt from basis sub-chunks, and chunks
  reused from the destination's previous version or another local file (read into a
  buffer, hashed, and that same buffer written: see :mod:`tb5sync.engine.basis`); a large file
  is renamed into place only when verified chunks cover all of its bytes
  (:meth:`tb5sync.roles.largefile.LargeFileJob._commit`);
* a file is written to a temporary name (small files: ``.NAME.XXXX.tb5tmp`` in
  the same directory, :meth:`tb5sync.roles.destination.Destination.write_file`; large files:
  ``ROOT/.tb5sync/partial/<key>``, the key a BLAKE3 of the file's state path, size and
  mtime at the source), then renamed into place, so no reader sees a half-written file;
* every change at the destination goes through :class:`~tb5sync.roles.destination.Destination`,
  relative to directory descriptors of the destination root's jail: no listing (checked
  first: every entry's parent is one of its directories) and no directory swapped for a
  symlink during the run leads a write outside the root;
* partial large files survive an interruption and their verified chunks are
  reused by the next run (resume, :mod:`tb5sync.roles.largefile`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import queue
import stat
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NamedTuple, TypeVar

import tb5sync.engine.chunking as chunking
from tb5sync.wire.replies import decode_part
from tb5sync.roles.destination import Destination, ProgressFn
from tb5sync.tree.entry import DIR, Entry
from tb5sync.errors import DestinationError, PathError, RemoteNotFoundError, RemoteProtocolError, SourceChangedError, SourceError, Tb5syncError
from tb5sync.tree.excludes import ExcludeRules
from tb5sync.roles.generator import Generator, ListingLimits, Planned
from tb5sync.wire.messages import FilesMeta
from tb5sync.engine.hashing import check_chunks, verify_chunks
from tb5sync.roles.largefile import BATCH_BYTES, MAX_INFLIGHT, LargeFileJob
from tb5sync.tree.quota import WriteQuota
from tb5sync.tree.options import SyncOptions, SyncStats
from tb5sync._os.paths import Jail
from tb5sync.tree.scan import Tree, scan_tree
from tb5sync.tree.state import TreeState

__all__ = ["Receiver", "dest_base", "prepare_dest_dir", "scan_in_background", "SMALL_FILE", "DELTA_FILE", "ProgressFn"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Files below this size (bytes) travel whole, batched, without a chunk-list round trip.
SMALL_FILE = 4 * 1024 * 1024
#: Files from this size (bytes) up that exist at the destination (a basis) travel as a delta
#: (:mod:`tb5sync.roles.largefile`: chunk list, chunks and sub-chunks of the basis reused) instead of
#: whole: a touch of a 2 MB file sends a chunk list, not 2 MB. Below it a delta's round trips
#: cost more than the bytes they save on a fast link (loopback, 100 files: a touch of 256 KiB
#: files took 2.1 ms a file as deltas and 0.8 ms whole; of 1 MiB files 3.9 and 2.0 ms).
DELTA_FILE = 1024 * 1024
#: Most files per small-file batch (one ``read_files`` request).
BATCH_FILES = 2048
#: The first small-file batch's bytes and files; each next batch may hold twice as many, up to
#: :data:`~tb5sync.roles.largefile.BATCH_BYTES` and :data:`BATCH_FILES`.
FIRST_BATCH_BYTES = 512 * 1024
FIRST_BATCH_FILES = 32


class _Written(NamedTuple):
    """A small-file batch handed to the writer thread: its files ``(entry, chunk list)`` in
    order, the reply's parts (recycled once written) and the future of
    :meth:`~tb5sync.roles.destination.Destination.write_files`'s results."""

    todo: list[tuple[Entry, list[tuple[bytes, int]]]]
    parts: list[Any]
    future: Future[list[Any]]


class _Writer:
    """One thread running submitted calls in order (the receiver's small-file writer, ``tb5-write``).

    Unlike a ``ThreadPoolExecutor``, :meth:`close` joins the thread whenever it was started, even
    when a ``KeyboardInterrupt`` cut :meth:`start` short, and finishes the join if one cuts the
    join short (then raises it): a batch the Cython writer is writing (it cannot be interrupted)
    is always finished, its temporary names renamed, before the process can exit.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tb5-write", daemon=True)
        self._closed = False

    def start(self) -> None:
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` on the thread after what was submitted before; its future."""
        fut: Future[T] = Future()
        self._queue.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # delivered through the future
                fut.set_exception(exc)

    def close(self) -> None:
        """Let the thread finish what was submitted and stop; wait for it. Safe to call twice."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
        interrupted: BaseException | None = None
        while self._thread.ident is not None and self._thread.is_alive():
            try:
                self._thread.join()
            except KeyboardInterrupt as exc:  # finish the join: no half-written batch at exit
                interrupted = exc
        if interrupted is not None:
            raise interrupted


def follow_dest_link(dst: str) -> str:
    """``dst``, or the directory it points to when it is a symlink to one (rsync changes into a
    destination given so; below it nothing is followed)."""
    return os.path.realpath(dst) if os.path.islink(dst) and os.path.isdir(dst) else dst


def dest_base(dst: str, dst_is_dir_hint: bool, name: str | None, src_kind: str) -> str:
    """Where the source base lands, with rsync's trailing-slash rules.

    Parameters
    ----------
    dst : str
        Destination path as given (absolute).
    dst_is_dir_hint : bool
        The destination was written with a trailing slash.
    name : str or None
        Source base name; None when the source had a trailing slash ("contents of").
    src_kind : str
        ``"d"``, ``"f"`` or ``"l"``.

    Returns
    -------
    str
        ``dst`` itself for "contents of" and for a file onto a non-directory;
        ``dst/name`` for a directory, and for a file onto an existing directory. A ``dst``
        that is a symlink to a directory is that directory (:func:`follow_dest_link`; a server
        resolves the result again inside its ROOT).
    """
    dst = follow_dest_link(dst)
    if name is None:
        return dst
    if src_kind == DIR or dst_is_dir_hint or os.path.isdir(dst):
        return os.path.join(dst, name)
    return dst


def prepare_dest_dir(dst: str, shown: str, dst_slash: bool, src_kind: str, *, mkpath: bool | None, dry_run: bool,
                     makedirs: Callable[[str], None] | None = None) -> tuple[str, ...]:
    """rsync 3.x's checks and messages for the directory a sync lands in, made before the receiver runs.

    The directory is ``dst`` itself when the source is a directory, when ``dst`` was written with a
    trailing slash or is a directory; otherwise (a single file onto a file path) its parent.
    Without ``mkpath`` the directory may be created, one level, only when its parent exists:
    else rsync fails (``mkdir "DST" failed``, exit 11; for a file's directory ``change_dir``,
    exit 3), and so does this, naming ``--mkpath``. A dry run creates nothing and only a file's
    missing directory fails it, as rsync's. With ``mkpath`` the missing directories are created
    here, at once (``makedirs``; a dry run only says so), as rsync ``--mkpath`` does. ``mkpath``
    None (the Python API's default) is rsync's rule where the parent exists, and creates missing
    parents (not the directory itself, made by the receiver as rsync makes it) where it does not,
    as this API always did.

    Parameters
    ----------
    dst : str
        The destination as an absolute path (on the side that writes).
    shown : str
        The destination as the user named it (a local path, or a URL's path), for messages.
    dst_slash : bool
        ``dst`` was written with a trailing slash.
    src_kind : str
        The source's kind (``"d"``, ``"f"`` or ``"l"``).
    mkpath : bool or None
        rsync's ``--mkpath`` (True), rsync's rule (False) or the API's (None, above).
    dry_run : bool
        rsync's ``-n``.
    makedirs : callable(str), optional
        Creates an absolute directory path and its missing parents (default ``os.makedirs``; a
        server passes one that stays inside its ROOT).

    Returns
    -------
    tuple of str
        The lines rsync ``-v``/``-i`` print about it, in its words: ``"created directory DST"``,
        ``"created N directories for DST"`` (``SyncStats.created``).

    Raises
    ------
    MissingParentError
        (exit 11) The directory's parent is missing, without ``mkpath``.
    MissingDirectoryError
        (exit 3) A single file's destination directory is missing, without ``mkpath``.
    DestinationError
        (exit 11) ``mkpath``'s mkdir failed (``mkdir "DST" failed: Not a directory (20)``).
    DestinationNotADirectoryError
        (exit 3) ``dst`` is not a directory and the source is one, or a file stands on
        ``dst``'s path (``afile/``, ``afile/x``; with ``mkpath`` the mkdir fails instead, exit 11).
    """
    from tb5sync.errors import DestinationNotADirectoryError, MissingDirectoryError, MissingParentError

    try:  # rsync's stat of the destination (main.c, get_local_name), symlinks followed
        st: os.stat_result | None = os.stat(dst.rstrip("/") + "/" if dst_slash else dst)
    except NotADirectoryError:
        st = None
        if not mkpath:  # with --mkpath rsync tries mkdir and fails there (exit 11)
            raise DestinationNotADirectoryError(
                f'cannot stat destination "{shown}": Not a directory (20) '
                "(a file stands where a directory is needed)", shown) from None
    except OSError:
        st = None  # missing (or unreadable: named below or by the receiver)
    if st is not None and src_kind == DIR and not stat.S_ISDIR(st.st_mode):
        raise DestinationNotADirectoryError(
            f'destination must be a directory when copying more than 1 file: "{shown}" is not a directory '
            "(a directory source is copied into a directory)", shown)
    into = src_kind == DIR or dst_slash or os.path.isdir(dst)
    target = dst if into else os.path.dirname(dst)
    name = shown.rstrip("/") or ("/" if shown.startswith("/") else ".")
    if not into:
        name = os.path.dirname(name) or "."
    missing, p = 0, target
    while not os.path.lexists(p):
        missing += 1
        up = os.path.dirname(p)
        if up == p:
            break
        p = up
    if missing == 0:
        return ()
    if mkpath:
        lines = [f"created {missing} director{'y' if missing == 1 else 'ies'} for {name}"]
        if dry_run:
            if into:
                lines.append(f"created directory {name}")
        else:
            try:
                (makedirs or os.makedirs)(target)
            except OSError as exc:  # a file on the way (ENOTDIR), no permission: rsync's words, exit 11
                if isinstance(exc, Tb5syncError):
                    raise
                raise DestinationError(f'mkdir "{name}" failed: {exc.strerror or exc} ({exc.errno})') from exc
        return tuple(lines)
    hint = ("; add --mkpath to create the missing parent directories (rsync 3's rule; "
            "tb5sync 0.1 created them without it)")
    if mkpath is None:  # the API's: missing parents made, then as rsync
        if not dry_run and (missing > 1 or not into):
            (makedirs or os.makedirs)(os.path.dirname(target) if into else target)
    elif not into:
        raise MissingDirectoryError(f'change_dir "{name}" failed: No such file or directory (2){hint}', name)
    elif missing > 1 and not dry_run:
        raise MissingParentError(f'mkdir "{name}" failed: No such file or directory (2){hint}', name)
    return (f"created directory {name}",) if into else ()


class Receiver:
    """Make ``dest`` match the sender's source.

    Parameters
    ----------
    dest : str
        Absolute destination base path (where the source's ``""`` entry lands).
    link : tb5sync.remote.links.Link
        Way to the sender.
    options : SyncOptions
    state : TreeState or None
        Destination scan cache and chunk index; ``state_prefix`` is ``dest``
        relative to the state's root.
    progress : ProgressFn, optional
    dst_scan : Future of Tree, optional
        A scan of ``dest`` already running (:func:`scan_in_background` with the same
        exclude rules); by default :meth:`run` starts one.
    link_dest_root : str, optional
        On a server, its ROOT: every ``--link-dest`` directory must lie inside it.
    fresh_base : bool
        ``dest`` did not exist before the caller made it (a local destination's state root):
        it is itemized as created (``cd+++++++++``), as rsync shows a directory it made.
    listing_limits : ListingLimits, optional
        On a server: caps on the source listing held for this session (its peer's); None: none.
    quota : WriteQuota, optional
        On a server: the session's write limits, charged with each file's size before it is
        written; past them the run stops with :class:`~tb5sync.errors.QuotaError`. None: none.
    """

    def __init__(
        self,
        dest: str,
        link: Any,
        options: SyncOptions = SyncOptions(),
        state: TreeState | None = None,
        state_prefix: str = "",
        progress: ProgressFn | None = None,
        params: chunking.ChunkParams = chunking.DEFAULT_PARAMS,
        dst_scan: Future[Tree] | None = None,
        link_dest_root: str | None = None,
        fresh_base: bool = False,
        listing_limits: ListingLimits | None = None,
        quota: WriteQuota | None = None,
    ) -> None:
        self.dest = dest.rstrip("/") or "/"
        self.fresh_base = fresh_base
        self._dst_scan = dst_scan
        self.link = link
        self.options = options
        self.state = state
        self.state_prefix = state_prefix
        self.progress = progress
        self.params = params
        self.destination = Destination(self.dest, state, state_prefix, progress, fsync=options.fsync, sparse=options.sparse, quota=quota)
        self.link_dest_root = link_dest_root
        #: the small-file batches handed to the writer thread and not settled yet, oldest first
        #: (:meth:`_settle_small`): at most two, the one being written and the next, queued
        self._unsettled: deque[_Written] = deque()
        self.listing_limits = listing_limits
        #: what the run warns of besides failures (rsync's "--link-dest arg does not exist: DIR"):
        #: in ``SyncStats.warnings``, so a server's reach its client
        self.warnings: list[str] = []

    # ---- entry point ------------------------------------------------------------------
    def run(self) -> SyncStats:
        """Run the whole sync and return its statistics.

        Entries that cannot be synced (a source file that cannot be read or vanished, a
        destination entry that cannot be written, replaced or deleted) are left out, each
        named in the result's ``failures``, and everything else is synced (rsync's model:
        the caller exits 23, or 24 when source files only vanished).

        Raises
        ------
        RemoteNotFoundError
            The source does not exist.
        DestinationError
            The destination's base cannot be made, or nothing more can be written (disk full,
            read-only file system).
        IntegrityError
            A chunk failed verification (nothing was committed for that file).
        ConnectError, ProtocolError
            The link failed.
        """
        t0 = time.perf_counter()
        # Scan the destination while the sender scans the source (they overlap on two cores).
        dst_fut = (
            self._dst_scan if self._dst_scan is not None
            else scan_in_background(self.dest, self.options.dest_rules, unlock=not self.options.dry_run)
        )
        generator = Generator(self.link, self.destination, self.options, self.params, self.listing_limits)
        ld = None
        try:
            planned = generator.make_plan(dst_fut)
            self.warnings.extend(generator.warnings)
            if self.fresh_base:
                items = planned.plan.items
                planned.plan.items = [("cd+++++++++", e) if e.path == "" and e.kind == DIR else (c, e) for c, e in items]
            if self.options.link_dest:  # rsync --link-dest: opened (and checked against a server's ROOT) before any change
                from tb5sync.roles.inodes import LinkDest

                ld = LinkDest(self.destination, self.options, self.link_dest_root)
                self.warnings.extend(ld.warnings)
                if planned.plan.items:  # -i / -n show new entries against the directories' copies, as rsync
                    planned.plan.items = ld.itemize(planned.plan.items)
            if planned.plan.items and self.options.hard_links:  # rsync -H -i: "hf+++++++++ p => leader"
                from tb5sync.roles.inodes import itemize_groups

                planned.plan.items = itemize_groups(planned.plan.items, generator.src_hardlinks)
            if (self.options.itemize or self.options.dry_run) and self.options.xattrs:  # rsync -X -i: the x column, read before any change
                planned.plan.items = generator.itemize_xattrs(planned.plan.items, planned.src)
            if planned.plan.items:
                from tb5sync.tree.plan import rsync_item_order

                planned.plan.items = rsync_item_order(planned.plan.items)
            if self.options.dry_run:
                return dataclasses.replace(generator.dry_run(planned, t0), warnings=tuple(self.warnings))
            try:
                self.destination.remove_stale(planned.temps)
                if self.state is not None:
                    self.state.prune_partials()
                try:
                    self._apply(generator, planned, ld)
                except BaseException:  # interrupted or failed: the directories made so far get their modes
                    generator.settle_dirs(planned.plan)
                    raise
                self.destination.sync_dirs()
            except PermissionError as exc:
                if isinstance(exc, Tb5syncError):
                    raise
                raise DestinationError(f"cannot write destination {exc.filename or self.dest}: {exc.strerror}") from exc
            except OSError as exc:
                if isinstance(exc, Tb5syncError):
                    raise
                if exc.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.ENOTDIR, errno.EISDIR, errno.EEXIST):
                    raise DestinationError(f"cannot write destination {exc.filename or self.dest}: {exc.strerror}") from exc
                raise
            finally:
                self.destination.flush_records()
        finally:
            if ld is not None:
                ld.close()
            self.destination.relock()
            self.destination.close()
        return SyncStats(
            files_total=planned.files_total,
            bytes_total=planned.bytes_total,
            wire_bytes=self.link.wire_bytes,
            seconds=time.perf_counter() - t0,
            failures=(*self.destination.failures, *self.destination.vanished()),
            skipped=tuple(self.destination.specials),
            deletes_skipped=planned.plan.deletes_skipped,
            itemized=generator.itemized(planned),
            warnings=tuple(self.warnings),
            **self.destination.stats,
        )

    def _apply(self, generator: Generator, planned: Planned, ld: Any = None) -> None:
        """Apply ``planned``: the generator's deletions and directories, the files' data, then symlinks, modes and mtimes.

        Small files (below :data:`SMALL_FILE`) are fetched first, in batches; then each large
        file, one after another. With ``--link-dest`` files identical in a DIR are linked first,
        with ``-H`` each hard-link group's other paths are linked to its first once that is written.

        ``ld`` is the open ``--link-dest`` directories (a :class:`~tb5sync.roles.inodes.LinkDest`), or None.
        """
        self._apply_plan(generator, planned, ld)

    def _apply_plan(self, generator: Generator, planned: Planned, ld: Any) -> None:
        """:meth:`_apply` once the ``--link-dest`` directories (``ld``, a :class:`~tb5sync.roles.inodes.LinkDest` or None) are open."""
        plan = planned.plan
        generator.prepare(plan, planned.src)
        dest = self.destination
        files = [e for e in plan.files if not dest.skipped(e.path)] if dest.failed_dirs else plan.files
        if ld is not None:  # identical files linked from DIR, not fetched
            files = ld.take(files)
        followers: dict[str, str] = {}
        if self.options.hard_links:  # rsync -H: each group's first path is written, the others linked to it
            from tb5sync.roles.inodes import link_groups

            followers = link_groups(generator.src_hardlinks, planned.src)
            files = [e for e in files if e.path not in followers]
        small: list[Entry] = []
        large: list[Entry] = []
        for e in files:  # a changed file with a basis here travels as a delta from DELTA_FILE up
            (large if e.size >= SMALL_FILE or (e.size >= DELTA_FILE and self._has_basis(e.path)) else small).append(e)
        self._fetch_small(small)
        for e in large:
            self._fetch_large_retrying(e)
        if followers:
            self._link_followers(followers)
        generator.finish(plan, planned.src)

    def _has_basis(self, rel: str) -> bool:
        """Whether the destination holds a regular, non-empty file at ``rel`` (a basis for a delta).

        Looked up through the jail (no symlink followed); any error is a no: the whole file is
        sent, and the write meets (and names) the error."""
        dest = self.destination
        try:
            dfd, name = dest.parent(rel)
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except (OSError, PathError):
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size > 0

    def _link_followers(self, followers: dict[str, str]) -> None:
        """``-H``: make each path of ``followers`` a hard link to its group's first path (already
        written, or unchanged). One that cannot be linked is the path's destination failure."""
        dest = self.destination
        failed = {f.path for f in dest.failures} | set(dest.changed)
        for path, leader in followers.items():
            if dest.skipped(path) or leader in failed:
                continue
            try:
                ldfd, lname = dest.parent(leader)
                if not dest.link_from(path, ldfd, lname):
                    dest.fail(path, "destination", "cannot hard-link to " + leader)
            except OSError as exc:
                if isinstance(exc, Tb5syncError) and not isinstance(exc, PathError):
                    raise
                dest.fail(path, "destination", exc)

    # ---- small files ------------------------------------------------------------------
    def _fetch_small(self, files: list[Entry]) -> None:
        """Fetch and write the small files ``files``: ``read_files`` batches, a window of them in flight.

        The first batches are small (:data:`FIRST_BATCH_BYTES`, doubling up to
        :data:`~tb5sync.roles.largefile.BATCH_BYTES`) so that writing starts while the sender still
        reads: a cold push of 2,000 files waited ~140 ms for a first 8 MiB batch.
        """
        batches: list[list[Entry]] = []
        cur: list[Entry] = []
        size = 0
        limit, nlimit = FIRST_BATCH_BYTES, FIRST_BATCH_FILES
        for e in files:
            cur.append(e)
            size += e.size
            if size >= limit or len(cur) >= nlimit:
                batches.append(cur)
                cur, size = [], 0
                limit, nlimit = min(2 * limit, BATCH_BYTES), min(2 * nlimit, BATCH_FILES)
        if cur:
            batches.append(cur)
        window = max(2, min(2 * self.link.streams, MAX_INFLIGHT))
        inflight: deque[tuple[list[Entry], Future[Any]]] = deque()
        self._unsettled = deque()
        # One writer thread: batch k is written (GIL released) while this thread waits for,
        # checks and verifies batch k + 1, queues it behind k (the writer goes on to it without
        # waiting for this thread), then settles k. Only the writer touches the destination's
        # files and directories meanwhile; this thread touches only the counts, failures and
        # rows kept for the state (Destination.record, fail, flush_records), which the writer
        # does not.
        writer = _Writer()
        try:
            writer.start()
            for b in batches:
                inflight.append((b, self.link.submit("read_files", paths=[e.path for e in b])))
                if len(inflight) >= window:
                    self._commit_small_batch(*inflight.popleft(), writer)
            while inflight:
                self._commit_small_batch(*inflight.popleft(), writer)
            self._settle_small()
        except BaseException:
            self._unsettled = deque(w for w in self._unsettled if not w.future.cancel())
            if self._unsettled:
                writer.close()  # the batches being written are finished, then counted and kept in the state
                while self._unsettled:
                    with contextlib.suppress(BaseException):
                        self._settle_small(keep=len(self._unsettled) - 1)
            raise
        finally:
            writer.close()

    def _commit_small_batch(self, batch: list[Entry], fut: Future[Any], writer: _Writer) -> None:
        """Verify the files of one ``read_files`` reply, hand them to ``writer`` (queued behind the
        batch before, so the writer never waits for this thread between batches), then settle the
        batch before (this one is settled by the next call or the last :meth:`_settle_small`).

        Every file's chunks are verified first (BLAKE3; a mismatch stops the run before any file
        of the batch is written), then the batch is written by
        :meth:`~tb5sync.roles.destination.Destination.write_files`: one call of the Cython writer with
        the GIL released, so the link's threads receive, and this thread verifies, the next
        batches meanwhile. One batch is written at a time: creating files from several threads
        was measured slower (ext4 contends on the same locks: rwsem spinning in the profile);
        ``$TB5SYNC_WRITE_THREADS`` shares one batch's directories out among threads
        (:func:`~tb5sync.roles.destination.write_threads`, default two, one directory per thread).
        """
        meta, parts = fut.result()
        fm = FilesMeta.from_wire(meta, [e.path for e in batch])
        pi = 0
        todo: list[tuple[Entry, list[tuple[bytes, int]]]] = []
        writes: list[tuple[str, Any, int, int]] = []
        missing: list[tuple[Entry, str | None]] = []
        pieces: list[tuple[memoryview, bytes]] = []
        owners: list[str] = []  # the path of each piece
        for i, (e, info) in enumerate(zip(batch, fm.files)):
            if info is None:
                missing.append((e, fm.failed.get(i)))
                continue
            if pi >= len(parts):
                raise RemoteProtocolError("read_files reply has fewer parts than files")
            size, mtime_ns, mode, refs, _wirelen, codec = info
            mv = memoryview(decode_part(parts[pi], size, codec))
            pi += 1
            off = 0
            for d, n in refs:
                pieces.append((mv[off : off + n], d))
                owners.append(e.path)
                off += n
            todo.append((e, refs))
            writes.append((e.path, mv, mode, mtime_ns))
        # the batch's chunks in one call; a mismatch names the first file it is in
        ok = check_chunks(pieces, parallel=False)
        if not all(ok):
            bad = ok.index(False)
            verify_chunks([pieces[bad]], owners[bad], parallel=False)  # raises IntegrityError naming it
        del pieces
        dest = self.destination
        self._unsettled.append(_Written(todo, parts, writer.submit(dest.write_files, writes)))
        self._settle_small(keep=1)  # the batch before: its failures and rows first, in order
        for e, reason in missing:
            if reason is not None:
                dest.fail(e.path, "source", reason)
            else:
                log.warning("source file vanished or kept changing: %s", e.path)
                dest.changed.append(e.path)
        dest.flush_records(min_rows=1024)  # the rows settled so far, while the writer writes (the state locks on its own)

    def _settle_small(self, keep: int = 0) -> None:
        """Settle the batches handed to the writer, oldest first, until ``keep`` are left: wait
        for each, name its failures, keep its scan-cache rows, count it. Each batch is settled
        once (taken off :attr:`_unsettled` before it is waited for)."""
        dest = self.destination
        while len(self._unsettled) > keep:
            written = self._unsettled.popleft()
            results = written.future.result()
            for (e, refs), res in zip(written.todo, results):
                if isinstance(res, OSError):
                    dest.fail(e.path, "destination", res)
                    continue
                dest.record(e.path, res, refs)
                dest.stats["files_transferred"] += 1
                dest.stats["bytes_transferred"] += res[0]
                dest.stats["chunks_sent"] += len(refs)
                dest.tick(res[0])
            self.link.recycle(written.parts)

    # ---- large files ------------------------------------------------------------------
    def _fetch_large_retrying(self, e: Entry, tries: int = 3) -> None:
        """Fetch the large file ``e`` with a new :class:`~tb5sync.roles.largefile.LargeFileJob`, up to ``tries`` times.

        A source that changes during a fetch is fetched again; one that vanished, or kept
        changing, is added to the destination's ``changed``; one that cannot be read, or
        written here, is named in the destination's failures (everything else is synced).
        """
        for attempt in range(tries):
            try:
                # a new job for the retry after making the directory writable: one job, one attempt
                self.destination.writable(
                    e.path, lambda: LargeFileJob(self.destination, self.link, e, self.params, self.options).run()
                )
                return
            except SourceChangedError:
                log.info("source changed during transfer, retrying: %s (attempt %d)", e.path, attempt + 1)
            except RemoteNotFoundError:
                log.warning("source file vanished: %s", e.path)
                self.destination.changed.append(e.path)
                return
            except SourceError as exc:
                self.destination.fail(e.path, "source", exc)
                return
            except OSError as exc:
                if isinstance(exc, Tb5syncError):
                    raise
                self.destination.fail(e.path, "destination", exc)
                return
        log.warning("source file kept changing: %s", e.path)
        self.destination.changed.append(e.path)


def scan_in_background(dest: str, rules: ExcludeRules, unlock: bool = True, root: str | None = None) -> Future[Tree]:
    """Start scanning the destination ``dest`` (and its listing digests) in a daemon thread.

    Returns
    -------
    Future of Tree
        Settles with the tree (empty when ``dest`` does not exist) or with the scan's
        exception (e.g. ``PermissionError``). With ``unlock`` (not for a dry run: it changes
        modes) a directory this process owns but may not list is given ``u+rx`` first
        (:func:`tb5sync.tree.scan.scan_tree`); the receiver gives the mode back at the end.
        Pass it to :class:`Receiver` as ``dst_scan`` when the scan should start before the receiver can run (the server starts it as a
        push session opens, while the client's other streams join).

    ``root`` (a server's ROOT, ``dest`` inside it): ``dest`` is looked up from a jail of ROOT
    (:meth:`tb5sync._os.paths.Jail.locate`, no symlink on the way), never by its path, so a parent
    swapped for a symlink after the server checked ``dest`` is a ``PathError``, not a listing of
    what lies outside ROOT.
    """
    fut: Future[Tree] = Future()

    def scan_into() -> None:
        try:
            if root is None:
                tree = scan_tree(dest, rules, missing_ok=True, unlock=unlock)
            else:
                with Jail(root) as jail:
                    rel = os.path.relpath(dest, root)
                    try:
                        dfd, name = jail.locate("" if rel == "." else rel)
                    except (FileNotFoundError, NotADirectoryError):  # its directory is not there (yet)
                        dfd = -1
                if dfd < 0:
                    tree = Tree([], {})
                else:
                    try:
                        tree = scan_tree(dest, rules, missing_ok=True, unlock=unlock, at=(dfd, name))
                    finally:
                        os.close(dfd)
            tree.digests()
            fut.set_result(tree)
        except BaseException as exc:  # delivered to the caller through the future
            fut.set_exception(exc)

    threading.Thread(target=scan_into, name="tb5-scan", daemon=True).start()
    return fut
