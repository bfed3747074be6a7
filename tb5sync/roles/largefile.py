"""One large file's fetch: a work file filled from local copies and the sender, verified, renamed into place.

The receiver makes one :class:`LargeFileJob` per attempt at a file of at least
:data:`~tb5sync.roles.receiver.SMALL_FILE` bytes; all that belongs to that file lives on the job.
In order of the chunk list, each chunk is looked for in the work file of an interrupted run,
the basis (the destination's previous version), then the tree's chunk index, and copied when
found (each copy checked: :func:`tb5sync.engine.basis.check_copy`); the rest is fetched whole or
rebuilt from basis sub-chunks plus the fetched rest (:mod:`tb5sync.engine.refine`), each chunk
verified against its BLAKE3 digest before it is written. The work file is renamed into place
only when verified bytes cover the whole file. It is ``ROOT/.tb5sync/partial/<key>`` when
the destination's state is persistent (the key a BLAKE3 of the file's state path, size and
mtime at the source: the next run reuses an interrupted run's chunks), else a temporary name.
The work file is held under an exclusive ``flock`` for the whole job: a second run writing
the same version of the same path at the same time gets a temporary work file of its own
(:meth:`~tb5sync.roles.destination.Destination.open_work`), so two runs never write one file. Every
open, rename and unlink goes through the destination's jail (no symlink followed).
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import stat
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Any, TypeVar

import tb5sync.engine.chunking as chunking
import tb5sync.engine.refine as refine
from tb5sync.engine.basis import BasisFinder, check_copy, start_writeback
from tb5sync._os.io import close_later, map_read, pwrite_all
from tb5sync.wire.parts import InFile
from tb5sync.wire.replies import decode_ranges
from tb5sync.roles.destination import Destination
from tb5sync.tree.entry import Entry
from tb5sync.errors import IntegrityError, PathError, RemoteProtocolError, SourceChangedError
from tb5sync.wire.messages import SENDER_MAX_READ, ChunkListPiece, SubChunksReply
from tb5sync.engine.hashing import check_chunks, chunk_digest, hash_pool, verify_chunks
from tb5sync.tree.options import SyncOptions

__all__ = ["LargeFileJob", "BATCH_BYTES", "MAX_INFLIGHT", "PIECE_BYTES", "RANGE_BYTES", "submit_then"]

log = logging.getLogger(__name__)

#: Target bytes per small-file batch (see the receiver) and per chunk-range request.
BATCH_BYTES = 8 * 1024 * 1024
#: Most requests in flight (each up to BATCH_BYTES): bounds memory whatever the stream count.
MAX_INFLIGHT = 12
#: Bytes of a large file's missing chunks asked for per ``read_ranges`` request (or one chunk): each
#: reply costs the same Python on both sides (a request, a reply, a wake-up of the run thread,
#: a mapping to hash it in) whatever its size, so fewer, larger ones cost less per GB.
RANGE_BYTES = 16 * 1024 * 1024
#: Most bytes of a large file's ``read_ranges`` in flight (the window, at most 2 per stream).
RANGE_INFLIGHT_BYTES = 96 * 1024 * 1024
#: :data:`RANGE_BYTES` and :data:`RANGE_INFLIGHT_BYTES` for a file with no basis on a link whose
#: streams splice replies into the work file (:attr:`~tb5sync.remote.links.RemoteLink.splices`),
#: unless ``--compress lz4``: such a reply takes no receive buffer, so replies of the sender's most
#: (``SENDER_MAX_READ``) cost no memory and halve the replies, requests and run-thread wake-ups
#: per GB. With ``--compress auto`` a compressed part is one that shrank to under 1/8, so a reply
#: that comes compressed all the same takes a small buffer; with ``lz4`` every reply would be
#: compressed into (and received in) a buffer of up to 32 MiB on each side: 16 MiB then, as before
#: (a 512 MiB text file pushed with 32 MiB reads and lz4 peaked at 298 MiB on the receiver).
RANGE_BYTES_SPLICED = SENDER_MAX_READ
RANGE_INFLIGHT_BYTES_SPLICED = 5 * SENDER_MAX_READ
#: Bytes of a large file's chunk list asked for per ``chunk_list`` piece.
PIECE_BYTES = 64 * 1024 * 1024
#: Checked chunk-list pieces kept ready ahead of the one being copied and fetched.
PIECES_AHEAD = 3
#: Reused chunks being read, checked and copied at once per large file (one max-size buffer each).
COPY_INFLIGHT = 6
#: A basis from this size (bytes) up is closed on a thread of its own after the commit.
CLOSE_LATER_BYTES = 64 * 1024 * 1024
#: Bytes of a large file's work file after which the writeback of the part settled so far is started.
WRITEBACK_BYTES = 32 * 1024 * 1024
#: Groups in a row without one sub-chunk found in the basis after which a file's remaining
#: missing chunks are fetched whole (the basis shares nothing with the new version).
REFINE_GIVE_UP = 3
#: Rounds of places asked of the chunk index for one chunk (4 places each) before giving up.
_INDEX_ROUNDS = 8
#: Basis bytes indexed for a missing chunk beyond its own length (room for bytes deleted from it).
REFINE_SLACK = 64 * 1024


def _verify_write(data: memoryview | bytes, digest: bytes, fd: int, off: int) -> bool:
    """Write chunk ``data`` at byte ``off`` of ``fd`` only if it has the BLAKE3 ``digest``; whether it did.

    Runs in the hash pool (hashing and ``pwrite`` release the GIL). Raises OSError when the write fails.
    """
    if chunk_digest(data) != digest:
        return False
    pwrite_all(fd, data, off)
    return True


def _verify_write_reply(pieces: list[memoryview | bytes], group: list[tuple[int, int, bytes]], fd: int) -> list[bool]:
    """:func:`_verify_write` of each chunk of one ``read_ranges`` reply, in order; whether each was written.

    ``pieces`` are the reply's chunk bytes, ``group`` their ``(offset, length, digest)``. Runs
    on the thread that received the reply (:func:`submit_then`): each chunk is hashed and
    written while its bytes are in this core's cache, with no hand-over to another thread (the
    streams' readers verify their replies side by side). Raises OSError when a write fails.
    """
    return [_verify_write(data, d, fd, off) for data, (off, _n, d) in zip(pieces, group)]


def _verify_in_file(fd: int, group: list[tuple[int, int, bytes]]) -> list[bool]:
    """Whether each chunk ``(offset, length, digest)`` of ``group`` (consecutive in the file or not)
    now in work file ``fd`` has its BLAKE3 digest: hashed where the reply's bytes were received, in
    the page cache (one read-only mapping of the group's span; read faults map the cached pages).
    """
    start = min(off for off, _n, _d in group)
    end = max(off + n for off, n, _d in group)
    base = start - start % mmap.ALLOCATIONGRANULARITY
    if end == base:
        return [chunk_digest(b"") == d for _o, _n, d in group]
    m = map_read(fd, end - base, base)  # its munmap without the GIL (a 32 MiB span's takes a while)
    try:
        mv = memoryview(m)
        try:
            return [chunk_digest(mv[off - base : off - base + n]) == d for off, n, d in group]
        finally:
            mv.release()
    finally:
        m.close()


T = TypeVar("T")
#: What a reply's verification hands the run thread: whether each chunk was written (None when
#: it failed), the reply's parts (their buffer to give back), the error it failed with.
_Verified = tuple[list[bool] | None, list[Any], BaseException | None]


def submit_then(link: Any, method: str, then: Callable[[dict[str, Any], Any], T], *,
                into_file: tuple[int, list[int], list[int]] | None = None, **args: Any) -> Future[T]:
    """``link.submit_then(method, then, into_file=..., **args)`` (see
    :meth:`tb5sync.remote.links.Link.submit_then`), or, for a link without it, ``then`` chained to
    ``link.submit``'s future (``into_file`` unused), run by whichever thread settles it; the same
    cancel rule (a future cancelled before ``then`` started never runs it)."""
    own = getattr(link, "submit_then", None)
    if own is not None:
        fut: Future[T] = own(method, then, into_file=into_file, **args)
        return fut
    outer: Future[T] = Future()

    def done(f: Future[Any]) -> None:
        try:
            meta, parts = f.result()
            if outer.set_running_or_notify_cancel():
                outer.set_result(then(meta, parts))
            else:
                link.recycle(parts)
        except BaseException as exc:
            try:
                outer.set_exception(exc)
            except InvalidStateError:
                pass

    link.submit(method, **args).add_done_callback(done)
    return outer

class _CopyBuffers:
    """Scratch buffers of ``size`` bytes (the largest chunk) for :func:`check_copy`, made on first use.

    Only the thread that runs :meth:`LargeFileJob.run` takes and gives back buffers; a buffer
    handed to a copy task is given back once that task is done. At most one buffer per copy in
    flight plus one for :meth:`LargeFileJob._copy_elsewhere` is ever made.
    """

    __slots__ = ("size", "_free")

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[bytearray] = []

    def get(self) -> bytearray:
        """A free buffer of :attr:`size` bytes (contents undefined), made now if none is free."""
        return self._free.pop() if self._free else bytearray(self.size)

    def put(self, buf: bytearray) -> None:
        """Give back a buffer nothing reads or writes any more."""
        self._free.append(buf)

    def check_copy(self, src_fd: int, src_off: int, n: int, digest: bytes, dst_fd: int, dst_off: int) -> bool:
        """:func:`check_copy` on this thread with one of these buffers."""
        buf = self.get()
        try:
            return check_copy(src_fd, src_off, n, digest, dst_fd, dst_off, buf)
        finally:
            self.put(buf)


class LargeFileJob:
    """Fetch one large file into a work file and commit it; one job per file and attempt.

    Parameters
    ----------
    destination : Destination
        Where the file lands; its counters, progress and scan-cache rows are updated.
    link : tb5sync.remote.links.Link
        Way to the sender.
    entry : Entry
        The source's entry of the file (its path and mode; size and mtime come from the
        first chunk-list piece).
    params : chunking.ChunkParams
        Chunking of the destination (basis re-alignment, copy buffers of ``max_size``).
    options : SyncOptions

    Attributes
    ----------
    rel : str
        The file's path relative to the destination base.
    size, mtime_ns : int
        The source's size (bytes) and mtime (ns) its chunk list was made from.
    work, fd : str, int
        The work file's path (partial or temporary) and descriptor (-1 when not open).
    verified : int
        Bytes of the work file verified so far (copied, fetched or rebuilt, each checked).
    basis, refiner : BasisFinder, (refine.BasisIndex, refine.Placements)
        The basis and its sub-chunk index and placements while :meth:`run` runs (None: no basis).
    all_refs : list of (bytes, int)
        Every chunk ``(digest, length)`` of the file, in order, as the pieces arrive.

    Notes
    -----
    :meth:`run` runs on the receiver's thread, and so do every update of :attr:`verified`
    and of the destination's counters. The job's other threads: the chunk-list helper (asks
    for pieces), the hash pool (checked copies into the work file, each at its own range),
    and the planner (reads the basis, builds chunks; the run thread verifies and writes them).
    """

    def __init__(self, destination: Destination, link: Any, entry: Entry, params: chunking.ChunkParams, options: SyncOptions) -> None:
        self.destination = destination
        self.link = link
        self.entry = entry
        self.rel = entry.path
        self.params = params
        self.options = options
        self.size = 0
        self.mtime_ns = 0
        self.work = ""
        self.fd = -1
        self.verified = 0
        self.basis: BasisFinder | None = None
        self.refiner: tuple[refine.BasisIndex, refine.Placements] | None = None
        self.all_refs: list[tuple[bytes, int]] = []

    def run(self) -> None:
        """Fetch the file into a work file, piece by piece of its chunk list, then commit.

        The chunk list comes in pieces of about :data:`PIECE_BYTES` (``chunk_list`` with
        ``start``/``limit``); the next piece is asked for as soon as one arrives, so the
        sender cuts and hashes it while the ranges of this one are on the wire.

        Raises
        ------
        SourceChangedError
            The source's size or mtime changed during the fetch (the receiver tries again).
        RemoteNotFoundError
            The source file vanished.
        IntegrityError
            A chunk failed verification, or verified bytes do not cover the file (nothing
            is committed).
        RemoteProtocolError
            A malformed reply.
        QuotaError
            The file's size passes the destination's quota (a server's session limits).
        OSError
            The work file cannot be written or renamed into place.
        """
        first_fut = self.link.submit("chunk_list", path=self.rel, start=0, limit=BATCH_BYTES)
        self.basis = self._open_basis()
        committed = False
        try:
            first = first_fut.result()
            if self.basis is not None:  # sub-chunks of the same open basis (see refine)
                self.refiner = refine.BasisIndex(self.basis.fd, self.basis.size), refine.Placements()
            self._fetch_into_work(first)
            committed = True
        finally:
            self.refiner = None
            basis, self.basis = self.basis, None
            if basis is not None:
                log.debug("basis of %s: %d bytes cut to re-align", self.rel, basis.cut_bytes)
                if committed and basis.size >= CLOSE_LATER_BYTES:
                    # The rename unlinked the basis: this close frees its blocks and pages (~0.25 s
                    # per GiB on the development VM's ext4), work that need not delay the reply
                    # (a smaller basis is closed here: starting a thread costs more).
                    close_later(basis.fd)
                else:
                    os.close(basis.fd)

    def _fetch_into_work(self, first: dict[str, Any]) -> None:
        """:meth:`run` once the first chunk-list piece is here: open the work file, fill it, commit it."""
        piece = ChunkListPiece.from_wire(first, self.rel)
        size, mtime_ns = piece.size, piece.mtime_ns
        self.size, self.mtime_ns = size, mtime_ns
        dest = self.destination
        key = None
        if dest.state is not None and dest.partials:
            key = chunk_digest(f"{dest.spath(self.rel)}\0{size}\0{mtime_ns}".encode("utf-8", "surrogateescape"))
        if dest.quota is not None:  # before the work file exists: a refusal leaves nothing behind
            dest.quota.charge(size, self.rel)
        committed = False
        wdir, keep_partial = -1, True
        try:
            self.fd, wdir, self.work, keep_partial = dest.open_work(self.rel, key)
            partial_size = os.fstat(self.fd).st_size
            self.verified = 0
            groups = self._missing_groups(first, partial_size)
            try:
                self._fetch_ranges(self.fd, self.rel, groups, size, mtime_ns)
            finally:
                groups.close()  # no copy task may still write into fd once it is closed
            st = self._commit(wdir)
            committed = True
            dest.record(self.rel, st, self.all_refs)
            dest.flush_records()
            dest.stats["files_transferred"] += 1
            dest.stats["bytes_transferred"] += size
        finally:
            if not committed and not keep_partial and wdir >= 0:
                dest.drop_work(wdir, self.work)
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1

    def _commit(self, wdir: int) -> os.stat_result:
        """Give the work file its size, mode and mtime and rename it over the file's final path.

        ``wdir`` is the work file's directory descriptor (see
        :meth:`~tb5sync.roles.destination.Destination.open_work`).

        Returns
        -------
        os.stat_result
            Of the file now at its final path.

        Raises
        ------
        IntegrityError
            Verified bytes do not cover the whole file (nothing is renamed).
        OSError
            The rename (or, across file systems, the copy) failed.
        """
        if self.verified != self.size:
            raise IntegrityError(f"{self.rel}: {self.verified} of {self.size} bytes verified before commit")
        fd = self.fd
        os.ftruncate(fd, self.size)
        os.fchmod(fd, self.entry.mode)
        os.utime(fd, ns=(self.mtime_ns, self.mtime_ns))
        self.destination.commit_work(self.rel, fd, wdir, self.work)
        return os.fstat(fd)

    def _pieces(self, first: dict[str, Any]) -> Iterator[tuple[int, list[tuple[bytes, int]]]]:
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
        rel, size, mtime_ns = self.rel, self.size, self.mtime_ns
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
                    piece = ChunkListPiece.from_wire(info, rel)
                    if (piece.size, piece.mtime_ns) != (size, mtime_ns):
                        raise SourceChangedError(rel)
                    start, end, refs = piece.start, piece.end, piece.chunks
                    if start != pos:
                        raise RemoteProtocolError(f"chunk_list piece of {rel} does not continue at {pos}")
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

    def _open_basis(self) -> BasisFinder | None:
        """Open the destination's current version of the file as a basis, or None when there is none.

        The scan cache's chunk list of the basis is used as a hint when its row matches the
        basis's size, mtime and inode; nothing is cut or hashed here.
        """
        dest = self.destination
        try:
            bfd = dest.open_read(self.rel)
        except OSError:
            return None
        try:
            st = os.fstat(bfd)
            if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
                os.close(bfd)
                return None
            hit = None
            if dest.state is not None:
                hit = dest.state.lookup(dest.spath(self.rel), st.st_size, st.st_mtime_ns, st.st_ino)
            return BasisFinder(bfd, st.st_size, self.params, hit[1] if hit is not None else None)
        except BaseException:
            os.close(bfd)
            raise

    def _missing_groups(self, first: dict[str, Any], partial_size: int) -> Iterator[list[tuple[int, int, bytes]]]:
        """Fill what is present locally, piece by piece; yield groups of missing ``(offset, length, digest)``.

        A chunk is present when the work file already holds it (its first ``partial_size``
        bytes: an interrupted earlier run), or when the basis or another file of the tree has
        bytes with its digest. Each place is checked with :func:`check_copy` (one read, one
        hash, one write of the same buffer) in the hash pool, :data:`COPY_INFLIGHT` chunks at a
        time, in order of the chunk list; a chunk whose first place misses gets its other places
        tried here before it is counted missing. Each group is at most :data:`RANGE_BYTES` (or
        one chunk) of chunks to ask for in one request. :attr:`all_refs` receives every chunk
        of the file, in order.
        """
        fd, basis, all_refs, dest = self.fd, self.basis, self.all_refs, self.destination
        range_bytes = self._range_sizes()[0]
        pool = hash_pool()
        # Copy buffers (one max-size chunk each) are made when a chunk first has a local place to
        # be copied from: a file with no basis and no indexed copy (a cold push) makes none. Making
        # COPY_INFLIGHT of them up front zeroed 24 MiB per large file under the GIL, more than a
        # 6 MiB file's own copies cost.
        bufs = _CopyBuffers(min(self.params.max_size, max(self.size, 1)))  # at most the file: a 1 MiB delta needs no 4 MiB buffers
        opened: dict[str, int] = {}
        pending: deque[tuple[int, int, bytes, int, Future[bool] | None, bytearray | None]] = deque()
        cur: list[tuple[int, int, bytes]] = []
        nbytes = 0
        flushes: list[Future[None]] = []
        settled = flushed = 0  # chunks before ``settled`` are copied or counted missing
        indexed: set[bytes] = set()  # digests of the current piece that the tree's chunk index has

        def submit(off: int, n: int, d: bytes) -> None:
            if off + n <= partial_size:
                place, src, dst = off, fd, -1  # already in the work file?
            else:
                found = basis.first_place(off, n, d) if basis is not None else None
                place, src, dst = (found, basis.fd, fd) if found is not None and basis is not None else (-1, -1, -1)
            if place < 0 or n > bufs.size:
                pending.append((off, n, d, -1, None, None))
                return
            buf = bufs.get()
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
                    bufs.put(buf)
            if ok and place >= 0 and basis is not None:
                basis.found(off, n, place)
                if self.refiner is not None:
                    self.refiner[1].record(off, place)
            if not ok and (basis is not None or d in indexed):
                ok = self._copy_elsewhere(off, n, d, {place}, opened, bufs, d in indexed)
            if ok:
                self.verified += n
                dest.stats["chunks_reused"] += 1
                dest.tick(n)
                return None
            out = None
            if cur and nbytes + n > range_bytes:
                out, cur, nbytes = cur, [], 0
            cur.append((off, n, d))
            nbytes += n
            return out

        try:
            for start, refs in self._pieces(first):
                all_refs += refs
                # the chunk index asked once per piece: only chunks it has are looked up one by one
                # (kept for the whole file: chunks of the previous piece may still be pending)
                if dest.state is not None:
                    indexed |= dest.state.known_chunks([d for d, _n in refs])
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

    def _copy_elsewhere(self, off: int, n: int, d: bytes, tried: set[int], opened: dict[str, int], bufs: _CopyBuffers,
                        in_index: bool = True) -> bool:
        """Try the other places of chunk ``d`` (basis re-alignment, then the tree's chunk index); True if copied.

        ``in_index``: False when the chunk index is known to have no place of ``d`` (asked once per
        piece, :meth:`~tb5sync.tree.state.TreeState.known_chunks`): only the basis is tried.

        ``off``, ``n``: the chunk's offset and length (bytes); ``tried``: basis offsets already
        tried; ``opened``: files of the tree opened for this job (state path -> fd, closed by the
        caller); ``bufs``: the job's copy buffers (one is taken only when a place is tried; a chunk
        longer than they are: False at once).
        """
        fd, basis, state = self.fd, self.basis, self.destination.state
        if n > bufs.size:
            return False
        if basis is not None:
            for place in basis.more_places(off, n, d, tried):
                if bufs.check_copy(basis.fd, place, n, d, fd, off):
                    basis.found(off, n, place)
                    if self.refiner is not None:
                        self.refiner[1].record(off, place)
                    return True
        if state is None or not in_index:
            return False
        me = self.destination.spath(self.rel)
        tried_paths: set[str] = set()
        stale: list[str] = []
        try:
            for _round in range(_INDEX_ROUNDS):
                places = state.find_chunk(d, exclude=tried_paths)
                if not places:
                    return False
                for spath, soff, slen in places:
                    tried_paths.add(spath)
                    if slen != n or (spath == me and basis is not None):
                        continue  # the basis itself was tried above
                    lfd = opened.get(spath)
                    if lfd is None:
                        try:
                            lfd = self.destination.open_in_root(spath)
                        except FileNotFoundError:
                            stale.append(spath)  # deleted behind our back
                            continue
                        except (OSError, PathError):
                            continue
                        opened[spath] = lfd
                    if bufs.check_copy(lfd, soff, n, d, fd, off):
                        return True
                    stale.append(spath)  # changed since it was indexed
            return False
        finally:
            if stale and not self.options.dry_run:
                # Stale rows would hide the places that still hold the chunk (the index is asked
                # for a few places at a time): drop them; a later scan indexes what is there.
                state.forget([p for p in stale if p != me])

    def _range_sizes(self) -> tuple[int, int]:
        """Bytes per ``read_ranges`` request and most bytes of them in flight for this file:
        :data:`RANGE_BYTES_SPLICED` and :data:`RANGE_INFLIGHT_BYTES_SPLICED` when there is no basis,
        the sender does not compress every chunk (``--compress lz4``) and every data stream of the
        link splices, else :data:`RANGE_BYTES` and
        :data:`RANGE_INFLIGHT_BYTES`."""
        if self.refiner is None and self.options.compress != "lz4" and getattr(self.link, "splices", False):
            return RANGE_BYTES_SPLICED, RANGE_INFLIGHT_BYTES_SPLICED
        return RANGE_BYTES, RANGE_INFLIGHT_BYTES

    def _fetch_ranges(self, fd: int, rel: str, groups: Iterator[list[tuple[int, int, bytes]]], size: int, mtime_ns: int) -> None:
        """Ask for each group of missing chunks with a window of requests in flight; verify, then pwrite.

        ``fd``, ``rel``, ``size`` and ``mtime_ns`` are the job's work file, path and source
        size and mtime (passed in: this step and its helpers below take the file as arguments).
        """
        range_bytes, inflight_bytes = self._range_sizes()
        window = max(2, min(2 * self.link.streams, MAX_INFLIGHT, inflight_bytes // range_bytes))
        inflight: deque[tuple[list[tuple[int, int, bytes]], Future[Any], bool]] = deque()

        refiner = self.refiner
        sub_params = refine.params_to_wire(refine.SUB_PARAMS)
        # With a basis, each group's sub-chunk list is turned into a plan (basis windows cut and
        # indexed, the rest asked for, the chunks assembled) on one planner thread, in order,
        # while this thread verifies and writes the groups before it.
        planner = ThreadPoolExecutor(1, thread_name_prefix="tb5-refine") if refiner is not None else None

        misses = 0  # groups in a row refined without one sub-chunk found in the basis

        def on_reply(g: list[tuple[int, int, bytes]]) -> Callable[[dict[str, Any], list[Any]], _Verified]:
            lengths = [n for _, n, _ in g]

            def then(meta: dict[str, Any], parts: list[Any] | InFile) -> _Verified:
                # On the thread that received the reply (a stream's reader): each chunk hashed and,
                # only if it matches, written right away, while its bytes are in this core's cache;
                # or, received straight into the work file's page cache, hashed there.
                if isinstance(parts, InFile):
                    try:
                        if parts.error is not None:
                            raise parts.error
                        return _verify_in_file(fd, g), [], None
                    except BaseException as exc:
                        return None, [], exc
                try:
                    return _verify_write_reply(decode_ranges(meta, parts, lengths), g, fd), parts, None
                except BaseException as exc:  # handed to the run thread with the buffer to give back
                    return None, parts, exc

            return then

        def settle(g: list[tuple[int, int, bytes]], written: list[bool] | None, parts: list[Any], exc: BaseException | None) -> None:
            """Give a verified reply's buffer back, re-fetch what failed, count it."""
            self.link.recycle(parts)
            if exc is not None:
                raise exc
            assert written is not None
            if not all(written):
                # Asked once more: a source changed after the sender's check (its bytes go
                # out with sendfile) now fails that check; a second mismatch is corruption.
                # The chunks that did match are in place already and are written again.
                log.info("%s: chunk digest mismatch, asking for the ranges once more", rel)
                pieces, again = self._read_verified(rel, g, size, mtime_ns)
                for (off, _n, _d), data in zip(g, pieces):
                    pwrite_all(fd, data, off)
                self.link.recycle(again)
            total = sum(n for _off, n, _d in g)
            self.destination.stats["chunks_sent"] += len(g)
            self.verified += total
            self.destination.tick(total)

        def submit(g: list[tuple[int, int, bytes]]) -> None:
            ranges = [[off, n] for off, n, _ in g]
            if planner is not None and refiner is not None and misses < REFINE_GIVE_UP:
                subs = self.link.submit("sub_chunks", path=rel, ranges=ranges, size=size, mtime_ns=mtime_ns, params=sub_params)
                inflight.append((g, planner.submit(self._assemble_refined, rel, g, subs, size, mtime_ns, *refiner), True))
            else:
                fut = submit_then(self.link, "read_ranges", on_reply(g), into_file=(fd, [off for off, _n, _d in g], [n for _o, n, _d in g]),
                                  path=rel, ranges=ranges, size=size, mtime_ns=mtime_ns)
                inflight.append((g, fut, False))

        try:
            it = iter(groups)
            for g in it:
                submit(g)
                if len(inflight) >= window:
                    break
            while inflight:
                head = inflight[0][1]
                if not inflight[0][2] and not head.done():
                    # Wait for a later reply first: those before it are then (nearly always) in
                    # too, so the run thread wakes once per few replies, not once per reply.
                    later = inflight[min(len(inflight), max(1, (window + 1) // 2)) - 1]
                    if not later[2]:
                        try:
                            later[1].exception()
                        except BaseException:
                            pass
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
                # verified and written by the stream's reader (a future that raises wrote nothing)
                written, parts, exc = fut.result()
                settle(g, written, parts, exc)
        finally:
            # No reader may still write into fd (the caller closes it) once this returns: cancel
            # the replies not yet being verified, wait for those that are, give their buffers back.
            for _g, fut, refined in inflight:
                if refined or fut.cancel():
                    continue
                try:
                    _w, parts, _e = fut.result()
                except BaseException:
                    continue
                self.link.recycle(parts)
            inflight.clear()
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
        self, rel: str, g: list[tuple[int, int, bytes]], subs_fut: Future[Any], size: int, mtime_ns: int, index: refine.BasisIndex, placed: refine.Placements
    ) -> list[tuple[bytearray, int]]:
        """Build each missing chunk of ``g`` from basis sub-chunks plus the fetched rest; see :mod:`tb5sync.engine.refine`.

        Runs on the planner thread, one group after another. Returns ``(bytes, matched)`` per
        chunk, not yet verified: ``matched`` is how many of its bytes came from the basis.

        Raises
        ------
        RemoteProtocolError
            The sender's replies do not match the requests.
        """
        subs_wire = SubChunksReply.from_wire(subs_fut.result(), len(g)).subs
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
            self.verified += n
            self.destination.stats["bytes_matched"] += matched
            total += matched
            self.destination.tick(n)
        return total
