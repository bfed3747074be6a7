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


cdef extern from *:
    """
    #ifdef __linux__
    #ifndef _GNU_SOURCE
    #define _GNU_SOURCE
    #endif
    #include <fcntl.h>
    #include <errno.h>
    #include <unistd.h>
    #define TB5_HAVE_SPLICE 1
    /* Move n bytes from socket `sock` into file `fd` at `off` through the pipe (pr, pw), at most
       `chunk` bytes at a time: the socket's pages go into the pipe (no copy on loopback or a
       scatter-gather NIC), the pipe's into the file's page cache (the one copy). */
    static void tb5_splice_to_file(int sock, int pr, int pw, int fd, long long off, long long n, long long chunk,
                                   long long *taken, long long *written, int *err, int *side) {
        long long t = 0, w = 0;
        *err = 0; *side = -1;
        while (w < n) {
            if (t == w) {
                long long want = n - t < chunk ? n - t : chunk;
                ssize_t k = splice(sock, NULL, pw, NULL, (size_t)want, SPLICE_F_MOVE | SPLICE_F_MORE);
                if (k < 0) { if (errno == EINTR) continue; *err = errno; *side = 0; break; }
                if (k == 0) { *side = 2; break; }
                t += k;
            }
            loff_t o = (loff_t)(off + w);
            ssize_t m = splice(pr, NULL, fd, &o, (size_t)(t - w), SPLICE_F_MOVE);
            if (m < 0) { if (errno == EINTR) continue; *err = errno; *side = 1; break; }
            if (m == 0) { *err = EIO; *side = 1; break; }
            w += m;
        }
        *taken = t; *written = w;
    }
    #else
    #define TB5_HAVE_SPLICE 0
    static void tb5_splice_to_file(int sock, int pr, int pw, int fd, long long off, long long n, long long chunk,
                                   long long *taken, long long *written, int *err, int *side) {
        *taken = 0; *written = 0; *err = 38; *side = 0;  /* ENOSYS */
    }
    #endif
    """
    int TB5_HAVE_SPLICE
    void tb5_splice_to_file(int sock, int pr, int pw, int fd, long long off, long long n, long long chunk,
                            long long *taken, long long *written, int *err, int *side) nogil

#: Whether this build has :func:`splice_to_file` (Linux).
HAVE_SPLICE = bool(TB5_HAVE_SPLICE)


def splice_to_file(int sock, int pr, int pw, int fd, long long off, long long n, long long chunk):
    """Move ``n`` bytes from socket ``sock`` to file ``fd`` at byte ``off`` through the pipe ``(pr, pw)``,
    ``chunk`` bytes (the pipe's size) at a time, with the GIL released; see ``tb5sync._os.io.splice_to_file``.

    Returns ``(taken, written, errno, side)``: bytes taken from the socket, bytes written to the
    file (the pipe holds the difference), and where it stopped early: ``side`` -1 (done), 0 (the
    socket failed with ``errno``; ``EAGAIN``: its receive timeout passed), 1 (the file failed
    with ``errno``), 2 (the socket reached its end).
    """
    cdef long long taken = 0, written = 0
    cdef int err = 0, side = -1
    with nogil:
        tb5_splice_to_file(sock, pr, pw, fd, off, n, chunk, &taken, &written, &err, &side)
    return taken, written, err, side


from cpython.buffer cimport PyBUF_WRITABLE, PyBuffer_FillInfo
from libc.errno cimport errno
from posix.mman cimport MAP_FAILED, MAP_SHARED, PROT_READ, mmap, munmap


cdef class ReadMapping:
    """A read-only shared mapping of ``length`` bytes of file ``fd`` from ``offset`` (a multiple of
    ``mmap.ALLOCATIONGRANULARITY``), with ``mmap`` and ``munmap`` run without the GIL.

    The buffer protocol gives its bytes (read-only); :meth:`close` unmaps it. ``mmap.mmap`` holds
    the GIL in ``munmap``, which for a 32 MiB span of mapped page-cache pages (a verified reply)
    takes a fraction of a millisecond with a TLB shoot-down on each core: every reply's
    verification paid it with every other thread waiting. The twin is
    ``mmap.mmap(fd, length, access=ACCESS_READ, offset=offset)`` (``tb5sync._os.io.map_read``).

    Raises
    ------
    ValueError
        ``length`` is not positive.
    OSError
        ``mmap`` failed (errno as the call's).
    """
    cdef char *data
    cdef Py_ssize_t size
    cdef Py_ssize_t exports

    def __cinit__(self, int fd, Py_ssize_t length, long long offset):
        cdef void *p
        self.data = NULL
        self.size = 0
        self.exports = 0
        if length <= 0:
            raise ValueError("length must be > 0")
        with nogil:
            p = mmap(NULL, <size_t>length, PROT_READ, MAP_SHARED, fd, <long>offset)
        if p == MAP_FAILED:
            raise OSError(errno, "mmap failed")
        self.data = <char *>p
        self.size = length

    def __getbuffer__(self, Py_buffer *buffer, int flags):
        if self.data == NULL:
            raise ValueError("mapping closed")
        if flags & PyBUF_WRITABLE:
            raise BufferError("the mapping is read-only")
        PyBuffer_FillInfo(buffer, self, self.data, self.size, 1, flags)
        self.exports += 1

    def __releasebuffer__(self, Py_buffer *buffer):
        self.exports -= 1

    def __len__(self):
        return self.size

    @property
    def closed(self):
        return self.data == NULL

    def close(self):
        """Unmap (GIL released); a second call does nothing.

        Raises
        ------
        BufferError
            A view of the mapping is still held (as ``mmap.mmap.close``).
        """
        cdef char *p = self.data
        cdef size_t n = <size_t>self.size
        if p == NULL:
            return
        if self.exports:
            raise BufferError("cannot close the mapping: views of it still exist")
        self.data = NULL
        with nogil:
            munmap(p, n)

    def __dealloc__(self):
        if self.data != NULL:
            munmap(self.data, <size_t>self.size)
            self.data = NULL
