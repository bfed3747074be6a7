"""File metadata beyond ``stat``: extended attributes (rsync ``-X``) and rsync's unsafe symlinks.

Extended attributes go through one backend chosen at run time (:func:`xattr_backend`):

* ``"os"``: Python's ``os.listxattr/getxattr/setxattr/removexattr`` (Linux only: CPython does not
  have them on macOS);
* ``"libc"``: the C library's ``flistxattr``/``fgetxattr``/``fsetxattr``/``fremovexattr`` through
  ``ctypes``, with the calling convention of the platform (macOS takes a ``position`` and an
  ``options`` argument, ``XATTR_NOFOLLOW`` unused since every call is on a descriptor; Linux and
  FreeBSD-style glibc take neither). macOS gets this one; ``TB5SYNC_XATTR_LIBC=1`` forces it
  elsewhere (the tests run it on Linux).

Every call takes a file descriptor, opened by the caller relative to a directory descriptor with
``O_NOFOLLOW``, so a name swapped for a symlink is never followed. Which names are copied
(:func:`copied_name`): on Linux the ``user.`` namespace (what rsync copies as a non-root user);
elsewhere (macOS) every name as it is, ``com.apple.*`` included.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import sys

__all__ = ["xattr_backend", "list_xattrs", "set_xattrs", "copied_name", "unsafe_symlink", "XATTR_LIBC_ENV"]

#: Set to 1 to use the libc backend even where ``os.getxattr`` exists.
XATTR_LIBC_ENV = "TB5SYNC_XATTR_LIBC"
_MAC = sys.platform == "darwin"
#: The errors that mean "this file system or file has no extended attributes".
NO_XATTRS = frozenset(e for e in (errno.ENOTSUP, errno.EOPNOTSUPP, getattr(errno, "ENODATA", None), errno.EPERM) if e is not None)


def xattr_backend() -> str:
    """``"os"`` or ``"libc"`` (see the module's doc), decided from the platform and :data:`XATTR_LIBC_ENV`."""
    if hasattr(os, "listxattr") and os.environ.get(XATTR_LIBC_ENV, "") in ("", "0"):
        return "os"
    return "libc"


def copied_name(name: bytes) -> bool:
    """Whether the attribute ``name`` is copied: ``user.*`` on Linux, every name on macOS."""
    return _MAC or not sys.platform.startswith("linux") or name.startswith(b"user.")


_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        sz, vp, cp = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_char_p
        if _MAC:  # ssize_t flistxattr(int fd, char *namebuf, size_t size, int options), ...
            lib.flistxattr.argtypes = [ctypes.c_int, vp, sz, ctypes.c_int]
            lib.fgetxattr.argtypes = [ctypes.c_int, cp, vp, sz, ctypes.c_uint32, ctypes.c_int]
            lib.fsetxattr.argtypes = [ctypes.c_int, cp, vp, sz, ctypes.c_uint32, ctypes.c_int]
            lib.fremovexattr.argtypes = [ctypes.c_int, cp, ctypes.c_int]
        else:  # ssize_t flistxattr(int fd, char *list, size_t size), ...
            lib.flistxattr.argtypes = [ctypes.c_int, vp, sz]
            lib.fgetxattr.argtypes = [ctypes.c_int, cp, vp, sz]
            lib.fsetxattr.argtypes = [ctypes.c_int, cp, vp, sz, ctypes.c_int]
            lib.fremovexattr.argtypes = [ctypes.c_int, cp]
        for f in (lib.flistxattr, lib.fgetxattr):
            f.restype = ctypes.c_ssize_t
        lib.fsetxattr.restype = lib.fremovexattr.restype = ctypes.c_int
        _libc = lib
    return _libc


def _check(ret: int) -> int:
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return ret


def _libc_list(fd: int) -> list[bytes]:
    lib = _lib()
    extra = (0,) if _MAC else ()
    while True:
        n = _check(lib.flistxattr(fd, None, 0, *extra))
        buf = ctypes.create_string_buffer(max(n, 1))
        try:
            k = _check(lib.flistxattr(fd, buf, n, *extra))
        except OSError as exc:
            if exc.errno == errno.ERANGE:  # grew meanwhile
                continue
            raise
        return [x for x in buf.raw[:k].split(b"\0") if x]


def _libc_get(fd: int, name: bytes) -> bytes:
    lib = _lib()
    extra = (0, 0) if _MAC else ()
    while True:
        n = _check(lib.fgetxattr(fd, name, None, 0, *extra))
        buf = ctypes.create_string_buffer(max(n, 1))
        try:
            k = _check(lib.fgetxattr(fd, name, buf, n, *extra))
        except OSError as exc:
            if exc.errno == errno.ERANGE:
                continue
            raise
        return buf.raw[:k]


def _libc_set(fd: int, name: bytes, value: bytes) -> None:
    lib = _lib()
    _check(lib.fsetxattr(fd, name, value, len(value), *((0, 0) if _MAC else (0,))))


def _libc_remove(fd: int, name: bytes) -> None:
    lib = _lib()
    _check(lib.fremovexattr(fd, name, *((0,) if _MAC else ())))


def list_xattrs(fd: int) -> list[tuple[bytes, bytes]]:
    """The copied attributes (:func:`copied_name`) of the file open as ``fd``: ``(name, value)``
    sorted by name; ``[]`` where the file system has none.

    Raises
    ------
    OSError
        Reading them failed otherwise (``EACCES``...).
    """
    libc = xattr_backend() == "libc"
    try:
        names = _libc_list(fd) if libc else [os.fsencode(n) for n in os.listxattr(fd)]
    except OSError as exc:
        if exc.errno in NO_XATTRS:
            return []
        raise
    out = []
    for n in sorted(x for x in names if copied_name(x)):
        try:
            v = _libc_get(fd, n) if libc else os.getxattr(fd, n)
        except OSError as exc:
            if exc.errno in NO_XATTRS:  # removed meanwhile
                continue
            raise
        out.append((n, v))
    return out


def set_xattrs(fd: int, want: list[tuple[bytes, bytes]], have: list[tuple[bytes, bytes]] | None = None) -> bool:
    """Make the copied attributes of ``fd`` exactly ``want``: set those that differ, remove the
    others (``have``: its attributes now, read when None). True when something changed.

    Raises
    ------
    OSError
        Setting or removing one failed (``ENOTSUP`` on a file system without them, ``ENOSPC``...).
    """
    if have is None:
        have = list_xattrs(fd)
    libc = xattr_backend() == "libc"
    cur, new = dict(have), dict(want)
    changed = False
    for n, v in want:
        if cur.get(n) != v:
            _libc_set(fd, n, v) if libc else os.setxattr(fd, n, v)
            changed = True
    for n in cur:
        if n not in new:
            _libc_remove(fd, n) if libc else os.removexattr(fd, n)
            changed = True
    return changed


def unsafe_symlink(target: str, path: str, at: str | None = None, top: str | None = None) -> bool:
    """rsync's unsafe symlink as rsync 3.4+ judges it (``unsafe_symlink`` in its ``util1.c``):
    ``target`` is absolute, or leads out of the transferred tree from the link at ``path``
    (relative to the transfer's top, which is the source's parent when the source was named
    without a trailing slash). The one rule every route uses: the sender's scan
    (``--safe-links``, ``--copy-unsafe-links``) and the receiving side on what arrives
    (:meth:`tb5sync.roles.generator.Generator`), whatever the sender did.

    Unsafe:

    - an empty or absolute target;
    - a ``..`` after any other name of the target (``a/../x``, ``sub/..``): that name may be a
      link of the same transfer (``d/via -> sub/parent/../..`` with ``sub/parent -> ..`` climbs
      above the top though its lexical depth never does; CVE-2024-12088). rsync 3.4's code also
      refuses ``../..`` (any target ending in ``/..``); here leading ``..`` are judged by depth;
    - a target whose leading ``..`` climb above the top: the depth of the link's directory is
      counted down by each ``..`` and up by each other name, in order; below 0 is unsafe.

    With ``..`` only in front, each later name descends, and a name that is a link of the same
    transfer is itself judged by this rule, so a safe link never resolves above the top through
    other links of the transfer.

    Where the source can be seen (the sender's scan and a local sync pass ``at``, the link's path
    in the file system as the scan reached it, through links it followed), a link is also unsafe
    when it resolves (``realpath``, following every link on the way) elsewhere than its text
    leads from where it is listed: below a link copied as its referent (``b_dir -> ../b``),
    ``b_dir/c_dir -> ../c`` leads to ``b_dir/../c`` in the copy but resolves to ``b``'s sibling
    ``c`` in the source, so it is unsafe and ``--copy-unsafe-links`` copies it (rsync's bug
    #470 keeps it, dangling), while ``b_dir/in_b -> file`` resolves where its text leads and
    stays a link. With ``top`` too (the transfer's top in the file system: ``--safe-links``, which
    leaves unsafe links out rather than copying them), a link that resolves outside ``top`` is
    unsafe as well: ``x -> l/f`` through ``l -> ../outside`` (itself left out) would otherwise
    dangle in the copy, or lead wherever an ``l`` already at the destination leads. The receiving
    side, which sees only the listing, judges by the text alone.
    """
    if not target or target.startswith("/"):
        return True
    depth = path.count("/")  # directories above the link, inside the tree
    named = False
    for part in target.split("/"):
        if part == "..":
            depth -= 1
            if named or depth < 0:
                return True
        elif part not in ("", "."):
            named = True
            depth += 1
    if at is None:
        return False
    # the text only climbs in front, so the lexical join is where it leads in the copy
    real = os.path.realpath(at)
    if real != os.path.realpath(os.path.normpath(os.path.join(os.path.dirname(at), target))):
        return True
    if top is None:
        return False
    inside = os.path.realpath(top)
    return real != inside and not real.startswith(inside.rstrip(os.sep) + os.sep)
