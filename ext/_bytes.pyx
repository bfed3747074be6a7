# cython: language_level=3
"""Receive buffers that are already ``bytes``: the tb5:// reads land in the object returned.

``empty_bytes(n)`` makes a ``bytes`` object of ``n`` bytes whose contents are not yet set
(``PyBytes_FromStringAndSize(NULL, n)``, as CPython's own ``os.read`` does before filling it)
and a writable memoryview of its storage. The caller receives a read into the view and only
then hands the object out, so no copy is made between the socket and the user's ``bytes``.
The pure-Python path (``tb5sync.fs.file.new_buffer`` without this module) uses a bytearray and
copies it once.
"""

from cpython.buffer cimport PyBUF_WRITE
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.memoryview cimport PyMemoryView_FromMemory


def empty_bytes(Py_ssize_t n):
    """``(b, view)``: a new ``bytes`` of ``n`` bytes, not yet filled, and a writable memoryview of it.

    The view does not keep ``b`` alive: hold ``b`` while the view is in use, and let nothing
    read ``b`` (or hash it) before it is filled.

    Raises
    ------
    ValueError
        ``n`` is negative.
    MemoryError
        ``n`` bytes cannot be allocated.
    """
    if n < 0:
        raise ValueError("n must be >= 0")
    if n < 2:  # CPython shares its empty and one-byte objects: never hand those out for writing
        b = bytearray(n)
        return b, memoryview(b)
    b = PyBytes_FromStringAndSize(NULL, n)
    return b, PyMemoryView_FromMemory(PyBytes_AS_STRING(b), n, PyBUF_WRITE)
