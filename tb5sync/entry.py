"""Manifest entries: one regular file, directory or symlink, and the checks on their paths.

No I/O beyond ``lstat`` in :func:`kind_of`. A manifest is a list of :class:`Entry`, one per
regular file, directory or symlink under a base path, with paths relative to the base
(``""`` is the base itself) in POSIX form, parents before children.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from typing import NamedTuple

from .errors import UsageError

__all__ = ["Entry", "FILE", "DIR", "LINK", "check_relpath", "kind_of", "source_name"]

FILE = "f"
DIR = "d"
LINK = "l"


class Entry(NamedTuple):
    """One manifest entry.

    Attributes
    ----------
    path : str
        POSIX path relative to the scan base; ``""`` is the base itself.
    kind : str
        ``"f"`` regular file, ``"d"`` directory, ``"l"`` symlink.
    mode : int
        Permission bits (``stat.S_IMODE``).
    size : int
        Bytes (0 for directories; the target's length for symlinks).
    mtime_ns : int
        Modification time, nanoseconds since the epoch.
    target : str
        Symlink target as stored (not resolved); ``""`` otherwise.
    """

    path: str
    kind: str
    mode: int
    size: int
    mtime_ns: int
    target: str = ""

    @classmethod
    def from_wire(cls, item: Sequence[object]) -> Entry:
        """Validate and build an entry from its msgpack array form.

        Raises
        ------
        UsageError
            Wrong arity or field types, or an unsafe path (absolute or with ``..``).
        """
        if not isinstance(item, (list, tuple)) or len(item) != 6:
            raise UsageError("manifest entry must be an array of 6 fields")
        path, kind, mode, size, mtime_ns, target = item
        if not (
            isinstance(path, str)
            and kind in (FILE, DIR, LINK)
            and isinstance(mode, int)
            and isinstance(size, int)
            and size >= 0
            and isinstance(mtime_ns, int)
            and isinstance(target, str)
        ):
            raise UsageError(f"malformed manifest entry {item!r:.200}")
        check_relpath(path)
        return cls(path, str(kind), mode & 0o7777, size, mtime_ns, target)


def check_relpath(path: str) -> str:
    """Return ``path`` if it is a safe relative POSIX path, else raise.

    Safe means: not absolute, no ``..`` or ``.`` component, no empty component, no NUL.
    ``""`` (the base itself) is safe.

    Raises
    ------
    UsageError
        Naming the path and what is wrong with it.
    """
    if path == "":
        return path
    if "\0" in path:
        raise UsageError(f"path contains NUL: {path!r}")
    if path.startswith("/"):
        raise UsageError(f"absolute path not allowed: {path!r}")
    # fast path (manifests of 10^5 entries): no empty component and no component starting with "."
    if "//" not in path and not path.endswith("/") and not path.startswith(".") and "/." not in path:
        return path
    for part in path.split("/"):
        if part in ("", ".", ".."):
            raise UsageError(f"path component {part!r} not allowed in {path!r}")
    return path


def kind_of(path: str) -> str:
    """``"l"``, ``"d"`` or ``"f"`` for the local ``path`` (symlinks not followed); anything else counts as ``"f"``."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return LINK
    return DIR if stat.S_ISDIR(st.st_mode) else FILE


def source_name(path: str) -> str | None:
    """The name a source lands under, or None for "the contents of" (rsync's trailing slash).

    ``"a/b"`` -> ``"b"``; ``"a/b/"``, ``""``, ``"."`` and ``".."`` -> None.
    """
    if path.endswith("/") or path == "":
        return None
    name = os.path.basename(path.rstrip("/"))
    return None if name in ("", ".", "..") else name
