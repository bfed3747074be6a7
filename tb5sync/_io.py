"""Write-all loops, a quiet unlink, a background close, a rate limit: the few I/O helpers writers share.

``os.write`` and ``os.pwrite`` may write fewer bytes than asked (a signal, a full pipe, a
file system that splits large writes); these loops go on until every byte is written.
"""

from __future__ import annotations

import os
import threading

__all__ = ["write_all", "pwrite_all", "unlink_quiet", "close_later", "RateLimit"]


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
    (io.c, ``sleep_for_bwlimit``).

    Parameters
    ----------
    rate : int
        Bytes per second, > 0.
    """

    BURST = 0.05  # seconds of slack a caller may run ahead of the timeline

    def __init__(self, rate: int) -> None:
        import time

        self.rate = rate
        self._clock = time.monotonic
        self._sleep = time.sleep
        self._lock = threading.Lock()
        self._free = self._clock()  # when the bytes booked so far will have gone out

    def take(self, nbytes: int) -> float:
        """Book ``nbytes`` and sleep until they are due; returns the seconds slept."""
        if nbytes <= 0:
            return 0.0
        with self._lock:
            now = self._clock()
            self._free = max(self._free, now) + nbytes / self.rate
            wait = self._free - now - self.BURST
        if wait > 0:
            self._sleep(wait)
            return wait
        return 0.0
