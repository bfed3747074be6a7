"""Where the chunks of a new version of a file lie in its old version (the basis), and copying them.

The receiver of a large file asks :class:`BasisFinder` for places in the basis where a chunk
of the new version may be, and checks each place with :func:`check_copy`: read the bytes into
a buffer, hash them, compare with the sender's digest, and write that same buffer into the
work file only if they match. A place is therefore only ever a hint; a wrong or stale hint
costs one read and one hash, never a wrong byte.

Hints, cheapest first:

* the basis's chunk list from the scan cache (digest -> offset), when the cache has a row for
  the basis's current size, mtime and inode (it may still be stale: verified anyway);
* continuation: the chunk lies where the previous verified chunk's offset in the basis says,
  i.e. at ``offset + shift``, ``shift`` being basis minus new offset of the last match (right
  for unchanged runs and for same-size overwrites; no chunking of the basis needed);
* without a cached list, after two misses in a row, the basis is cut (cut points only, no hashing) from the end of
  the last verified match (a cut point of the basis: a chunk's cut depends only on its own
  bytes) to past the expected place, and basis chunks with the same length are tried,
  nearest first. This re-aligns after an insertion or a deletion, and after an edit that
  moved a cut point.

The basis is not cut or hashed up front: an unchanged run costs one read, one hash and one
write per chunk (the receiver used to cut and hash the whole basis before the first chunk was
copied, then read and hash each reused chunk again). Unlike a map of the basis's own chunks,
continuation also finds a chunk of the new version whose bytes are in the basis at a place
where the basis was cut differently (after an edit that moved a cut): 18% fewer bytes on the
wire for the ``big_delta`` bench.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import tb5sync.engine.chunking as chunking
from tb5sync._os.io import portable, read_into
from tb5sync.engine.hashing import ChunkRef, chunk_digest

__all__ = ["BasisFinder", "check_copy", "start_writeback"]

_sync_file_range: Any = None  # libc's sync_file_range (Linux), False where there is none


def start_writeback(fd: int, off: int, n: int) -> None:
    """Start writing back the dirty pages of bytes ``[off, off + n)`` of ``fd``; do not wait for them.

    On Linux this is ``sync_file_range(SYNC_FILE_RANGE_WRITE)``: block allocation and I/O
    submission happen now, in the calling thread, instead of all at once in the ``rename``
    that replaces an existing file (ext4's ``auto_da_alloc`` flushes the whole new file there:
    ~0.4 s per GiB on the development VM, on the critical path). Elsewhere, or if the call
    fails, nothing happens (also with ``$TB5SYNC_PORTABLE=1``). Durability is unchanged: nothing
    waits for the disk either way.
    """
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = False
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                fn = ctypes.CDLL(None, use_errno=True).sync_file_range
                fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                fn.restype = ctypes.c_int
                _sync_file_range = fn
            except (OSError, AttributeError):
                pass
    if _sync_file_range and not portable():
        _sync_file_range(fd, off, n, 2)  # SYNC_FILE_RANGE_WRITE; a failure only means no head start


def check_copy(src_fd: int, src_off: int, n: int, digest: bytes, dst_fd: int, dst_off: int, buf: bytearray) -> bool:
    """Read ``n`` bytes at ``src_off``, and write them at ``dst_off`` only if they hash to ``digest``.

    The bytes hashed are the bytes written (one buffer, one read): what lands in ``dst_fd`` is
    verified whatever happens to the source file meanwhile. Blocking; releases the GIL while
    reading, hashing and writing, so callers run it in the hash pool.

    Parameters
    ----------
    src_fd : int
        Readable file holding the candidate bytes.
    src_off : int
        Offset of the candidate in ``src_fd``, bytes.
    n : int
        Chunk length in bytes, ``1 <= n <= len(buf)``.
    digest : bytes
        The chunk's BLAKE3-256 digest (32 bytes).
    dst_fd : int
        Work file to write into; ``-1``: only check (the bytes are already in place).
    dst_off : int
        Offset of the chunk in ``dst_fd``, bytes.
    buf : bytearray
        Scratch buffer, at least ``n`` bytes, owned by the caller until this returns.

    Returns
    -------
    bool
        True when the bytes matched (and were written); False for a short read or a mismatch
        (nothing written).

    Raises
    ------
    OSError
        Reading ``src_fd`` failed for another reason than its end, or the write failed.
    """
    view = memoryview(buf)[:n]
    if read_into(src_fd, view, src_off) != n or chunk_digest(view) != digest:
        return False
    pos = dst_off
    while dst_fd >= 0 and view:
        k = os.pwrite(dst_fd, view, pos)
        view = view[k:]
        pos += k
    return True


class BasisFinder:
    """Hints where chunks of a file's new version are in the basis (its previous version).

    Parameters
    ----------
    fd : int
        The basis, open for reading (the caller closes it).
    size : int
        Basis size in bytes at open time.
    params : ChunkParams
        Chunk parameters of the new version's chunk list.
    cached : sequence of (digest, length), optional
        The basis's chunk list from the scan cache, if any (a hint like the others).

    Notes
    -----
    Not thread-safe: one receiver thread asks, the hash pool only runs :func:`check_copy`.
    Ask in the order of the new version's chunk list: :meth:`found` and :meth:`more_places`
    track runs of matches and misses. Cutting only moves forward within a run of misses (its
    look-ahead doubling from ``avg_size`` up to 16 ``max_size`` as the run goes on), so it costs
    at most about the basis size however the file changed, and about the bytes of the
    misaligned chunks for a few edits.
    """

    def __init__(self, fd: int, size: int, params: chunking.ChunkParams, cached: Sequence[ChunkRef] | None = None) -> None:
        self.fd = fd
        self.size = size
        self.params = params
        self.by_digest: dict[bytes, int] = {}
        off = 0
        for d, n in cached or ():
            self.by_digest.setdefault(d, off)
            off += n
        if off != size:  # a cached list that does not add up is no hint at all
            self.by_digest.clear()
        self.by_length: dict[int, list[int]] = {}
        self.shift = 0
        self.anchor = 0
        self.misses = 0
        self._cut_from = 0
        self._cut_to = 0
        self.cut_bytes = 0

    def first_place(self, off: int, n: int, digest: bytes) -> int | None:
        """The most likely basis offset of the chunk ``(digest, n)`` at new offset ``off``, or None."""
        b = self.by_digest.get(digest)
        if b is not None and b + n <= self.size:
            return b
        g = off + self.shift
        return g if 0 <= g and g + n <= self.size else None

    def more_places(self, off: int, n: int, digest: bytes, tried: set[int]) -> list[int]:
        """Further basis offsets to try after the places in ``tried`` missed, best first (may be empty).

        The cached place and continuation with the current shift first (the shift may have
        changed since the first place was chosen), then basis chunks of length ``n`` near the
        expected place. The basis is cut only at the second miss in a row: the first chunk
        missed after a match is most often new data (an edit), which no cutting finds, while a
        second miss means the chunks after an edit are misaligned (an insertion, a deletion or
        a moved cut point).

        Raises
        ------
        OSError
            The basis cannot be read.
        """
        out: list[int] = []
        b = self.by_digest.get(digest)
        if b is not None and b + n <= self.size and b not in tried:
            out.append(b)
        g = off + self.shift
        if 0 <= g and g + n <= self.size and g not in tried and g not in out:
            out.append(g)
        self.misses += 1
        if self.misses >= 2 and not self.by_digest:  # a cached list already names every basis chunk
            # look further ahead the longer the run of misses (a deletion moves chunks forward)
            ahead = min(self.params.avg_size << (self.misses - 2), 16 * self.params.max_size)
            self._cut_to_cover(g + n + ahead)
        near = [b for b in dict.fromkeys(self.by_length.get(n, ())) if b not in tried and b not in out]
        near.sort(key=lambda b: abs(b - g))
        return out + near[:4]

    def found(self, off: int, n: int, place: int) -> None:
        """The chunk at new offset ``off`` (``n`` bytes) was verified at basis offset ``place``."""
        self.shift = place - off
        self.anchor = place + n
        self.misses = 0

    def _cut_to_cover(self, hi: int) -> None:
        """Cut the basis (cut points only) from the last match's end to past ``hi``; record chunk lengths.

        The chain of cuts starts at :attr:`anchor` (the end of the last verified match, a cut
        point of the basis) and is extended, never re-cut, by later calls in the same run of
        misses; ``min_size`` bytes past ``hi`` are cut too. Callers raise ``hi`` the longer a
        run of misses lasts, so that chunks moved forward by a deletion are reached.
        """
        prm = self.params
        if not self._cut_from <= self.anchor <= self._cut_to:
            self._cut_from = self._cut_to = self.anchor
        start = self._cut_to
        end = min(self.size, max(hi + prm.min_size, start + prm.max_size))
        if end <= start or hi + prm.min_size <= start:
            return
        buf = os.pread(self.fd, end - start, start)
        cuts = chunking.cut_points(buf, prm, final=start + len(buf) >= self.size)
        self.cut_bytes += len(buf)
        prev = 0
        for c in cuts:
            self.by_length.setdefault(c - prev, []).append(start + prev)
            prev = c
        self._cut_to = start + prev
