"""Write-all loops, a quiet unlink, a background close: the few file helpers writers share.

``os.write`` and ``os.pwrite`` may write fewer bytes than asked (a signal, a full pipe, a
file system that splits large writes); these loops go on until every byte is written.
"""

from __future__ import annotations

import os
import threading

__all__ = ["write_all", "pwrite_all", "unlink_quiet", "close_later"]


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
