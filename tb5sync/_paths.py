"""Path jail: map request paths into a root and open files without following symlinks.

Request paths are relative POSIX paths. A path that is absolute or contains
``..`` is refused outright. A path whose parent directories pass through a
symlink is resolved, and refused if the result leaves the root. Files are then
opened component by component relative to directory descriptors with
``O_NOFOLLOW``, so a symlink swapped in during a request cannot redirect it.
"""

from __future__ import annotations

import os
import re
import threading

from .errors import PathError

__all__ = ["STATE_DIR", "split_request_path", "resolve_in_root", "check_in_root", "temp_name", "is_temp_name", "DirFds"]

#: Directory under a root that holds tb5sync's own state (scan cache, chunk index, partial files).
STATE_DIR = ".tb5sync"

#: Names of files being written: ``.NAME.XXXXXXXX.tb5tmp`` beside their final name.
_TEMP = re.compile(r"\..+\.[0-9a-f]{8}\.tb5tmp\Z", re.S)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


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


def temp_name(name: str) -> str:
    """Temporary name for a file being written as ``name`` (a base name): ``.NAME.XXXXXXXX.tb5tmp``.

    Renamed into place when complete; :func:`is_temp_name` recognises it (listings hide it).
    """
    return f".{name[:200]}.{os.urandom(4).hex()}.tb5tmp"


def is_temp_name(name: str) -> bool:
    """True for a base name made by :func:`temp_name`."""
    return _TEMP.match(name) is not None


class DirFds:
    """Open files under a base directory without following symlinks in any component.

    Directory descriptors are cached per relative directory. Close with :meth:`close`.

    Parameters
    ----------
    base : str
        Absolute path of an existing directory.

    Raises
    ------
    OSError
        ``base`` cannot be opened as a directory.
    """

    def __init__(self, base: str) -> None:
        self.base = base
        self._base_fd = os.open(base, _DIR_FLAGS)
        self._local = threading.local()
        self._all: set[int] = set()
        self._lock = threading.Lock()

    def _cache(self) -> dict[str, int]:
        cache = getattr(self._local, "cache", None)
        if cache is None:
            cache = self._local.cache = {}
        return cache

    def dir_fd(self, reldir: str) -> int:
        """Descriptor of directory ``reldir`` (relative POSIX path, ``""`` for the base).

        Each thread keeps its own small cache of descriptors, so one thread never
        closes a descriptor another is using.

        Raises
        ------
        PathError
            A component is a symlink (``ELOOP``) or not a directory.
        OSError
            Other failures (e.g. ``FileNotFoundError``).
        """
        if not reldir:
            return self._base_fd
        cache = self._cache()
        fd = cache.get(reldir)
        if fd is not None:
            return fd
        parent, _, name = reldir.rpartition("/")
        pfd = self.dir_fd(parent)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=pfd)
        except OSError as exc:
            if exc.errno in (40, 20):  # ELOOP, ENOTDIR
                raise PathError(reldir, "a path component is a symlink or not a directory") from exc
            raise
        if len(cache) >= 64:
            for key in list(cache)[:32]:
                old = cache.pop(key)
                with self._lock:
                    self._all.discard(old)
                os.close(old)
        cache[reldir] = fd
        with self._lock:
            self._all.add(fd)
        return fd

    def open(self, relpath: str, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
        """Open ``relpath`` (relative to the base) with ``O_NOFOLLOW``; returns a new descriptor.

        Raises
        ------
        PathError
            The file or a parent component is a symlink.
        OSError
            Other failures.
        """
        parent, _, name = relpath.rpartition("/")
        dfd = self.dir_fd(parent)
        try:
            return os.open(name, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode, dir_fd=dfd)
        except OSError as exc:
            if exc.errno == 40:
                raise PathError(relpath, "is a symlink; not followed") from exc
            raise

    def close(self) -> None:
        """Close every cached descriptor. Safe to call twice."""
        with self._lock:
            fds, self._all = list(self._all), set()
            if self._base_fd >= 0:
                fds.append(self._base_fd)
                self._base_fd = -1
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
