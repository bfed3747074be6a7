# cython: language_level=3, boundscheck=False, wraparound=False
"""Cython twin of ``tb5sync.tree.scan.py_listdir_stat``: one directory's names with their lstat fields.

The directory is read and every name is ``fstatat``-ed (``AT_SYMLINK_NOFOLLOW``) relative to
the directory's descriptor with the GIL released; the Python objects are made afterwards.
The docstring of the pure-Python twin documents both (see ``tb5sync/_scan.pyi``).
"""

from libc.errno cimport ENOENT
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy, strlen
from posix.unistd cimport close as c_close

cdef extern from "Python.h":
    object PyUnicode_DecodeFSDefaultAndSize(const char *s, Py_ssize_t size)

cdef extern from *:
    """
    #include <errno.h>
    static int tb5_errno(void) { return errno; }
    static void tb5_clear_errno(void) { errno = 0; }
    /* the mtime's timespec: POSIX.1-2008 names it st_mtim, macOS st_mtimespec */
    #if defined(__APPLE__) || defined(TB5_STAT_MTIMESPEC)
    #define TB5_ST_MTIM st_mtimespec
    #else
    #define TB5_ST_MTIM st_mtim
    #endif
    """
    int tb5_errno() nogil
    void tb5_clear_errno() nogil

cdef extern from "<fcntl.h>" nogil:
    int open(const char *path, int flags)
    int fcntl(int fd, int cmd, ...)
    int F_DUPFD_CLOEXEC
    int O_RDONLY
    int O_DIRECTORY
    int O_CLOEXEC
    int AT_SYMLINK_NOFOLLOW

cdef extern from "<sys/stat.h>" nogil:
    ctypedef long time_t
    cdef struct timespec:
        time_t tv_sec
        long tv_nsec
    cdef struct struct_stat "stat":
        unsigned int st_mode
        long long st_size
        timespec st_mtim "TB5_ST_MTIM"  # st_mtimespec on macOS (the macro above)
    int fstatat(int dirfd, const char *pathname, struct_stat *buf, int flags)

cdef extern from "<dirent.h>" nogil:
    ctypedef struct DIR:
        pass
    cdef struct dirent:
        char *d_name
    DIR *fdopendir(int fd)
    void rewinddir(DIR *dirp)
    dirent *readdir(DIR *dirp)
    int closedir(DIR *dirp)

cdef struct Item:
    char *name
    size_t name_len
    unsigned int mode
    long long size
    long long mtime_ns
    long long mtime_s   # whole seconds, read when big is set
    int big             # the mtime does not fit in a signed 64-bit count of ns (before 1677 or after 2262)

__all__ = ["listdir_stat"]


def listdir_stat(path):
    """``[(name, st_mode, st_size, st_mtime_ns), ...]`` of the directory ``path``, in directory order.

    ``path`` may be a descriptor of the directory (duplicated, so left open). See
    ``tb5sync.tree.scan.py_listdir_stat``.
    """
    import os

    cdef int given = -1
    if isinstance(path, int):
        given = path
        path = f"<descriptor {given}>"
    cdef bytes bpath = os.fsencode(path)
    cdef const char *cpath = bpath
    cdef int fd
    cdef DIR *d = NULL
    cdef dirent *de
    cdef Item *items = NULL
    cdef Item *grown
    cdef size_t n = 0, cap = 0, i, ln
    cdef struct_stat st
    cdef const char *nm
    cdef int err = 0, stat_err = 0
    cdef char *bad_name = NULL

    with nogil:
        if given >= 0:
            fd = fcntl(given, F_DUPFD_CLOEXEC, 0)
        else:
            fd = open(cpath, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        if fd < 0:
            err = tb5_errno()
        else:
            d = fdopendir(fd)
            if d == NULL:
                err = tb5_errno()
                c_close(fd)
            elif given >= 0:
                rewinddir(d)  # the duplicate shares the offset: list from the start
    if err:
        raise OSError(err, os.strerror(err), path)
    try:
        with nogil:
            while True:
                tb5_clear_errno()
                de = readdir(d)
                if de == NULL:
                    err = tb5_errno()
                    break
                nm = de.d_name
                if nm[0] == 46 and (nm[1] == 0 or (nm[1] == 46 and nm[2] == 0)):  # "." and ".."
                    continue
                ln = strlen(nm)
                if fstatat(fd, nm, &st, AT_SYMLINK_NOFOLLOW) != 0:
                    if tb5_errno() == ENOENT:  # vanished since readdir: left out, as the Python twin does
                        continue
                    stat_err = tb5_errno()
                    bad_name = <char *>malloc(ln + 1)
                    if bad_name != NULL:
                        memcpy(bad_name, nm, ln + 1)
                    break
                if n == cap:
                    cap = cap * 2 + 64
                    grown = <Item *>realloc(items, cap * sizeof(Item))
                    if grown == NULL:
                        err = -1
                        break
                    items = grown
                items[n].name = <char *>malloc(ln + 1)
                if items[n].name == NULL:
                    err = -1
                    break
                memcpy(items[n].name, nm, ln + 1)
                items[n].name_len = ln
                items[n].mode = st.st_mode
                items[n].size = st.st_size
                # time_t * 10^9 overflows 64 bits past 2262-04-11 (and before 1677-09-21): such
                # mtimes are put together as Python ints below, every other one here in C
                if st.st_mtim.tv_sec >= -9223372035LL and st.st_mtim.tv_sec <= 9223372035LL:
                    items[n].mtime_ns = <long long>st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec
                    items[n].big = 0
                else:
                    items[n].mtime_s = <long long>st.st_mtim.tv_sec
                    items[n].mtime_ns = st.st_mtim.tv_nsec
                    items[n].big = 1
                n += 1
        if err == -1:
            raise MemoryError()
        if err:
            raise OSError(err, os.strerror(err), path)
        if stat_err:
            name = PyUnicode_DecodeFSDefaultAndSize(bad_name, strlen(bad_name)) if bad_name != NULL else "?"
            raise OSError(stat_err, os.strerror(stat_err), os.path.join(path, name))
        out = []
        for i in range(n):
            out.append((PyUnicode_DecodeFSDefaultAndSize(items[i].name, items[i].name_len),
                        items[i].mode, items[i].size,
                        items[i].mtime_ns if not items[i].big else (<object>items[i].mtime_s) * 1000000000 + items[i].mtime_ns))
        return out
    finally:
        if given >= 0:
            rewinddir(d)  # leave the caller's descriptor as it was (as os.scandir(fd) does)
        closedir(d)  # closes fd too
        for i in range(n):
            free(items[i].name)
        free(items)
        free(bad_name)
