# cython: language_level=3, boundscheck=False, wraparound=False
"""Cython twin of the sender's whole-file read (``tb5sync.roles.sender.Sender._read_one``), a batch per call.

For each file, with the GIL released and relative to its directory's descriptor only:
``openat(dir, name, O_RDONLY|O_NONBLOCK|O_NOFOLLOW|O_CLOEXEC)``, ``fstat`` (a regular file only),
``pread`` of ``st_size + 1`` bytes (``EINTR`` retried) into the caller's buffer right after the
previous file, ``fstat`` again, ``close``. A file that is not read whole and unchanged gets a code
instead of a result, and the caller reads it again on the Python path (which names the error, or
retries a file that changed, exactly as before). See ``tb5sync/_read.pyi``.
"""

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_WRITABLE
from libc.stdlib cimport calloc, free

cdef extern from *:
    """
    #include <errno.h>
    #include <fcntl.h>
    #include <sys/stat.h>
    #include <unistd.h>
    #ifndef O_CLOEXEC
    #define O_CLOEXEC 0
    #endif
    #if defined(__APPLE__) || defined(TB5_STAT_MTIMESPEC)
    #define TB5_ST_MTIM st_mtimespec
    #else
    #define TB5_ST_MTIM st_mtim
    #endif

    #define TB5_NOT_REGULAR (-1)
    #define TB5_CHANGED (-2)
    #define TB5_NO_ROOM (-3)

    typedef struct {
        int dfd;
        const char *name;
        /* out */
        int err;               /* 0, an errno, or one of the TB5_ codes */
        long long size;
        long long mtime_s;
        long mtime_ns;
        unsigned int mode;
        Py_ssize_t offset;     /* where its bytes start in the buffer */
    } tb5_rfile;

    /* Read one whole file at buf + *used (at most cap bytes in all); 0 or a code. */
    static int tb5_read_one(tb5_rfile *f, char *buf, Py_ssize_t cap, Py_ssize_t *used) {
        int fd, err = 0;
        struct stat st, st2;
        Py_ssize_t want, got = 0;
        fd = openat(f->dfd, f->name, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0)
            return errno;
        if (fstat(fd, &st) != 0) { err = errno; goto done; }
        if (!S_ISREG(st.st_mode)) { err = TB5_NOT_REGULAR; goto done; }
        if (st.st_size < 0 || (long long)st.st_size + 1 > (long long)(cap - *used)) { err = TB5_NO_ROOM; goto done; }
        want = (Py_ssize_t)st.st_size + 1;  /* one byte more: a file that grew is seen */
        while (got < want) {
            ssize_t k = pread(fd, buf + *used + got, (size_t)(want - got), (off_t)got);
            if (k < 0) {
                if (errno == EINTR) continue;
                err = errno;
                goto done;
            }
            if (k == 0) break;
            got += k;
        }
        if (got != (Py_ssize_t)st.st_size) { err = TB5_CHANGED; goto done; }
        if (fstat(fd, &st2) != 0) { err = errno; goto done; }
        if (st2.st_size != st.st_size || st2.TB5_ST_MTIM.tv_sec != st.TB5_ST_MTIM.tv_sec
                || st2.TB5_ST_MTIM.tv_nsec != st.TB5_ST_MTIM.tv_nsec) { err = TB5_CHANGED; goto done; }
        f->size = (long long)st.st_size;
        f->mtime_s = (long long)st.TB5_ST_MTIM.tv_sec;
        f->mtime_ns = (long)st.TB5_ST_MTIM.tv_nsec;
        f->mode = (unsigned int)st.st_mode;
        f->offset = *used;
        *used += got;
    done:
        close(fd);
        return err;
    }
    """
    ctypedef struct tb5_rfile:
        int dfd
        const char *name
        int err
        long long size
        long long mtime_s
        long mtime_ns
        unsigned int mode
        Py_ssize_t offset
    int tb5_read_one(tb5_rfile *f, char *buf, Py_ssize_t cap, Py_ssize_t *used) nogil
    int TB5_NOT_REGULAR
    int TB5_CHANGED
    int TB5_NO_ROOM

__all__ = ["read_files", "NOT_REGULAR", "CHANGED", "NO_ROOM"]

#: Result codes (negative; a positive int is an errno).
NOT_REGULAR = TB5_NOT_REGULAR
CHANGED = TB5_CHANGED
NO_ROOM = TB5_NO_ROOM


def read_files(list files, buf, Py_ssize_t start=0):
    """Read a batch of whole small files into ``buf``, one after another from ``start``.

    ``files`` is a list of ``(dir_fd, name)``: an open directory descriptor and the file's name in
    it (bytes, one component; a symlink is not followed). ``buf`` is a writable contiguous buffer.
    Returns ``(results, used)``: one result per file, in order, either
    ``(offset, size, mtime_ns, st_mode)`` (its bytes are ``buf[offset:offset + size]``, read whole
    with size and mtime the same before and after) or an ``int``: an ``errno``, :data:`NOT_REGULAR`,
    :data:`CHANGED` (its size or mtime changed while read) or :data:`NO_ROOM` (it did not fit in
    what was left of ``buf``; later, smaller files may still have been read); ``used`` is the end
    of the last file read (bytes). The GIL is released for the whole batch.
    """
    cdef Py_ssize_t n = len(files), i, used = start, cap
    cdef tb5_rfile *fs = <tb5_rfile *>calloc(n if n > 0 else 1, sizeof(tb5_rfile))
    cdef Py_buffer view
    cdef char *base
    if fs == NULL:
        raise MemoryError()
    keep = []
    try:
        PyObject_GetBuffer(buf, &view, PyBUF_WRITABLE)
        try:
            base = <char *>view.buf
            cap = view.len
            if start < 0 or start > cap:
                raise ValueError("start outside the buffer")
            for i in range(n):
                dfd, name = files[i]
                if not isinstance(name, bytes):
                    raise TypeError("name must be bytes")
                keep.append(name)
                fs[i].dfd = dfd
                fs[i].name = <const char *>(<bytes>name)
            with nogil:
                for i in range(n):
                    fs[i].err = tb5_read_one(&fs[i], base, cap, &used)
        finally:
            PyBuffer_Release(&view)
        out = []
        for i in range(n):
            if fs[i].err:
                out.append(fs[i].err)
            else:
                out.append((fs[i].offset, fs[i].size, (<object>fs[i].mtime_s) * 1000000000 + fs[i].mtime_ns, fs[i].mode))
        return out, used
    finally:
        free(fs)
