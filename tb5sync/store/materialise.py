"""Materialise a snapshot: build it under a temporary name next to the destination, then rename.

The result has rsync -a's metadata: permission bits, mtimes (ns) of files, symlinks and
directories (directories last, deepest first), symlinks as symlinks. Owners are not kept
(rsync keeps them only when run as root). Files with the same content are cloned
(``FICLONE`` on Linux filesystems that share extents: Btrfs, XFS; copy-on-write, so they stay
independent) or, when asked, hard-linked if their mode and mtime agree too; otherwise written.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

from tb5sync._os.io import portable
from tb5sync._os.paths import temp_name
from tb5sync.errors import DestinationError, DestinationExistsError, IntegrityError
from tb5sync.store.manifest import Item
from tb5sync.store.packs import fsync_dir

if TYPE_CHECKING:
    from tb5sync.store.index import ChunkReader

__all__ = ["materialise", "reflink_supported"]

_FICLONE = 0x40049409  # _IOW(0x94, 9, int), linux/fs.h


def reflink_supported() -> bool:
    """Whether cloning is attempted: Linux, unless ``TB5SYNC_NO_REFLINK=1`` or ``TB5SYNC_PORTABLE=1`` forces the portable copy."""
    return sys.platform.startswith("linux") and not portable("TB5SYNC_NO_REFLINK")


def _clone(src_fd: int, dst_fd: int) -> bool:
    """Clone ``src_fd``'s extents into ``dst_fd``; False where the filesystem cannot."""
    import fcntl

    try:
        fcntl.ioctl(dst_fd, _FICLONE, src_fd)
    except OSError:
        return False
    return True


def _set_times(path: bytes, it: Item) -> None:
    if it.kind == "l":
        if os.utime in os.supports_follow_symlinks:
            with contextlib.suppress(OSError):  # some filesystems refuse symlink times
                os.utime(path, ns=(it.mtime_ns, it.mtime_ns), follow_symlinks=False)
        return
    os.utime(path, ns=(it.mtime_ns, it.mtime_ns))


def _write_all(fd: int, views: list[memoryview]) -> None:
    """Write ``views`` in order to ``fd``: ``writev`` of at most 512 buffers a call where the platform
    has it, else one ``write`` each; short writes resumed where they stopped.

    Raises
    ------
    OSError
        A write fails, or writes nothing (``ENOSPC``-like).
    """
    writev = getattr(os, "writev", None)
    pending = [v for v in views if len(v)]
    i = 0
    while i < len(pending):
        n = writev(fd, pending[i : i + 512]) if writev is not None else os.write(fd, pending[i])
        if n <= 0:
            raise OSError(28, "write wrote nothing")
        while n and i < len(pending):
            if n >= len(pending[i]):
                n -= len(pending[i])
                i += 1
            else:
                pending[i] = pending[i][n:]
                n = 0


def _build(store: ChunkReader, items: list[Item], top: bytes, hardlink: bool) -> None:
    dirs = {it.path for it in items if it.kind == "d"}
    cloning = reflink_supported()  # until the first refusal: one filesystem under one destination
    where = store.locate(d for it in items if it.kind == "f" and len(it.chunks) == 1 for d, _ in it.chunks)
    done: dict[bytes, tuple[bytes, int, int]] = {}  # file digest -> (path, mode, mtime_ns)
    for it in items:
        if it.path and (it.path.rpartition(b"/")[0] not in dirs):
            raise IntegrityError(f"manifest entry {it.path!r} is not inside a directory of the snapshot")
        full = os.path.join(top, it.path) if it.path else top
        if it.kind == "d":
            os.mkdir(full, 0o700)
        elif it.kind == "l":
            assert it.target is not None
            os.symlink(it.target, full)
        else:
            first = done.get(it.digest) if it.digest is not None else None
            if first is not None and hardlink and first[1:] == (it.mode, it.mtime_ns):
                os.link(first[0], full)
                continue
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            try:
                cloned = False
                if first is not None and it.size and cloning:
                    src = os.open(first[0], os.O_RDONLY)
                    try:
                        cloned = cloning = _clone(src, fd)
                    finally:
                        os.close(src)
                if not cloned:
                    digests = [d for d, _ in it.chunks]
                    if len(digests) > 1:
                        views = getattr(store, "iter_chunk_views", None)
                        chunks: Iterable[bytes | list[memoryview]] = (views(digests) if views is not None
                                                                      else store.iter_chunks(digests))
                    else:  # one chunk or none: read here, located in advance
                        chunks = [store.read_at(d, where.get(d)) for d in digests]
                    for data in chunks:
                        _write_all(fd, [memoryview(data)] if not isinstance(data, list) else data)
                os.fchmod(fd, it.mode)
            finally:
                os.close(fd)
            _set_times(full, it)
            if it.digest is not None and first is None:
                done[it.digest] = (full, it.mode, it.mtime_ns)
            continue
        if it.kind == "l":
            _set_times(full, it)
    for it in sorted((it for it in items if it.kind == "d"), key=lambda i: i.path.count(b"/"), reverse=True):
        full = os.path.join(top, it.path) if it.path else top
        os.chmod(full, it.mode)
        _set_times(full, it)


def materialise(store: ChunkReader, items: list[Item], dest: str, replace: bool = False, hardlink: bool = False) -> None:
    """Write the snapshot ``items`` at ``dest``: all of it, or nothing at ``dest``.

    ``dest`` must not exist, or be an empty directory (for a directory snapshot), unless
    ``replace``: then the old ``dest`` is moved aside, the new one renamed in, the old one removed.

    Raises
    ------
    DestinationError
        ``dest`` cannot be written; :class:`~tb5sync.errors.DestinationExistsError` (exit 2): it
        exists and ``replace`` is False.
    IntegrityError
        A chunk is missing or damaged, or the manifest is unsafe (nothing is left at ``dest``).
    """
    dest = os.path.abspath(dest)
    parent, base = os.path.split(dest)
    root = items[0]
    exists = os.path.lexists(dest)
    if exists and not replace:
        empty_dir = root.kind == "d" and not os.path.islink(dest) and os.path.isdir(dest) and not os.listdir(dest)
        if not empty_dir:
            raise DestinationExistsError(f"{dest} exists (store get --force replaces it)")
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise DestinationError(f"cannot create {parent}: {exc.strerror}") from exc
    tmp = os.path.join(parent, temp_name(base))
    btmp = os.fsencode(tmp)
    try:
        _build(store, items, btmp, hardlink)
        if exists and replace and os.path.isdir(dest) and not os.path.islink(dest):
            aside = os.path.join(parent, temp_name(base))
            os.rename(dest, aside)
            os.rename(tmp, dest)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(tmp, dest)
    except BaseException:
        if os.path.isdir(tmp) and not os.path.islink(tmp):
            for dirpath, dirnames, _ in os.walk(tmp):  # rmtree needs write permission on the directories
                for d in dirnames:
                    with contextlib.suppress(OSError):
                        os.chmod(os.path.join(dirpath, d), stat.S_IRWXU)
            with contextlib.suppress(OSError):
                os.chmod(tmp, stat.S_IRWXU)
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise
    fsync_dir(parent)
