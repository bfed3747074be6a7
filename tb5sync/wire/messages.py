"""The wire vocabulary: every request method, who answers it, the codecs and the limits.

Sans-IO, like :mod:`tb5sync.wire.protocol` below it: no sockets, no files. A session is opened
with an OPEN frame (``{"op": "push" | "pull" | "fs" | "ls" | "ping" | "join" | "source" | "sink" | "disk" | "store", ...}``,
see :mod:`tb5sync.daemon.server`), then carries REQUEST frames ``{"m": method, "a": {args}}`` answered
by RESPONSE (a dict) or DATA (``(meta, parts)``) frames. The method sets below are the only
lists of what each session answers; servers, links and clients import them from here.

Methods
-------
Answered by a :class:`~tb5sync.roles.sender.Sender` (pull: the server's; push: the client's):

``tree(start)``
    RESPONSE ``{"root": entry, "dirs": [[path, digest, files, bytes], ...], "total": int,
    "failed": [[path, reason], ...], "skipped": [[path, what], ...]}`` (optional, first page only:
    ``failed`` the directories the sender could not list, ``skipped`` its special files).
``entries(dirs, skip)``
    RESPONSE ``{"entries": [entry, ...], "more": bool}``.
``chunk_list(path, start, size, mtime_ns)``
    RESPONSE ``{"refs": [[digest, length], ...], "end": int, ...}`` (one piece of a large file's chunks).
``file_digests(paths)``
    RESPONSE ``{"digests": [bytes | None, ...]}``.
``read_ranges(path, ranges, size, mtime_ns)``
    DATA, meta ``{"parts": [[rawlen, wirelen, codec], ...], "wire": [wirelen, ...]}``.
``read_files(paths)``
    DATA, meta ``{"files": [[size, mtime_ns, mode, refs, wirelen, codec] | None, ...], "wire": [...],
    "failed": [[index, reason], ...]}`` (``failed``, optional: files the sender could not read; the
    others that are None vanished or kept changing).
``sub_chunks(path, ranges, size, mtime_ns, params)``
    RESPONSE ``{"subs": [...]}`` (see :mod:`tb5sync.engine.refine`).

Answered by the push client's handler only: ``finish(**result)`` (the server's result).

Answered by the fs session (:class:`~tb5sync.daemon.fsops.FsOps`): :data:`FS_METHODS`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

from tb5sync.tree.entry import STATE_DIR, Entry, check_relpath, path_from_wire, path_to_wire, show_path
from tb5sync.errors import RemoteProtocolError, UsageError, shown
from tb5sync.wire.protocol import MAX_PAYLOAD

__all__ = [
    "DEFAULT_PORT",
    "MAX_ENTRIES",
    "MAX_LISTING_BYTES",
    "ENTRY_COST",
    "STRING_COST",
    "SENDER_METHODS",
    "PUSH_CLIENT_METHODS",
    "RESULT_WHOLE_MAX",
    "RESULT_PAGE_BYTES",
    "result_pages",
    "ResultPages",
    "DATA_METHODS",
    "READ_METHODS",
    "FS_METHODS",
    "FS_IDEMPOTENT",
    "FS_DATA_METHODS",
    "PING_METHODS",
    "STORE_METHODS",
    "STORE_WRITE_METHODS",
    "STORE_MAX_BATCH",
    "STORE_MAX_DIGESTS",
    "STORE_FEATURES",
    "STORE_MAX_RECIPE_BYTES",
    "STORE_MAX_RECIPES",
    "STORE_MAX_RECIPE_REPLY",
    "CODEC_RAW",
    "CODEC_LZ4",
    "SENDER_MAX_READ",
    "READ_FILES_MAX",
    "READ_FILES_SLACK",
    "MAX_CHUNK",
    "MAX_REQUEST_PATHS",
    "FS_MAX_READ",
    "FS_MAX_WRITE",
    "CAT_MANY_BUDGET",
    "DIGEST_SIZE",
    "DirSummary",
    "TreePage",
    "EntriesPage",
    "ChunkListPiece",
    "FileDigests",
    "RangesMeta",
    "FileInfo",
    "FilesMeta",
    "SubChunksReply",
    "check_chunks",
    "check_peer_path",
    "PATH_ARGS",
    "args_to_wire",
    "paths_from_wire",
]

#: TCP port a server listens on and a ``tb5://`` URL names when none is given.
DEFAULT_PORT: Final = 8873

#: Requests a sender answers (the server's in a pull, the client's in a push).
SENDER_METHODS: Final = frozenset({"tree", "entries", "chunk_list", "file_digests", "read_ranges", "read_files", "sub_chunks"})
#: Requests the push client answers: a sender's, plus the server's result: ``finish_part`` (a page
#: of a long list of it, :func:`result_pages`) then ``finish``.
PUSH_CLIENT_METHODS: Final = SENDER_METHODS | {"finish", "finish_part"}
#: Sender requests answered with DATA frames (file bytes): sent on the data streams.
DATA_METHODS: Final = frozenset({"read_ranges", "read_files"})
#: Sender requests answered with RESPONSE that read file data: also sent on the data streams.
READ_METHODS: Final = frozenset({"sub_chunks"})
#: The ``ping`` session's only request (``tb5sync bench``).
PING_METHODS: Final = frozenset({"ping"})
#: Most bytes one ``source`` (server sends) or ``sink`` (server discards) session of
#: ``tb5sync bench`` may move: 64 GiB.
BENCH_MAX_BYTES: Final = 1 << 36
#: Most bytes of the temporary file of one ``disk`` session (``tb5sync bench``): 64 GiB, and never
#: more than the free space of the server's state directory less 256 MiB.
BENCH_MAX_DISK: Final = 1 << 36

#: A server's default cap on the entries of one session's source listing it holds (directory
#: summaries and listed entries counted together; ``tb5sync serve --max-entries``): about what
#: :data:`MAX_LISTING_BYTES` holds of short paths.
MAX_ENTRIES: Final = 3_000_000
#: A server's default cap on the bytes of one session's source listing it holds, counted as
#: :data:`ENTRY_COST` per entry plus :data:`STRING_COST` per byte of its path, link target and
#: extended attributes (``tb5sync serve --max-listing-bytes``).
MAX_LISTING_BYTES: Final = 2 << 30
#: Bytes counted per entry besides its strings: what a server really holds per entry of a pushing
#: peer's listing (its Entry, the objects of its fixed fields, its places in the generator's and the
#: plan's lists and dicts, the itemized result), measured as peak RSS growth of ``tb5sync serve``
#: over a dry-run push of 200,000 files (~700 bytes each with 9-byte names; attacker6's
#: listing_mem.py: 1M entries held ~630 MiB while counted as 70 MiB at 64 bytes).
ENTRY_COST: Final = 704
#: Bytes counted per byte of an entry's path, link target and extended attributes: the same
#: measure with 59-byte names grew ~2.9 bytes per name byte more (a path is held in several forms).
STRING_COST: Final = 3

#: A client's bounds on a ref manifest a server or a fan-out source sends (``store pull``, fan-out):
#: entries, as a listing's :data:`MAX_ENTRIES`; the manifest's bytes (msgpack, the sum of its
#: announced chunks, checked before one is fetched): a quarter of :data:`MAX_LISTING_BYTES`, since
#: a decoded entry is held in several times its encoded bytes; its chunks; a path's bytes, one name's
#: (NAME_MAX) and a link target's (PATH_MAX less its NUL, Linux's longest symlink).
MAX_MANIFEST_ENTRIES: Final = MAX_ENTRIES
MAX_MANIFEST_BYTES: Final = MAX_LISTING_BYTES // 4
MAX_MANIFEST_CHUNKS: Final = 65536
MAX_MANIFEST_PATH: Final = 4095
MAX_MANIFEST_NAME: Final = 255
MAX_MANIFEST_TARGET: Final = 4095

#: Requests the fs session (``tb5://`` through fsspec) answers.
FS_METHODS: Final = frozenset(
    {
        "info",
        "ls",
        "find",
        "cat",
        "cat_many",
        "digest",
        "put",
        "wopen",
        "wwrite",
        "wclose",
        "put_open",
        "put_piece",
        "put_close",
        "rm",
        "mkdir",
        "rmdir",
        "move",
        "copy",
        "touch",
        "more",
    }
)
#: fs requests that change nothing: safe to send again on a new connection after a broken one.
FS_IDEMPOTENT: Final = frozenset({"info", "ls", "find", "cat", "cat_many", "digest"})
#: fs requests that arrive as DATA frames (meta ``{"m", "a"}``, then the raw bytes, handed to the
#: method as ``data``): a piece of a file received by ``put_open``/``put_close``.
FS_DATA_METHODS: Final = frozenset({"put_piece"})

#: Requests the store session answers (OPEN ``{"op": "store"}``, :class:`tb5sync.store.ops.StoreOps`):
#: ``refs(prefix)``, ``ref(name)``, ``have(digests, lease)``, ``chunks(digests)`` (DATA),
#: ``put_chunks(lease, chunks)``, ``flush(lease)``, ``commit(lease, name, manifest, mchunks, ...)``,
#: ``list(name)``, ``read(name, path, offset, length)`` (DATA). Chunks are named by digest only,
#: so any node holding them can answer ``have``/``chunks``.
#: With the ``"pieces"`` feature (:data:`STORE_FEATURES`) also ``recipes(digests)`` (the pieces of the
#: chunks kept as recipes), ``have_pieces(digests, lease)`` (which pieces the server's store holds,
#: held for the lease) and ``put_recipes(lease, recipes, pieces)`` (chunks sent as a recipe plus only
#: the pieces the receiver lacks; each chunk rebuilt and checked against its digest before it is
#: recorded); ``chunks(digests)`` then also answers piece digests.
STORE_METHODS: Final = frozenset({"refs", "ref", "have", "chunks", "put_chunks", "flush", "commit", "list", "read",
                                  "recipes", "have_pieces", "put_recipes"})
#: Store requests that write (refused by a ``--read-only`` server).
STORE_WRITE_METHODS: Final = frozenset({"put_chunks", "flush", "commit", "put_recipes"})
#: What a store session's OPEN reply lists under ``features`` (a server older than these lists none,
#: and is then sent and asked for whole chunks only): ``"pieces"``, the piece-level methods above. The
#: reply's ``piece_params`` is the server's store's piece parameter version (None: a v1 store, which
#: keeps chunks whole; a client pushes pieces only to a store with the same version as its own cut).
STORE_FEATURES: Final = ("pieces",)
#: Most chunk bytes (the sum of the recipes' lengths) one ``put_recipes`` request may rebuild, and
#: most recipes one ``recipes`` reply or ``put_recipes`` request carries.
STORE_MAX_RECIPE_BYTES: Final = 64 * 1024 * 1024
STORE_MAX_RECIPES: Final = 4096
#: Most bytes of recipe blobs one ``recipes`` reply carries (a client asks for 16 MiB of chunks at a
#: time: ~150 KB of recipes).
STORE_MAX_RECIPE_REPLY: Final = 8 * 1024 * 1024
#: Most chunk bytes one ``chunks`` reply or ``put_chunks`` request carries (and one ``read`` reply).
STORE_MAX_BATCH: Final = 16 * 1024 * 1024
#: Most digests one ``have`` or ``chunks`` request names.
STORE_MAX_DIGESTS: Final = 65536

#: Part codecs in DATA replies: the raw bytes, or one lz4 block.
CODEC_RAW: Final = 0
CODEC_LZ4: Final = 1

#: Most bytes one sender read request (``read_ranges``/``read_files``) may ask for.
SENDER_MAX_READ: Final = 32 * 1024 * 1024
#: What a ``read_files`` reply may carry past :data:`SENDER_MAX_READ` (its last file), bytes.
READ_FILES_SLACK: Final = 4 * 1024 * 1024
#: Most bytes of file data one ``read_files`` reply carries (the sender stops its batch there, and
#: refuses a file past what is left): a reply claiming more is refused before it is decompressed.
READ_FILES_MAX: Final = SENDER_MAX_READ + READ_FILES_SLACK
#: Longest chunk a chunk list may name, bytes: a chunk is fetched by one read (``read_ranges``,
#: at most :data:`SENDER_MAX_READ`), so a longer one could never arrive; refused before anything
#: is sized by it.
MAX_CHUNK: Final = SENDER_MAX_READ
#: Most bytes one fs ``cat`` reply carries (a longer read is split into several requests).
FS_MAX_READ: Final = 16 * 1024 * 1024
#: Most bytes one fs ``put``/``wwrite`` request may carry.
FS_MAX_WRITE: Final = 16 * 1024 * 1024
#: Most bytes of file data one ``cat_many`` reply carries.
CAT_MANY_BUDGET: Final = 32 * 1024 * 1024

assert STORE_MAX_BATCH + 64 * 1024 < MAX_PAYLOAD // 2 and SENDER_MAX_READ < MAX_PAYLOAD and FS_MAX_READ < MAX_PAYLOAD and CAT_MANY_BUDGET < MAX_PAYLOAD

#: Bytes of a chunk digest (BLAKE3-256) on the wire.
DIGEST_SIZE: Final = 32


# ---- replies: decoded and validated once, here ------------------------------------------------
#
# Each reply a receiver gets from a sender has a frozen type: ``to_wire()`` gives the msgpack-ready
# form the sender sends, ``from_wire(...)`` checks a peer's reply (types, bounds, lengths adding up,
# paths safe) and raises :class:`~tb5sync.errors.RemoteProtocolError` naming what was wrong. Nothing
# above this module re-checks the shape of a reply.


#: Request arguments that hold a path (``path``) or a list of them (``paths``, ``dirs``): sent
#: as :func:`~tb5sync.tree.entry.path_to_wire` gives them (bytes for a name that is not valid UTF-8).
PATH_ARGS: Final = frozenset({"path", "paths", "dirs"})


def args_to_wire(args: dict[str, Any]) -> dict[str, Any]:
    """A sender request's arguments with their paths (:data:`PATH_ARGS`) in wire form."""
    out = dict(args)
    for k in PATH_ARGS.intersection(args):
        v = args[k]
        out[k] = path_to_wire(v) if isinstance(v, str) else [path_to_wire(p) if isinstance(p, str) else p for p in v]
    return out


#: Most paths one request may name (``entries``' directories, ``file_digests``' and
#: ``read_files``' paths): 4x the largest batch a tb5sync client sends (4,096 directories), so
#: that one request cannot hold a session's thread for minutes (a million paths of a tiny file).
MAX_REQUEST_PATHS: Final = 16384


def paths_from_wire(value: object, what: str, limit: int = MAX_REQUEST_PATHS) -> list[str]:
    """A request's list of paths (str or bytes each) as Python holds them.

    Raises
    ------
    UsageError
        Not a list of str or bytes, or more than ``limit`` of them (:data:`MAX_REQUEST_PATHS`).
    """
    if not isinstance(value, list):
        raise UsageError(f"{what} must be a list of paths")
    if len(value) > limit:
        raise UsageError(f"{what}: {len(value)} paths in one request, at most {limit}")
    return [path_from_wire(p) for p in value]


def check_peer_path(path: str, what: str) -> str:
    """Return ``path`` (a path of an entry a peer listed, relative to the base) if a receiver may
    write it, else raise.

    Besides :func:`~tb5sync.tree.entry.check_relpath`'s rules, no component may be tb5sync's state
    directory (:data:`~tb5sync.tree.entry.STATE_DIR`, at any depth): a scan never lists one, so only
    a forged listing holds it, and on a server whose base is its root it would write into the
    server's own state (scan cache, partial files, the ``--store``).

    Raises
    ------
    RemoteProtocolError
        Naming ``what`` (the page) and the path.
    """
    try:
        check_relpath(path)
    except (UsageError, TypeError) as exc:
        raise RemoteProtocolError(f"bad path in the peer's {what}: {path!r:.200}") from exc
    if STATE_DIR in path and STATE_DIR in path.split("/"):
        raise RemoteProtocolError(f"refused path in the peer's {what}: {path!r:.200} ({STATE_DIR} is tb5sync's own state)")
    return path


def check_peer_target(entry: Entry, what: str) -> None:
    """Refuse a peer's symlink entry whose target no file system can hold: one with a NUL byte
    (``symlink(2)`` takes a C string). Caught here, before the plan, so nothing is written.

    Raises
    ------
    RemoteProtocolError
        Naming ``what`` (the page) and the entry's path.
    """
    if entry.kind == "l" and "\x00" in entry.target:
        raise RemoteProtocolError(f"refused link in the peer's {what}: {show_path(entry.path)} has a target "
                                  "holding a NUL byte (no file system stores one)")


def _bad(what: str) -> RemoteProtocolError:
    return RemoteProtocolError(f"malformed {what}")


def _is_uint(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_chunks(value: object, total: int, where: str) -> list[tuple[bytes, int]]:
    """A wire chunk list ``[[digest, length], ...]`` as ``[(digest, length), ...]``, checked.

    Parameters
    ----------
    value : object
        The list as decoded from msgpack.
    total : int
        Bytes the chunks must add up to.
    where : str
        Path named in the error.

    Raises
    ------
    RemoteProtocolError
        Not a list of ``[32-byte digest, positive length]``, a length over :data:`MAX_CHUNK`, or
        the lengths do not add up to ``total``.
    """
    if not isinstance(value, list):
        raise RemoteProtocolError(f"chunk list of {where} is not a list")
    refs: list[tuple[bytes, int]] = []
    acc = 0
    for item in value:
        if not (isinstance(item, (list, tuple)) and len(item) == 2):
            raise RemoteProtocolError(f"malformed chunk in the chunk list of {where}")
        d, n = item
        if not isinstance(d, bytes) or len(d) != DIGEST_SIZE or not _is_uint(n) or n == 0:
            raise RemoteProtocolError(f"malformed chunk in the chunk list of {where}")
        if n > MAX_CHUNK:
            raise RemoteProtocolError(f"chunk of {where} longer than {MAX_CHUNK} bytes ({n}): no read could fetch it")
        refs.append((d, n))
        acc += n
    if acc != total:
        raise RemoteProtocolError(f"chunk list of {where} does not add up to its size")
    return refs


class DirSummary(NamedTuple):
    """One directory of a :class:`TreePage`: its path, listing digest, direct files and their bytes."""

    path: str
    digest: bytes
    files: int
    bytes: int


# ---- rsync -H and -X: per-entry extras of the tree and entries pages (wire keys "hl", "xa")
#: At most this many extended attributes on one entry, and bytes in one name / value (Linux's limits).
MAX_XATTRS, MAX_XATTR_NAME, MAX_XATTR_VALUE = 4096, 255, 65536


def ext_to_wire(out: dict[str, Any], hardlinks: dict[int, int], xattrs: dict[int, list[tuple[bytes, bytes]]]) -> None:
    """Add the extras of a page to its wire map: ``"hl": [[index, group], ...]`` (rsync ``-H``: entries
    of one group share an inode), ``"xa": [[index, [[name, value], ...]], ...]`` (``-X``); left out when empty."""
    if hardlinks:
        out["hl"] = [[i, g] for i, g in sorted(hardlinks.items())]
    if xattrs:
        out["xa"] = [[i, [[n, v] for n, v in xa]] for i, xa in sorted(xattrs.items())]


def ext_from_wire(msg: dict[str, Any], n: int, what: str) -> tuple[dict[int, int], dict[int, list[tuple[bytes, bytes]]]]:
    """Check a peer's ``"hl"`` and ``"xa"`` (see :func:`ext_to_wire`) for a page of ``n`` entries.

    Raises
    ------
    RemoteProtocolError
        Not lists of the right shapes, an index out of the page, a name or value too long.
    """
    hl_in, xa_in = msg.get("hl", []), msg.get("xa", [])
    if not isinstance(hl_in, list) or not isinstance(xa_in, list):
        raise _bad(what)
    hardlinks: dict[int, int] = {}
    for row in hl_in:
        if not (isinstance(row, list) and len(row) == 2 and _is_uint(row[0]) and row[0] < n and _is_uint(row[1])):
            raise _bad(f"{what} (hard-link group)")
        hardlinks[row[0]] = row[1]
    xattrs: dict[int, list[tuple[bytes, bytes]]] = {}
    for row in xa_in:
        if not (isinstance(row, list) and len(row) == 2 and _is_uint(row[0]) and row[0] < n and isinstance(row[1], list)
                and len(row[1]) <= MAX_XATTRS):
            raise _bad(f"{what} (extended attributes)")
        pairs = []
        for pair in row[1]:
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], bytes) and isinstance(pair[1], bytes)
                    and 0 < len(pair[0]) <= MAX_XATTR_NAME and b"\0" not in pair[0] and len(pair[1]) <= MAX_XATTR_VALUE):
                raise _bad(f"{what} (extended attribute)")
            pairs.append((pair[0], pair[1]))
        xattrs[row[0]] = pairs
    return hardlinks, xattrs
# ---- end of the -H -X block


@dataclass(frozen=True, slots=True)
class TreePage:
    """Reply to ``tree(start)``: the source's root entry and a page of directory summaries.

    Attributes
    ----------
    root : Entry
        The source base itself (path ``""``).
    dirs : list of DirSummary
        Directories from ``start`` on, parents before children.
    total : int
        Directories in the whole tree (the receiver asks again until it has them all).
    failed : list of (str, str)
        ``(path, reason)`` of the source directories that could not be listed (their
        listing is empty); sent on the first page only (wire key ``failed``, left out when
        empty).
    skipped : list of (str, str)
        ``(path, what)`` of the special files (FIFOs, sockets, devices) the sender leaves out;
        first page only (wire key ``skipped``, left out when empty).
    """

    root: Entry
    dirs: list[DirSummary]
    total: int
    failed: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    root_xattrs: list[tuple[bytes, bytes]] = field(default_factory=list)  # -X: the root's (wire "xa", index 0)

    def to_wire(self) -> dict[str, Any]:
        dirs = [[path_to_wire(d.path), d.digest, d.files, d.bytes] for d in self.dirs]
        out: dict[str, Any] = {"root": self.root.to_wire(), "dirs": dirs, "total": self.total}
        ext_to_wire(out, {}, {0: self.root_xattrs} if self.root_xattrs else {})
        if self.failed:
            out["failed"] = [[path_to_wire(p), r] for p, r in self.failed]
        if self.skipped:
            out["skipped"] = [[path_to_wire(p), w] for p, w in self.skipped]
        return out

    @classmethod
    def from_wire(cls, msg: object) -> TreePage:
        """Check a peer's ``tree`` reply. Raises RemoteProtocolError (or UsageError for an unsafe entry path)."""
        if not isinstance(msg, dict):
            raise _bad("tree page")
        rows, total, root = msg.get("dirs"), msg.get("total"), msg.get("root")
        if not isinstance(rows, list) or not _is_uint(total) or not isinstance(root, list):
            raise _bad("tree page")
        entry = Entry.from_wire(root)
        if entry.path != "":
            raise RemoteProtocolError("the tree's root entry must have the path ''")
        check_peer_target(entry, "tree")
        dirs = []
        for row in rows:
            if not (isinstance(row, list) and len(row) == 4):
                raise _bad("directory summary")
            path, digest, files, nbytes = row
            if isinstance(path, bytes):
                path = path_from_wire(path)
            if not (isinstance(path, str) and isinstance(digest, bytes) and _is_uint(files) and _is_uint(nbytes)):
                raise _bad("directory summary")
            check_peer_path(path, "tree")
            dirs.append(DirSummary(path, digest, files, nbytes))
        _, xa = ext_from_wire(msg, 1, "tree page")
        return cls(
            entry, dirs, total, _check_failed(msg.get("failed", []), "tree page"), _check_failed(msg.get("skipped", []), "tree page"),
            xa.get(0, []),
        )


@dataclass(frozen=True, slots=True)
class EntriesPage:
    """Reply to ``entries(dirs, skip)``: children of the asked directories, in the order asked.

    ``more`` is True when the sender stopped early (ask again with ``skip`` past what came);
    a page with ``more`` is never empty.
    """

    entries: list[Entry]
    more: bool
    hardlinks: dict[int, int] = field(default_factory=dict)  # -H: entry index -> group (wire "hl")
    xattrs: dict[int, list[tuple[bytes, bytes]]] = field(default_factory=dict)  # -X: entry index -> attributes ("xa")

    def to_wire(self) -> dict[str, Any]:
        out = {"entries": [e.to_wire() for e in self.entries], "more": self.more}
        ext_to_wire(out, self.hardlinks, self.xattrs)
        return out

    @classmethod
    def from_wire(cls, msg: object) -> EntriesPage:
        """Check a peer's ``entries`` reply. Raises RemoteProtocolError (UsageError for an unsafe path)."""
        if not isinstance(msg, dict):
            raise _bad("entries page")
        items, more = msg.get("entries"), msg.get("more")
        if not isinstance(items, list) or not isinstance(more, bool) or (more and not items):
            raise _bad("entries page")
        hl, xa = ext_from_wire(msg, len(items), "entries page")
        entries = [Entry.from_wire(item) for item in items]
        for e in entries:
            check_peer_path(e.path, "entries page")
            check_peer_target(e, "entries page")
        return cls(entries, more, hl, xa)


@dataclass(frozen=True, slots=True)
class ChunkListPiece:
    """Reply to ``chunk_list``: the chunks of bytes ``[start, end)`` of a file of ``size`` bytes.

    ``digest`` (BLAKE3 over the whole chunk list) is present only when the piece is the whole file.
    ``mtime_ns`` is the file's mtime in nanoseconds when it was read.
    """

    size: int
    mtime_ns: int
    start: int
    end: int
    chunks: list[tuple[bytes, int]]
    digest: bytes | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "size": self.size,
            "mtime_ns": self.mtime_ns,
            "start": self.start,
            "end": self.end,
            "chunks": [list(r) for r in self.chunks],
        }
        if self.digest is not None:
            out["digest"] = self.digest
        return out

    @classmethod
    def from_wire(cls, msg: object, where: str) -> ChunkListPiece:
        """Check a peer's ``chunk_list`` reply for file ``where``. Raises RemoteProtocolError."""
        if not isinstance(msg, dict):
            raise _bad(f"chunk_list reply for {where}")
        size, mtime_ns, start, end = msg.get("size"), msg.get("mtime_ns"), msg.get("start"), msg.get("end")
        if not (_is_uint(size) and isinstance(mtime_ns, int) and _is_uint(start) and _is_uint(end)):
            raise _bad(f"chunk_list reply for {where}")
        assert isinstance(size, int) and isinstance(mtime_ns, int) and isinstance(start, int) and isinstance(end, int)
        if not start <= end <= size:
            raise RemoteProtocolError(f"chunk_list piece of {where} is out of the file's bounds")
        digest = msg.get("digest")
        if digest is not None and not (isinstance(digest, bytes) and len(digest) == DIGEST_SIZE):
            raise _bad(f"file digest of {where}")
        return cls(size, mtime_ns, start, end, check_chunks(msg.get("chunks"), end - start, where), digest)


@dataclass(frozen=True, slots=True)
class FileDigests:
    """Reply to ``file_digests(paths)``: one BLAKE3 file digest per path, None for a file that is gone."""

    digests: list[bytes | None]

    def to_wire(self) -> dict[str, Any]:
        return {"digests": self.digests}

    @classmethod
    def from_wire(cls, msg: object, count: int) -> FileDigests:
        """Check a peer's reply to a request for ``count`` paths. Raises RemoteProtocolError."""
        digests = msg.get("digests") if isinstance(msg, dict) else None
        if not isinstance(digests, list) or len(digests) != count:
            raise RemoteProtocolError("file_digests reply has the wrong length")
        if not all(d is None or isinstance(d, bytes) for d in digests):
            raise _bad("file_digests reply")
        return cls(digests)


def _check_failed(value: object, what: str) -> list[tuple[str, str]]:
    """A wire list of ``[path, reason]`` (entries a sender could not read), checked."""
    if not isinstance(value, list):
        raise _bad(f"{what}: failed entries")
    out = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], (str, bytes)) and isinstance(item[1], str)):
            raise _bad(f"{what}: failed entry")
        path, reason = path_from_wire(item[0]), item[1]
        if path:
            check_peer_path(path, f"{what} (failed entry)")
        out.append((path, reason[:4096]))
    return out


def _check_wire(meta: dict[str, Any], count: int, what: str) -> list[int]:
    wire = meta.get("wire")
    if not isinstance(wire, list) or len(wire) != count or not all(_is_uint(n) for n in wire):
        raise RemoteProtocolError(f"{what} reply: DATA meta lacks part lengths")
    return wire


@dataclass(frozen=True, slots=True)
class RangesMeta:
    """DATA meta of a ``read_ranges`` reply: per part ``(raw length, wire length, codec)``; ``wire`` the wire lengths."""

    parts: list[tuple[int, int, int]]

    @property
    def wire(self) -> list[int]:
        return [w for _, w, _ in self.parts]

    def to_wire(self) -> dict[str, Any]:
        return {"parts": [list(p) for p in self.parts], "wire": self.wire}

    @classmethod
    def from_wire(cls, meta: object, lengths: Sequence[int]) -> RangesMeta:
        """Check the meta against the asked range ``lengths`` (bytes). Raises RemoteProtocolError."""
        mparts = meta.get("parts") if isinstance(meta, dict) else None
        if not isinstance(mparts, list) or len(mparts) != len(lengths):
            raise RemoteProtocolError("read_ranges reply does not match the request")
        assert isinstance(meta, dict)
        wire = _check_wire(meta, len(lengths), "read_ranges")
        parts = []
        for n, p, w in zip(lengths, mparts, wire):
            if not (isinstance(p, list) and len(p) == 3 and all(_is_uint(x) for x in p)):
                raise _bad("read_ranges part")
            if p[0] != n:
                raise RemoteProtocolError("read_ranges part has the wrong length")
            if p[1] != w or p[2] not in (CODEC_RAW, CODEC_LZ4):
                raise _bad("read_ranges part")
            parts.append((p[0], p[1], p[2]))
        return cls(parts)


class FileInfo(NamedTuple):
    """One file of a ``read_files`` reply: its size (bytes), mtime (ns), mode bits, chunks, wire length and codec."""

    size: int
    mtime_ns: int
    mode: int
    chunks: list[tuple[bytes, int]]
    wirelen: int
    codec: int


@dataclass(frozen=True, slots=True)
class FilesMeta:
    """DATA meta of a ``read_files`` reply: a :class:`FileInfo` per asked path, None for a file that is not sent.

    The parts of the reply are the files that are not None, in order. ``failed`` maps the
    index of a None file the sender could not read to why (wire key ``failed``, left out
    when empty); the other None files vanished or kept changing.
    """

    files: list[FileInfo | None]
    failed: dict[int, str] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        files = [None if f is None else [f.size, f.mtime_ns, f.mode, [list(r) for r in f.chunks], f.wirelen, f.codec] for f in self.files]
        out: dict[str, Any] = {"files": files, "wire": [f.wirelen for f in self.files if f is not None]}
        if self.failed:
            out["failed"] = [[i, r] for i, r in sorted(self.failed.items())]
        return out

    @classmethod
    def from_wire(cls, meta: object, paths: Sequence[str]) -> FilesMeta:
        """Check the meta against the asked ``paths``. Raises RemoteProtocolError."""
        files = meta.get("files") if isinstance(meta, dict) else None
        if not isinstance(files, list) or len(files) != len(paths):
            raise RemoteProtocolError("read_files reply does not match the request")
        assert isinstance(meta, dict)
        out: list[FileInfo | None] = []
        total = 0
        for path, info in zip(paths, files):
            if info is None:
                out.append(None)
                continue
            if not (isinstance(info, list) and len(info) == 6):
                raise _bad(f"read_files entry for {path}")
            size, mtime_ns, mode, chunks, wirelen, codec = info
            if not (_is_uint(size) and isinstance(mtime_ns, int) and _is_uint(mode) and _is_uint(wirelen)) or codec not in (CODEC_RAW, CODEC_LZ4):
                raise _bad(f"read_files entry for {path}")
            total += size
            if total > READ_FILES_MAX:
                raise RemoteProtocolError(f"read_files reply of {total}+ bytes exceeds the {READ_FILES_MAX} one may carry")
            out.append(FileInfo(size, mtime_ns, mode, check_chunks(chunks, size, path), wirelen, codec))
        wire = _check_wire(meta, sum(f is not None for f in out), "read_files")
        if wire != [f.wirelen for f in out if f is not None]:
            raise _bad("read_files part lengths")
        failed = meta.get("failed", [])
        if not isinstance(failed, list) or not all(
            isinstance(x, list) and len(x) == 2 and _is_uint(x[0]) and x[0] < len(out) and out[x[0]] is None and isinstance(x[1], str)
            for x in failed
        ):
            raise _bad("read_files failed entries")
        return cls(out, {i: r[:4096] for i, r in failed})


@dataclass(frozen=True, slots=True)
class SubChunksReply:
    """Reply to ``sub_chunks``: one encoded sub-chunk list per asked range (decoded by :func:`tb5sync.engine.refine.decode_subs`)."""

    subs: list[Any]

    def to_wire(self) -> dict[str, Any]:
        return {"subs": self.subs}

    @classmethod
    def from_wire(cls, msg: object, count: int) -> SubChunksReply:
        """Check a peer's reply to a request for ``count`` ranges. Raises RemoteProtocolError."""
        subs = msg.get("subs") if isinstance(msg, dict) else None
        if not isinstance(subs, list) or len(subs) != count:
            raise RemoteProtocolError("sub_chunks reply does not match the request")
        return cls(subs)


# ---- a push's result, in pages ----------------------------------------------------------------

#: A push's result (``finish``) encoded larger than this travels in pages: its long lists go ahead
#: in ``finish_part`` requests of at most :data:`RESULT_PAGE_BYTES` each (a dry run of 200,000
#: files with 109-byte names lists ~44 MB: over a control frame's 32 MiB). Smaller results go
#: whole, as a server before pages sent them, which any client reads.
RESULT_WHOLE_MAX = 16 << 20
#: Most bytes of the items of one ``finish_part`` page (msgpack-encoded).
RESULT_PAGE_BYTES = 4 << 20
#: The lists of a push's result that may travel in pages: (section, key).
RESULT_PAGED = frozenset({("stats", "itemized"), ("stats", "failures"), ("stats", "skipped"), ("stats", "warnings"),
                          ("stats", "created"), ("changes", "transfer"), ("changes", "delete"), ("changes", "lines")})


def result_pages(result: dict[str, Any], whole_max: int | None = None,
                 page_bytes: int | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Split a push's ``finish`` result whose encoding exceeds ``whole_max`` bytes (None:
    :data:`RESULT_WHOLE_MAX`; ``page_bytes`` None: :data:`RESULT_PAGE_BYTES`).

    Returns ``(rest, pages)``: each page ``{"section", "key", "items"}`` holds consecutive items
    (at most ``page_bytes`` encoded, at least one) of the list ``result[section][key]`` (one of
    :data:`RESULT_PAGED`), in order; ``rest`` is ``result`` with those lists emptied and
    ``"pages"`` (their count) set. No pages (``rest`` is ``result``) when it fits whole.
    """
    import msgpack

    whole_max = RESULT_WHOLE_MAX if whole_max is None else whole_max
    page_bytes = RESULT_PAGE_BYTES if page_bytes is None else page_bytes
    if len(msgpack.packb(result, use_bin_type=True)) <= whole_max:
        return result, []
    rest = {k: dict(v) if isinstance(v, dict) else v for k, v in result.items()}
    pages: list[dict[str, Any]] = []
    for section, key in sorted(RESULT_PAGED):
        items = rest.get(section, {}).get(key) if isinstance(rest.get(section), dict) else None
        if not isinstance(items, (list, tuple)) or not items:  # SyncStats.as_dict keeps tuples
            continue
        page: list[Any] = []
        size = 0
        for item in items:
            n = len(msgpack.packb(item, use_bin_type=True))
            if page and size + n > page_bytes:
                pages.append({"section": section, "key": key, "items": page})
                page, size = [], 0
            page.append(item)
            size += n
        pages.append({"section": section, "key": key, "items": page})
        rest[section][key] = []
    rest["pages"] = len(pages)
    return rest, pages


class ResultPages:
    """The client's side of :func:`result_pages`: collects ``finish_part`` pages, then puts them
    back into the ``finish`` result (:meth:`merge`).

    Raises
    ------
    RemoteProtocolError
        A page of an unknown list, or whose items are not a list; a result announcing another
        number of pages than arrived.
    """

    def __init__(self) -> None:
        self.lists: dict[tuple[str, str], list[Any]] = {}
        self.count = 0

    def add(self, section: object, key: object, items: object) -> None:
        """One page (the ``finish_part`` request's arguments)."""
        if (section, key) not in RESULT_PAGED or not isinstance(items, list):
            raise RemoteProtocolError(f"malformed result page from the server: {shown((section, key))}")
        self.lists.setdefault((str(section), str(key)), []).extend(items)
        self.count += 1

    def merge(self, result: dict[str, Any]) -> dict[str, Any]:
        """``result`` (the ``finish`` request's arguments) with the pages' lists in their places."""
        announced = result.get("pages", 0)
        if announced != self.count:
            raise RemoteProtocolError(f"the server announced {shown(announced)} result pages and sent {self.count}")
        for (section, key), items in self.lists.items():
            part = result.get(section)
            if not isinstance(part, dict):
                raise RemoteProtocolError(f"the server's paged result has no {section!r}")
            part[key] = items + list(part.get(key) or [])
        return result
