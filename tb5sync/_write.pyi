"""Type stub of the Cython small-file writer built from ``ext/_write.pyx``.

The pure-Python twin is :meth:`tb5sync.roles.destination.Destination.write_file`, taken once per
file; :meth:`tb5sync.roles.destination.Destination.write_files` picks between them.
"""

__all__ = ["write_files", "tmpfile_state"]

def write_files(
    files: list[tuple[int, bytes, bytes, bytes | bytearray | memoryview, int, int]], fsync: bool = False, tmpfile: bool = False
) -> list[tuple[int, int, int] | int]:
    """``(dir_fd, tmp, name, data, mode, mtime_ns)`` per file -> ``(st_size, st_mtime_ns, st_ino)``
    of the committed file, or the ``errno`` of a failed one (nothing left at its temporary name,
    its final name untouched). Every call is relative to ``dir_fd``; the GIL is released for the
    whole batch. ``tmpfile`` (Linux ``O_TMPFILE``, where the kernel, file system and ``linkat``
    allow it): ``openat(".", O_TMPFILE)``, ``write``, ``fchmod``, ``futimens``, ``fsync`` when
    asked, ``fstat``, ``linkat`` to ``name`` (an existing ``name``: linked at ``tmp``, then
    ``renameat`` over it). Otherwise: ``openat(tmp, O_CREAT|O_EXCL|O_NOFOLLOW)``, ``flock``, the
    same writes, ``renameat(tmp, name)``."""

def tmpfile_state() -> int:
    """``1``: the unnamed (``O_TMPFILE``) path served a file in this process; ``-1``: it was
    refused here (every file takes the named path since); ``0``: not tried yet."""
