"""Type stub of the Cython small-file writer built from ``ext/_write.pyx``.

The pure-Python twin is :meth:`tb5sync.destination.Destination.write_file`, taken once per
file; :meth:`tb5sync.destination.Destination.write_files` picks between them.
"""

__all__ = ["write_files"]

def write_files(
    files: list[tuple[int, bytes, bytes, bytes | bytearray | memoryview, int, int]], fsync: bool = False
) -> list[tuple[int, int, int] | int]:
    """``(dir_fd, tmp, name, data, mode, mtime_ns)`` per file -> ``(st_size, st_mtime_ns, st_ino)``
    of the committed file, or the ``errno`` of a failed one (its temporary name removed, its final
    name untouched). Every call is relative to ``dir_fd`` (``openat`` ``O_CREAT|O_EXCL|O_NOFOLLOW``,
    ``write``, ``fchmod``, ``futimens``, ``fsync`` when asked, ``fstat``, ``renameat``); the GIL is
    released for the whole batch."""
