"""Path jail: map request paths into a root and open files without following symlinks.

Request paths are relative POSIX paths. A path that is absolute or contains
``..`` is refused outright. A path whose parent directories pass through a
symlink is resolved, and refused if the result leaves the root
(:func:`resolve_in_root`, :meth:`Jail.resolve`). Files and directories are then
opened by a :class:`Jail`: relative to directory descriptors opened with
``O_DIRECTORY|O_NOFOLLOW`` from the root down, so no symlink (swapped in during
a request or not) and no ``..`` can lead outside.

How a lookup walks
    Where the kernel has ``openat2`` (Linux >= 5.6) a lookup of several
    components is one ``openat2(root, "a/b/c", RESOLVE_BENEATH |
    RESOLVE_NO_SYMLINKS)`` call (through ``ctypes``: Python has no
    ``os.openat2``); elsewhere (macOS, older kernels, a seccomp filter that
    refuses it, or ``$TB5SYNC_JAIL_PORTABLE=1``) it is a walk of one
    ``openat(dir_fd, name, O_NOFOLLOW)`` per component. Both refuse the same
    paths; the choice is made at run time (:func:`openat2_available`). A failed
    ``openat2`` lookup is walked again portably, so the error names its cause
    the same way on every system.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import sys
import threading
from collections.abc import Callable, Iterator, Sequence

from tb5sync.errors import PathError, RemoteNotFoundError, SourceNotFoundError, UsageError, shown

__all__ = [
    "STATE_DIR",
    "PORTABLE_ENV",
    "split_request_path",
    "resolve_in_root",
    "check_in_root",
    "temp_name",
    "temp_tags",
    "is_temp_name",
    "claim_temp",
    "release_temp",
    "temp_is_claimed",
    "openat2_available",
    "Jail",
]

#: Directory under a root that holds tb5sync's own state (scan cache, chunk index, partial files).
STATE_DIR = ".tb5sync"

#: Names of files being written: ``.NAME.XXXXXXXX.tb5tmp`` beside their final name.
_TEMP = re.compile(r"\..+\.[0-9a-f]{8}\.tb5tmp\Z", re.S)

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = os.O_NOFOLLOW | _CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW
#: Base names that are not names of an entry (a "/" cannot come out of ``rpartition("/")``).
_NOT_NAMES = frozenset({"", ".", ".."})
#: Reading a request path: a FIFO must not block ``open()``.
_READ_FLAGS = os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK

#: Set to ``1`` to make every :class:`Jail` created afterwards walk component by component
#: even where ``openat2`` is available (tests, or a kernel whose ``openat2`` misbehaves).
PORTABLE_ENV = "TB5SYNC_JAIL_PORTABLE"


def split_request_path(path: str) -> list[str]:
    """Split a request path into components, refusing unsafe ones.

    ``""``, ``"."`` and ``"/"``-free relative paths are accepted; empty and ``.``
    components are dropped (``"a//b/./c"`` is ``["a", "b", "c"]``).

    Raises
    ------
    PathError
        The path is absolute, contains a ``..`` component, or a NUL byte.
    """
    if not isinstance(path, str):
        raise PathError(repr(path), "not a string")
    if "\0" in path:
        raise PathError(path, "contains a NUL byte")
    if path.startswith("/"):
        raise PathError(path, "absolute paths are not allowed")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise PathError(path, "'..' is not allowed")
    return parts


def resolve_in_root(root: str, path: str) -> str:
    """Absolute local path of request ``path`` under ``root``; the final component is not resolved.

    Parent directories are resolved with ``realpath``; if they lead outside
    ``root`` (through a symlink), or the result is tb5sync's state directory
    ``root/.tb5sync`` or inside it, the request is refused.

    Parameters
    ----------
    root : str
        Absolute, already-resolved root directory.
    path : str
        Request path relative to ``root``.

    Raises
    ------
    PathError
        Unsafe path, it resolves outside ``root``, or into its state directory.
    """
    parts = split_request_path(path)
    if not parts:
        return root
    parent = os.path.realpath(os.path.join(root, *parts[:-1]))
    return check_in_root(root, os.path.join(parent, parts[-1]), path)


def follow_slash(full: str, given: str, root: str | None = None, *, follow: bool = False) -> str:
    """``full`` itself, or the directory it links to when ``given`` ends with ``/``.

    POSIX path resolution (and so rsync) takes ``link/`` to mean the directory a symlink points
    to: ``rsync -a link/ dst/`` copies that directory's contents, never the link. Without the
    trailing slash the link is the source itself (copied as a link).

    Parameters
    ----------
    full : str
        Absolute path of the source as given (its last component not resolved).
    given : str
        The source as the user or the peer wrote it (only its trailing slash matters).
    root : str, optional
        A served root the resolved directory must stay inside (a pull).
    follow : bool
        rsync ``-L``: a symlink source is what it points to (a file or a directory), slash or not.

    Raises
    ------
    RemoteNotFoundError
        ``link/`` whose target does not exist: a served one (with ``root``); a local one raises
        its subclass ``SourceNotFoundError``.
    UsageError
        ``link/`` whose target is not a directory (POSIX's ENOTDIR).
    PathError
        The target lies outside ``root``.
    """
    if not (follow or given.endswith("/")) or not os.path.islink(full):
        return full
    try:
        st = os.stat(full)
    except FileNotFoundError:
        if root is None:
            raise SourceNotFoundError(f"local source {given!r} is a symlink to nothing") from None
        raise RemoteNotFoundError(f"source {given!r} is a symlink to nothing") from None
    except OSError as exc:
        raise RemoteNotFoundError(f"source {given!r}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode) and not (follow and stat.S_ISREG(st.st_mode)):
        raise UsageError(f"source {given!r}: not a directory (a trailing slash names a directory)")
    real = os.path.realpath(full)
    return real if root is None else check_in_root(root, real, given)


def check_in_root(root: str, full: str, path: str) -> str:
    """Return ``full`` if it lies inside ``root`` and outside ``root/.tb5sync``, else raise.

    Parameters
    ----------
    root : str
        Absolute, resolved root directory.
    full : str
        Absolute path, already resolved as far as the caller wants (no ``..``).
    path : str
        The request path, named in the error.

    Raises
    ------
    PathError
        ``full`` is outside ``root``, or is or lies in tb5sync's state directory.
    """
    if full == root:
        return full
    prefix = root.rstrip("/") + "/"
    if not full.startswith(prefix):
        raise PathError(path, "resolves outside the served root")
    if full[len(prefix) :].split("/", 1)[0] == STATE_DIR:
        raise PathError(path, f"{STATE_DIR} is tb5sync's own state")
    return full


#: Most bytes of a name (NAME_MAX of Linux and macOS file systems).
NAME_MAX = 255
#: Bytes a temporary name adds around the kept part of the name: ``.`` and ``.XXXXXXXX.tb5tmp``.
_TEMP_EXTRA = 1 + 1 + 8 + len(".tb5tmp")


def temp_name(name: str, tag: str | None = None) -> str:
    """Temporary name for a file being written as ``name`` (a base name): ``.NAME.XXXXXXXX.tb5tmp``.

    Renamed into place when complete; :func:`is_temp_name` recognises it (listings hide it).
    ``NAME`` is cut, at a character boundary, so that the whole name stays within
    :data:`NAME_MAX` bytes (a name of 255 bytes in any script gets a temporary name too).
    ``XXXXXXXX`` is ``tag`` (8 lowercase hex digits; a batch takes its tags from one
    ``os.urandom`` call, see :func:`temp_tags`), else 4 random bytes in hex.
    """
    raw = name.encode("utf-8", "surrogateescape")
    keep = NAME_MAX - _TEMP_EXTRA
    if len(raw) > keep:
        while keep > 1 and (raw[keep] & 0xC0) == 0x80:  # not inside a UTF-8 sequence
            keep -= 1
        name = raw[:keep].decode("utf-8", "surrogateescape")
    return f".{name}.{tag or os.urandom(4).hex()}.tb5tmp"


def temp_tags(n: int) -> list[str]:
    """``n`` random tags for :func:`temp_name` (8 hex digits each) from one ``os.urandom`` call."""
    raw = os.urandom(4 * n).hex()
    return [raw[8 * i : 8 * i + 8] for i in range(n)]


def is_temp_name(name: str) -> bool:
    """True for a base name made by :func:`temp_name`."""
    return _TEMP.match(name) is not None


#: Temporary names of writes in progress that hold no open descriptor between requests (the fs
#: session's streamed writes): a run of this process that removes stale temporary files
#: leaves them alone.
_claimed: set[str] = set()
_claimed_lock = threading.Lock()

#: Told of every claim and release (``(claimed, name, where)``) when set: an fs worker process
#: forwards them to its server, whose stale-file sweep must see them too
#: (:mod:`tb5sync.daemon.fsworkers`). None: claims stay in this process.
claim_listener: Callable[[bool, str, Sequence[str]], None] | None = None


def claim_temp(name: str, where: Sequence[str] = ()) -> None:
    """Mark the temporary name ``name`` (a base name from :func:`temp_name`) as in use by this process.

    ``where``: the components of its directory below the served root (for :data:`claim_listener`)."""
    with _claimed_lock:
        _claimed.add(name)
    if claim_listener is not None:
        claim_listener(True, name, where)


def release_temp(name: str, where: Sequence[str] = ()) -> None:
    """Undo :func:`claim_temp` (the write was committed or removed); an unclaimed name is ignored."""
    with _claimed_lock:
        _claimed.discard(name)
    if claim_listener is not None:
        claim_listener(False, name, where)


def temp_is_claimed(name: str) -> bool:
    """True while ``name`` is claimed by a write of this process (:func:`claim_temp`)."""
    with _claimed_lock:
        return name in _claimed


# ---- openat2 (Linux >= 5.6), through ctypes --------------------------------------------------

#: openat2's number: 437 in the unified table every one of these architectures uses
#: (alpha, ia64 and MIPS number it otherwise, and are left to the portable walk).
_OPENAT2_NR = 437
_OPENAT2_MACHINES = frozenset({"x86_64", "amd64", "aarch64", "arm64", "riscv64", "ppc64le", "ppc64", "s390x", "i386", "i686", "armv7l", "armv8l", "loongarch64"})
_RESOLVE_NO_SYMLINKS = 0x04  # no symlink in any component, the last one included (ELOOP)
_RESOLVE_BENEATH = 0x08  # never above the starting directory (EXDEV)
#: Errors after which an ``openat2`` lookup is walked again portably: a symlink or a non-directory
#: on the way (the walk tells which), an escape attempt, or a rename race the kernel reports.
_WALK_AGAIN = frozenset({errno.ELOOP, errno.ENOTDIR, errno.EXDEV, errno.EAGAIN})

_Openat2 = Callable[[int, str, int, int], int]
_openat2_fn: _Openat2 | None = None
_openat2_probed = False


def _load_openat2() -> _Openat2 | None:
    """``openat2(dir_fd, path, flags, mode) -> fd`` with RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS, or None.

    None where the system has no working ``openat2``: not Linux, an architecture
    whose number we do not know, a kernel before 5.6 (``ENOSYS``) or a seccomp
    filter that refuses it (``EPERM``). The probe opens ``/`` relative to itself
    and checks that the descriptor it gets is that directory.
    """
    if sys.platform != "linux":
        return None
    if os.uname().machine not in _OPENAT2_MACHINES:  # platform.machine()'s source, without importing platform
        return None
    import ctypes

    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long

    class OpenHow(ctypes.Structure):
        _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]

    nr = ctypes.c_long(_OPENAT2_NR)
    size = ctypes.c_size_t(ctypes.sizeof(OpenHow))
    tmpfile = getattr(os, "O_TMPFILE", 0)  # it holds O_DIRECTORY's bit: compare it whole

    hows: dict[tuple[int, int], Any] = {}  # (flags, mode) -> its OpenHow, made once (never written by the kernel)

    def openat2(dir_fd: int, path: str, flags: int, mode: int) -> int:
        how = hows.get((flags, mode))
        if how is None:
            # openat2 refuses a mode without O_CREAT/O_TMPFILE (EINVAL)
            creates = flags & os.O_CREAT or tmpfile and flags & tmpfile == tmpfile
            how = OpenHow(flags, mode if creates else 0, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS)
            if len(hows) < 64:
                hows[(flags, mode)] = how
        name = os.fsencode(path)
        while True:
            fd = syscall(nr, ctypes.c_long(dir_fd), name, ctypes.byref(how), size)
            if fd >= 0:
                return int(fd)
            code = ctypes.get_errno()
            if code != errno.EINTR:
                raise OSError(code, os.strerror(code), path)

    try:
        top = os.open("/", _DIR_FLAGS)
    except OSError:
        return None
    try:
        fd = openat2(top, ".", _DIR_FLAGS, 0)
    except OSError:
        return None
    finally:
        os.close(top)
    try:
        a, b = os.fstat(fd), os.stat("/")
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
            return None
    finally:
        os.close(fd)
    return openat2


def openat2_available() -> bool:
    """True when lookups can use ``openat2`` with ``RESOLVE_BENEATH`` here (probed once per process).

    :envvar:`TB5SYNC_JAIL_PORTABLE` does not change the answer; it only makes
    :class:`Jail` not use it.
    """
    return _openat2() is not None


def _openat2() -> _Openat2 | None:
    global _openat2_fn, _openat2_probed
    if not _openat2_probed:  # a race probes twice, harmlessly
        _openat2_fn = _load_openat2()
        _openat2_probed = True
    return _openat2_fn


# ---- the portable walk -------------------------------------------------------------------------

#: What ``open(name, O_NOFOLLOW)`` of a symlink fails with: ELOOP (Linux, macOS; ENOTDIR on Linux
#: with O_DIRECTORY), EMLINK (FreeBSD), EFTYPE (NetBSD).
_LINK_ERRNOS = frozenset(e for e in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK, getattr(errno, "EFTYPE", None)) if e is not None)


def _is_symlink(exc: OSError, name: str, dir_fd: int) -> bool:
    """True when ``exc``, raised opening ``name`` in ``dir_fd`` with ``O_NOFOLLOW``, means it is a symlink."""
    if exc.errno not in _LINK_ERRNOS:
        return False
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _check_name(name: str, shown: str) -> None:
    """Refuse a component that is not a plain name (``..`` above all).

    Raises
    ------
    PathError
        ``name`` is empty, ``.``, ``..``, or holds ``/`` or NUL.
    """
    if name in ("", ".", "..") or "/" in name or "\0" in name:
        raise PathError(shown, "'..' is not allowed" if name == ".." else f"bad path component {name!r}")


def _open_child(dir_fd: int, name: str, shown: str, create: bool = False) -> int:
    """A new descriptor of directory ``name`` in ``dir_fd``, never through a symlink.

    Parameters
    ----------
    dir_fd : int
        Directory descriptor inside the jail.
    name : str
        One checked path component.
    shown : str
        The path named in errors.
    create : bool
        Create ``name`` (mode 0o777 less the umask) when it is missing.

    Raises
    ------
    PathError
        ``name`` is a symlink.
    OSError
        Other failures (``FileNotFoundError``, ``NotADirectoryError``, ...).
    """
    made = False
    while True:
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            if not create or made:
                raise
            made = True
            try:
                os.mkdir(name, 0o777, dir_fd=dir_fd)
            except FileExistsError:
                pass  # made meanwhile by someone else: open what is there (still O_NOFOLLOW)
        except OSError as exc:
            if _is_symlink(exc, name, dir_fd):
                raise PathError(shown, "a path component is a symlink") from exc
            raise


def _open_in(dir_fd: int, name: str, flags: int, mode: int, shown: str) -> int:
    """``open(name, flags | O_NOFOLLOW, mode)`` in ``dir_fd``; a symlink is a :class:`PathError`."""
    try:
        return os.open(name, flags | _NOFOLLOW, mode, dir_fd=dir_fd)
    except OSError as exc:
        if _is_symlink(exc, name, dir_fd):
            raise PathError(shown, "is a symlink; not followed") from exc
        raise


def _walk(start: int, parts: Sequence[str], shown: str, create: bool) -> int:
    """A new descriptor of directory ``parts`` below ``start``, one ``O_NOFOLLOW`` open per component."""
    fd = -1
    try:
        for name in parts:
            nfd = _open_child(start if fd < 0 else fd, name, shown, create)
            if fd >= 0:
                os.close(fd)
            fd = nfd
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    return fd if fd >= 0 else os.dup(start)


# ---- the jail ---------------------------------------------------------------------------------


class Jail:
    """A directory tree that no lookup can leave: every open walks down from its root.

    Every lookup goes through directory descriptors opened with
    ``O_DIRECTORY|O_NOFOLLOW`` from the root down (or one ``openat2`` with
    ``RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS``, where the kernel has it), so no
    symlink and no ``..`` in any component, the last one included, leads anywhere:
    they are :class:`~tb5sync.errors.PathError`. A directory renamed or swapped
    for a symlink between two lookups cannot redirect the second one.

    Two kinds of paths:

    * *Jail paths* (:meth:`open_dir`, :meth:`open_file`, :meth:`open_cached`,
      :meth:`dir_fd`): a relative POSIX string or a sequence of components,
      taken as they are; a symlink anywhere is refused. The cached lookups walk
      one component at a time, each level kept, never through ``openat2``.
    * *Request paths* (:meth:`resolve`, :meth:`open_read`, :meth:`parent`): a
      symlink whose target is inside the root is followed (parents always, the
      last component for reads), by resolving the path first
      (:func:`resolve_in_root`); the result, never outside the root nor in its
      ``.tb5sync``, is then looked up as a jail path, so a symlink swapped in
      after the resolution is refused, not followed.

    Descriptors returned are new (the caller closes them), except those of
    :meth:`dir_fd` and :attr:`fd`, which the jail owns. Close with :meth:`close`
    (or use it as a context manager).

    Parameters
    ----------
    root : str
        An existing directory, not itself a symlink. Absolute and resolved
        (``os.path.realpath``) for the request-path methods.
    portable : bool or None
        True: walk one component at a time even where ``openat2`` is available.
        None (default): use ``openat2`` when :func:`openat2_available`, unless
        ``$TB5SYNC_JAIL_PORTABLE`` (or ``$TB5SYNC_PORTABLE``) is set to anything but ``0``.
    fd : int or None
        A descriptor of the root directory, already open (e.g. by another jail's
        :meth:`open_dir`): the jail takes it over (closes it) and never opens ``root`` by
        path, so a parent of ``root`` swapped for a symlink meanwhile changes nothing
        (the request-path methods still compute with ``root``, but every lookup goes
        through the descriptor). None: ``root`` is opened (``O_DIRECTORY|O_NOFOLLOW``).

    Raises
    ------
    OSError
        ``root`` cannot be opened as a directory (``ELOOP``/``ENOTDIR`` for a symlink);
        ``NotADirectoryError`` for an ``fd`` that is not a directory's (it is closed).
    """

    def __init__(self, root: str, *, portable: bool | None = None, fd: int | None = None) -> None:
        self.root = root
        if fd is None:
            self._fd = os.open(root, _DIR_FLAGS)
        else:
            try:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), root)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
        if portable is None:
            # this variable, or $TB5SYNC_PORTABLE (tb5sync._os.io.portable: every portable path at once)
            portable = any(os.environ.get(v, "") not in ("", "0") for v in (PORTABLE_ENV, "TB5SYNC_PORTABLE"))
        self._openat2 = None if portable else _openat2()
        self._local = threading.local()
        self._cached: set[int] = set()
        self._lock = threading.Lock()

    def __enter__(self) -> Jail:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def fd(self) -> int:
        """Descriptor of the root (owned by the jail; -1 once closed)."""
        return self._fd

    @property
    def uses_openat2(self) -> bool:
        """True when this jail's lookups go through ``openat2``, False for the portable walk."""
        return self._openat2 is not None

    @staticmethod
    def _parts(path: str | Sequence[str]) -> list[str]:
        if isinstance(path, str):
            return split_request_path(path)
        parts = list(path)
        for name in parts:
            if not isinstance(name, str):
                raise PathError(shown(path), "components must be strings")
            _check_name(name, "/".join(parts))
        return parts

    # ---- jail paths ---------------------------------------------------------------------
    def open_dir(self, path: str | Sequence[str], *, create: bool = False, start: int | None = None) -> int:
        """A new descriptor of directory ``path``; no component may be a symlink.

        Parameters
        ----------
        path : str or sequence of str
            Jail path (``""`` or ``[]``: the starting directory itself, duplicated).
        create : bool
            Create missing directories on the way (mode 0o777 less the umask), as ``mkdir -p``.
        start : int or None
            Walk from this directory descriptor (one inside the jail, e.g. from
            :meth:`open_dir`) instead of the root.

        Raises
        ------
        PathError
            A component is a symlink, ``..``, empty or absolute.
        OSError
            Other failures: ``FileNotFoundError`` (missing, without ``create``),
            ``NotADirectoryError`` (a component is a file), ...
        """
        parts = self._parts(path)
        base = self._fd if start is None else start
        if not parts:
            return os.dup(base)
        shown = "/".join(parts)
        if len(parts) == 1:  # one openat(O_NOFOLLOW): as safe as openat2, and cheaper than its ctypes call
            return _open_child(base, parts[0], shown, create)
        if self._openat2 is not None:
            try:
                return self._openat2(base, shown, _DIR_FLAGS, 0)
            except OSError as exc:
                if exc.errno not in _WALK_AGAIN and not (create and exc.errno == errno.ENOENT):
                    raise
        return _walk(base, parts, shown, create)

    def open_file(self, path: str | Sequence[str], flags: int = os.O_RDONLY, mode: int = 0o600, *, shown: str | None = None) -> int:
        """Open ``path`` with ``flags | O_NOFOLLOW | O_CLOEXEC``; no component may be a symlink.

        Parameters
        ----------
        path : str or sequence of str
            Jail path. ``""`` opens the root itself (as ``"."``).
        flags : int
            ``os.open`` flags.
        mode : int
            Permission bits of a file ``O_CREAT`` makes (less the umask).
        shown : str or None
            The path named in errors (default: ``path``).

        Returns
        -------
        int
            A new descriptor.

        Raises
        ------
        PathError
            The file or a directory on the way is a symlink, or a component is ``..``, empty or absolute.
        OSError
            Other failures (``FileNotFoundError``, ``IsADirectoryError``, ...).
        """
        parts = self._parts(path)
        if shown is None:
            shown = "/".join(parts)
        if not parts:
            return _open_in(self._fd, ".", flags, mode, shown)
        if self._openat2 is not None:
            try:
                return self._openat2(self._fd, "/".join(parts), flags | _NOFOLLOW, mode)
            except OSError as exc:
                if exc.errno not in _WALK_AGAIN:
                    raise
        if len(parts) == 1:
            return _open_in(self._fd, parts[0], flags, mode, shown)
        dfd = _walk(self._fd, parts[:-1], shown, False)
        try:
            return _open_in(dfd, parts[-1], flags, mode, shown)
        finally:
            os.close(dfd)

    def locate(self, path: str | Sequence[str]) -> tuple[int, str]:
        """``(dir_fd, name)`` of the entry at jail path ``path``, for lookups relative to its directory.

        ``dir_fd`` is a new descriptor (the caller closes it) of the directory holding the
        entry, looked up as :meth:`open_dir` does (no symlink on the way); ``name`` its last
        component, not looked up. The root itself (``""``) is ``(a duplicate of fd, ".")``.
        A session's base is opened this way (then ``os.stat(name, dir_fd=dir_fd,
        follow_symlinks=False)``, ``os.open(name, ... | O_NOFOLLOW, dir_fd=dir_fd)``), never
        by a path resolved again later.

        Raises
        ------
        PathError
            A directory on the way is a symlink, or a component is ``..``, empty or absolute.
        OSError
            Other failures (``FileNotFoundError``, ``NotADirectoryError``, ...).
        """
        parts = self._parts(path)
        if not parts:
            return os.dup(self._fd), "."
        return self.open_dir(parts[:-1]), parts[-1]

    def open_cached(self, relpath: str, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
        """:meth:`open_file` with the parent directory's descriptor from this thread's cache (:meth:`dir_fd`).

        For many opens in few directories (the sender's reads): one dictionary
        lookup and one ``openat`` per file, as fast as a plain ``open``.

        Parameters
        ----------
        relpath : str
            Jail path as a string without empty or ``.`` components (``"a/b/c"``).
        flags, mode : int
            As :meth:`open_file`.

        Returns
        -------
        int
            A new descriptor.

        Raises
        ------
        PathError
            The file or a directory on the way is a symlink, or a component is ``..`` or empty.
        OSError
            Other failures (``FileNotFoundError``, ``IsADirectoryError``, ...).
        """
        parent, _, name = relpath.rpartition("/")
        if name in _NOT_NAMES:
            _check_name(name, relpath)
        dfd = self.dir_fd(parent)
        try:
            return os.open(name, flags | _NOFOLLOW, mode, dir_fd=dfd)
        except OSError as exc:
            if _is_symlink(exc, name, dfd):
                raise PathError(relpath, "is a symlink; not followed") from exc
            raise

    def dir_fd(self, reldir: str) -> int:
        """Descriptor of directory ``reldir`` (relative POSIX path, ``""`` for the root), cached.

        Each thread keeps its own cache of up to 64 descriptors (half are closed
        when it fills), so one thread never closes a descriptor another is using.
        The descriptor belongs to the jail: do not close it, and use it before the
        next call to :meth:`dir_fd` or :meth:`open_cached` in this thread.
        A directory renamed after it was cached is still reached through its
        descriptor (wherever it now is inside the root).

        Raises
        ------
        PathError
            A component is a symlink, ``..`` or empty.
        OSError
            Other failures (``FileNotFoundError``, ``NotADirectoryError``, ...).
        """
        if not reldir:
            return self._fd
        cache = getattr(self._local, "cache", None)
        if cache is None:
            cache = self._local.cache = {}
        fd = cache.get(reldir)
        if fd is not None:
            return fd
        parent, _, name = reldir.rpartition("/")
        _check_name(name, reldir)
        fd = _open_child(self.dir_fd(parent), name, reldir)
        if len(cache) >= 64:
            for key in list(cache)[:32]:
                old = cache.pop(key)
                with self._lock:
                    self._cached.discard(old)
                os.close(old)
        cache[reldir] = fd
        with self._lock:
            self._cached.add(fd)
        return fd

    # ---- request paths ------------------------------------------------------------------
    def resolve(self, path: str, *, follow: bool = False) -> list[str]:
        """Components of request ``path`` with symlinks in its parents resolved (and its last one if ``follow``).

        Only the path is computed (``realpath``); nothing is opened, so the result
        is then looked up as a jail path, which refuses a symlink swapped in meanwhile.

        Parameters
        ----------
        path : str
            Request path relative to the root (``""`` is the root: ``[]``).
        follow : bool
            Resolve the last component too when it is a symlink.

        Raises
        ------
        PathError
            ``path`` is absolute, has a ``..`` or NUL, or resolves outside the root
            or into its ``.tb5sync``.
        """
        if not split_request_path(path):
            return []
        full = resolve_in_root(self.root, path)
        if follow and os.path.islink(full):
            full = check_in_root(self.root, os.path.realpath(full), path)
        rel = os.path.relpath(full, self.root)
        return [] if rel == "." else rel.split("/")

    def literal(self, path: str) -> list[str]:
        """Components of request ``path`` as written (refused as :meth:`resolve` refuses them:
        unsafe, or naming the state directory)."""
        parts = split_request_path(path)
        if parts and parts[0] == STATE_DIR:
            raise PathError(path, f"{STATE_DIR} is tb5sync's own state")
        return parts

    def locate_request(self, path: str, parts: list[str] | None = None) -> tuple[int, list[str]]:
        """``(dir_fd, parts)`` of request ``path`` (not the root): ``parts`` its components with
        symlinks in its parents resolved (as :meth:`resolve`), ``dir_fd`` a new descriptor of the
        directory holding ``parts[-1]`` (the caller closes it), looked up as :meth:`open_dir` does.

        The path as written is tried first: when no parent is a symlink (one ``openat2``, or one
        ``openat`` per component) that is the answer, with no ``realpath``; a symlink on the way
        (``PathError`` from the lookup) falls back to :meth:`resolve` and a lookup of its result.
        Either way every directory is opened from the root's descriptor without following a
        symlink, so nothing outside the root is reached, whatever changes meanwhile.

        ``parts``, when given, is ``literal(path)`` (computed already by the caller).

        Raises
        ------
        PathError
            As :meth:`resolve`; ``path`` is the root; a symlink on the way after the resolution.
        OSError
            Other failures (``FileNotFoundError`` for a missing parent, ...).
        """
        if parts is None:
            parts = self.literal(path)
        if not parts:
            raise PathError(path, "is the served root itself")
        try:
            return self.open_dir(parts[:-1]), parts
        except PathError:  # a symlink in the parents: resolve them (inside the root)
            pass
        parts = self.resolve(path)
        return self.open_dir(parts[:-1]), parts

    def open_read(self, path: str) -> tuple[int, str]:
        """Open request ``path`` for reading (a last symlink inside the root is followed).

        Opened ``O_RDONLY|O_NONBLOCK`` (a FIFO does not block the open). The path as written is
        tried first (no ``realpath`` when no component is a symlink, see :meth:`locate_request`).

        Returns
        -------
        tuple of (int, str)
            A new descriptor, and the resolved path relative to the root (``""`` for the root).

        Raises
        ------
        PathError
            As :meth:`resolve`, or a symlink on the way (swapped in after the resolution).
        OSError
            Other failures (``FileNotFoundError`` for a missing file or dangling link, ...).
        """
        parts = self.literal(path)
        if parts:  # the path as written, when no component is a symlink: no realpath
            try:
                return self.open_file(parts, _READ_FLAGS, shown=path), "/".join(parts)
            except PathError:  # a symlink on the way: resolve it (inside the root)
                pass
        parts = self.resolve(path, follow=True)
        return self.open_file(parts, _READ_FLAGS, shown=path), "/".join(parts)

    def open_request_dir(self, path: str) -> tuple[int, list[str]]:
        """A new descriptor of the directory at request ``path`` (symlinks inside the root followed,
        the last one too), and its components with those symlinks resolved.

        The path as written is tried first (:meth:`open_dir` of :meth:`literal`: one ``openat2``,
        or one ``openat`` per component, no ``realpath``); only a symlink on the way (a
        ``PathError`` from that lookup) falls back to :meth:`resolve` (``follow=True``) and a lookup
        of its result. Either way every directory is opened from the root's descriptor without
        following a symlink, so nothing outside the root is reached, whatever changes meanwhile.

        Raises
        ------
        PathError
            As :meth:`resolve`; a symlink on the way after the resolution.
        OSError
            Other failures (``FileNotFoundError``, ``NotADirectoryError``, ...).
        """
        parts = self.literal(path)
        try:
            return self.open_dir(parts), parts
        except PathError:  # a symlink on the way: resolve it (inside the root)
            pass
        parts = self.resolve(path, follow=True)
        return self.open_dir(parts), parts

    @contextlib.contextmanager
    def parent(self, path: str, *, create: bool = False, follow: bool = False) -> Iterator[tuple[int, str, str]]:
        """Where request ``path`` is created, renamed or unlinked: ``(dir_fd, name, relpath)``.

        A context manager: ``dir_fd`` (a new descriptor of the directory holding
        ``path``, parent symlinks inside the root resolved) is closed on exit.
        ``name`` is the last component, not followed; ``relpath`` the resolved
        path relative to the root. Use ``name`` only relative to ``dir_fd``
        (``os.unlink(name, dir_fd=dir_fd)``, ``os.rename(..., dst_dir_fd=dir_fd)``).

        The path as written is tried first (as :meth:`locate_request`): its parent opened from the
        root's descriptor with no symlink allowed, and no ``realpath``; a symlink on the way falls
        back to :meth:`resolve` and a lookup of its result. A name swapped for a symlink after
        either step is then acted on as a link (replaced or removed, never followed), and a parent
        swapped for one is refused by the lookup, so nothing outside the root is reached.

        Parameters
        ----------
        path : str
            Request path; not the root itself.
        create : bool
            Create missing parent directories.
        follow : bool
            A last component that is a symlink whose target lies inside the root stands for that
            target (a write lands where ``open(path, "w")`` would write); one leading outside is
            ``PathError``.

        Raises
        ------
        PathError
            As :meth:`resolve`; ``path`` is the root; a symlink on the way.
        OSError
            Other failures (``FileNotFoundError`` for a missing parent without ``create``, ...).
        """
        parts = self.literal(path)
        dfd = -1
        if parts:
            try:
                dfd = self.open_dir(parts[:-1], create=create)
            except PathError:  # a symlink in the parents: resolve them (inside the root), below
                pass
        if dfd >= 0 and follow:
            try:
                linked = stat.S_ISLNK(os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False).st_mode)
            except FileNotFoundError:
                linked = False
            except BaseException:
                os.close(dfd)
                raise
            if linked:  # the last component is a link: where it leads is resolved below
                os.close(dfd)
                dfd = -1
        if dfd < 0:
            parts = self.resolve(path, follow=follow)
            if not parts:
                raise PathError(path, "the served root itself cannot be replaced or removed")
            dfd = self.open_dir(parts[:-1], create=create)
        try:
            yield dfd, parts[-1], "/".join(parts)
        finally:
            os.close(dfd)

    def close(self) -> None:
        """Close the root's and every cached descriptor. Safe to call twice."""
        with self._lock:
            fds, self._cached = list(self._cached), set()
            if self._fd >= 0:
                fds.append(self._fd)
                self._fd = -1
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
