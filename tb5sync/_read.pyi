"""Type stub of the Cython batch reader of whole small files built from ``ext/_read.pyx``.

The pure-Python twin is :meth:`tb5sync.roles.sender.Sender._read_one`, taken once per file;
:meth:`tb5sync.roles.sender.Sender.read_files` picks between them.
"""

__all__ = ["read_files", "NOT_REGULAR", "CHANGED", "NO_ROOM"]

NOT_REGULAR: int
CHANGED: int
NO_ROOM: int

def read_files(
    files: list[tuple[int, bytes]], buf: bytearray | memoryview, start: int = 0
) -> tuple[list[tuple[int, int, int, int] | int], int]:
    """``(dir_fd, name)`` per file -> ``((offset, size, mtime_ns, st_mode) or a code, used)``: each
    file opened ``O_NOFOLLOW`` relative to ``dir_fd`` and read whole into ``buf`` after the previous
    one (from ``start``), its size and mtime the same before and after; a code is an ``errno``,
    ``NOT_REGULAR``, ``CHANGED`` or ``NO_ROOM``. The GIL is released for the whole batch."""
