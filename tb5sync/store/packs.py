"""Pack files: many chunks in one immutable file, and the one interface packs are stored through.

Pack format v1 (``STORE/packs/<2 hex>/<pack id>``)::

    b"TB5PACK1"                               8-byte magic and format version
    then per chunk:  digest (32 bytes, BLAKE3-256 of the data) | length (u32 little-endian) | data

Each chunk is framed with its own digest and length, so a pack can be walked and re-indexed
without the database (:func:`iter_frames`), and every read checks the frame and the digest.
A pack is written under a temporary name, fsynced, and only then put in place under its final
name; it never changes afterwards (restic's and borg's packs/segments work the same way).

:class:`PackStorage` is the only way the rest of the store touches packs: put, ranged get, list
and delete of immutable named objects. :class:`LocalPackStorage` keeps them in a directory; an
object store (fsspec) can implement the same four calls.
"""

from __future__ import annotations

import abc
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from tb5sync._os.io import durable_sync
from tb5sync.errors import IntegrityError, UsageError

__all__ = [
    "PACK_MAGIC",
    "FRAME_HEADER",
    "PackStorage",
    "LocalPackStorage",
    "FsspecPackStorage",
    "frame_header",
    "parse_frame_header",
    "iter_frames",
    "fsync_dir",
]

#: First bytes of every pack (format version 1).
PACK_MAGIC = b"TB5PACK1"
#: Bytes before each chunk's data: digest (32) and length (u32 LE).
FRAME_HEADER = 36
_LEN = struct.Struct("<I")


def frame_header(digest: bytes, length: int) -> bytes:
    """The 36 bytes that precede a chunk of ``length`` bytes with ``digest`` in a pack."""
    return digest + _LEN.pack(length)


def parse_frame_header(head: bytes | memoryview) -> tuple[bytes, int]:
    """``(digest, length)`` from a 36-byte frame header.

    Raises
    ------
    IntegrityError
        ``head`` is shorter than 36 bytes (a truncated pack).
    """
    if len(head) != FRAME_HEADER:
        raise IntegrityError("truncated chunk frame in pack")
    return bytes(head[:32]), _LEN.unpack(head[32:36])[0]


def iter_frames(data: bytes | memoryview, name: str = "pack") -> Iterator[tuple[bytes, int, int]]:
    """Walk the frames of a whole pack: yields ``(digest, data offset, length)``.

    Raises
    ------
    IntegrityError
        Bad magic, or a frame that runs past the end (the digests are not checked here).
    """
    mv = memoryview(data)
    if bytes(mv[: len(PACK_MAGIC)]) != PACK_MAGIC:
        raise IntegrityError(f"{name}: not a pack (bad magic)")
    pos = len(PACK_MAGIC)
    while pos < len(mv):
        if pos + FRAME_HEADER > len(mv):
            raise IntegrityError(f"{name}: truncated frame header at offset {pos}")
        digest, length = parse_frame_header(mv[pos : pos + FRAME_HEADER])
        start = pos + FRAME_HEADER
        if start + length > len(mv):
            raise IntegrityError(f"{name}: frame at offset {pos} runs past the end")
        yield digest, start, length
        pos = start + length


def fsync_dir(path: str) -> None:
    """fsync a directory so a rename or unlink in it is durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        durable_sync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_name(name: str) -> str:
    """Check a pack name (lowercase hex, 8..64 characters).

    Raises
    ------
    UsageError
        Anything else (a name is never a path).
    """
    if not isinstance(name, str) or not 8 <= len(name) <= 64 or any(c not in "0123456789abcdef" for c in name):
        raise UsageError(f"bad pack name {name!r}: expected 8 to 64 lowercase hex digits")
    return name


class PackStorage(abc.ABC):
    """Where packs live: immutable named objects, written once, read by range, listed, deleted.

    Implementations must make :meth:`put_file` atomic (a reader sees the whole object or
    none) and durable when it returns; names are lowercase hex (:func:`check_name`).
    """

    @abc.abstractmethod
    def put_file(self, name: str, path: str) -> int:
        """Store the finished, fsynced local file ``path`` as object ``name``; returns its size in bytes.

        The local file is consumed (moved or uploaded then removed).
        """

    @abc.abstractmethod
    def get_range(self, name: str, offset: int, length: int) -> bytes:
        """``length`` bytes of object ``name`` from byte ``offset``.

        Raises
        ------
        FileNotFoundError
            No such object.
        IntegrityError
            The object is shorter than ``offset + length``.
        """

    @abc.abstractmethod
    def list(self) -> dict[str, tuple[int, float]]:
        """Every object: name -> (size in bytes, modification time in seconds since the epoch)."""

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Remove object ``name`` (no error when it is already gone)."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release cached handles."""


class LocalPackStorage(PackStorage):
    """Packs as files ``DIR/<first 2 hex>/<name>`` (like git's and restic's object fan-out).

    Open descriptors of recently read packs are cached (at most ``max_open``); a pack
    deleted by another process stays readable through a descriptor opened before, and its
    bytes are still checked against their digests.
    """

    def __init__(self, root: str, max_open: int = 64, read_only: bool = False) -> None:
        self.root = root
        if not read_only:  # read-only: a store with no pack yet reads none
            os.makedirs(root, exist_ok=True)
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()
        self._max_open = max_open

    def path(self, name: str) -> str:
        """Local file of pack ``name``."""
        check_name(name)
        return os.path.join(self.root, name[:2], name)

    def put_file(self, name: str, path: str) -> int:
        final = self.path(name)
        d = os.path.dirname(final)
        os.makedirs(d, exist_ok=True)
        size = os.stat(path).st_size
        os.rename(path, final)
        fsync_dir(d)
        return size

    def _fd(self, name: str) -> int:
        with self._lock:
            fd = self._fds.get(name)
            if fd is not None:
                self._fds.move_to_end(name)
                return fd
        fd = os.open(self.path(name), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        with self._lock:
            old = self._fds.get(name)
            if old is not None:
                os.close(fd)
                return old
            self._fds[name] = fd
            while len(self._fds) > self._max_open:
                _, victim = self._fds.popitem(last=False)
                os.close(victim)
        return fd

    def get_range(self, name: str, offset: int, length: int) -> bytes:
        fd = self._fd(name)
        try:
            data = os.pread(fd, length, offset)
        except OSError:
            self._forget(name)
            raise
        if len(data) != length:
            raise IntegrityError(f"pack {name} is truncated: wanted {length} bytes at {offset}, got {len(data)}")
        return data

    def _forget(self, name: str) -> None:
        with self._lock:
            fd = self._fds.pop(name, None)
        if fd is not None:
            os.close(fd)

    def list(self) -> dict[str, tuple[int, float]]:
        out: dict[str, tuple[int, float]] = {}
        try:
            subs = os.listdir(self.root)
        except FileNotFoundError:
            return out
        for sub in subs:
            d = os.path.join(self.root, sub)
            try:
                names = os.listdir(d)
            except (NotADirectoryError, FileNotFoundError):
                continue
            for n in names:
                try:
                    check_name(n)
                    st = os.stat(os.path.join(d, n))
                except (UsageError, FileNotFoundError):
                    continue
                out[n] = (st.st_size, st.st_mtime)
        return out

    def delete(self, name: str) -> None:
        self._forget(name)
        p = self.path(name)
        try:
            os.unlink(p)
        except FileNotFoundError:
            return
        fsync_dir(os.path.dirname(p))

    def close(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), OrderedDict()
        for fd in fds:
            os.close(fd)


class FsspecPackStorage(PackStorage):
    """Packs as objects ``ROOT/<first 2 hex>/<name>`` of an fsspec filesystem (an object store: s3,
    gcs, az; or ``memory``, ``file``).

    Object stores make a whole-object PUT atomic, which is all :meth:`put_file` needs; ranged
    reads are ``cat_file(path, start, end)``. fsspec is not imported here: pass the filesystem.

    Parameters
    ----------
    fs : fsspec.AbstractFileSystem
        The filesystem.
    root : str
        Prefix of the packs on it (e.g. ``"bucket/store/packs"``).
    """

    def __init__(self, fs: object, root: str) -> None:
        self.fs: Any = fs
        self.root = root.rstrip("/")

    def path(self, name: str) -> str:
        """Object path of pack ``name``."""
        check_name(name)
        return f"{self.root}/{name[:2]}/{name}"

    def put_file(self, name: str, path: str) -> int:
        size = os.stat(path).st_size
        self.fs.put_file(path, self.path(name))
        os.unlink(path)
        return size

    def get_range(self, name: str, offset: int, length: int) -> bytes:
        data = bytes(self.fs.cat_file(self.path(name), start=offset, end=offset + length))
        if len(data) != length:
            raise IntegrityError(f"pack {name} is truncated: wanted {length} bytes at {offset}, got {len(data)}")
        return data

    def list(self) -> dict[str, tuple[int, float]]:
        out: dict[str, tuple[int, float]] = {}
        try:
            found = self.fs.find(self.root, detail=True)
        except FileNotFoundError:
            return out
        for p, info in found.items():
            n = p.rstrip("/").rsplit("/", 1)[-1]
            try:
                check_name(n)
            except UsageError:
                continue
            out[n] = (int(info.get("size") or 0), self._listed_mtime(info))
        return out

    def _listed_mtime(self, info: dict[str, Any]) -> float:
        """The modification time (seconds) :meth:`list` reports for a listed object: 0.0 (unknown)
        here; a subclass whose listings carry one reads it."""
        return 0.0

    def delete(self, name: str) -> None:
        try:
            self.fs.rm_file(self.path(name))
        except FileNotFoundError:
            pass
