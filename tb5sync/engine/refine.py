"""Sub-chunk refinement of a delta: send the changed parts of a missing chunk, not all of it.

With chunking format v1 (~1 MiB chunks) one edited byte costs a whole chunk on the wire. When
the receiver has a basis (the destination's old version of the file), for each chunk it lacks
it asks the sender for that chunk's *sub-chunk list*: FastCDC with small parameters
(:data:`SUB_PARAMS`, 4/16/64 KiB) cut from the chunk's first byte, each sub-chunk named by its
xxh3-128 digest. The receiver cuts the basis bytes the chunk most likely replaced with the same
parameters (:class:`BasisIndex`), copies the sub-chunks it finds there and fetches only the
others (:func:`plan`). The chunk is then verified against its BLAKE3 digest like any other
chunk, so a wrong match (or an xxh3 collision) costs one refetch of the whole chunk, never a
wrong byte at the final path.

This is rsync's idea (A. Tridgell, "Efficient Algorithms for Sorting and Synchronization", PhD
thesis, ANU, 1999: the receiver's blocks are matched and only the rest is sent) with
content-defined sub-chunks instead of fixed blocks and a rolling checksum (as in LBFS:
A. Muthitacharoen, B. Chen, D. Mazieres, "A Low-bandwidth Network File System", SOSP 2001).
The sub-chunk parameters travel in each request, so they are not part of the on-disk format.
"""

from __future__ import annotations

import bisect
import os
from typing import Any

import xxhash

import tb5sync.engine.chunking as chunking
from tb5sync._os.io import read_into
from tb5sync.engine.chunking import ChunkParams
from tb5sync.errors import RemoteProtocolError, UsageError

__all__ = [
    "SUB_PARAMS",
    "SUB_DIGEST_SIZE",
    "params_to_wire",
    "params_from_wire",
    "sub_chunk_list",
    "encode_subs",
    "decode_subs",
    "BasisIndex",
    "plan",
    "fill_copies",
    "Placements",
]

#: Sub-chunk parameters: 4 KiB min, 16 KiB average, 64 KiB max, normalization level 2.
#: Version 0: they are never written to disk (each request carries them).
SUB_PARAMS = ChunkParams(version=0, min_size=4096, avg_size=16384, max_size=65536, normalization=2)
#: Most sub-chunks a :class:`BasisIndex` holds before it starts over (~4 GiB of basis windows).
MAX_ENTRIES = 1 << 18
#: Bytes of a sub-chunk's name (xxh3-128).
SUB_DIGEST_SIZE = 16
#: Most sub-chunk parameters a request may ask for (bounds the sender's work per sub-chunk).
_MIN_SUB = 256
_MAX_SUB = 1024 * 1024


def params_to_wire(p: ChunkParams) -> list[int]:
    """``[min_size, avg_size, max_size, normalization]`` of ``p`` (bytes, bytes, bytes, level)."""
    return [p.min_size, p.avg_size, p.max_size, p.normalization]


def params_from_wire(value: Any) -> ChunkParams:
    """The :class:`ChunkParams` a request names, checked.

    Raises
    ------
    UsageError
        Not four ints, or sizes outside 256 B .. 1 MiB, or parameters ChunkParams refuses.
    """
    if not (isinstance(value, (list, tuple)) and len(value) == 4 and all(isinstance(x, int) for x in value)):
        raise UsageError("sub-chunk params must be [min_size, avg_size, max_size, normalization]")
    lo, avg, hi, nc = value
    if lo < _MIN_SUB or hi > _MAX_SUB:
        raise UsageError(f"sub-chunk sizes must lie within {_MIN_SUB}..{_MAX_SUB} bytes, got {lo}..{hi}")
    return ChunkParams(version=0, min_size=lo, avg_size=avg, max_size=hi, normalization=nc)


def sub_chunk_list(view: bytes | bytearray | memoryview, params: ChunkParams = SUB_PARAMS) -> list[tuple[bytes, int]]:
    """Cut ``view`` with ``params`` from its first byte and name each piece by xxh3-128.

    Returns
    -------
    list of (digest, length)
        16-byte digests and lengths in bytes, in order; the lengths sum to ``len(view)``.
    """
    mv = memoryview(view)
    out = []
    prev = 0
    for c in chunking.cut_points(mv, params):
        out.append((xxhash.xxh3_128_digest(mv[prev:c]), c - prev))
        prev = c
    return out


def encode_subs(subs: list[tuple[bytes, int]]) -> list[Any]:
    """Wire form of a sub-chunk list: ``[concatenated digests (bytes), [length, ...]]``."""
    return [b"".join(d for d, _ in subs), [n for _, n in subs]]


def decode_subs(value: Any, total: int) -> list[tuple[bytes, int]]:
    """Inverse of :func:`encode_subs`, checked against the chunk length ``total`` (bytes).

    Raises
    ------
    RemoteProtocolError
        Malformed, or the lengths do not add up to ``total``.
    """
    if not (isinstance(value, (list, tuple)) and len(value) == 2):
        raise RemoteProtocolError("malformed sub-chunk list")
    blob, lengths = value
    if not isinstance(blob, bytes) or not isinstance(lengths, list) or len(blob) != SUB_DIGEST_SIZE * len(lengths):
        raise RemoteProtocolError("malformed sub-chunk list")
    if not all(isinstance(n, int) and n > 0 for n in lengths) or sum(lengths) != total:
        raise RemoteProtocolError("sub-chunk lengths do not add up to the chunk")
    k = SUB_DIGEST_SIZE
    return [(blob[i * k : (i + 1) * k], n) for i, n in enumerate(lengths)]


class BasisIndex:
    """Sub-chunks of windows of a basis file: xxh3-128 digest -> offset in the basis.

    Parameters
    ----------
    fd : int
        The basis, open for reading (not closed here).
    size : int
        Its size in bytes.
    params : ChunkParams
        Sub-chunk parameters (the same as the sender's).

    Notes
    -----
    A window is cut from its own first byte, so its sub-chunks line up with the sender's when
    it starts where the missing chunk's old version started (the end of the basis copy of the
    chunk before it); further in, content-defined cuts resynchronise after an edit by
    themselves. Windows already indexed are not read again.
    """

    def __init__(self, fd: int, size: int, params: ChunkParams = SUB_PARAMS) -> None:
        self.fd = fd
        self.size = size
        self.params = params
        self._where: dict[tuple[bytes, int], int] = {}
        self._windows: set[tuple[int, int]] = set()
        self.indexed_bytes = 0

    def add_window(self, start: int, end: int) -> None:
        """Index the sub-chunks of basis bytes ``[start, end)`` (clipped to the file).

        Raises
        ------
        OSError
            The basis cannot be read.
        """
        start = max(0, min(start, self.size))
        end = max(start, min(end, self.size))
        if end <= start or (start, end) in self._windows:
            return
        if len(self._where) > MAX_ENTRIES:
            # Bounded memory (~275 bytes per entry): windows far behind are rarely asked again.
            self._where.clear()
            self._windows.clear()
        self._windows.add((start, end))
        data = os.pread(self.fd, end - start, start)
        off = start
        for d, n in sub_chunk_list(data, self.params):
            self._where.setdefault((d, n), off)
            off += n
        self.indexed_bytes += len(data)

    def find(self, digest: bytes, length: int) -> int | None:
        """Basis offset of a sub-chunk with this digest and length, or None."""
        return self._where.get((digest, length))

    def holds(self, at: int, digest: bytes, length: int) -> bool:
        """Whether basis bytes ``[at, at + length)`` have this xxh3-128 digest (one read)."""
        if at < 0 or at + length > self.size:
            return False
        data = os.pread(self.fd, length, at)
        return len(data) == length and xxhash.xxh3_128_digest(data) == digest


def plan(
    subs: list[tuple[bytes, int]], index: BasisIndex
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """Split a missing chunk into what the basis has and what must be fetched.

    Parameters
    ----------
    subs : list of (digest, length)
        The chunk's sub-chunk list from the sender, in order.
    index : BasisIndex
        Sub-chunks of the basis windows indexed so far.

    Returns
    -------
    (copies, fetches)
        ``copies``: ``(offset in chunk, basis offset, length)``; ``fetches``:
        ``(offset in chunk, length)``. Both in bytes, adjacent pieces merged, together covering
        the chunk exactly once.
    """
    where: list[int | None] = [index.find(d, n) for d, n in subs]
    # A sub-chunk cut by the end of the chunk (or begun by its start) is rarely a sub-chunk of
    # the basis window, but its bytes usually sit right after (before) a neighbour that
    # matched: try that one place, one read each, going forward from matches, then backward.
    for i in range(1, len(subs)):
        prev_at = where[i - 1]
        if where[i] is None and prev_at is not None and index.holds(prev_at + subs[i - 1][1], *subs[i]):
            where[i] = prev_at + subs[i - 1][1]
    for i in range(len(subs) - 2, -1, -1):
        next_at = where[i + 1]
        if where[i] is None and next_at is not None and index.holds(next_at - subs[i][1], *subs[i]):
            where[i] = next_at - subs[i][1]
    copies: list[tuple[int, int, int]] = []
    fetches: list[tuple[int, int]] = []
    off = 0
    for (_, n), at in zip(subs, where):
        if at is None:
            if fetches and fetches[-1][0] + fetches[-1][1] == off:
                fetches[-1] = (fetches[-1][0], fetches[-1][1] + n)
            else:
                fetches.append((off, n))
        elif copies and copies[-1][0] + copies[-1][2] == off and copies[-1][1] + copies[-1][2] == at:
            copies[-1] = (copies[-1][0], copies[-1][1], copies[-1][2] + n)
        else:
            copies.append((off, at, n))
        off += n
    return copies, fetches


def fill_copies(buf: memoryview, fd: int, copies: list[tuple[int, int, int]]) -> None:
    """Read each ``(offset in chunk, basis offset, length)`` of ``copies`` from ``fd`` into ``buf``.

    Raises
    ------
    OSError
        A read fails or ends early (the basis shrank): the chunk cannot be assembled.
    """
    for at, src, n in copies:
        got = 0
        while got < n:
            k = read_into(fd, buf[at + got : at + n], src + got)
            if k <= 0:
                raise OSError(f"basis ended at {src + got} bytes while copying a sub-chunk")
            got += k


class Placements:
    """Where chunks of the new file were found in the basis, to guess where a missing one was.

    ``record`` is called in increasing order of new-file offset (the order chunks are planned).
    """

    def __init__(self) -> None:
        self._new: list[int] = []
        self._old: list[int] = []

    def record(self, new_off: int, basis_off: int) -> None:
        """Chunk at ``new_off`` (bytes) of the new file was found at ``basis_off`` of the basis."""
        if self._new and new_off <= self._new[-1]:
            return
        self._new.append(new_off)
        self._old.append(basis_off)

    def hint(self, new_off: int) -> int:
        """Likely basis offset of the bytes at ``new_off``: same shift as the last chunk found before it."""
        k = bisect.bisect_left(self._new, new_off) - 1
        if k < 0:
            return new_off
        return self._old[k] + (new_off - self._new[k])
