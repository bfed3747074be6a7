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

from tb5sync.errors import UsageError

__all__ = [
    "Entry",
    "FILE",
    "DIR",
    "LINK",
    "check_relpath",
    "kind_of",
    "source_name",
    "path_to_wire",
    "path_from_wire",
    "show_path",
    "STATE_DIR",
]

#: The name of tb5sync's state directory under a root (scan cache, chunk index, partial files,
#: ``serve --store``'s default store): never listed by a scan, refused in a peer's listing
#: (:func:`tb5sync.wire.messages.check_peer_path`). The same as :data:`tb5sync._os.paths.STATE_DIR`: the
#: two modules are independent siblings of the ground layer (tests/test_daemon_state.py checks it).
STATE_DIR = ".tb5sync"

FILE = "f"
DIR = "d"
LINK = "l"


def path_to_wire(path: str) -> str | bytes:
    """A name or path as it travels: itself when it is valid UTF-8 (a msgpack str), else its bytes
    (a msgpack bin).

    Python gives a name that is not valid UTF-8 (``printf 'caf\\351.txt'``) as a str holding
    surrogate escapes (``os.fsdecode``); msgpack cannot encode those as text, so the name goes
    as the bytes the filesystem holds, and :func:`path_from_wire` makes the same str again.
    """
    if path.isascii():
        return path
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return os.fsencode(path)
    return path


def path_from_wire(value: object) -> str:
    """A name or path from the wire (str, or bytes from :func:`path_to_wire`) as Python holds it.

    Raises
    ------
    UsageError
        Neither str nor bytes.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return os.fsdecode(value)
    raise UsageError(f"a path must be a string or bytes, not {type(value).__name__}")


def show_path(path: str) -> str:
    """``path`` fit to print: bytes that are not valid UTF-8 shown as ``\\xNN`` escapes."""
    if path.isascii():
        return path
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


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

    def to_wire(self) -> list[object]:
        """The msgpack array form ``[path, kind, mode, size, mtime_ns, target]`` (path and target
        as :func:`path_to_wire` gives them)."""
        return [path_to_wire(self.path), self.kind, self.mode, self.size, self.mtime_ns,
                path_to_wire(self.target) if self.target else ""]

    @classmethod
    def from_wire(cls, item: Sequence[object]) -> Entry:
        """Validate and build an entry from its msgpack array form (see :meth:`to_wire`).

        Raises
        ------
        UsageError
            Wrong arity or field types, or an unsafe path (absolute or with ``..``).
        """
        if not isinstance(item, (list, tuple)) or len(item) != 6:
            raise UsageError("manifest entry must be an array of 6 fields")
        path, kind, mode, size, mtime_ns, target = item
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if isinstance(target, bytes):
            target = os.fsdecode(target)
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
