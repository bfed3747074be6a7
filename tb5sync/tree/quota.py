"""What one session of the daemon may write: ``--max-session-bytes`` and ``--min-free-space``.

A :class:`WriteQuota` is made per session (a push, an fs connection, a store connection) and
charged with the bytes of each file (or chunk batch) *before* any of them is written, so a
refused write leaves nothing behind: no temporary file, nothing at a final path. The limits
follow rsyncd's ``max-size``-like refusals and bazel-remote's ``--max_size``: a session past its
bytes, or a write that would leave less than the free space asked for on ROOT's file system,
fails with :class:`~tb5sync.errors.QuotaError` naming the limit and the option.
"""

from __future__ import annotations

import shutil
import threading

from tb5sync.errors import QuotaError, UsageError, shown

__all__ = ["WriteQuota"]


class WriteQuota:
    """Bytes a session has written and may still write.

    Parameters
    ----------
    where : str
        A directory on the file system written to (ROOT); its free space is read with
        :func:`shutil.disk_usage` (``statvfs``: Linux and macOS alike).
    max_bytes : int or None
        Most bytes the session may write, counted as file sizes (a file replaced counts whole);
        None: no limit.
    min_free : int
        Free bytes (for an unprivileged user) a write must leave on ``where``'s file system; 0: no check.

    Raises
    ------
    UsageError
        A negative limit.
    """

    def __init__(self, where: str, max_bytes: int | None = None, min_free: int = 0) -> None:
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
            raise UsageError(f"max_session_bytes must be a non-negative int, not {shown(max_bytes)}")
        if isinstance(min_free, bool) or not isinstance(min_free, int) or min_free < 0:
            raise UsageError(f"min_free_space must be a non-negative int, not {shown(min_free)}")
        self.where = where
        self.max_bytes = max_bytes
        self.min_free = min_free
        #: bytes charged so far
        self.used = 0
        #: the name shown for ``what == ""`` (the transfer's root: a single-file push's file), e.g. the
        #: destination path relative to the server's ROOT as the client named it; set by the session
        self.root_name = ""
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        """Whether any limit is set."""
        return self.max_bytes is not None or self.min_free > 0

    def charge(self, nbytes: int, what: str) -> None:
        """Count ``nbytes`` (>= 0) about to be written for ``what`` (a path relative to the transfer's
        root, shown in the error; ``""``, the root itself, is shown as :attr:`root_name`).

        Raises
        ------
        QuotaError
            The session would pass ``max_bytes``, or the file system would keep less than
            ``min_free`` bytes free; nothing is counted then.
        """
        what = what or self.root_name  # a single-file push charges its root: name the file
        if what.isprintable() and len(what) <= 200:
            what_ = what
        else:
            what_ = shown(what)
        if nbytes < 0:
            raise UsageError(f"{what_}: negative size {nbytes}")
        with self._lock:
            if self.max_bytes is not None and self.used + nbytes > self.max_bytes:
                raise QuotaError(f"{what_}: writing {nbytes} bytes would pass this session's limit of "
                                 f"{self.max_bytes} bytes ({self.used} written; the server's --max-session-bytes)")
            if self.min_free:
                free = shutil.disk_usage(self.where).free
                if free - nbytes < self.min_free:
                    raise QuotaError(f"{what_}: writing {nbytes} bytes would leave less than {self.min_free} bytes "
                                     f"free on the server ({free} free; its --min-free-space)")
            self.used += nbytes
