"""Write-all loops, a quiet unlink, a background close, a rate limit, and the portable choice of
the Linux-only file calls: the few file helpers readers and writers share.

``os.write`` and ``os.pwrite`` may write fewer bytes than asked (a signal, a full pipe, a
file system that splits large writes); these loops go on until every byte is written.

:func:`portable` is the one switch that forces every portable path at once
(``$TB5SYNC_PORTABLE=1``: what a system without the Linux calls gets; docs/ARCHITECTURE.md,
"Portability"): :func:`read_into` without ``preadv``, :func:`copy_range` without
``copy_file_range``, :func:`populated_buffer` without ``MAP_POPULATE``; other modules ask it
before ``sendfile``, ``sync_file_range``, ``openat2``, ``FICLONE`` and ``TCP_USER_TIMEOUT``.
:func:`durable_sync` is the one flush to stable storage (``F_FULLFSYNC`` on macOS, where
``fsync`` leaves data in the drive's cache).
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["splice_to_file", "splice_to_file_py", "HAVE_SPLICE", "durable_sync", "write_all", "pwrite_all", "unlink_quiet", "close_later", "portable", "read_into", "copy_range",
           "populated_buffer", "preallocate", "PORTABLE_ENV", "RateLimit", "usable_cpus", "map_read"]

#: Set to anything but ``0`` (or empty): every Linux-only call takes its portable path.
PORTABLE_ENV = "TB5SYNC_PORTABLE"

#: errno values after which ``copy_file_range`` is given up for a read and a write (another file
#: system, one that cannot, a kernel without it, a seccomp filter).
_NO_COPY_RANGE = frozenset(e for e in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP,
                                       getattr(errno, "ENOTSUP", None), errno.EPERM, errno.EIO) if e is not None)
_COPY_BLOCK = 1 << 20


def portable(specific: str | None = None) -> bool:
    """True when ``$TB5SYNC_PORTABLE`` (or the ``specific`` variable, e.g.
    ``TB5SYNC_JAIL_PORTABLE``) is set to anything but ``0``: take the portable path."""
    return os.environ.get(PORTABLE_ENV, "0") not in ("", "0") or (
        specific is not None and os.environ.get(specific, "0") not in ("", "0"))


def usable_cpus() -> int:
    """How many CPUs this process may run on (>= 1): the size of its affinity set
    (``sched_getaffinity``, Linux: what ``taskset``, ``numactl`` or a cgroup cpuset leaves it),
    else, where there is no such call (macOS) or with ``$TB5SYNC_PORTABLE=1``, ``os.cpu_count()``.

    Thread pools are sized from this, so that a process pinned to 2 of 16 cores does not start
    16 hashing threads that take turns on 2. Python 3.13's ``os.process_cpu_count`` is the same.
    """
    if hasattr(os, "sched_getaffinity") and not portable():
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except OSError:
            pass
    return os.cpu_count() or 1


try:
    import fcntl as _fcntl
except ImportError:  # not a POSIX system
    _fcntl = None  # type: ignore[assignment]

#: ``fcntl(fd, F_FULLFSYNC)`` (macOS, iOS): None where the system has no such call.
_F_FULLFSYNC: int | None = getattr(_fcntl, "F_FULLFSYNC", None)


def durable_sync(fd: int) -> None:
    """Flush ``fd``'s data and metadata to stable storage, so that they survive a power cut.

    On macOS ``fsync(2)`` only hands the data to the drive, whose cache may still lose it; Apple's
    ``fcntl(fd, F_FULLFSYNC)`` asks the drive to flush too (Apple, fsync(2) and fcntl(2) man
    pages; SQLite's ``PRAGMA fullfsync`` is the same call). Where the system has no
    ``F_FULLFSYNC`` (Linux: ``fsync`` already flushes the drive's cache), or the file system
    refuses it (``ENOTSUP``/``EINVAL``: some network and FUSE file systems), ``fsync``.

    Raises
    ------
    OSError
        As ``fsync(2)`` (``EIO``: the data may be lost; ``EBADF``, ...).
    """
    if _F_FULLFSYNC is not None:
        try:
            _fcntl.fcntl(fd, _F_FULLFSYNC)
            return
        except OSError as exc:
            if exc.errno in (errno.EBADF, errno.EIO):
                raise
    os.fsync(fd)


def populated_buffer(n: int) -> bytearray | mmap.mmap:
    """A writable buffer of ``n`` bytes (``n`` >= 1) whose pages are all in place; its contents are zeros.

    Linux: an anonymous private mapping made with ``MAP_POPULATE``, every page put in place by the
    one ``mmap`` call instead of one fault per 4 KiB page at first touch: 14 receive buffers of
    9 MiB cost 49 ms of CPU that way against 78 ms (``benches/README.md``, p16m). CPython 3.11
    holds the GIL during that call, as it did while a ``bytearray`` was zeroed.
    Elsewhere (macOS has no ``MAP_POPULATE``), with :func:`portable`, or if the mapping is refused:
    a ``bytearray``, whose pages fault in as it is zeroed.
    """
    flag = getattr(mmap, "MAP_POPULATE", 0)
    if flag and not portable():
        try:
            return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flag)
        except (OSError, ValueError):
            pass
    return bytearray(n)


def read_into(fd: int, view: memoryview, off: int) -> int:
    """Read up to ``len(view)`` bytes at offset ``off`` of ``fd`` into ``view``; returns the count (0 at the end).

    ``preadv`` (straight into the buffer: Linux, macOS >= 11, the BSDs) where ``os`` has it,
    else ``pread`` and a copy (also with :func:`portable`). May return less than asked.

    Raises
    ------
    OSError
        The read failed.
    """
    if hasattr(os, "preadv") and not portable():
        return os.preadv(fd, [view], off)
    data = os.pread(fd, len(view), off)
    view[: len(data)] = data
    return len(data)


def copy_range(src: int, dst: int, n: int, src_off: int | None = None, dst_off: int | None = None) -> int:
    """Copy up to ``n`` bytes from ``src`` to ``dst``; returns the count (0 at the source's end).

    ``copy_file_range`` (Linux: in the kernel, a reflink where the file system shares extents)
    where ``os`` has it, else (macOS, :func:`portable`, or a file system or kernel that refuses
    it) a ``pread``/``pwrite`` of at most 1 MiB. ``None`` offsets use and move the file
    offsets, as ``copy_file_range`` does.

    Raises
    ------
    OSError
        A read or write failed.
    """
    if hasattr(os, "copy_file_range") and not portable():
        try:
            return os.copy_file_range(src, dst, n, src_off, dst_off)
        except OSError as exc:
            if exc.errno not in _NO_COPY_RANGE:
                raise
    data = os.pread(src, min(n, _COPY_BLOCK), src_off) if src_off is not None else os.read(src, min(n, _COPY_BLOCK))
    if dst_off is not None:
        pwrite_all(dst, data, dst_off)
    else:
        write_all(dst, data)
    return len(data)


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """Write all of ``data`` at the current offset of ``fd``.

    Raises
    ------
    OSError
        A write failed (some of ``data`` may be written).
    """
    view = memoryview(data)
    while view:
        k = os.write(fd, view)
        view = view[k:]


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, off: int) -> None:
    """Write all of ``data`` at byte offset ``off`` of ``fd`` (the file offset does not move).

    Raises
    ------
    OSError
        A write failed (some of ``data`` may be written).
    """
    view = memoryview(data)
    while view:
        k = os.pwrite(fd, view, off)
        view = view[k:]
        off += k


#: errno values of ``posix_fallocate`` that mean "this file system cannot": the file is then
#: written without preallocation (a full disk, ``ENOSPC``, is an error, as is any other).
_NO_FALLOCATE = frozenset(e for e in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", None))
                          if e is not None)


def preallocate(fd: int, size: int) -> bool:
    """Reserve the first ``size`` bytes of the new file ``fd`` on disk before it is written.

    Linux: ``posix_fallocate(fd, 0, size)``, so that a full disk fails here, before any byte
    travels, and the page-cache writes that follow skip delayed block allocation (a streamed
    ``get_file`` of 256 MiB measured 1.39-1.46 GB/s with it against 1.02-1.24 without, medians
    of 6, alternating). Elsewhere (macOS has no ``posix_fallocate``), with :func:`portable`
    (``$TB5SYNC_PORTABLE`` or ``$TB5SYNC_FALLOCATE_PORTABLE``), for ``size`` 0 or on a file system
    that cannot (``EINVAL``/``EOPNOTSUPP``/``ENOSYS``): nothing, and False. True when reserved.

    Raises
    ------
    OSError
        ``ENOSPC`` (the disk cannot hold ``size`` bytes), ``EFBIG``, or another error of the call.
    """
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None or size <= 0 or portable("TB5SYNC_FALLOCATE_PORTABLE"):
        return False
    try:
        fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in _NO_FALLOCATE:
            return False
        raise
    return True


def unlink_quiet(path: str) -> None:
    """Remove the file ``path``; a missing file or any other ``OSError`` is ignored."""
    try:
        os.unlink(path)
    except OSError:
        pass


def close_later(fd: int) -> None:
    """Close ``fd`` on a daemon thread.

    For a descriptor whose close may be slow and need not be waited for: the last reference
    to an unlinked file (the kernel frees its blocks and pages in that close). The caller
    must not use ``fd`` again.
    """
    threading.Thread(target=os.close, args=(fd,), name="tb5-release", daemon=True).start()


class RateLimit:
    """At most ``rate`` bytes per second, shared by every thread that calls :meth:`take`.

    Each :meth:`take` books its bytes on one timeline (the time the link would need at
    ``rate``, after what was booked before) and sleeps until its slot ends, less a burst
    allowance of 50 ms; so N bytes taken by any number of threads take at least about
    N / rate seconds in all. rsync's ``--bwlimit`` sleeps the same way after each write
    (io.c, ``sleep_for_bwlimit``). The sleep is cut in slices of :attr:`SLICE` seconds, each
    followed by the caller's ``stop`` check, so a wait ends soon after its session does.

    Parameters
    ----------
    rate : int
        Bytes per second, > 0.
    """

    BURST = 0.05  # seconds of slack a caller may run ahead of the timeline
    SLICE = 0.2  # longest sleep between two ``stop`` checks, seconds

    def __init__(self, rate: int) -> None:
        import time

        self.rate = rate
        self._clock = time.monotonic
        self._sleep = time.sleep
        self._lock = threading.Lock()
        self._free = self._clock()  # when the bytes booked so far will have gone out

    def take(self, nbytes: int, stop: Callable[[], str | None] | None = None, *, max_wait: float | None = None) -> float:
        """Book ``nbytes`` and sleep until they are due; returns the seconds slept.

        Parameters
        ----------
        nbytes : int
            Bytes about to be sent.
        stop : callable or None
            Called every :attr:`SLICE` seconds while sleeping: a str (why: "the session
            ended", "the peer closed the connection") ends the wait with ``ConnectError``.
        max_wait : float or None
            Longest wait allowed, seconds (a server's idle timeout): a longer one is refused
            at once (nothing booked) with ``LinkTimeoutError``. None: no limit.

        Raises
        ------
        ConnectError
            ``stop`` gave a reason (the bytes booked are given back).
        LinkTimeoutError
            The wait would exceed ``max_wait``.
        """
        if nbytes <= 0:
            return 0.0
        with self._lock:
            now = self._clock()
            due = max(self._free, now) + nbytes / self.rate
            wait = due - now - self.BURST
            if max_wait is not None and wait > max_wait:
                from tb5sync.errors import LinkTimeoutError

                raise LinkTimeoutError(
                    f"--bwlimit of {self.rate} B/s: sending {nbytes} bytes would wait {wait:.0f} s, "
                    f"longer than the idle timeout ({max_wait:g} s)")
            self._free = due
        if wait <= 0:
            return 0.0
        end = now + wait
        while True:
            left = end - self._clock()
            if left <= 0:
                return wait
            reason = stop() if stop is not None else None
            if reason:
                from tb5sync.errors import ConnectError

                with self._lock:  # give the rest of the slot back to the other streams
                    self._free -= min(nbytes / self.rate, max(0.0, due - self._clock()))
                raise ConnectError(f"--bwlimit wait ended: {reason}")
            self._sleep(min(left, self.SLICE) if stop is not None else left)
        with self._lock:
            now = self._clock()
            self._free = max(self._free, now) + nbytes / self.rate
            wait = self._free - now - self.BURST
        if wait > 0:
            self._sleep(wait)
            return wait
        return 0.0


# ---- a read-only mapping whose munmap does not hold the GIL --------------------------------
try:
    from tb5sync._bytes import ReadMapping as _CyReadMapping
except ImportError:  # built without the Cython cores
    _CyReadMapping = None


def map_read(fd: int, length: int, offset: int = 0) -> "mmap.mmap | Any":
    """A read-only shared mapping of ``length`` (> 0) bytes of file ``fd`` from ``offset`` (a
    multiple of ``mmap.ALLOCATIONGRANULARITY``): a buffer (``memoryview`` it) with ``close()``.

    ``tb5sync._bytes.ReadMapping`` where built (``mmap`` and ``munmap`` with the GIL released:
    unmapping a 32 MiB span of page-cache pages holds ``mmap.mmap.close`` for a fraction of a
    millisecond, every other thread waiting), else, or with ``$TB5SYNC_PUREPYTHON=1`` (read per
    call), ``mmap.mmap(fd, length, access=ACCESS_READ, offset=offset)``. Both refuse to close
    while a view is held (``BufferError``).

    Raises
    ------
    OSError
        The file cannot be mapped.
    ValueError
        ``length`` is not positive, or ``offset`` is not aligned.
    """
    if _CyReadMapping is not None and os.environ.get("TB5SYNC_PUREPYTHON") != "1":
        if offset % mmap.ALLOCATIONGRANULARITY:
            raise ValueError("offset must be a multiple of mmap.ALLOCATIONGRANULARITY")
        return _CyReadMapping(fd, length, offset)
    return mmap.mmap(fd, length, access=mmap.ACCESS_READ, offset=offset)


# ---- splice: a socket's bytes into a file's page cache -------------------------------------
try:  # the Cython loop (GIL released for the whole range), unless TB5SYNC_PUREPYTHON=1
    from tb5sync._bytes import HAVE_SPLICE as _CY_SPLICE, splice_to_file as _cy_splice_to_file
except ImportError:
    _CY_SPLICE, _cy_splice_to_file = False, None


def splice_to_file_py(sock: int, pr: int, pw: int, fd: int, off: int, n: int, chunk: int) -> tuple[int, int, int, int]:
    """The pure-Python twin of ``tb5sync._bytes.splice_to_file`` (``os.splice``; same results).

    Moves ``n`` bytes from socket ``sock`` to file ``fd`` at ``off`` through the pipe ``(pr, pw)``,
    ``chunk`` bytes at a time. Returns ``(taken, written, errno, side)``: bytes taken from the
    socket, bytes written (the pipe holds the rest), and where it stopped early: ``side`` -1
    (done), 0 (the socket failed with ``errno``), 1 (the file did), 2 (the socket's end).
    """
    taken = written = 0
    flags = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_MORE", 4)
    while written < n:
        if taken == written:
            try:
                k = os.splice(sock, pw, min(n - taken, chunk), flags=flags)
            except InterruptedError:
                continue
            except OSError as exc:
                return taken, written, exc.errno or errno.EIO, 0
            if k == 0:
                return taken, written, 0, 2
            taken += k
        try:
            m = os.splice(pr, fd, taken - written, offset_dst=off + written, flags=getattr(os, "SPLICE_F_MOVE", 1))
        except InterruptedError:
            continue
        except OSError as exc:
            return taken, written, exc.errno or errno.EIO, 1
        if m == 0:
            return taken, written, errno.EIO, 1
        written += m
    return taken, written, 0, -1


#: Whether :func:`splice_to_file` can run here (Linux); ``$TB5SYNC_SPLICE_PORTABLE=1`` (or
#: ``$TB5SYNC_PORTABLE=1``) makes the transport receive into buffers instead (its portable twin).
HAVE_SPLICE = hasattr(os, "splice") and sys.platform.startswith("linux")
splice_to_file: Callable[[int, int, int, int, int, int, int], tuple[int, int, int, int]] = (
    _cy_splice_to_file if _CY_SPLICE and _cy_splice_to_file is not None and os.environ.get("TB5SYNC_PUREPYTHON") != "1"
    else splice_to_file_py
)
