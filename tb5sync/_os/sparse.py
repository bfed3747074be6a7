"""Sparse files (rsync ``-S``): find a file's data, write runs of zero blocks as holes.

rsync's receiver with ``--sparse`` seeks over zeros instead of writing them (``write_sparse`` in
its ``fileio.c``, 1 KiB at a time), so every file-system block that holds only zeros is left
unallocated. Here the unit is :data:`BLOCK` (4 KiB, aligned to the file's offsets: the block
size of ext4, APFS and tmpfs), which leaves the same blocks unallocated on those file systems.

Where a file already holds holes, :func:`data_extents` finds its data with
``lseek(SEEK_DATA/SEEK_HOLE)`` (Linux, macOS, FreeBSD; looked up at run time); elsewhere, or with
``TB5SYNC_NO_SEEK_HOLE=1``, the whole file counts as data and the zero-block scan alone decides.
"""

from __future__ import annotations

import errno
import os

__all__ = ["BLOCK", "data_extents", "has_zero_blocks", "write_sparse", "copy_sparse", "seek_hole_supported"]

#: The unit of a hole, bytes (aligned to file offsets).
BLOCK = 4096
_ZERO = bytes(BLOCK)
_ZERO_BIG = bytes(64 * BLOCK)
#: Set to 1 to ignore SEEK_DATA/SEEK_HOLE (the portable path: every byte is read and scanned).
NO_SEEK_HOLE_ENV = "TB5SYNC_NO_SEEK_HOLE"


def seek_hole_supported() -> bool:
    """Whether :func:`data_extents` asks the file system (``os.SEEK_DATA`` exists and is not turned off)."""
    return hasattr(os, "SEEK_DATA") and hasattr(os, "SEEK_HOLE") and os.environ.get(NO_SEEK_HOLE_ENV, "") in ("", "0")


def data_extents(fd: int, size: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of the ranges of the first ``size`` bytes of ``fd`` that may hold data, in order.

    With ``SEEK_DATA``/``SEEK_HOLE`` the file system's holes are left out; without them (or when
    the file system answers ``EINVAL``/``ENXIO`` oddly) the whole range is one extent.
    """
    if size <= 0:
        return []
    if not seek_hole_supported():
        return [(0, size)]
    out: list[tuple[int, int]] = []
    pos = 0
    try:
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # no data past pos
                    break
                raise
            if start >= size:
                break
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            out.append((start, end - start))
            pos = end
    except OSError:
        return [(0, size)]
    return out


def _zero_blocks(buf: memoryview, off: int) -> list[tuple[int, int]]:
    """``(start, end)`` offsets within ``buf`` (which starts at file offset ``off``) of its whole
    aligned zero blocks, merged into runs."""
    runs: list[tuple[int, int]] = []
    n = len(buf)
    i = (-off) % BLOCK  # first aligned block
    while i + BLOCK <= n:
        if i + len(_ZERO_BIG) <= n and buf[i : i + len(_ZERO_BIG)] == _ZERO_BIG:
            j = i + len(_ZERO_BIG)
        elif buf[i : i + BLOCK] == _ZERO:
            j = i + BLOCK
        else:
            i += BLOCK
            continue
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], j)
        else:
            runs.append((i, j))
        i = j
    return runs


def has_zero_blocks(fd: int, size: int, bufsize: int = 8 * 1024 * 1024) -> bool:
    """Whether the data of ``fd`` (its first ``size`` bytes, see :func:`data_extents`) holds an
    aligned block of zeros that is allocated: one :func:`copy_sparse` would turn into a hole."""
    buf = bytearray(bufsize)
    mv = memoryview(buf)
    for start, length in data_extents(fd, size):
        pos = start
        while pos < start + length:
            k = os.preadv(fd, [mv[: min(bufsize, start + length - pos)]], pos)
            if k <= 0:
                break
            if _zero_blocks(mv[:k], pos):
                return True
            pos += k
    return False


def write_sparse(fd: int, data: bytes | bytearray | memoryview, off: int = 0) -> None:
    """``pwrite`` ``data`` at ``off`` of ``fd`` except its aligned zero blocks (left as holes when
    the file did not hold data there; the caller gives a new file, or truncates it to its size).

    Raises
    ------
    OSError
        A write failed.
    """
    mv = memoryview(data).cast("B")
    pos = 0
    for a, b in [*_zero_blocks(mv, off), (len(mv), len(mv))]:
        while pos < a:
            pos += os.pwrite(fd, mv[pos:a], off + pos)
        pos = max(pos, b)


def copy_sparse(src: int, dst: int, n: int, bufsize: int = 8 * 1024 * 1024) -> None:
    """Copy the first ``n`` bytes of ``src`` into the new, empty file ``dst``, zero blocks as holes.

    Only :func:`data_extents` of ``src`` are read; ``dst`` is truncated to ``n`` at the end.

    Raises
    ------
    OSError
        A read or write failed, or ``src`` is shorter than its extents say.
    """
    buf = bytearray(min(bufsize, max(n, 1)))
    mv = memoryview(buf)
    for start, length in data_extents(src, n):
        pos = start
        while pos < start + length:
            k = os.preadv(src, [mv[: min(len(buf), start + length - pos)]], pos)
            if k <= 0:
                raise OSError(errno.EIO, f"file shorter than {n} bytes")
            write_sparse(dst, mv[:k], pos)
            pos += k
    os.ftruncate(dst, n)
