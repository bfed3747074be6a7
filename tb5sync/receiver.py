"""The receiver: owns a destination tree, runs the sync, fetches what is missing, commits atomically.

It is the same code whether the sender is in-process (local sync), behind a
client connection (pull) or behind the server's connection (push): it talks to
the sender through a *link* with one method, ``submit(method, **args) -> Future``
(:mod:`tb5sync.links`); no module of the receiving side imports the sockets.

The receiving side is split as rsync splits it:

* :mod:`tb5sync.generator` fetches the source's listing where it differs, plans, and
  shapes the destination tree (deletions, directories, symlinks, modes and mtimes);
* this module runs the whole sync (:meth:`Receiver.run`) and writes the small files
  (below :data:`SMALL_FILE`), whole and in batches;
* :mod:`tb5sync.largefile` fetches each large file, one
  :class:`~tb5sync.largefile.LargeFileJob` per file and attempt;
* :mod:`tb5sync.destination` is what they share: the destination's paths and temporary
  names, the scan cache's new rows, the counters and the progress.

Invariants kept here (see docs/ARCHITECTURE.md):

* every chunk is verified against its BLAKE3 digest before it is written
  (:func:`tb5sync.hashing.verify_chunks`): chunks that arrive (small files here, large
  files in :mod:`tb5sync.largefile`), chunks rebuilt from basis sub-chunks, and chunks
  reused from the destination's previous version or another local file (read into a
  buffer, hashed, and that same buffer written: see :mod:`tb5sync._basis`); a large file
  is renamed into place only when verified chunks cover all of its bytes
  (:meth:`tb5sync.largefile.LargeFileJob._commit`);
* a file is written to a temporary name (small files: ``.NAME.XXXX.tb5tmp`` in
  the same directory, :meth:`tb5sync.destination.Destination.write_file`; large files:
  ``ROOT/.tb5sync/partial/<key>``, the key a BLAKE3 of the file's state path, size and
  mtime at the source), then renamed into place, so no reader sees a half-written file;
* every change at the destination goes through :class:`~tb5sync.destination.Destination`,
  relative to directory descriptors of the destination root's jail: no listing (checked
  first: every entry's parent is one of its directories) and no directory swapped for a
  symlink during the run leads a write outside the root;
* partial large files survive an interruption and their verified chunks are
  reused by the next run (resume, :mod:`tb5sync.largefile`).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

from . import chunking
from ._replies import decode_part
from .destination import Destination, ProgressFn
from .entry import DIR, Entry
from .errors import DestinationError, RemoteNotFoundError, RemoteProtocolError, SourceChangedError, SourceError, Tb5syncError
from .excludes import ExcludeRules
from .generator import Generator, Planned
from .messages import FilesMeta
from .hashing import verify_chunks
from .largefile import BATCH_BYTES, MAX_INFLIGHT, LargeFileJob
from .options import SyncOptions, SyncStats
from .scan import Tree, scan_tree
from .state import TreeState

__all__ = ["Receiver", "dest_base", "scan_in_background", "SMALL_FILE", "ProgressFn"]

log = logging.getLogger(__name__)

#: Files below this size (bytes) travel whole, batched, without a chunk-list round trip.
SMALL_FILE = 4 * 1024 * 1024
#: Most files per small-file batch (one ``read_files`` request).
BATCH_FILES = 2048


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
        ``dst/name`` for a directory, and for a file onto an existing directory.
    """
    if name is None:
        return dst
    if src_kind == DIR or dst_is_dir_hint or os.path.isdir(dst):
        return os.path.join(dst, name)
    return dst


class Receiver:
    """Make ``dest`` match the sender's source.

    Parameters
    ----------
    dest : str
        Absolute destination base path (where the source's ``""`` entry lands).
    link : tb5sync.links.Link
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
        self.destination = Destination(self.dest, state, state_prefix, progress, fsync=options.fsync, sparse=options.sparse)
        self.link_dest_root = link_dest_root
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
        generator = Generator(self.link, self.destination, self.options, self.params)
        ld = None
        try:
            planned = generator.make_plan(dst_fut)
            if self.fresh_base:
                items = planned.plan.items
                planned.plan.items = [("cd+++++++++", e) if e.path == "" and e.kind == DIR else (c, e) for c, e in items]
            if self.options.link_dest:  # rsync --link-dest: opened (and checked against a server's ROOT) before any change
                from .inodes import LinkDest

                ld = LinkDest(self.destination, self.options, self.link_dest_root)
                self.warnings.extend(ld.warnings)
                if planned.plan.items:  # -i / -n show new entries against the directories' copies, as rsync
                    planned.plan.items = ld.itemize(planned.plan.items)
            if planned.plan.items and self.options.hard_links:  # rsync -H -i: "hf+++++++++ p => leader"
                from .inodes import itemize_groups

                planned.plan.items = itemize_groups(planned.plan.items, generator.src_hardlinks)
            if (self.options.itemize or self.options.dry_run) and self.options.xattrs:  # rsync -X -i: the x column, read before any change
                planned.plan.items = generator.itemize_xattrs(planned.plan.items, planned.src)
            if planned.plan.items:
                from .plan import rsync_item_order

                planned.plan.items = rsync_item_order(planned.plan.items)
            if self.options.dry_run:
                return dataclasses.replace(generator.dry_run(planned, t0), warnings=tuple(self.warnings))
            try:
                self.destination.remove_stale(planned.temps)
                if self.state is not None:
                    self.state.prune_partials()
                self._apply(generator, planned, ld)
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

        ``ld`` is the open ``--link-dest`` directories (a :class:`~tb5sync.inodes.LinkDest`), or None.
        """
        self._apply_plan(generator, planned, ld)

    def _apply_plan(self, generator: Generator, planned: Planned, ld: Any) -> None:
        """:meth:`_apply` once the ``--link-dest`` directories (``ld``, a :class:`~tb5sync.inodes.LinkDest` or None) are open."""
        plan = planned.plan
        generator.prepare(plan, planned.src)
        dest = self.destination
        files = [e for e in plan.files if not dest.skipped(e.path)] if dest.failed_dirs else plan.files
        if ld is not None:  # identical files linked from DIR, not fetched
            files = ld.take(files)
        followers: dict[str, str] = {}
        if self.options.hard_links:  # rsync -H: each group's first path is written, the others linked to it
            from .inodes import link_groups

            followers = link_groups(generator.src_hardlinks, planned.src)
            files = [e for e in files if e.path not in followers]
        small = [e for e in files if e.size < SMALL_FILE]
        large = [e for e in files if e.size >= SMALL_FILE]
        self._fetch_small(small)
        for e in large:
            self._fetch_large_retrying(e)
        if followers:
            self._link_followers(followers)
        generator.finish(plan, planned.src)

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
        batches: list[list[Entry]] = []
        cur: list[Entry] = []
        size = 0
        for e in files:
            cur.append(e)
            size += e.size
            if size >= BATCH_BYTES or len(cur) >= BATCH_FILES:
                batches.append(cur)
                cur, size = [], 0
        if cur:
            batches.append(cur)
        window = max(2, min(2 * self.link.streams, MAX_INFLIGHT))
        inflight: deque[tuple[list[Entry], Future[Any]]] = deque()
        it = iter(batches)
        for b in it:
            inflight.append((b, self.link.submit("read_files", paths=[e.path for e in b])))
            if len(inflight) >= window:
                self._commit_small_batch(*inflight.popleft())
        while inflight:
            self._commit_small_batch(*inflight.popleft())

    def _commit_small_batch(self, batch: list[Entry], fut: Future[Any]) -> None:
        """Verify and write the files of one ``read_files`` reply, one after the other.

        Writing them from several threads was measured slower: creating files in ext4
        is kernel time that contends on the same locks (rwsem spinning in the profile).
        """
        meta, parts = fut.result()
        fm = FilesMeta.from_wire(meta, [e.path for e in batch])
        files = fm.files
        pi = 0
        todo: list[tuple[Entry, Any, int, int, int, list[tuple[bytes, int]]]] = []
        for i, (e, info) in enumerate(zip(batch, files)):
            if info is None:
                if i in fm.failed:
                    self.destination.fail(e.path, "source", fm.failed[i])
                else:
                    log.warning("source file vanished or kept changing: %s", e.path)
                    self.destination.changed.append(e.path)
                continue
            if pi >= len(parts):
                raise RemoteProtocolError("read_files reply has fewer parts than files")
            size, mtime_ns, mode, refs, _wirelen, codec = info
            data = decode_part(parts[pi], size, codec)
            pi += 1
            todo.append((e, data, size, mtime_ns, mode, refs))
        for item in todo:
            e, _data, size, _mtime_ns, _mode, refs = item
            try:
                st = self.destination.writable(e.path, lambda item=item: self._write_small(item))
            except OSError as exc:
                if isinstance(exc, Tb5syncError):
                    raise
                self.destination.fail(e.path, "destination", exc)
                continue
            self.destination.record(e.path, st, refs)
            self.destination.stats["files_transferred"] += 1
            self.destination.stats["bytes_transferred"] += size
            self.destination.stats["chunks_sent"] += len(refs)
            self.destination.tick(size)
        self.link.recycle(parts)
        self.destination.flush_records(min_rows=4096)

    def _write_small(self, item: tuple[Entry, Any, int, int, int, list[tuple[bytes, int]]]) -> os.stat_result:
        """Verify one small file's chunks, write it to a temporary name, rename it into place.

        Raises
        ------
        IntegrityError
            A chunk does not match its digest (nothing is written).
        OSError
            The file cannot be written (the temporary file is removed).
        """
        e, data, _size, mtime_ns, mode, refs = item
        mv = memoryview(data)
        pieces = []
        off = 0
        for d, n in refs:
            pieces.append((mv[off : off + n], d))
            off += n
        verify_chunks(pieces, e.path, parallel=False)
        return self.destination.write_file(e.path, mv, mode, mtime_ns)

    # ---- large files ------------------------------------------------------------------
    def _fetch_large_retrying(self, e: Entry, tries: int = 3) -> None:
        """Fetch the large file ``e`` with a new :class:`~tb5sync.largefile.LargeFileJob`, up to ``tries`` times.

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


def scan_in_background(dest: str, rules: ExcludeRules, unlock: bool = True) -> Future[Tree]:
    """Start scanning the destination ``dest`` (and its listing digests) in a daemon thread.

    Returns
    -------
    Future of Tree
        Settles with the tree (empty when ``dest`` does not exist) or with the scan's
        exception (e.g. ``PermissionError``). With ``unlock`` (not for a dry run: it changes
        modes) a directory this process owns but may not list is given ``u+rx`` first
        (:func:`tb5sync.scan.scan_tree`); the receiver gives the mode back at the end.
        Pass it to :class:`Receiver` as ``dst_scan`` when the scan should start before the receiver can run (the server starts it as a
        push session opens, while the client's other streams join).
    """
    fut: Future[Tree] = Future()

    def scan_into() -> None:
        try:
            tree = scan_tree(dest, rules, missing_ok=True, unlock=unlock)
            tree.digests()
            fut.set_result(tree)
        except BaseException as exc:  # delivered to the caller through the future
            fut.set_exception(exc)

    threading.Thread(target=scan_into, name="tb5-scan", daemon=True).start()
    return fut
