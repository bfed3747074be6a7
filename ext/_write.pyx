# cython: language_level=3, boundscheck=False, wraparound=False
"""Cython twin of the small-file commit (``tb5sync.roles.destination.Destination.write_file``), a batch per call.

For each file, with the GIL released and relative to its directory's descriptor only, one of two
paths:

- unnamed (Linux ``O_TMPFILE``, asked with ``tmpfile=True``, used while the kernel and file system
  have it): ``openat(dir, ".", O_TMPFILE|O_RDWR|O_CLOEXEC, 0600)``, ``write``, ``fchmod``,
  ``futimens``, ``fsync`` when asked, ``fstat``, then ``linkat`` of the finished inode to its final
  name (``AT_EMPTY_PATH``, else ``/proc/self/fd/N`` with ``AT_SYMLINK_FOLLOW``), ``close``. The file
  has no name until it is whole (no temporary name to add and rename, no ``flock``, nothing left
  behind by a crash). A final name that exists (``EEXIST``) gets the inode linked under the
  temporary name (``flock`` first), then ``renameat`` over it, as below.
- named (portable; macOS, ``tmpfile=False``, or where ``O_TMPFILE``/``linkat`` is refused):
  ``openat(dir, tmp, O_RDWR|O_CREAT|O_EXCL|O_NOFOLLOW|O_CLOEXEC, 0600)``, ``flock(LOCK_EX|LOCK_NB)``,
  ``write`` (all of it, ``EINTR`` retried), ``fchmod``, ``futimens`` (atime = mtime), ``fsync`` when
  asked (``F_FULLFSYNC`` on macOS), ``fstat``, ``close``, ``renameat(dir, tmp, dir, name)``.

A file that fails at any step has its temporary name removed (``unlinkat``) and its final name
untouched; its ``errno`` is returned and the caller takes that file again on the Python path
(which names it, unlocks a read-only directory, replaces an empty directory, or stops the run on
a full disk). See ``tb5sync/_write.pyi``.
"""

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from libc.stdlib cimport calloc, free

cdef extern from *:
    """
    #include <errno.h>
    #include <fcntl.h>
    #include <sys/file.h>
    #include <sys/stat.h>
    #include <unistd.h>
    #include <stdio.h>
    #ifndef O_CLOEXEC
    #define O_CLOEXEC 0
    #endif
    #if defined(__APPLE__) || defined(TB5_STAT_MTIMESPEC)
    #define TB5_ST_MTIM st_mtimespec
    #else
    #define TB5_ST_MTIM st_mtim
    #endif
    static int tb5_errno(void) { return errno; }

    /* Flush to stable storage: F_FULLFSYNC where the system has it (macOS: fsync leaves the data
       in the drive's cache), fsync where it has not or the file system refuses it (as
       tb5sync._os.io.durable_sync). */
    static int tb5_durable_sync(int fd) {
    #ifdef F_FULLFSYNC
        if (fcntl(fd, F_FULLFSYNC) == 0) return 0;
        if (errno == EBADF || errno == EIO) return -1;
    #endif
        return fsync(fd);
    }

    typedef struct {
        int dfd;
        const char *tmp;
        const char *name;
        const char *data;
        Py_ssize_t len;
        unsigned int mode;
        long long sec;
        long nsec;
        /* out */
        int err;
        long long size;
        long long mtime_s;
        long mtime_ns;
        unsigned long long ino;
    } tb5_wfile;

    /* The bytes, mode and times of one open file, then its stat; 0 or -1 (errno set). */
    static int tb5_fill(int fd, tb5_wfile *f, int do_fsync, struct stat *st) {
        Py_ssize_t off = 0;
        struct timespec ts[2];
        while (off < f->len) {
            ssize_t k = write(fd, f->data + off, (size_t)(f->len - off));
            if (k < 0) {
                if (errno == EINTR) continue;
                return -1;
            }
            if (k == 0) { errno = EIO; return -1; }
            off += k;
        }
        if (fchmod(fd, (mode_t)(f->mode & 07777)) != 0) return -1;
        ts[0].tv_sec = (time_t)f->sec; ts[0].tv_nsec = f->nsec;
        ts[1] = ts[0];
        if (futimens(fd, ts) != 0) return -1;
        if (do_fsync && tb5_durable_sync(fd) != 0) return -1;
        if (fstat(fd, st) != 0) return -1;
        return 0;
    }

    static void tb5_done(tb5_wfile *f, const struct stat *st) {
        f->size = (long long)st->st_size;
        f->mtime_s = (long long)st->TB5_ST_MTIM.tv_sec;
        f->mtime_ns = (long)st->TB5_ST_MTIM.tv_nsec;
        f->ino = (unsigned long long)st->st_ino;
    }

    /* The named path: write, commit and stat one file under its temporary name, then rename it;
       0 or an errno (the temporary name removed). */
    static int tb5_write_named(tb5_wfile *f, int do_fsync) {
        int fd, err;
        struct stat st;
        fd = openat(f->dfd, f->tmp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (fd < 0)
            return errno;  /* EEXIST: not ours, nothing to remove */
        (void)flock(fd, LOCK_EX | LOCK_NB);  /* marks it live for another run's stale sweep */
        if (tb5_fill(fd, f, do_fsync, &st) != 0) goto fail;
        if (close(fd) != 0) { fd = -1; goto fail; }
        fd = -1;
        if (renameat(f->dfd, f->tmp, f->dfd, f->name) != 0) goto fail;
        tb5_done(f, &st);
        return 0;
    fail:
        err = errno;
        if (fd >= 0) close(fd);
        unlinkat(f->dfd, f->tmp, 0);
        return err;
    }

    /* Whether the unnamed path works here: 0 not known yet, 1 yes, -1 no (the kernel or the file
       system refuses O_TMPFILE, or neither way of linkat is allowed). Set by the first file that
       learns it; a race only makes two threads learn the same thing. */
    static volatile int tb5_tmpfile_ok = 0;

    #ifdef O_TMPFILE
    /* Give the unnamed file open as fd the name `name` in dfd: 0 or -1 (errno set; ENOSYS when
       no way of linking an open file is allowed here). */
    static int tb5_link_fd(int fd, int dfd, const char *name) {
        char proc[64];
    #ifdef AT_EMPTY_PATH
        if (linkat(fd, "", dfd, name, AT_EMPTY_PATH) == 0) return 0;
        if (errno != ENOENT && errno != EPERM && errno != EINVAL) return -1;
    #endif
        snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
        if (linkat(AT_FDCWD, proc, dfd, name, AT_SYMLINK_FOLLOW) == 0) return 0;
        if (errno != ENOENT && errno != EPERM && errno != EINVAL) return -1;
        /* no /proc here (ENOSYS: every file takes the named path from now on), or the directory
           was removed meanwhile (ENOENT: this file's error only) */
        {
            int err = errno;
            errno = (faccessat(AT_FDCWD, "/proc/self/fd", F_OK, 0) == 0 && err == ENOENT) ? ENOENT : ENOSYS;
        }
        return -1;
    }
    #endif

    /* Write, commit and stat one file; 0 or an errno (nothing left at the temporary name). */
    static int tb5_write_one(tb5_wfile *f, int do_fsync, int tmpfile) {
    #ifdef O_TMPFILE
        int fd, err;
        struct stat st;
        if (!tmpfile || tb5_tmpfile_ok < 0)
            return tb5_write_named(f, do_fsync);
        fd = openat(f->dfd, ".", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
        if (fd < 0) {
            if (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL) {
                tb5_tmpfile_ok = -1;  /* no O_TMPFILE in this kernel or file system */
                return tb5_write_named(f, do_fsync);
            }
            return errno;  /* EACCES, ENOSPC, ...: the Python path names it */
        }
        if (tb5_fill(fd, f, do_fsync, &st) != 0) goto fail;
        if (tb5_link_fd(fd, f->dfd, f->name) == 0) {
            tb5_tmpfile_ok = 1;
        } else if (errno == ENOSYS) {
            close(fd);
            tb5_tmpfile_ok = -1;
            return tb5_write_named(f, do_fsync);
        } else if (errno == EEXIST) {
            /* the final name exists: the inode under the temporary name, renamed over it */
            (void)flock(fd, LOCK_EX | LOCK_NB);
            if (tb5_link_fd(fd, f->dfd, f->tmp) != 0) goto fail;  /* EEXIST: not ours */
            if (renameat(f->dfd, f->tmp, f->dfd, f->name) != 0) {
                err = errno;
                unlinkat(f->dfd, f->tmp, 0);
                close(fd);
                return err;
            }
        } else {
            goto fail;
        }
        if (close(fd) != 0) return errno;  /* linked: the name stays, as a failed close after rename */
        tb5_done(f, &st);
        return 0;
    fail:
        err = errno;
        close(fd);  /* unnamed: nothing to remove */
        return err;
    #else
        (void)tmpfile;
        return tb5_write_named(f, do_fsync);
    #endif
    }

    /* 1: the unnamed path was used, -1: refused here, 0: not tried yet. */
    static int tb5_tmpfile_state(void) { return tb5_tmpfile_ok; }
    """
    ctypedef struct tb5_wfile:
        int dfd
        const char *tmp
        const char *name
        const char *data
        Py_ssize_t len
        unsigned int mode
        long long sec
        long nsec
        int err
        long long size
        long long mtime_s
        long mtime_ns
        unsigned long long ino
    int tb5_write_one(tb5_wfile *f, int do_fsync, int tmpfile) nogil
    int tb5_tmpfile_state()

__all__ = ["write_files", "tmpfile_state"]


def tmpfile_state():
    """Whether the unnamed path (``O_TMPFILE`` + ``linkat``) served a file in this process.

    Returns ``1`` (it did), ``-1`` (the kernel, file system or ``/proc`` refused it: every file
    takes the named path from then on) or ``0`` (not tried yet, or not built with ``O_TMPFILE``).
    """
    return tb5_tmpfile_state()


def write_files(list files, bint fsync=False, bint tmpfile=False):
    """Write and commit a batch of small files; one result per file, in order.

    ``tmpfile``: write each file unnamed and link it to its name once whole (Linux
    ``O_TMPFILE``), where the system allows it; else (and always without ``O_TMPFILE``) under
    ``tmp``, renamed to ``name``.

    ``files`` is a list of ``(dir_fd, tmp, name, data, mode, mtime_ns)``: ``dir_fd`` an open
    directory descriptor, ``tmp`` and ``name`` bytes (the temporary and the final name in it),
    ``data`` a contiguous bytes-like object, ``mode`` the permission bits, ``mtime_ns`` an int
    (ns since the epoch; access time set to it too). A result is ``(st_size, st_mtime_ns, st_ino)``
    of the committed file, or an ``int`` errno (nothing left at ``tmp``; ``name`` untouched).
    """
    cdef Py_ssize_t n = len(files), i, got = 0
    cdef tb5_wfile *fs = <tb5_wfile *>calloc(n if n > 0 else 1, sizeof(tb5_wfile))
    cdef Py_buffer *bufs = <Py_buffer *>calloc(n if n > 0 else 1, sizeof(Py_buffer))
    cdef int do_fsync = fsync
    cdef int use_tmpfile = tmpfile
    if fs == NULL or bufs == NULL:
        free(fs)
        free(bufs)
        raise MemoryError()
    keep = []
    try:
        for i in range(n):
            dfd, tmp, name, data, mode, mtime_ns = files[i]
            if not isinstance(tmp, bytes) or not isinstance(name, bytes):
                raise TypeError("tmp and name must be bytes")
            keep.append(tmp)
            keep.append(name)
            PyObject_GetBuffer(data, &bufs[i], PyBUF_SIMPLE)
            got = i + 1
            sec, nsec = divmod(mtime_ns, 1000000000)
            fs[i].dfd = dfd
            fs[i].tmp = <const char *>(<bytes>tmp)
            fs[i].name = <const char *>(<bytes>name)
            fs[i].data = <const char *>bufs[i].buf
            fs[i].len = bufs[i].len
            fs[i].mode = mode
            fs[i].sec = sec
            fs[i].nsec = nsec
        with nogil:
            for i in range(n):
                fs[i].err = tb5_write_one(&fs[i], do_fsync, use_tmpfile)
        out = []
        for i in range(n):
            if fs[i].err:
                out.append(fs[i].err)
            else:
                out.append((fs[i].size, (<object>fs[i].mtime_s) * 1000000000 + fs[i].mtime_ns, fs[i].ino))
        return out
    finally:
        for i in range(got):
            PyBuffer_Release(&bufs[i])
        free(bufs)
        free(fs)
