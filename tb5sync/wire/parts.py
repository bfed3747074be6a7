"""Reply parts backed by files: what a sender hands the transport to send with ``sendfile(2)``.

No sockets here: roles (the sender, the fs operations) build replies from these, and
:mod:`tb5sync.wire.transport` sends them (``sendfile`` where the socket allows, a read and a
send otherwise); :func:`tb5sync.wire.rpc.serve` closes them once sent.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["FileRange", "InFile", "SharedFd", "close_parts"]


class FileRange:
    """A part of a DATA reply that is sent straight from a file with ``sendfile(2)``.

    The bytes go from the page cache to the socket without a copy through user space (on
    loopback and on NICs with scatter-gather, without any copy at the sender). The reply's
    ``parts`` may mix these with bytes-like parts; :func:`serve` closes them once sent.

    Parameters
    ----------
    fd : SharedFd
        The open file (shared by the parts of one reply; closed with the last of them).
    offset, length : int
        Byte range of the file.
    pad : bool
        What the transport does when the file ends before ``offset + length`` while being sent:
        True (the sync engine's parts, checked by digest at the receiver) completes the announced
        frame with zeros; False (fs reads, which carry no digest) fails the send with ``OSError``
        (``EIO``), which ends the connection mid-frame, so the reader sees an error, not zeros.
    sendfile : bool
        True: ``sendfile(2)`` where the socket allows. False: the transport reads the range in
        1 MiB blocks into one reused buffer and sends each (on Linux loopback this moved 1.9 GB/s
        against sendfile's 1.3: the receiver copies out of page-cache pages more slowly than out
        of the socket's own; ``benches/bench_fs.py``'s notes).
    """

    __slots__ = ("fd", "offset", "length", "pad", "sendfile", "_open")

    def __init__(self, fd: SharedFd, offset: int, length: int, pad: bool = True, sendfile: bool = True) -> None:
        self.fd = fd
        self.offset = offset
        self.length = length
        self.pad = pad
        self.sendfile = sendfile
        self._open = True
        fd.users += 1

    def __len__(self) -> int:
        return self.length

    def close(self) -> None:
        """Release this part's hold on the file (idempotent)."""
        if self._open:
            self._open = False
            self.fd.release()


class SharedFd:
    """A file descriptor closed when its last :class:`FileRange` is closed (or at once if none took it)."""

    __slots__ = ("fd", "users")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.users = 0

    def release(self) -> None:
        """Drop one user; close the descriptor when none is left."""
        self.users -= 1
        if self.users <= 0 and self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


def close_parts(parts: list[Any]) -> None:
    """Close the :class:`FileRange` parts of a reply (after sending it, or when it is dropped)."""
    for p in parts:
        if isinstance(p, FileRange):
            p.close()


class InFile:
    """The parts of a DATA reply received straight into a file instead of a buffer (see
    :meth:`tb5sync.remote.links.Link.submit_then`): part ``i`` is at byte ``offsets[i]`` of ``fd``,
    ``lengths[i]`` long, not yet checked. ``error``: the ``OSError`` writing them met (the
    stream went on), else None. ``len()`` is the number of parts.
    """

    __slots__ = ("fd", "offsets", "lengths", "error")

    def __init__(self, fd: int, offsets: list[int], lengths: list[int], error: OSError | None) -> None:
        self.fd, self.offsets, self.lengths, self.error = fd, offsets, lengths, error

    def __len__(self) -> int:
        return len(self.offsets)
