"""Digests: BLAKE3-256 content addresses and xxh3 quick checks.

* A chunk's content address is BLAKE3-256 of its bytes (the BLAKE3 spec,
  O'Connor, Aumasson, Neves, Wilcox-O'Hearn, 2020), 32 bytes.
* A file's digest is BLAKE3-256 over the concatenation of its chunk digests,
  in order (an empty file's digest is BLAKE3 of the empty string).
* xxh3-128 (Collet, xxHash spec) is used where only a cheap change check is
  needed, never as an address.

The ``blake3`` package releases the GIL while hashing, so chunks are hashed in
a thread pool in parallel with I/O.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import blake3 as _blake3
import xxhash

import tb5sync.engine.chunking as chunking
from tb5sync._os.io import read_into as _io_read_into
from tb5sync._os.io import usable_cpus
from tb5sync.errors import IntegrityError, SourceChangedError, UsageError

__all__ = [
    "check_environment",
    "DIGEST_SIZE",
    "ChunkRef",
    "chunk_digest",
    "file_digest",
    "quick_digest",
    "check_chunks",
    "verify_chunks",
    "chunk_buffer",
    "chunk_fd",
    "iter_chunk_fd",
    "WINDOW",
    "default_window",
    "read_exact",
    "hash_pool",
    "hash_threads",
    "set_hash_threads",
    "set_chunk_threads",
    "chunk_threads",
    "cut_buffer",
]

#: Size of every content address, bytes.
DIGEST_SIZE = 32

#: A chunk as (BLAKE3-256 digest, length in bytes).
ChunkRef = tuple[bytes, int]

# Chunks smaller than this are hashed inline; larger ones go to the pool.
_POOL_MIN = 256 * 1024
class _ThreadSetting:
    """A thread count (set by the caller, else from ``$env``, else a default for this machine)
    and the process-wide pool made from it on first use; setting the count again replaces the
    pool once its queued work is done. Thread-safe.
    """

    def __init__(
        self, what: str, env: str, most: int, default: Callable[[int], int], workers: Callable[[int], int], prefix: str
    ) -> None:
        self.what, self.env, self.most, self.prefix = what, env, most, prefix
        self.default, self.workers = default, workers
        self._n = 0
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def set(self, n: int) -> None:
        if not isinstance(n, int) or not 0 <= n <= self.most:
            raise UsageError(f"{self.what} must be an int in 0..{self.most}")
        with self._lock:
            self._n = n
            old, self._pool = self._pool, None
        if old is not None:
            old.shutdown(wait=False)

    def count(self) -> int:
        with self._lock:
            return self._count()

    def _count(self) -> int:
        if not self._n:
            self._n = _env_threads(self.env, self.most) or self.default(usable_cpus())
        return self._n

    def pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers(self._count()), thread_name_prefix=self.prefix)
            return self._pool


_hash = _ThreadSetting(
    "hash threads", "TB5SYNC_HASH_THREADS", 256, lambda cpus: max(2, cpus), lambda n: n, "tb5-hash"
)
# The calling thread cuts one part itself: the pool has one thread fewer.
_cut = _ThreadSetting(
    "chunk threads", "TB5SYNC_CHUNK_THREADS", 64, lambda cpus: 1 if cpus < 8 else min(4, cpus // 4),
    lambda n: max(1, n - 1), "tb5-cut",
)


def set_hash_threads(n: int) -> None:
    """Set the number of hashing threads (0: the default, see :func:`hash_pool`).

    Takes effect for a pool not yet created; a running pool is replaced once its queued
    work is done. On a machine with many cores, one hashing thread keeps up with about
    4-5 GB/s of BLAKE3, so a link of ~10 GB/s needs 3 or more next to the chunker.

    Raises
    ------
    UsageError
        ``n`` is negative or above 256.
    """
    _hash.set(n)


def hash_threads() -> int:
    """Threads of :func:`hash_pool` (set, from ``$TB5SYNC_HASH_THREADS``, or the default), >= 1.

    Raises
    ------
    UsageError
        ``$TB5SYNC_HASH_THREADS`` is not an integer in 0..256.
    """
    return _hash.count()


def hash_pool() -> ThreadPoolExecutor:
    """The process-wide thread pool used for hashing.

    Its size is the last :func:`set_hash_threads` value, else ``$TB5SYNC_HASH_THREADS``,
    else the CPUs this process may run on (:func:`tb5sync._os.io.usable_cpus`; at least 2).

    Raises
    ------
    UsageError
        ``$TB5SYNC_HASH_THREADS`` is not an integer in 0..256.
    """
    return _hash.pool()


def set_chunk_threads(n: int) -> None:
    """Set how many threads cut one large buffer (0: the default, see :func:`chunk_threads`).

    Raises
    ------
    UsageError
        ``n`` is negative or above 64.
    """
    _cut.set(n)


def chunk_threads() -> int:
    """Threads that cut one buffer side by side (:func:`chunking.parallel_cut_points`).

    The last :func:`set_chunk_threads` value, else ``$TB5SYNC_CHUNK_THREADS``, else 1 on
    machines with fewer than 8 CPUs (where the other end, the hashing and the copies already
    use every core) and ``min(4, cpus // 4)`` above. One thread cuts ~2.4 GB/s (scalar) to
    ~3.4 GB/s (AVX-512 lanes); a ~10 GB/s link needs 3-4.

    Raises
    ------
    UsageError
        ``$TB5SYNC_CHUNK_THREADS`` is not an integer in 0..64.
    """
    return _cut.count()


def check_environment() -> None:
    """Check ``$TB5SYNC_HASH_THREADS`` and ``$TB5SYNC_CHUNK_THREADS`` now (a process's start: the
    CLI, a server), not when the first large file is hashed.

    Raises
    ------
    UsageError
        Either is set to something else than an integer in its range.
    """
    _env_threads("TB5SYNC_HASH_THREADS", 256)
    _env_threads("TB5SYNC_CHUNK_THREADS", 64)


def _env_threads(name: str, most: int) -> int:
    """The thread count in environment variable ``name`` (0 when unset).

    Raises
    ------
    UsageError
        Not an integer in 0..``most``.
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return 0
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= most:
        raise UsageError(f"{name} must be an integer from 0 to {most}, got {text!r}")
    return n


def cut_buffer(mv: memoryview, params: chunking.ChunkParams, final: bool) -> list[int]:
    """:func:`chunking.cut_points` of ``mv`` (same result), cut by :func:`chunk_threads` threads."""
    if len(mv) < 4 * params.max_size:
        return chunking.cut_points(mv, params, final)
    n = chunk_threads()
    if n <= 1:
        return chunking.cut_points(mv, params, final)
    return chunking.parallel_cut_points(mv, params, final, n, _cut.pool())


def chunk_digest(data: bytes | bytearray | memoryview) -> bytes:
    """BLAKE3-256 of ``data``: the chunk's content address, 32 bytes."""
    return _blake3.blake3(data).digest()


def file_digest(chunk_digests: Iterable[bytes]) -> bytes:
    """BLAKE3-256 over the concatenation of ``chunk_digests`` (each 32 bytes), 32 bytes."""
    h = _blake3.blake3()
    for d in chunk_digests:
        h.update(d)
    return h.digest()


def quick_digest(data: bytes | bytearray | memoryview) -> bytes:
    """xxh3-128 of ``data`` (16 bytes): a cheap change check, not a content address."""
    return xxhash.xxh3_128_digest(data)


def _matches(piece: tuple[bytes | bytearray | memoryview, bytes]) -> bool:
    return chunk_digest(piece[0]) == piece[1]


def check_chunks(
    pieces: Sequence[tuple[bytes | bytearray | memoryview, bytes]], parallel: bool | None = None
) -> list[bool]:
    """Whether each ``(bytes, digest)`` of ``pieces`` has that BLAKE3-256 digest.

    Parameters
    ----------
    pieces : sequence of (bytes-like, bytes)
        A chunk's bytes and its expected 32-byte digest.
    parallel : bool, optional
        Hash in :func:`hash_pool` (True) or on this thread (False). By default in the pool
        when there is more than one piece or the one piece is larger than 256 KiB.

    Returns
    -------
    list of bool
        One per piece, in order.
    """
    if parallel is None:
        parallel = len(pieces) > 1 or (bool(pieces) and len(pieces[0][0]) > _POOL_MIN)
    if parallel:
        return list(hash_pool().map(_matches, pieces))
    return [_matches(p) for p in pieces]


def verify_chunks(
    pieces: Sequence[tuple[bytes | bytearray | memoryview, bytes]], where: str, parallel: bool | None = None
) -> None:
    """Check that each ``(bytes, digest)`` of ``pieces`` has that BLAKE3-256 digest.

    Parameters
    ----------
    pieces : sequence of (bytes-like, bytes)
        A chunk's bytes and its expected 32-byte digest.
    where : str
        The file the chunks belong to, for the error message.
    parallel : bool, optional
        See :func:`check_chunks`.

    Raises
    ------
    IntegrityError
        Some chunk does not match its digest (data corrupted in transit).
    """
    if not all(check_chunks(pieces, parallel)):
        raise IntegrityError(f"chunk digest mismatch in {where}: data corrupted in transit")


def chunk_buffer(
    view: bytes | bytearray | memoryview,
    params: chunking.ChunkParams = chunking.DEFAULT_PARAMS,
) -> list[ChunkRef]:
    """Cut ``view`` into FastCDC chunks and hash each one.

    Parameters
    ----------
    view : buffer
        The whole content of a file (any object with the buffer protocol).
    params : ChunkParams
        Chunker parameter set.

    Returns
    -------
    list of (digest, length)
        One entry per chunk, in order; lengths sum to ``len(view)``. Empty input gives ``[]``.
    """
    mv = memoryview(view)
    if len(mv) <= params.min_size:  # no cut before min_size: one chunk (none when empty), as cut_points says
        return [(chunk_digest(mv), len(mv))] if len(mv) else []
    cuts = cut_buffer(mv, params, True)
    spans = []
    start = 0
    for end in cuts:
        spans.append((start, end))
        start = end
    if len(spans) > 1 or (spans and spans[0][1] >= _POOL_MIN):
        digests = list(hash_pool().map(lambda se: chunk_digest(mv[se[0] : se[1]]), spans))
    else:
        digests = [chunk_digest(mv[s:e]) for s, e in spans]
    return [(d, e - s) for d, (s, e) in zip(digests, spans)]


#: Bytes of a file read at a time by :func:`iter_chunk_fd` (at least the largest chunk), unless
#: more chunk threads need a larger window (:func:`default_window`). 16 MiB: the chunk list of a
#: file in the page cache costs 0.59 CPU s/GB with it against 0.64 with 32 MiB windows
#: (``benches/bench_cpu.py --parts stages``: fewer fresh pages, bytes still in cache when hashed).
WINDOW = 16 * 1024 * 1024
#: Ranges up to this many bytes at the start of a file are read into a new ``bytes`` (no pooled buffer).
_SMALL_READ = 1024 * 1024


class _BufferPool:
    """Window buffers reused across calls of :func:`iter_chunk_fd`; thread-safe.

    Reading a window into a buffer that is already mapped costs one copy from the page
    cache and no page faults; a new 32 MiB buffer per window would fault in every page
    again. One iteration holds two buffers (the window being cut, the one being hashed);
    at most ``keep`` idle buffers are kept (96 MiB of windows at most when idle).

    A new buffer is an anonymous ``mmap`` (POSIX; the same on macOS), not a ``bytearray``:
    ``bytearray(n)`` zeroes its ``n`` bytes with the GIL held (a fifth to a third of a
    push's GIL-held time on the sending side, ``benches/bench_cpu.py --parts gil``), while a
    mapping's pages are zero-filled by the kernel as the first ``preadv`` into them faults
    them in, with the GIL released.
    """

    def __init__(self, keep: int = 3) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self.keep = keep

    def get(self, n: int) -> mmap.mmap:
        """A writable buffer of at least ``n`` bytes (``n`` >= 1; its contents are garbage)."""
        with self._lock:
            for i, b in enumerate(self._free):
                if len(b) >= n:
                    return self._free.pop(i)
        return mmap.mmap(-1, n)

    def put(self, buf: mmap.mmap) -> None:
        """Give ``buf`` back (no view of it may be used afterwards)."""
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buf)


_buffers = _BufferPool()


def _buffer_size(n: int, window: int) -> int:
    """Bytes of the pooled buffer for a read of ``n``: a power of two of at least 1 MiB, at most ``window`` (so few sizes recur)."""
    if n >= window:
        return n
    return min(window, max(_SMALL_READ, 1 << (n - 1).bit_length()))


#: ``read_into(fd, view, offset) -> bytes read``: ``preadv`` (one copy, Linux, macOS >= 11, the
#: BSDs), else ``pread`` and a copy (:func:`tb5sync._os.io.read_into`, chosen per call: ``$TB5SYNC_PORTABLE=1``
#: forces the copy).
read_into: Callable[[int, memoryview, int], int] = _io_read_into


def read_exact(fd: int, view: memoryview, off: int, where: str = "") -> None:
    """Fill ``view`` with the bytes of ``fd`` at offset ``off`` (``EINTR`` and short reads retried).

    Reads with ``pread``-like calls, never a memory map: a file truncated meanwhile gives
    an error here, not a ``SIGBUS``.

    Raises
    ------
    SourceChangedError
        The file ends before ``off + len(view)`` (it shrank while being read); names ``where``.
    OSError
        A read failed.
    """
    pos = 0
    n = len(view)
    while pos < n:
        k = read_into(fd, view[pos:], off + pos)
        if k <= 0:
            raise SourceChangedError(where or f"descriptor {fd}")
        pos += k


def default_window(params: chunking.ChunkParams = chunking.DEFAULT_PARAMS) -> int:
    """Bytes :func:`iter_chunk_fd` reads at a time by default: :data:`WINDOW`, or more when
    :func:`chunk_threads` threads cut each window, so that every thread gets a segment of at least
    ``2 * params.max_size`` (:func:`chunking.parallel_cut_points`' shortest: 8 MiB with format v1;
    4 threads: 32 MiB windows)."""
    n = chunk_threads()
    return max(WINDOW, params.max_size, 2 * params.max_size * n if n > 1 else 0)


def iter_chunk_fd(
    fd: int,
    size: int,
    params: chunking.ChunkParams = chunking.DEFAULT_PARAMS,
    start: int = 0,
    window: int | None = None,
    stop: int | None = None,
    where: str = "",
) -> Iterator[list[ChunkRef]]:
    """Chunk and hash bytes ``[start, size)`` of the open file ``fd``, one window at a time.

    The file is read ``window`` bytes at a time into pooled buffers (so at most about two
    windows are held, whatever the file size), cut with :func:`cut_buffer` and ``final=False``
    except at the end, and the next window is read and cut while the pool hashes the chunks of
    the previous one. Each chunk starts where the previous one ended, so the cut points are the
    same as chunking the whole range in one buffer. The file is never memory-mapped: a
    concurrent truncation is an error, never a ``SIGBUS``.

    Parameters
    ----------
    fd : int
        Open file, readable.
    size : int
        End of the range in bytes (exclusive), normally the file size.
    params : ChunkParams
        Chunker parameter set.
    start : int
        First byte (inclusive); the chunking restarts here, so it should be a cut point of
        the file (0, or an offset an earlier call returned) to give the file's own chunks.
    window : int or None
        Bytes read at a time; raised to ``params.max_size`` when smaller. None:
        :func:`default_window`.
    stop : int or None
        No window is started at or past this offset: the chunks end at the first window's
        last cut at or after ``stop`` (or at ``size``). None: go on to ``size``.
    where : str
        The file's name in errors.

    Yields
    ------
    list of (digest, length)
        The chunks of each window, in order; all lengths together sum to ``size - start``.
        Nothing is yielded for an empty range.

    Raises
    ------
    SourceChangedError
        The file shrank below ``size`` while it was read.
    OSError
        The file cannot be read.
    """
    window = default_window(params) if window is None else max(int(window), params.max_size)
    pool = hash_pool()
    pending: list[tuple[list[int], list[Future[list[bytes]]], mmap.mmap | None]] = []
    pos = start
    limit = size if stop is None else min(size, stop)
    try:
        while pos < size and (pos < limit or pos == start):
            end = min(size, pos + window)
            buf: mmap.mmap | None = None
            if pos == 0 and end <= _SMALL_READ:
                data = os.pread(fd, end, 0)
                if len(data) != end:
                    raise SourceChangedError(where or f"descriptor {fd}")
                mv = memoryview(data)
            else:
                buf = _buffers.get(_buffer_size(end - pos, window))
                mv = memoryview(buf)[: end - pos]
                read_exact(fd, mv, pos, where)
            cuts = cut_buffer(mv, params, end == size)
            spans = list(zip([0, *cuts[:-1]], cuts))
            lengths = [c - b for b, c in spans]
            prev = cuts[-1] if cuts else 0
            # One task per group of consecutive chunks (as many groups as hashing threads), not
            # one per chunk: a window's chunks cost a few futures and wake-ups, not ~16.
            futs = [pool.submit(_hash_spans, mv, grp) if grp[-1][1] - grp[0][0] >= _POOL_MIN else _done(_hash_spans(mv, grp))
                    for grp in _split_spans(spans, hash_threads())]
            del mv
            if pending:
                yield _collect(*pending.pop())
            pending.append((lengths, futs, buf))
            pos += prev
        if pending:
            yield _collect(*pending.pop())
    finally:
        for _lengths, futs, buf in pending:  # abandoned: let the hashing of the buffer end first
            for f in futs:
                f.cancel()
            for f in futs:
                if not f.cancelled():
                    try:
                        f.result()
                    except BaseException:
                        pass
            if buf is not None:
                _buffers.put(buf)


def _done(value: list[bytes]) -> Future[list[bytes]]:
    fut: Future[list[bytes]] = Future()
    fut.set_result(value)
    return fut


def _hash_spans(mv: memoryview, spans: Sequence[tuple[int, int]]) -> list[bytes]:
    """:func:`chunk_digest` of ``mv[start:end]`` for each ``(start, end)`` of ``spans``, in order."""
    return [chunk_digest(mv[b:e]) for b, e in spans]


def _split_spans(spans: list[tuple[int, int]], parts: int) -> list[list[tuple[int, int]]]:
    """``spans`` (consecutive ``(start, end)``) in at most ``parts`` runs of consecutive spans of
    about equal bytes (none empty; no run when ``spans`` is empty)."""
    if not spans:
        return []
    parts = max(1, min(parts, len(spans)))
    total = spans[-1][1] - spans[0][0]
    out: list[list[tuple[int, int]]] = [[]]
    for se in spans:
        if out[-1] and len(out) < parts and se[0] - spans[0][0] >= total * len(out) / parts:
            out.append([])
        out[-1].append(se)
    return out


def _collect(lengths: list[int], futs: list[Future[list[bytes]]], buf: mmap.mmap | None) -> list[ChunkRef]:
    """The window's chunks once hashed; its buffer goes back to the pool."""
    try:
        digests = [d for f in futs for d in f.result()]
        return list(zip(digests, lengths))
    finally:
        if buf is not None:
            for f in futs:  # on an error, wait for the others before the buffer is reused
                if not f.done():
                    f.cancel()
                    if not f.cancelled():
                        try:
                            f.result()
                        except BaseException:
                            pass
            _buffers.put(buf)


def chunk_fd(fd: int, size: int, params: chunking.ChunkParams = chunking.DEFAULT_PARAMS, where: str = "") -> list[ChunkRef]:
    """Chunk and hash the first ``size`` bytes of the open file ``fd`` (see :func:`iter_chunk_fd`).

    Memory stays bounded by two windows (:func:`default_window`) whatever the file size.

    Raises
    ------
    SourceChangedError
        The file shrank below ``size`` while it was read (``where`` names it).
    OSError
        The file cannot be read.
    """
    out: list[ChunkRef] = []
    for refs in iter_chunk_fd(fd, size, params, where=where):
        out += refs
    return out


def refs_to_blob(refs: Sequence[ChunkRef]) -> bytes:
    """Pack a chunk list as bytes: per chunk 32 digest bytes then a 4-byte little-endian length."""
    out = bytearray()
    for d, n in refs:
        out += d
        out += n.to_bytes(4, "little")
    return bytes(out)


def blob_to_refs(blob: bytes) -> list[ChunkRef]:
    """Inverse of :func:`refs_to_blob`.

    Raises
    ------
    ValueError
        ``blob``'s length is not a multiple of 36.
    """
    if len(blob) % 36:
        raise ValueError(f"chunk list blob of {len(blob)} bytes is not a multiple of 36")
    return [(blob[i : i + 32], int.from_bytes(blob[i + 32 : i + 36], "little")) for i in range(0, len(blob), 36)]
