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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import msgpack

from tb5sync.errors import IntegrityError, PeerLimitError, UnsafeManifestError, UsageError
from tb5sync.tree.excludes import NO_RULES, ExcludeRules
from tb5sync.engine.hashing import ChunkRef, blob_to_refs, file_digest, refs_to_blob
from tb5sync.wire.messages import (
    MAX_MANIFEST_BYTES,
    MAX_MANIFEST_CHUNKS,
    MAX_MANIFEST_ENTRIES,
    MAX_MANIFEST_NAME,
    MAX_MANIFEST_PATH,
    MAX_MANIFEST_TARGET,
)

__all__ = ["MANIFEST_VERSION", "Item", "encode_manifest", "decode_manifest", "decode_peer_manifest",
           "check_peer_manifest_size", "walk", "check_path"]

MANIFEST_VERSION = 1

#: The bounds on a manifest a peer sends (read at each call; :mod:`tb5sync.wire.messages`)
PEER_MAX_ENTRIES = MAX_MANIFEST_ENTRIES
PEER_MAX_BYTES = MAX_MANIFEST_BYTES


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
        raise IntegrityError(f"unsafe path in manifest: {_short(path)}")
    for part in path.split(b"/"):
        if part in (b"", b".", b".."):
            raise IntegrityError(f"unsafe path in manifest: {_short(path)}")
    return path


def encode_manifest(items: list[Item]) -> bytes:
    """The msgpack bytes of a manifest (format v1) holding ``items`` (sorted here by path)."""
    items = sorted(items, key=lambda it: it.path)
    return msgpack.packb({"v": MANIFEST_VERSION, "entries": [it.to_wire() for it in items]}, use_bin_type=True)


def _short(v: object) -> str:
    """``v``'s repr, cut to 200 characters (a peer's path in a one-line message)."""
    r = repr(v)
    return r if len(r) <= 200 else r[:200] + "..."


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def decode_manifest(data: bytes, where: str = "manifest", max_entries: int | None = None) -> list[Item]:
    """Parse and check manifest bytes (every field's type, safe paths, chunk lengths adding up).
    ``max_entries``: no array of the msgpack may be longer (a peer's manifest: the decoding stops
    there; :func:`decode_peer_manifest`).

    Raises
    ------
    IntegrityError
        Not a v1 manifest, or any entry malformed (named by ``where``).
    PeerLimitError
        An array longer than ``max_entries``.
    """
    try:
        if max_entries is None:
            msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
        else:
            msg = msgpack.unpackb(data, raw=False, strict_map_key=True, max_array_len=max_entries + 1)
    except ValueError as exc:
        if max_entries is not None and "max_array_len" in str(exc):
            raise PeerLimitError(f"{where}: the manifest has more than the {max_entries} entries this client holds") from None
        raise IntegrityError(f"{where}: not a manifest ({exc})") from exc
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
            raise IntegrityError(f"{where}: malformed entry {_short(path)}")
        try:
            check_path(path)
        except IntegrityError as exc:
            raise IntegrityError(f"{where}: {exc}") from None
        if prev is not None and path <= prev:
            raise IntegrityError(f"{where}: entries not sorted (or one twice) at {_short(path)}")
        prev = path
        try:
            chunks = blob_to_refs(blob)
        except ValueError as exc:
            raise IntegrityError(f"{where}: {_short(path)}: {exc}") from exc
        if kind == "f":
            if (digest is None or len(digest) != 32 or sum(n for _, n in chunks) != size
                    or file_digest(d for d, _ in chunks) != digest):
                raise IntegrityError(f"{where}: file entry {_short(path)} has a bad digest or chunk list")
        elif kind == "l" and (target is None or b"\x00" in target):
            what = "no target" if target is None else "a target holding a NUL byte (no file system stores one)"
            raise IntegrityError(f"{where}: symlink entry {_short(path)} has {what}")
        out.append(Item(path, kind, mode, size, mtime_ns, target, digest, chunks))
    if not out or out[0].path != b"":
        raise IntegrityError(f"{where}: no root entry")
    return out


def check_peer_manifest_size(mchunks: Sequence[ChunkRef], where: str) -> None:
    """Refuse a peer's ref whose manifest is announced past this side's bounds, before any of it
    is fetched: more than :data:`~tb5sync.wire.messages.MAX_MANIFEST_CHUNKS` chunks or
    :data:`PEER_MAX_BYTES` bytes.

    Raises
    ------
    PeerLimitError
        Past a bound (``where`` names the ref and the peer).
    """
    if len(mchunks) > MAX_MANIFEST_CHUNKS:
        raise PeerLimitError(f"{where}: the manifest has more than the {MAX_MANIFEST_CHUNKS} chunks this client holds")
    total = sum(n for _, n in mchunks)
    if total > PEER_MAX_BYTES:
        raise PeerLimitError(f"{where}: the manifest is {total} bytes, more than the {PEER_MAX_BYTES} this client holds")


def decode_peer_manifest(data: bytes, where: str) -> list[Item]:
    """:func:`decode_manifest` for a manifest a server or a fan-out source sent: besides its
    checks, at most :data:`PEER_MAX_ENTRIES` entries, each path at most
    :data:`~tb5sync.wire.messages.MAX_MANIFEST_PATH` bytes with names of at most
    :data:`~tb5sync.wire.messages.MAX_MANIFEST_NAME`, link targets at most
    :data:`~tb5sync.wire.messages.MAX_MANIFEST_TARGET` bytes, and every entry but the root
    inside a directory entry of the manifest (never below a file or a symlink, which
    :func:`~tb5sync.store.materialise.materialise` would write through).

    Raises
    ------
    PeerLimitError
        Past a bound.
    UnsafeManifestError
        Malformed, or an unsafe, duplicate or misplaced entry (``where`` names the ref and the peer).
    """
    bound = PEER_MAX_ENTRIES
    try:
        items = decode_manifest(data, where, max_entries=bound)
    except IntegrityError as exc:
        raise UnsafeManifestError(str(exc)) from None
    if len(items) > bound:
        raise PeerLimitError(f"{where}: the manifest has more than the {bound} entries this client holds")
    dirs: set[bytes] = set()
    for it in items:
        p = it.path
        if len(p) > MAX_MANIFEST_PATH or any(len(n) > MAX_MANIFEST_NAME for n in p.split(b"/")):
            raise PeerLimitError(f"{where}: entry {_short(p)} has a path or a name longer than this client holds "
                                 f"({MAX_MANIFEST_PATH} bytes, {MAX_MANIFEST_NAME} a name)")
        if it.target is not None and len(it.target) > MAX_MANIFEST_TARGET:
            raise PeerLimitError(f"{where}: link {_short(p)} has a target longer than the {MAX_MANIFEST_TARGET} bytes "
                                 "this client holds")
        if p and p.rpartition(b"/")[0] not in dirs:
            raise UnsafeManifestError(f"{where}: entry {_short(p)} is not inside a directory of the snapshot "
                                      "(below a file or a symlink, or its directory is missing)")
        if it.kind == "d":
            dirs.add(p)
    return items


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
