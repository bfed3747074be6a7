"""Disk throughput of one directory: write a temporary file, read it back cold, remove it.

Used by ``tb5sync bench`` on both ends: the client in its ``--dir`` (default the current
directory), the server in its state directory (``ROOT/.tb5sync`` or ``--state-dir``) for the
``disk`` session op. The file is named ``.tb5sync-bench-<random>.tmp``, created exclusively
(mode 0600), held under an exclusive ``flock`` while the test runs, and removed whatever happens.
A process killed mid-test cannot remove it: :func:`remove_stale` (run by a server as it starts)
removes the ones no live test holds. A caller's ``alive()`` is asked between blocks, so a test
whose client went away stops within one block.

Reading back "cold" (from the disk, not the page cache) needs the written pages dropped from the
cache. ``O_DIRECT`` would do it but is Linux-only and needs aligned buffers, so the method is
chosen at run time (:func:`cache_drop_method`):

- ``"fadvise"``: ``posix_fadvise(POSIX_FADV_DONTNEED)`` after ``fsync`` (Linux, the BSDs): the
  clean pages are dropped;
- ``"nocache"``: ``fcntl(F_NOCACHE)`` on the write and read descriptors (macOS, which has no
  ``posix_fadvise``): the data is not kept in the unified buffer cache;
- ``"none"``: neither exists; the read may come from the cache, and the result says so
  (``cold`` False), so the caller can use a file larger than the memory instead.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import sys
import time
from collections.abc import Callable
from typing import Any

from tb5sync.errors import ConnectError, DestinationError, UsageError

__all__ = ["disk_rates", "remove_stale", "cache_drop_method", "BLOCK", "MIN_SIZE", "MAX_SIZE", "FREE_MARGIN"]

#: Names of test files (``.tb5sync-bench-<16 hex>.tmp``).
_NAME = re.compile(r"\.tb5sync-bench-[0-9a-f]{16}\.tmp\Z")
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)

#: Bytes per write and read call.
BLOCK = 4 * 1024 * 1024
#: Smallest and largest test file, bytes.
MIN_SIZE = 1024 * 1024
MAX_SIZE = 64 * 1024 * 1024 * 1024
#: Free space that must remain after the test file is written, bytes.
FREE_MARGIN = 256 * 1024 * 1024
#: macOS's F_NOCACHE (sys/fcntl.h), for Pythons whose fcntl module does not name it.
_F_NOCACHE_DARWIN = 48


def cache_drop_method() -> str:
    """``"fadvise"``, ``"nocache"`` or ``"none"``: how this platform gets a cold read (module docstring)."""
    if hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_DONTNEED"):
        return "fadvise"
    if sys.platform == "darwin":
        return "nocache"
    return "none"


def _nocache(fd: int) -> None:
    import fcntl

    fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", _F_NOCACHE_DARWIN), 1)


def remove_stale(directory: str | os.PathLike[str]) -> int:
    """Remove the test files in ``directory`` that no running test holds (left by a killed process).

    A running test holds its file under an exclusive ``flock``; a file that cannot be locked
    without waiting is left alone. Symlinks are never followed; errors are ignored (a
    directory that cannot be listed has nothing removed).

    Returns
    -------
    int
        Files removed.
    """
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC)
    except OSError:
        return 0
    removed = 0
    try:
        for name in os.listdir(dfd):
            if not _NAME.match(name):
                continue
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, dir_fd=dfd)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by a live test: BlockingIOError
                os.unlink(name, dir_fd=dfd)
                removed += 1
            except OSError:
                pass
            finally:
                os.close(fd)
    finally:
        os.close(dfd)
    return removed


def _check_alive(alive: Callable[[], bool] | None, directory: str) -> None:
    if alive is not None and not alive():
        raise ConnectError(f"disk test in {directory}: stopped (the client went away or the server is stopping)")


def disk_rates(directory: str | os.PathLike[str], size: int, alive: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Write ``size`` bytes to a new file in ``directory`` (then ``fsync``), read them back cold,
    remove the file.

    Parameters
    ----------
    directory : str or path
        An existing, writable directory.
    size : int
        Bytes, ``MIN_SIZE`` .. ``MAX_SIZE``.
    alive : callable, optional
        Asked before each block of :data:`BLOCK` bytes written or read; when it answers False
        the test stops (``ConnectError``) and its file is removed.

    Returns
    -------
    dict
        ``{"bytes": int, "write_seconds": float, "read_seconds": float, "cold": bool,
        "method": str}``: the write time includes the ``fsync``; ``cold`` is False when the read
        may have come from the page cache (``method`` ``"none"``).

    Raises
    ------
    UsageError
        ``size`` out of range.
    DestinationError
        ``directory`` is missing or not writable, has less than ``size + FREE_MARGIN`` bytes free,
        or a write or read failed (the message names the directory and the cause).
    ConnectError
        ``alive()`` answered False.
    """
    if isinstance(size, bool) or not isinstance(size, int) or not MIN_SIZE <= size <= MAX_SIZE:
        raise UsageError(f"disk test size must be {MIN_SIZE}..{MAX_SIZE} bytes, got {size!r}")
    directory = os.fspath(directory)
    try:
        st = os.statvfs(directory)
    except OSError as exc:
        raise DestinationError(f"disk test in {directory}: {exc.strerror or exc}") from exc
    free = st.f_bavail * st.f_frsize
    if free < size + FREE_MARGIN:
        raise DestinationError(f"disk test in {directory}: {free >> 20} MiB free, the test needs "
                               f"{(size + FREE_MARGIN) >> 20} MiB (its size plus a margin); choose a smaller size")
    method = cache_drop_method()
    path = os.path.join(directory, f".tb5sync-bench-{secrets.token_hex(8)}.tmp")
    block = os.urandom(BLOCK)  # incompressible, so a compressing file system shows its real rate
    buf = bytearray(BLOCK)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC, 0o600)
    except OSError as exc:
        raise DestinationError(f"disk test in {directory}: cannot create a file: {exc.strerror or exc}") from exc
    lock = -1
    try:
        try:
            lock = os.open(path, os.O_RDONLY | _CLOEXEC)  # held until the file is removed: not stale
            fcntl.flock(lock, fcntl.LOCK_EX)
            if method == "nocache":
                _nocache(fd)
            t = time.perf_counter()
            left = size
            while left:
                _check_alive(alive, directory)
                view = memoryview(block)[: min(left, BLOCK)]
                left -= len(view)
                while view:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
            write_s = time.perf_counter() - t
            if method == "fadvise":
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            if method == "nocache":
                _nocache(fd)
            elif method == "fadvise":
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t = time.perf_counter()
            got = 0
            while True:
                _check_alive(alive, directory)
                n = os.readv(fd, [buf])
                if n == 0:
                    break
                got += n
            read_s = time.perf_counter() - t
        finally:
            os.close(fd)
        if got != size:
            raise DestinationError(f"disk test in {directory}: read back {got} of {size} bytes")
    except OSError as exc:
        if isinstance(exc, (DestinationError, ConnectError)):
            raise
        raise DestinationError(f"disk test in {directory}: {exc.strerror or exc}") from exc
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        if lock >= 0:
            os.close(lock)
    return {"bytes": size, "write_seconds": write_s, "read_seconds": read_s,
            "cold": method != "none", "method": method}
