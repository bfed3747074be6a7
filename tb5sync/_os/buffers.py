"""Buffer pools: the one home of reused buffers, so that large reads and receives do not fault in fresh pages.

Two disciplines, one per kind of owner:

* :class:`BufferPool` (receive side): buffers are handed out with :meth:`BufferPool.get` and given
  back explicitly with :meth:`BufferPool.put` once nothing reads them (the links' ``recycle``),
  because DATA bodies are cut into views that outlive the frame.
* :class:`ReadBuffers` (send side): a buffer is free again as soon as no memoryview of it is
  alive (sent, or consumed by an in-process receiver), so no caller has to give it back.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable

__all__ = ["BufferPool", "ReadBuffers"]

#: Whole units (bytes) in which :class:`ReadBuffers` sizes new buffers above one unit.
_UNIT = 4 * 1024 * 1024
#: Extra bytes a reused :class:`ReadBuffers` buffer may have beyond twice the request.
_SLACK = 8 * 1024 * 1024


class BufferPool:
    """Reusable receive buffers for large frames, so that each frame does not allocate and zero
    a fresh buffer (page faults and memset cost about as much as the copy from the socket).

    Parameters
    ----------
    max_buffers : int
        Most buffers kept for reuse; more are left to the garbage collector.
    min_size : int
        Frames with smaller payloads (bytes) are not pooled: allocating them is cheap.
    make : callable(int) -> bytearray or mmap.mmap
        Makes a new buffer of that many bytes (:func:`tb5sync._os.io.populated_buffer` for a
        session's receive buffers: their pages in place in one call).

    Notes
    -----
    Thread-safe. A buffer handed out by :meth:`get` must be given back with :meth:`put`
    only once nothing reads it any more; one that is never given back is simply freed.
    """

    def __init__(self, max_buffers: int = 16, min_size: int = 1024 * 1024,
                 make: Callable[[int], bytearray | mmap.mmap] = bytearray) -> None:
        self.max_buffers = max_buffers
        self.min_size = min_size
        self.make = make
        self._free: list[bytearray | mmap.mmap] = []
        self._lock = threading.Lock()

    def get(self, n: int) -> bytearray | mmap.mmap:
        """A buffer of at least ``n`` bytes (rounded up to whole MiB when new, made by ``make``: a
        ``bytearray`` or an anonymous mapping); contents undefined."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if n <= len(buf) <= 2 * n:
                    return self._free.pop(i)
        return self.make(-(-n // 1048576) * 1048576)

    def put(self, buf: bytearray | mmap.mmap) -> None:
        """Give ``buf`` back for reuse; the caller must hold no views into it that are still read."""
        with self._lock:
            if len(self._free) < self.max_buffers:
                self._free.append(buf)

    def give_back(self, obj: object) -> None:
        """:meth:`put` ``obj`` (the ``obj`` of a received payload's view) if it is a buffer of the
        kinds this pool hands out and of at least :attr:`min_size` bytes; anything else is left alone.
        The caller must hold no views into it that are still read."""
        if isinstance(obj, (bytearray, mmap.mmap)) and len(obj) >= self.min_size:
            self.put(obj)


class ReadBuffers:
    """Reusable buffers for :meth:`Sender.read_ranges`, handed out only when nothing views them.

    Reading each range into a fresh ``bytes`` costs page faults that take longer than the
    copy itself; these buffers are reused instead. A buffer is free again once every
    memoryview of it is gone (sent, or consumed by an in-process receiver): CPython refuses
    to resize a ``bytearray`` with live exports, which is the test used here.

    Parameters
    ----------
    max_buffers : int
        Most buffers kept; when all are in use a new one is made and dropped after use.
    """

    def __init__(self, max_buffers: int = 16) -> None:
        self.max_buffers = max_buffers
        self._bufs: list[bytearray] = []
        self._lock = threading.Lock()

    @staticmethod
    def _free(buf: bytearray) -> bool:
        try:
            buf.append(buf.pop())
        except BufferError:
            return False
        return True

    def get(self, n: int) -> memoryview:
        """A view of ``n`` bytes of a buffer nothing else refers to; contents undefined.

        The view is made under the lock, so the buffer counts as busy before another
        thread can look at it; it is free again once this view and all views cut from
        it are released.
        """
        with self._lock:
            for buf in self._bufs:
                if n <= len(buf) <= 2 * n + _SLACK and self._free(buf):
                    return memoryview(buf)[:n]
            # whole 4 MiB units, so that one buffer serves the next requests of similar size
            buf = bytearray(-(-n // _UNIT) * _UNIT if n > _UNIT else max(n, 1))
            if len(self._bufs) < self.max_buffers:
                self._bufs.append(buf)
            else:  # replace a free buffer of the wrong size, if any
                for i, old in enumerate(self._bufs):
                    if self._free(old):
                        self._bufs[i] = buf
                        break
            return memoryview(buf)[:n]
