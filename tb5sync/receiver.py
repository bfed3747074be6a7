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
import queue
import shutil
import stat
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from . import chunking, refine
from ._basis import BasisFinder, check_copy, start_writeback
from ._io import pwrite_all, unlink_quiet, write_all
from ._replies import check_refs, decode_part, decode_ranges
from .errors import (
    DestinationError,
    IntegrityError,
    RemoteNotFoundError,
    RemoteProtocolError,
    SourceChangedError,
    Tb5syncError,
    UsageError,
)
from .hashing import check_chunks, chunk_digest, chunk_fd, file_digest, hash_pool, verify_chunks
from .destination import Destination, ProgressFn
from .entry import DIR, FILE, LINK, Entry, check_relpath
from .excludes import ExcludeRules
from .plan import dry_run_changes, plan_sync
from .scan import Tree, scan_tree
from .options import SyncOptions, SyncStats
from .state import TreeState

__all__ = ["Receiver", "dest_base", "scan_in_background", "SMALL_FILE", "ProgressFn"]

log = logging.getLogger(__name__)

#: Files below this size (bytes) travel whole, batched, without a chunk-list round trip.
SMALL_FILE = 4 * 1024 * 1024
#: Target bytes per small-file batch and per chunk-range request.
BATCH_BYTES = 8 * 1024 * 1024
#: Most requests in flight (each up to BATCH_BYTES): bounds memory whatever the stream count.
MAX_INFLIGHT = 12
#: Bytes of a large file's chunk list asked for per ``chunk_list`` piece.
PIECE_BYTES = 64 * 1024 * 1024
#: Checked chunk-list pieces kept ready ahead of the one being copied and fetched.
PIECES_AHEAD = 3
BATCH_FILES = 2048
#: Reused chunks being read, checked and copied at once per large file (one max-size buffer each).
COPY_INFLIGHT = 6
#: Bytes of a large file's work file after which the writeback of the part settled so far is started.
WRITEBACK_BYTES = 32 * 1024 * 1024
#: Requests answered with a plain response that read file data: sent on the data streams too.
#: Groups in a row without one sub-chunk found in the basis after which a file's remaining
#: missing chunks are fetched whole (the basis shares nothing with the new version).
REFINE_GIVE_UP = 3
#: Rounds of places asked of the chunk index for one chunk (4 places each) before giving up.
_INDEX_ROUNDS = 8
#: Basis bytes indexed for a missing chunk beyond its own length (room for bytes deleted from it).
REFINE_SLACK = 64 * 1024


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
        #: Sub-chunk index and placements of the basis of the large file being fetched (None: no basis).
        self._refiner: tuple[refine.BasisIndex, refine.Placements] | None = None
        self._verified = 0  # bytes of the large file being fetched that are verified in its work file

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
                self._fetch_large(e)
                return
            except SourceChangedError:
                log.info("source changed during transfer, retrying: %s (attempt %d)", e.path, attempt + 1)
            except RemoteNotFoundError:
                log.warning("source file vanished: %s", e.path)
                self.destination.changed.append(e.path)
                return
        log.warning("source file kept changing: %s", e.path)
        self.destination.changed.append(e.path)

    def _fetch_large(self, e: Entry) -> None:
        """Fetch one large file into a work file, piece by piece of its chunk list, then commit.

        The chunk list comes in pieces of about :data:`PIECE_BYTES` (``chunk_list`` with
        ``start``/``limit``); the next piece is asked for as soon as one arrives, so the
        sender cuts and hashes it while the ranges of this one are on the wire.
        """
        first_fut = self.link.submit("chunk_list", path=e.path, start=0, limit=BATCH_BYTES)
        basis = self._open_basis(e.path)
        committed = False
        try:
            first = first_fut.result()
            if basis is not None:  # sub-chunks of the same open basis (see refine)
                self._refiner = refine.BasisIndex(basis.fd, basis.size), refine.Placements()
            self._fetch_large_with(e, first, basis)
            committed = True
        finally:
            self._refiner = None
            if basis is not None:
                log.debug("basis of %s: %d bytes cut to re-align", e.path, basis.cut_bytes)
                if committed:
                    _release_later(basis.fd)
                else:
                    os.close(basis.fd)

    def _fetch_large_with(self, e: Entry, first: dict[str, Any], basis: BasisFinder | None) -> None:
        """:meth:`_fetch_large` once the first chunk-list piece is here."""
        size, mtime_ns = first.get("size"), first.get("mtime_ns")
        if not isinstance(size, int) or not isinstance(mtime_ns, int) or size < 0:
            raise RemoteProtocolError("malformed chunk_list reply")
        final = self.destination.path(e.path)
        if self.state is not None and self.state.persistent:
            key = chunk_digest(f"{self.destination.spath(e.path)}\0{size}\0{mtime_ns}".encode("utf-8", "surrogateescape"))
            work = self.state.partial_path(key)
            keep_partial = True
        else:
            work = self.destination.temp_path(final)
            keep_partial = False
        fd = os.open(work, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        committed = False
        all_refs: list[tuple[bytes, int]] = []
        try:
            partial_size = os.fstat(fd).st_size
            self._verified = 0
            groups = self._missing_groups(fd, e.path, first, size, mtime_ns, all_refs, partial_size, basis)
            try:
                self._fetch_ranges(fd, e.path, groups, size, mtime_ns)
            finally:
                groups.close()  # no copy task may still write into fd once it is closed
            if self._verified != size:
                raise IntegrityError(f"{e.path}: {self._verified} of {size} bytes verified before commit")
            os.ftruncate(fd, size)
            os.fchmod(fd, e.mode)
            os.utime(fd, ns=(mtime_ns, mtime_ns))
            st = os.fstat(fd)
            os.close(fd)
            fd = -1
            try:
                os.rename(work, final)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                tmp = self.destination.temp_path(final)
                shutil.copy2(work, tmp)
                os.rename(tmp, final)
                os.unlink(work)
                st = os.stat(final)
            committed = True
            self.destination.record(e.path, st, all_refs)
            self.destination.flush_records()
            self.destination.stats["files_transferred"] += 1
            self.destination.stats["bytes_transferred"] += size
        finally:
            if fd >= 0:
                os.close(fd)
            if not committed and not keep_partial:
                unlink_quiet(work)

    def _pieces(self, rel: str, first: dict[str, Any], size: int, mtime_ns: int) -> Iterator[tuple[int, list[tuple[bytes, int]]]]:
        """Yield ``(start offset, refs)`` per chunk-list piece, in order.

        A helper thread asks for each next piece as soon as the previous one arrives, and keeps
        up to :data:`PIECES_AHEAD` checked pieces ready, so that the sender goes on cutting
        and hashing while the receiver copies and fetches (it used to wait for the receiver
        to finish each piece first: half of the sender's time was idle in a delta).

        Raises
        ------
        RemoteProtocolError
            A piece does not continue the previous one, or the chunks do not add up to ``size``.
        SourceChangedError
            The file's size or mtime changed between pieces.
        """
        ready: queue.Queue[tuple[int, list[tuple[bytes, int]]] | BaseException | None] = queue.Queue(PIECES_AHEAD)
        stop = threading.Event()

        def put(item: tuple[int, list[tuple[bytes, int]]] | BaseException | None) -> bool:
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    pass
            return False

        def fetch() -> None:
            info, pos = first, 0
            try:
                while True:
                    if (info.get("size"), info.get("mtime_ns")) != (size, mtime_ns):
                        raise SourceChangedError(rel)
                    chunks, start, end = info.get("chunks"), info.get("start"), info.get("end")
                    if not isinstance(chunks, list) or start != pos or not isinstance(end, int) or not pos <= end <= size:
                        raise RemoteProtocolError(f"chunk_list piece of {rel} does not continue at {pos}")
                    refs = [(bytes(d), int(n)) for d, n in chunks]
                    check_refs(refs, end - start, rel)
                    if end == pos and end < size:
                        raise RemoteProtocolError(f"empty chunk_list piece for {rel} before its end")
                    nxt = self.link.submit("chunk_list", path=rel, start=end, limit=PIECE_BYTES) if end < size else None
                    if not put((start, refs)) or nxt is None:
                        put(None)
                        return
                    pos = end
                    info = nxt.result()
            except BaseException as exc:  # delivered to the consumer, in order
                put(exc)

        helper = threading.Thread(target=fetch, name="tb5-pieces", daemon=True)
        helper.start()
        try:
            while True:
                item = ready.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()  # the helper gives up at its next put; it asks for nothing more after that

    def _open_basis(self, rel: str) -> BasisFinder | None:
        """Open the destination's current version of ``rel`` as a basis, or None when there is none.

        The scan cache's chunk list of the basis is used as a hint when its row matches the
        basis's size, mtime and inode; nothing is cut or hashed here.
        """
        try:
            bfd = os.open(self.destination.path(rel), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            st = os.fstat(bfd)
            if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
                os.close(bfd)
                return None
            hit = None
            if self.state is not None:
                hit = self.state.lookup(self.destination.spath(rel), st.st_size, st.st_mtime_ns, st.st_ino)
            return BasisFinder(bfd, st.st_size, self.params, hit[1] if hit is not None else None)
        except BaseException:
            os.close(bfd)
            raise

    def _missing_groups(
        self,
        fd: int,
        rel: str,
        first: dict[str, Any],
        size: int,
        mtime_ns: int,
        all_refs: list[tuple[bytes, int]],
        partial_size: int,
        basis: BasisFinder | None,
    ) -> Iterator[list[tuple[int, int, bytes]]]:
        """Fill what is present locally, piece by piece; yield groups of missing ``(offset, length, digest)``.

        A chunk is present when the work file already holds it (an interrupted earlier run), or
        when the basis or another file of the tree has bytes with its digest. Each place is
        checked with :func:`check_copy` (one read, one hash, one write of the same buffer) in the
        hash pool, :data:`COPY_INFLIGHT` chunks at a time, in order of the chunk list; a chunk
        whose first place misses gets its other places tried here before it is counted missing.
        Each group is at most :data:`BATCH_BYTES` (or one chunk) of chunks to ask for in one
        request. ``all_refs`` receives every chunk of the file, in order.
        """
        pool = hash_pool()
        bufs = [bytearray(self.params.max_size) for _ in range(COPY_INFLIGHT)]
        opened: dict[str, int] = {}
        pending: deque[tuple[int, int, bytes, int, Future[bool] | None, bytearray | None]] = deque()
        cur: list[tuple[int, int, bytes]] = []
        nbytes = 0
        flushes: list[Future[None]] = []
        settled = flushed = 0  # chunks before ``settled`` are copied or counted missing

        def submit(off: int, n: int, d: bytes) -> None:
            if off + n <= partial_size:
                place, src, dst = off, fd, -1  # already in the work file?
            else:
                found = basis.first_place(off, n, d) if basis is not None else None
                place, src, dst = (found, basis.fd, fd) if found is not None and basis is not None else (-1, -1, -1)
            if place < 0 or n > len(bufs[0]):
                pending.append((off, n, d, -1, None, None))
                return
            buf = bufs.pop()
            pending.append((off, n, d, place if src != fd else -2, pool.submit(check_copy, src, place, n, d, dst, off, buf), buf))

        def resolve() -> list[tuple[int, int, bytes]] | None:
            """Settle the oldest pending chunk; a full group of missing chunks when one is ready."""
            nonlocal cur, nbytes, settled, flushed
            off, n, d, place, fut, buf = pending.popleft()
            settled = off + n
            if settled - flushed >= WRITEBACK_BYTES:
                flushes.append(pool.submit(start_writeback, fd, flushed, settled - flushed))
                flushed = settled
            ok = False
            if fut is not None and buf is not None:
                try:
                    ok = fut.result()
                finally:
                    bufs.append(buf)
            if ok and place >= 0 and basis is not None:
                basis.found(off, n, place)
                if self._refiner is not None:
                    self._refiner[1].record(off, place)
            if not ok:
                ok = self._copy_elsewhere(fd, off, n, d, rel, basis, {place}, opened, bufs[-1])
            if ok:
                self._verified += n
                self.destination.stats["chunks_reused"] += 1
                self.destination.tick(n)
                return None
            out = None
            if cur and nbytes + n > BATCH_BYTES:
                out, cur, nbytes = cur, [], 0
            cur.append((off, n, d))
            nbytes += n
            return out

        try:
            for start, refs in self._pieces(rel, first, size, mtime_ns):
                all_refs += refs
                off = start
                for d, n in refs:
                    while len(pending) >= COPY_INFLIGHT:
                        group = resolve()
                        if group:
                            yield group
                    submit(off, n, d)
                    off += n
            while pending:
                group = resolve()
                if group:
                    yield group
            if cur:
                yield cur
        finally:
            for fut in [p[4] for p in pending] + flushes:
                if fut is not None:
                    fut.cancel()
                    try:
                        fut.result()
                    except BaseException:
                        pass
            for lfd in opened.values():
                os.close(lfd)

    def _copy_elsewhere(
        self,
        fd: int,
        off: int,
        n: int,
        d: bytes,
        rel: str,
        basis: BasisFinder | None,
        tried: set[int],
        opened: dict[str, int],
        buf: bytearray,
    ) -> bool:
        """Try the other places of chunk ``d`` (basis re-alignment, then the tree's chunk index); True if copied."""
        if n > len(buf):
            return False
        if basis is not None:
            for place in basis.more_places(off, n, d, tried):
                if check_copy(basis.fd, place, n, d, fd, off, buf):
                    basis.found(off, n, place)
                    if self._refiner is not None:
                        self._refiner[1].record(off, place)
                    return True
        if self.state is None:
            return False
        me = self.destination.spath(rel)
        tried_paths: set[str] = set()
        stale: list[str] = []
        try:
            for _round in range(_INDEX_ROUNDS):
                places = self.state.find_chunk(d, exclude=tried_paths)
                if not places:
                    return False
                for spath, soff, slen in places:
                    tried_paths.add(spath)
                    if slen != n or (spath == me and basis is not None):
                        continue  # the basis itself was tried above
                    lfd = opened.get(spath)
                    if lfd is None:
                        try:
                            lfd = os.open(os.path.join(self.state.root, spath), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                        except FileNotFoundError:
                            stale.append(spath)  # deleted behind our back
                            continue
                        except OSError:
                            continue
                        opened[spath] = lfd
                    if check_copy(lfd, soff, n, d, fd, off, buf):
                        return True
                    stale.append(spath)  # changed since it was indexed
            return False
        finally:
            if stale and not self.options.dry_run:
                # Stale rows would hide the places that still hold the chunk (the index is asked
                # for a few places at a time): drop them; a later scan indexes what is there.
                self.state.forget([p for p in stale if p != me])

    def _fetch_ranges(self, fd: int, rel: str, groups: Iterator[list[tuple[int, int, bytes]]], size: int, mtime_ns: int) -> None:
        """Ask for each group of missing chunks with a window of requests in flight; verify, then pwrite."""
        window = max(2, min(2 * self.link.streams, MAX_INFLIGHT))
        inflight: deque[tuple[list[tuple[int, int, bytes]], Future[Any], bool]] = deque()

        refiner = self._refiner
        sub_params = refine.params_to_wire(refine.SUB_PARAMS)
        # With a basis, each group's sub-chunk list is turned into a plan (basis windows cut and
        # indexed, the rest asked for, the chunks assembled) on one planner thread, in order,
        # while this thread verifies and writes the groups before it.
        planner = ThreadPoolExecutor(1, thread_name_prefix="tb5-refine") if refiner is not None else None

        misses = 0  # groups in a row refined without one sub-chunk found in the basis

        def submit(g: list[tuple[int, int, bytes]]) -> None:
            ranges = [[off, n] for off, n, _ in g]
            if planner is not None and refiner is not None and misses < REFINE_GIVE_UP:
                subs = self.link.submit("sub_chunks", path=rel, ranges=ranges, size=size, mtime_ns=mtime_ns, params=sub_params)
                inflight.append((g, planner.submit(self._assemble_refined, rel, g, subs, size, mtime_ns, *refiner), True))
            else:
                inflight.append((g, self.link.submit("read_ranges", path=rel, ranges=ranges, size=size, mtime_ns=mtime_ns), False))

        try:
            it = iter(groups)
            for g in it:
                submit(g)
                if len(inflight) >= window:
                    break
            while inflight:
                g, fut, refined = inflight.popleft()
                nxt = next(it, None)
                if nxt is not None:
                    submit(nxt)
                if refined:
                    matched = self._write_refined(fd, rel, g, fut.result(), size, mtime_ns)
                    # A basis that shares nothing with the new version only costs time: after a
                    # few groups in a row without a single matched sub-chunk, fetch the rest whole.
                    misses = 0 if matched else misses + 1
                    continue
                meta, parts = fut.result()
                pieces = decode_ranges(meta, parts, [n for _, n, _ in g])
                try:
                    verify_chunks([(data, d) for data, (_, _, d) in zip(pieces, g)], rel)
                except IntegrityError:
                    # Asked once more: a source changed after the sender's check (its bytes go
                    # out with sendfile) now fails that check; a second mismatch is corruption.
                    log.info("%s: chunk digest mismatch, asking for the ranges once more", rel)
                    self.link.recycle(parts)
                    pieces, parts = self._read_verified(rel, g, size, mtime_ns)
                for (off, _n, _d), data in zip(g, pieces):
                    pwrite_all(fd, data, off)
                    self.destination.stats["chunks_sent"] += 1
                    self._verified += len(data)
                    self.destination.tick(len(data))
                self.link.recycle(parts)
        finally:
            if planner is not None:
                planner.shutdown(wait=True, cancel_futures=True)

    def _read_verified(self, rel: str, g: list[tuple[int, int, bytes]], size: int, mtime_ns: int) -> tuple[list[memoryview | bytes], list[Any]]:
        """Ask for the chunks ``(offset, length, digest)`` of ``g`` now and check their digests.

        Returns the bytes of each chunk and the reply's parts (give them to ``link.recycle`` once
        the bytes are written).

        Raises
        ------
        IntegrityError
            A chunk does not match its digest.
        SourceChangedError
            The source no longer has the size and mtime the chunk list was made from.
        """
        ranges = [[off, n] for off, n, _ in g]
        meta, parts = self.link.submit("read_ranges", path=rel, ranges=ranges, size=size, mtime_ns=mtime_ns).result()
        pieces = decode_ranges(meta, parts, [n for _, n, _ in g])
        verify_chunks([(data, d) for data, (_, _, d) in zip(pieces, g)], rel)
        return pieces, parts

    def _assemble_refined(
        self,
        rel: str,
        g: list[tuple[int, int, bytes]],
        subs_fut: Future[Any],
        size: int,
        mtime_ns: int,
        index: refine.BasisIndex,
        placed: refine.Placements,
    ) -> list[tuple[bytearray, int]]:
        """Build each missing chunk of ``g`` from basis sub-chunks plus the fetched rest; see :mod:`tb5sync.refine`.

        Runs on the planner thread, one group after another. Returns ``(bytes, matched)`` per
        chunk, not yet verified: ``matched`` is how many of its bytes came from the basis.

        Raises
        ------
        RemoteProtocolError
            The sender's replies do not match the requests.
        """
        reply = subs_fut.result()
        subs_wire = reply.get("subs")
        if not isinstance(subs_wire, list) or len(subs_wire) != len(g):
            raise RemoteProtocolError("sub_chunks reply does not match the request")
        plans = []
        want: list[list[int]] = []
        for (off, n, _d), wire in zip(g, subs_wire):
            subs = refine.decode_subs(wire, n)
            at = placed.hint(off)
            index.add_window(at, at + n + REFINE_SLACK)
            copies, fetches = refine.plan(subs, index)
            plans.append((copies, fetches))
            want += [[off + a, k] for a, k in fetches]
        data_fut = self.link.submit("read_ranges", path=rel, ranges=want, size=size, mtime_ns=mtime_ns) if want else None
        out = []
        for (_off, n, _d), (copies, _fetches) in zip(g, plans):
            buf = bytearray(n)
            try:
                refine.fill_copies(memoryview(buf), index.fd, copies)
            except OSError:
                pass  # the basis shrank: the digest check sends this chunk the long way
            out.append((buf, sum(k for _, _, k in copies)))
        if data_fut is not None:
            meta, parts = data_fut.result()
            got = iter(decode_ranges(meta, parts, [k for _, k in want]))
            for (buf, _m), (_c, fetches) in zip(out, plans):
                mv = memoryview(buf)
                for a, k in fetches:
                    mv[a : a + k] = next(got)
            self.link.recycle(parts)
        return out

    def _write_refined(self, fd: int, rel: str, g: list[tuple[int, int, bytes]], built: list[tuple[bytearray, int]], size: int, mtime_ns: int) -> int:
        """Verify the chunks :meth:`_assemble_refined` built and write them; return the bytes matched in the basis.

        One that does not match its BLAKE3 digest (a basis changed under us, an xxh3
        collision) is fetched whole and verified again.

        Raises
        ------
        IntegrityError
            A chunk fetched whole still does not match its digest.
        """
        ok = check_chunks([(buf, d) for (buf, _m), (_o, _n, d) in zip(built, g)], parallel=True)
        total = 0
        for (off, n, d), (buf, matched), good in zip(g, built, ok):
            if not good:
                log.info("%s: chunk at %d rebuilt from the basis does not match; fetching it whole", rel, off)
                pieces, parts = self._read_verified(rel, [(off, n, d)], size, mtime_ns)
                buf = bytearray(pieces[0])
                self.link.recycle(parts)
                matched = 0
            pwrite_all(fd, buf, off)
            self.destination.stats["chunks_sent"] += 1
            self._verified += n
            self.destination.stats["bytes_matched"] += matched
            total += matched
            self.destination.tick(n)
        return total


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


def _release_later(fd: int) -> None:
    """Close ``fd`` on a daemon thread.

    Used for the basis of a committed large file: the rename has unlinked it, so this close
    drops the last reference and the kernel frees its blocks and pages there (~0.25 s per GiB
    on the development VM's ext4), work that need not delay the sync's reply. The bytes at the
    final path are the new version's whatever that thread does.
    """
    threading.Thread(target=os.close, args=(fd,), name="tb5-release", daemon=True).start()
