"""The receiver: owns a destination tree, plans the sync, fetches what is missing, commits atomically.

It is the same code whether the sender is in-process (local sync), behind a
client connection (pull) or behind the server's connection (push): it talks to
the sender through a *link* with one method, ``submit(method, **args) -> Future``.

Invariants kept here (see DESIGN.md):

* every chunk is verified against its BLAKE3 digest before it is written: chunks that
  arrive, chunks rebuilt from basis sub-chunks, and chunks reused from the destination's
  previous version or another local file (read into a buffer, hashed, and that same buffer
  written: see :mod:`tb5sync._basis`); a large file is renamed into place only when verified
  chunks cover all of its bytes;
* a file is written to a temporary name (small files: ``.NAME.XXXX.tb5tmp`` in
  the same directory; large files: ``ROOT/.tb5sync/partial/<key>``, the key a BLAKE3 of
  the file's state path, size and mtime at the source),
  then renamed into place, so no reader sees a half-written file;
* partial large files survive an interruption and their verified chunks are
  reused by the next run (resume).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, wait
from typing import Any

from . import chunking
from ._io import unlink_quiet, write_all
from ._replies import check_refs, decode_part
from .errors import (
    DestinationError,
    RemoteNotFoundError,
    RemoteProtocolError,
    SourceChangedError,
    Tb5syncError,
    UsageError,
)
from .hashing import chunk_fd, file_digest, verify_chunks
from .destination import Destination, ProgressFn
from .entry import DIR, FILE, LINK, Entry, check_relpath
from .excludes import ExcludeRules
from .largefile import BATCH_BYTES, MAX_INFLIGHT, LargeFileJob
from .plan import dry_run_changes, plan_sync
from .scan import Tree, scan_tree
from .options import SyncOptions, SyncStats
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
    ) -> None:
        self.dest = dest.rstrip("/") or "/"
        self._dst_scan = dst_scan
        self.link = link
        self.options = options
        self.state = state
        self.state_prefix = state_prefix
        self.progress = progress
        self.params = params
        self.destination = Destination(self.dest, state, state_prefix, progress)

    # ---- entry point ------------------------------------------------------------------
    def run(self) -> SyncStats:
        """Run the whole sync and return its statistics.

        Raises
        ------
        RemoteNotFoundError
            The source does not exist.
        DestinationError
            The destination cannot be written.
        IntegrityError
            A chunk failed verification (nothing was committed for that file).
        SourceChangedError
            Some source files kept changing; everything else was synced.
        ConnectError, ProtocolError
            The link failed.
        """
        t0 = time.perf_counter()
        rules = self.options.rules
        # Scan the destination while the sender scans the source (they overlap on two cores).
        dst_fut = self._dst_scan if self._dst_scan is not None else scan_in_background(self.dest, rules)
        try:
            root, src_dirs = self._fetch_summary()
            try:
                dst_tree = dst_fut.result()
            except PermissionError as exc:
                raise DestinationError(f"cannot read destination {self.dest}: {exc.strerror}") from exc
            src, dst = self._changed_parts(root, src_dirs, dst_tree)
        finally:
            wait([dst_fut])  # the scan never outlives the run
        same = self._compare_digests(src, dst) if self.options.checksum else None
        plan = plan_sync(src, dst, delete=self.options.delete, excludes=rules, same_content=same)
        files_total = sum(d[2] for d in src_dirs) + (root.kind == FILE)
        bytes_total = sum(d[3] for d in src_dirs) + (root.size if root.kind == FILE else 0)
        self.destination.total_bytes = sum(e.size for e in plan.files)
        if self.options.dry_run:
            return SyncStats(
                files_total=files_total,
                bytes_total=bytes_total,
                files_transferred=len(plan.files),
                bytes_transferred=self.destination.total_bytes,
                wire_bytes=self.link.wire_bytes,
                files_deleted=sum(1 for d in plan.delete if d.path not in {e.path for e in src}),
                seconds=time.perf_counter() - t0,
                extra={"plan": plan, "changes": dry_run_changes(plan, src)},
            )
        try:
            self._apply(plan, src)
        except PermissionError as exc:
            raise DestinationError(f"cannot write destination {exc.filename or self.dest}: {exc.strerror}") from exc
        except OSError as exc:
            if isinstance(exc, Tb5syncError):
                raise
            if exc.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.ENOTDIR, errno.EISDIR, errno.EEXIST):
                raise DestinationError(f"cannot write destination {exc.filename or self.dest}: {exc.strerror}") from exc
            raise
        finally:
            self.destination.flush_records()
        if self.destination.changed:
            raise SourceChangedError(", ".join(self.destination.changed[:10]) + (" ..." if len(self.destination.changed) > 10 else ""))
        return SyncStats(
            files_total=files_total,
            bytes_total=bytes_total,
            wire_bytes=self.link.wire_bytes,
            seconds=time.perf_counter() - t0,
            **self.destination.stats,
        )

    def _fetch_summary(self) -> tuple[Entry, list[tuple[str, bytes, int, int]]]:
        """The source's root entry and its directory summaries ``(path, digest, files, bytes)``, all pages.

        Raises
        ------
        RemoteNotFoundError
            The source does not exist.
        RemoteProtocolError
            A malformed page.
        """
        dirs: list[tuple[str, bytes, int, int]] = []
        root: Entry | None = None
        while True:
            page = self.link.submit("tree", start=len(dirs)).result()
            rows, total = page.get("dirs"), page.get("total")
            if not isinstance(rows, list) or not isinstance(total, int) or not isinstance(page.get("root"), list):
                raise RemoteProtocolError("malformed tree page")
            if root is None:
                root = Entry.from_wire(page["root"])
                if root.path != "":
                    raise RemoteProtocolError("the tree's root entry must have the path ''")
            for row in rows:
                if not (isinstance(row, list) and len(row) == 4):
                    raise RemoteProtocolError("malformed directory summary")
                path, digest, files, nbytes = row
                if not (isinstance(digest, bytes) and isinstance(files, int) and isinstance(nbytes, int) and files >= 0 and nbytes >= 0):
                    raise RemoteProtocolError("malformed directory summary")
                try:
                    check_relpath(path)
                except (UsageError, TypeError) as exc:
                    raise RemoteProtocolError(f"bad directory path in the tree: {path!r:.200}") from exc
                dirs.append((path, digest, files, nbytes))
            if len(dirs) >= total or not rows:
                return root, dirs

    def _fetch_entries(self, dirs: list[str]) -> dict[str, list[Entry]]:
        """The source's children of each directory in ``dirs``: directory path -> entries in name order.

        Directories are asked for in batches (all batches in flight at once), each batch
        page by page.

        Raises
        ------
        RemoteProtocolError
            An entry that is not a child of the directory it was listed under.
        UsageError
            An unsafe path (see :meth:`Entry.from_wire`).
        """
        batches: list[list[str]] = []
        cur: list[str] = []
        size = 0
        for d in dirs:
            cur.append(d)
            size += len(d) + 8
            if len(cur) >= 4096 or size >= 1024 * 1024:
                batches.append(cur)
                cur, size = [], 0
        if cur:
            batches.append(cur)
        futs = [self.link.submit("entries", dirs=b, skip=0) for b in batches]
        out: dict[str, list[Entry]] = {}
        for batch, fut in zip(batches, futs):
            got: list[Entry] = []
            while True:
                page = fut.result()
                items, more = page.get("entries"), page.get("more")
                if not isinstance(items, list) or not isinstance(more, bool) or (more and not items):
                    raise RemoteProtocolError("malformed entries page")
                got += [Entry.from_wire(item) for item in items]
                if not more:
                    break
                fut = self.link.submit("entries", dirs=batch, skip=len(got))
            # split the concatenation by parent directory; the sender keeps the order asked for
            it = iter(batch)
            d = next(it)
            listing: list[Entry] = []
            out[d] = listing
            for e in got:
                parent = e.path.rpartition("/")[0]
                while parent != d:
                    d = next(it, None)  # type: ignore[arg-type]
                    if d is None:
                        raise RemoteProtocolError(f"entry {e.path!r:.200} is not in the directories asked for")
                    listing = out[d] = []
                listing.append(e)
            for d in it:
                out[d] = []
        return out

    def _changed_parts(
        self, root: Entry, src_dirs: list[tuple[str, bytes, int, int]], dst_tree: Tree
    ) -> tuple[list[Entry], list[Entry]]:
        """The parts of both manifests that can differ: what :func:`plan_sync` must look at.

        A directory whose listing digest is the same on both sides has identical children
        (names, types, modes, sizes, mtimes, link targets): nothing in it changes, so its
        children are neither fetched nor planned. Left in are the roots, every other
        directory's children, and the entries of those other directories themselves (so
        that they are created, or get their mode and mtime back after their contents
        change). With ``--checksum`` nothing is skipped (contents are compared).

        Returns
        -------
        (src, dst) : lists of Entry
            Parents before children; ``src`` the source's part (fetched where it differs),
            ``dst`` the destination's.
        """
        dst_dg = dst_tree.digests() if not self.options.checksum else {}
        same = {p for p, dg, _, _ in src_dirs if dst_dg.get(p) == dg}
        need = [p for p, _, _, _ in src_dirs if p not in same]
        fetched = self._fetch_entries(need) if need else {}
        by_parent: dict[str, dict[str, Entry]] = {}

        def own_entry(d: str) -> Entry:
            # d's entry from its parent's listing, which is the same on both sides
            parent = d.rpartition("/")[0]
            idx = by_parent.get(parent)
            if idx is None:
                idx = by_parent[parent] = {e.path: e for e in dst_tree.children[parent]}
            e = idx.get(d)
            if e is None or e.kind != DIR:
                raise RemoteProtocolError(f"directory {d!r:.200} is not in its parent's listing")
            return e

        src = [root]
        for d in need:
            if d and d.rpartition("/")[0] in same:
                src.append(own_entry(d))
            src += fetched[d]
        dst = dst_tree.entries[:1]
        for d, kids in dst_tree.children.items():
            if d in same:
                continue
            if d and d.rpartition("/")[0] in same:
                dst.append(own_entry(d))
            dst += kids
        return src, dst

    def _compare_digests(self, src: list[Entry], dst: list[Entry]) -> dict[str, bool]:
        have = {e.path: e for e in dst if e.kind == FILE}
        both = [e.path for e in src if e.kind == FILE and e.path in have and have[e.path].size == e.size]
        out: dict[str, bool] = {}
        for i in range(0, len(both), 1024):
            batch = both[i : i + 1024]
            fut = self.link.submit("file_digests", paths=batch)
            mine = [self._local_digest(p) for p in batch]
            theirs = fut.result().get("digests", [])
            if len(theirs) != len(batch):
                raise RemoteProtocolError("file_digests reply has the wrong length")
            for p, a, b in zip(batch, mine, theirs):
                out[p] = a is not None and a == b
        return out

    def _local_digest(self, rel: str) -> bytes | None:
        try:
            fd = os.open(self.destination.path(rel), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if self.state is None:
                return file_digest(d for d, _ in chunk_fd(fd, st.st_size, self.params))
            return self.state.chunks_of(fd, self.destination.spath(rel), st, fresh=True)[0]
        finally:
            os.close(fd)

    # ---- applying the plan ------------------------------------------------------------
    def _apply(self, plan: Any, src: list[Entry]) -> None:
        src_paths = {e.path for e in src}
        # Deletions first, deepest first, before anything new is created: a path never
        # passes through an entry that this run just replaced (rsync's --delete-during order).
        for d in plan.delete:
            replaced = d.path in src_paths
            if self._remove(d, replaced) and not replaced:
                self.destination.stats["files_deleted"] += 1
        parent = os.path.dirname(self.dest)
        if parent and not os.path.isdir(parent):
            os.makedirs(parent, 0o755, exist_ok=True)  # rsync creates the destination directory
        for e in plan.mkdirs:
            p = self.destination.path(e.path)
            if e.path == "":
                os.makedirs(p, 0o700, exist_ok=True)
            else:
                os.mkdir(p, 0o700)
        small = [e for e in plan.files if e.size < SMALL_FILE]
        large = [e for e in plan.files if e.size >= SMALL_FILE]
        self._fetch_small(small)
        for e in large:
            self._fetch_large_retrying(e)
        for e in plan.links:
            self._make_link(e)
        for e in plan.meta:
            p = self.destination.path(e.path)
            if e.kind == FILE:
                os.chmod(p, e.mode)
                os.utime(p, ns=(e.mtime_ns, e.mtime_ns))
            elif e.kind == LINK:
                os.utime(p, ns=(e.mtime_ns, e.mtime_ns), follow_symlinks=False)
        for e in sorted(plan.dirs, key=lambda x: x.path.count("/") if x.path else -1, reverse=True):
            p = self.destination.path(e.path)
            os.chmod(p, e.mode)
            os.utime(p, ns=(e.mtime_ns, e.mtime_ns))

    def _remove(self, d: Entry, replaced: bool) -> bool:
        """Remove one destination entry (never following symlinks); True if it was removed.

        Directories are removed with ``rmdir`` only: their deletable children come
        earlier in the plan. A directory still holding excluded (protected) entries
        is kept; one that must be replaced by another type raises instead.
        """
        p = self.destination.path(d.path)
        try:
            if d.kind == DIR and not os.path.islink(p):
                os.rmdir(p)
            else:
                os.unlink(p)
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                if not replaced:
                    return False
                raise DestinationError(
                    f"cannot replace non-empty directory {p} with a {'file' if d.kind == DIR else 'directory'}"
                    " (use --delete, and check --exclude patterns)"
                ) from exc
            raise
        if self.state is not None:
            self.state.forget([self.destination.spath(d.path)])
        return True

    def _make_link(self, e: Entry) -> None:
        p = self.destination.path(e.path)
        tmp = self.destination.temp_path(p)
        os.symlink(e.target, tmp)
        try:
            os.utime(tmp, ns=(e.mtime_ns, e.mtime_ns), follow_symlinks=False)
            os.rename(tmp, p)
        except BaseException:
            unlink_quiet(tmp)
            raise

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
        files = meta.get("files")
        if not isinstance(files, list) or len(files) != len(batch):
            raise RemoteProtocolError("read_files reply does not match the request")
        pi = 0
        todo: list[tuple[Entry, Any, int, int, int, list[tuple[bytes, int]]]] = []
        for e, info in zip(batch, files):
            if info is None:
                log.warning("source file vanished or kept changing: %s", e.path)
                self.destination.changed.append(e.path)
                continue
            if pi >= len(parts):
                raise RemoteProtocolError("read_files reply has fewer parts than files")
            size, mtime_ns, mode, refs, _wirelen, codec = info
            data = decode_part(parts[pi], size, codec)
            pi += 1
            refs = [(bytes(d), int(n)) for d, n in refs]
            check_refs(refs, size, e.path)
            todo.append((e, data, size, mtime_ns, mode, refs))
        for (e, _data, size, _mtime_ns, _mode, refs), st in zip(todo, map(self._write_small, todo)):
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
        final = self.destination.path(e.path)
        tmp = self.destination.temp_path(final)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                write_all(fd, mv)
                os.fchmod(fd, mode & 0o7777)
                os.utime(fd, ns=(mtime_ns, mtime_ns))
                st = os.fstat(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
        except BaseException:
            unlink_quiet(tmp)
            raise
        return st

    # ---- large files ------------------------------------------------------------------
    def _fetch_large_retrying(self, e: Entry, tries: int = 3) -> None:
        for attempt in range(tries):
            try:
                LargeFileJob(self.destination, self.link, e, self.params, self.options).run()
                return
            except SourceChangedError:
                log.info("source changed during transfer, retrying: %s (attempt %d)", e.path, attempt + 1)
            except RemoteNotFoundError:
                log.warning("source file vanished: %s", e.path)
                self.destination.changed.append(e.path)
                return
        log.warning("source file kept changing: %s", e.path)
        self.destination.changed.append(e.path)


def scan_in_background(dest: str, rules: ExcludeRules) -> Future[Tree]:
    """Start scanning the destination ``dest`` (and its listing digests) in a daemon thread.

    Returns
    -------
    Future of Tree
        Settles with the tree (empty when ``dest`` does not exist) or with the scan's
        exception (e.g. ``PermissionError``). Pass it to :class:`Receiver` as ``dst_scan``
        when the scan should start before the receiver can run (the server starts it as a
        push session opens, while the client's other streams join).
    """
    fut: Future[Tree] = Future()

    def scan_into() -> None:
        try:
            tree = scan_tree(dest, rules, missing_ok=True)
            tree.digests()
            fut.set_result(tree)
        except BaseException as exc:  # delivered to the caller through the future
            fut.set_exception(exc)

    threading.Thread(target=scan_into, name="tb5-scan", daemon=True).start()
    return fut
