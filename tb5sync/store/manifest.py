"""Tree manifests: what a snapshot holds, stored in the store as a chunked object.

Manifest format v1: msgpack of ``{"v": 1, "entries": [entry, ...]}``, each entry
``[path, kind, mode, size, mtime_ns, target, digest, chunks]``:

``path``
    bytes, relative, ``/``-separated, no empty, ``.`` or ``..`` component; ``b""`` is the
    snapshot's root (the directory, or the single file, that was put).
``kind``
    ``"d"``, ``"f"`` or ``"l"``.
``mode``
    permission bits (``st_mode & 0o7777``).
``size``, ``mtime_ns``
    bytes; nanoseconds since the epoch.
``target``
    a symlink's target as bytes, else None.
``digest``, ``chunks``
    a file's digest (BLAKE3 over its chunk digests) and its chunk list packed as
    :func:`tb5sync.engine.hashing.refs_to_blob` (36 bytes per chunk); None and ``b""`` otherwise.

Entries are sorted by path (bytes order), so a directory comes before what it holds.
A manifest's address is the file digest of its own chunks, like any file's.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgpack

from tb5sync.errors import IntegrityError, UsageError
from tb5sync.tree.excludes import NO_RULES, ExcludeRules
from tb5sync.engine.hashing import ChunkRef, blob_to_refs, file_digest, refs_to_blob

__all__ = ["MANIFEST_VERSION", "Item", "encode_manifest", "decode_manifest", "walk", "check_path"]

MANIFEST_VERSION = 1


@dataclass
class Item:
    """One entry of a manifest (see the module docstring for the fields)."""

    path: bytes
    kind: str
    mode: int
    size: int
    mtime_ns: int
    target: bytes | None = None
    digest: bytes | None = None
    chunks: list[ChunkRef] = field(default_factory=list)

    def to_wire(self) -> list[object]:
        return [self.path, self.kind, self.mode, self.size, self.mtime_ns, self.target, self.digest,
                refs_to_blob(self.chunks) if self.kind == "f" else b""]


def check_path(path: bytes) -> bytes:
    """Check a manifest path: relative, no empty/``.``/``..`` component, no NUL.

    Raises
    ------
    IntegrityError
        The path could leave the directory it is materialised into.
    """
    if path == b"":
        return path
    if b"\0" in path or path.startswith(b"/"):
        raise IntegrityError(f"unsafe path in manifest: {path!r}")
    for part in path.split(b"/"):
        if part in (b"", b".", b".."):
            raise IntegrityError(f"unsafe path in manifest: {path!r}")
    return path


def encode_manifest(items: list[Item]) -> bytes:
    """The msgpack bytes of a manifest (format v1) holding ``items`` (sorted here by path)."""
    items = sorted(items, key=lambda it: it.path)
    return msgpack.packb({"v": MANIFEST_VERSION, "entries": [it.to_wire() for it in items]}, use_bin_type=True)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def decode_manifest(data: bytes, where: str = "manifest") -> list[Item]:
    """Parse and check manifest bytes (every field's type, safe paths, chunk lengths adding up).

    Raises
    ------
    IntegrityError
        Not a v1 manifest, or any entry malformed (named by ``where``).
    """
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated classes
        raise IntegrityError(f"{where}: not a manifest ({exc})") from exc
    if not isinstance(msg, dict) or msg.get("v") != MANIFEST_VERSION or not isinstance(msg.get("entries"), list):
        raise IntegrityError(f"{where}: unknown manifest format")
    out: list[Item] = []
    prev = None
    for e in msg["entries"]:
        if not isinstance(e, list) or len(e) != 8:
            raise IntegrityError(f"{where}: malformed entry")
        path, kind, mode, size, mtime_ns, target, digest, blob = e
        ok = (isinstance(path, bytes) and kind in ("d", "f", "l") and _is_int(mode) and mode <= 0o7777
              and _is_int(size) and isinstance(mtime_ns, int) and not isinstance(mtime_ns, bool)
              and (target is None or isinstance(target, bytes)) and (digest is None or isinstance(digest, bytes))
              and isinstance(blob, bytes))
        if not ok:
            raise IntegrityError(f"{where}: malformed entry {path!r}")
        check_path(path)
        if prev is not None and path <= prev:
            raise IntegrityError(f"{where}: entries not sorted at {path!r}")
        prev = path
        try:
            chunks = blob_to_refs(blob)
        except ValueError as exc:
            raise IntegrityError(f"{where}: {path!r}: {exc}") from exc
        if kind == "f":
            if (digest is None or len(digest) != 32 or sum(n for _, n in chunks) != size
                    or file_digest(d for d, _ in chunks) != digest):
                raise IntegrityError(f"{where}: file entry {path!r} has a bad digest or chunk list")
        elif kind == "l" and target is None:
            raise IntegrityError(f"{where}: symlink entry {path!r} has no target")
        out.append(Item(path, kind, mode, size, mtime_ns, target, digest, chunks))
    if not out or out[0].path != b"":
        raise IntegrityError(f"{where}: no root entry")
    return out


def walk(root: str, rules: ExcludeRules = NO_RULES) -> Iterator[tuple[bytes, os.stat_result, str]]:
    """Walk ``root`` (a directory or a single file): yields ``(relative path bytes, lstat, full path)``.

    Directories are listed in sorted order, the root first as ``b""``. Symlinks are not
    followed. Sockets, FIFOs and devices are skipped (rsync -a copies devices only as root).
    Paths ``rules`` excludes (rsync's exclude patterns) are left out, excluded directories
    not entered.

    Raises
    ------
    UsageError
        ``root`` does not exist or is not a directory, file or symlink.
    """
    broot = os.fsencode(root)
    try:
        st = os.lstat(broot)
    except FileNotFoundError as exc:
        raise UsageError(f"nothing to put: {root} does not exist") from exc
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        raise UsageError(f"cannot put {root}: not a directory, file or symlink")
    yield b"", st, root
    if not stat.S_ISDIR(st.st_mode):
        return
    stack = [b""]
    while stack:
        rel = stack.pop()
        base = os.path.join(broot, rel) if rel else broot
        with os.scandir(base) as it:
            names = sorted(de.name for de in it)
        subdirs = []
        for name in names:
            child = rel + b"/" + name if rel else name
            full = os.path.join(broot, child)
            try:
                cst = os.lstat(full)
            except FileNotFoundError:
                continue  # vanished while we walked
            if rules and rules.match(os.fsdecode(child), stat.S_ISDIR(cst.st_mode)):
                continue
            if stat.S_ISDIR(cst.st_mode):
                subdirs.append(child)
            elif not (stat.S_ISREG(cst.st_mode) or stat.S_ISLNK(cst.st_mode)):
                continue
            yield child, cst, os.fsdecode(full)
        stack.extend(reversed(subdirs))
