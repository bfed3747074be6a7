"""Keyed blobs in the artifact store: single objects named by an opaque key (a build cache's entries).

A blob is one byte string stored as the store's chunks (FastCDC v1, BLAKE3-256, deduplicated
with everything else in the store) and named by a key (``ac/<sha256>``, ``cas/<sha256>``, a
ccache key path...). Unlike a ref it has no manifest: its row holds the chunk list itself.

Table (in ``index.sqlite``, store format v1, additive)::

    blobs(key TEXT PRIMARY KEY, digest BLOB, chunks BLOB, size INTEGER, created REAL, last_used REAL)
    counters(name TEXT PRIMARY KEY, value REAL)   -- a served cache's hit/miss/byte counters

Rules, the same as refs': a blob row is written only once every chunk it lists is indexed, in the
transaction that drops the writer's lease (so gc never sweeps a chunk between its write and the
row); gc marks every blob's chunks; quota eviction removes whole blobs and refs, least recently
used first (:func:`tb5sync.store.gc.enforce_quota`), never single chunks; a blob replaced by a
new value under the same key keeps serving the old value until the new row is committed.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tb5sync.errors import IntegrityError, UsageError
from tb5sync.engine.hashing import ChunkRef, blob_to_refs, chunk_digest, file_digest, hash_pool, refs_to_blob
from tb5sync.store.index import check_entry_fits, require_indexed
from tb5sync.store.pieces import blob_to_recipe
from tb5sync.store.packs import FRAME_HEADER, LocalPackStorage, parse_frame_header
from tb5sync.store.writer import PackWriter, _drop_lease

if TYPE_CHECKING:
    from tb5sync.store.index import StoreCore as Store

__all__ = ["BlobInfo", "check_blob_key", "put_blob", "put_blobs", "blob", "delete_blob", "blob_keys", "read_blob", "touch_blobs",
           "FileRange", "blob_ranges", "close_ranges", "add_counters", "counters", "MAX_KEY"]

#: Longest key accepted, in bytes of UTF-8.
MAX_KEY = 1024
#: A hit within this many seconds of the recorded last use is not written again (seconds).
TOUCH_GRACE = 1.0
#: A chunk verified against its digest is read again without re-hashing for at most this long
#: (seconds), and only while its pack file keeps the identity it had when it was verified
#: (see :func:`read_blob`).
VERIFIED_TTL = 300.0
#: Whether a hit whose chunks are recipes of pieces verified since their packs last changed is
#: answered as ranges of the pieces' frames (:func:`blob_ranges`, sent with ``sendfile``). Off:
#: one ``loop.sendfile`` per ~16 KiB piece cost 13.1 ms of server CPU per 3.5 MB GET against
#: 4.0 ms gathered from the pieces without re-hashing (``benches/bench_bigget.py``); such hits are
#: read by :func:`read_blob`.
RANGES_OF_PIECES = True
#: Packs whose verified chunks are remembered per store (least recently read forgotten first).
VERIFIED_PACKS = 65536


@dataclass(frozen=True)
class BlobInfo:
    """A keyed blob: its ``key``, object ``digest`` (BLAKE3 over its chunk digests), chunk list,
    ``size`` (bytes), ``created`` and ``last_used`` (seconds since the epoch)."""

    key: str
    digest: bytes
    chunks: tuple[ChunkRef, ...]
    size: int
    created: float
    last_used: float


_CONTROL = re.compile("[\x00-\x1f\x7f]")  # what check_blob_key refuses: C0 controls and DEL


def check_blob_key(key: object) -> str:
    """Check a blob key: 1 to :data:`MAX_KEY` bytes of UTF-8, ``/``-separated segments, none empty,
    ``.`` or ``..``, no NUL or control character.

    Raises
    ------
    UsageError
        Anything else, naming the key.
    """
    if not isinstance(key, str) or not key or len(key.encode("utf-8", "surrogatepass")) > MAX_KEY:
        raise UsageError(f"bad blob key {key!r}: 1 to {MAX_KEY} bytes")
    if _CONTROL.search(key):
        raise UsageError(f"bad blob key {key!r}: control character")
    for seg in key.split("/"):
        if seg in ("", ".", ".."):
            raise UsageError(f"bad blob key {key!r}: empty, . or .. segment")
    return key


def _info(row: tuple) -> BlobInfo:  # type: ignore[type-arg]
    return BlobInfo(row[0], bytes(row[1]), tuple(blob_to_refs(bytes(row[2]))), row[3], row[4], row[5])


def put_blob(store: Store, key: str, src: str | os.PathLike[str] | bytes) -> BlobInfo:
    """Store ``src`` (a finished local file, or bytes) as blob ``key``, replacing any value it had.

    The file is read once in windows (at most 16 MiB + one chunk in memory), cut, hashed and only
    the chunks the store lacks are written; the row appears (or changes) only once they are all
    indexed. Runs the store's quota check afterwards only if the caller asks (see
    :func:`tb5sync.store.gc.enforce_quota`).

    Raises
    ------
    UsageError
        Bad key.
    SourceChangedError
        The file changed while it was read.
    EntryTooLargeError
        The blob needs more stored bytes than ``store.quota`` (its size is checked first, its new
        chunks as they are written): nothing is stored, nothing is evicted.
    """

    check_blob_key(key)
    quota = getattr(store, "quota", None)
    size0 = len(src) if isinstance(src, (bytes, bytearray, memoryview)) else os.stat(os.fspath(src)).st_size
    check_entry_fits(quota, size0, f"blob {key!r}")
    lease = store.lease()
    writer = PackWriter(store, lease)
    writer.limit = quota
    try:
        if isinstance(src, (bytes, bytearray, memoryview)):
            digest, refs = store.put_bytes(bytes(src), lease, writer)
        else:
            path = os.fspath(src)
            refs = store._put_file(path, os.stat(path), lease, writer)
            digest = file_digest(d for d, _ in refs)
        writer.flush()
        size = sum(n for _, n in refs)
        now = time.time()
        with store._tx() as db:
            require_indexed(db, dict.fromkeys(d for d, _ in refs), f"blob {key!r}")
            db.execute("INSERT OR REPLACE INTO blobs VALUES (?,?,?,?,?,?)",
                       (key, digest, refs_to_blob(refs), size, now, now))
            _drop_lease(db, lease.id)
    except BaseException:
        writer.abort()
        with contextlib.suppress(Exception):
            lease.release()
        raise
    return BlobInfo(key, digest, tuple(refs), size, now, now)


def put_blobs(store: Store, items: list[tuple[str, bytes]]) -> list[BlobInfo]:
    """Store several ``(key, bytes)`` blobs with one lease, one pack and one index transaction (group commit).

    Same rules as :func:`put_blob` (rows appear only once their chunks are indexed; a later item
    with the same key wins). Used by the HTTP cache to write small PUTs that arrive together at
    the cost of one pack's ``fsync`` instead of one each.

    Raises
    ------
    UsageError
        A bad key (nothing is stored then).
    EntryTooLargeError
        One item alone is larger than ``store.quota`` (nothing is stored then).
    """

    for key, data in items:
        check_blob_key(key)
        check_entry_fits(getattr(store, "quota", None), len(data), f"blob {key!r}")
    if not items:
        return []
    lease = store.lease()
    writer = PackWriter(store, lease)
    try:
        done = []
        for key, data in items:
            digest, refs = store.put_bytes(bytes(data), lease, writer)
            done.append((key, digest, refs))
        writer.flush()
        now = time.time()
        with store._tx() as db:
            require_indexed(db, dict.fromkeys(d for _, _, refs in done for d, _ in refs), "blob batch")
            db.executemany("INSERT OR REPLACE INTO blobs VALUES (?,?,?,?,?,?)",
                           [(k, dg, refs_to_blob(refs), sum(n for _, n in refs), now, now) for k, dg, refs in done])
            _drop_lease(db, lease.id)
    except BaseException:
        writer.abort()
        with contextlib.suppress(Exception):
            lease.release()
        raise
    return [BlobInfo(k, dg, tuple(refs), sum(n for _, n in refs), now, now) for k, dg, refs in done]


def blob(store: Store, key: str, touch: bool = True) -> BlobInfo | None:
    """Blob ``key``, or None; ``touch`` records the use (LRU order), at most once per second."""
    check_blob_key(key)
    rows = store._q("SELECT key, digest, chunks, size, created, last_used FROM blobs WHERE key=?", (key,))
    if not rows:
        return None
    info = _info(rows[0])
    now = time.time()
    if touch and now - info.last_used >= TOUCH_GRACE:
        with store._tx() as db:
            db.execute("UPDATE blobs SET last_used=? WHERE key=?", (now, key))
    return info


def touch_blobs(store: Store, keys: list[str]) -> None:
    """Record a use of each of ``keys`` now (the LRU order of quota eviction; within
    :data:`TOUCH_GRACE` seconds of the last recorded use, nothing is written). 500 per statement."""
    now = time.time()
    with store._tx() as db:
        for k in range(0, len(keys), 500):
            part = keys[k : k + 500]
            db.execute(f"UPDATE blobs SET last_used=? WHERE last_used<? AND key IN ({','.join('?' * len(part))})",
                       (now, now - TOUCH_GRACE, *part))


def has_blobs(store: Store, keys: list[str]) -> set[str]:
    """Which of ``keys`` are held (500 per query)."""
    out: set[str] = set()
    for k in range(0, len(keys), 500):
        part = keys[k : k + 500]
        out.update(r[0] for r in store._q(f"SELECT key FROM blobs WHERE key IN ({','.join('?' * len(part))})", part))
    return out


def delete_blob(store: Store, key: str) -> bool:
    """Remove blob ``key`` (its chunks go at the next gc unless something else holds them); whether it was there."""
    check_blob_key(key)
    with store._tx() as db:
        return db.execute("DELETE FROM blobs WHERE key=?", (key,)).rowcount > 0


def blob_keys(store: Store, prefix: str = "") -> list[str]:
    """Keys starting with ``prefix`` (plain string prefix), sorted."""
    return [r[0] for r in store._q("SELECT key FROM blobs ORDER BY key") if r[0].startswith(prefix)]


class _Verified:
    """Which chunks of which local packs were verified, per pack: the pack file's identity then
    ``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)`` of the descriptor read, when the marks
    expire, and the offsets verified. In memory only; a pack whose identity changes loses its marks."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.packs: OrderedDict[str, tuple[tuple[int, ...], float, set[int]]] = OrderedDict()

    def ok(self, pack: str, ident: tuple[int, ...], offset: int, now: float) -> bool:
        with self.lock:
            got = self.packs.get(pack)
            if got is None or got[0] != ident or now >= got[1]:
                return False
            self.packs.move_to_end(pack)
            return offset in got[2]

    def ok_all(self, pack: str, ident: tuple[int, ...], offsets: list[int], now: float) -> bool:
        """Whether every one of ``offsets`` of ``pack`` was verified under ``ident`` (one lock)."""
        with self.lock:
            got = self.packs.get(pack)
            if got is None or got[0] != ident or now >= got[1]:
                return False
            self.packs.move_to_end(pack)
            have = got[2]
            return all(o in have for o in offsets)

    def mark(self, pack: str, ident: tuple[int, ...], offset: int | list[int], now: float) -> None:
        with self.lock:
            got = self.packs.get(pack)
            if got is None or got[0] != ident or now >= got[1]:
                got = (ident, now + VERIFIED_TTL, set())
                self.packs[pack] = got
            if isinstance(offset, int):
                got[2].add(offset)
            else:
                got[2].update(offset)
            self.packs.move_to_end(pack)
            while len(self.packs) > VERIFIED_PACKS:
                self.packs.popitem(last=False)

    def clear(self) -> None:
        with self.lock:
            self.packs.clear()


_VERIFIED: weakref.WeakKeyDictionary[Any, _Verified] = weakref.WeakKeyDictionary()
_VERIFIED_LOCK = threading.Lock()


def _verified(store: Store) -> _Verified:
    with _VERIFIED_LOCK:
        v = _VERIFIED.get(store)
        if v is None:
            v = _VERIFIED[store] = _Verified()
        return v


def _ident(fd: int) -> tuple[int, ...]:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


#: A recipe chunk's plan: its pieces as ``[(piece digest, pack, data offset, length), ...]``.
_Segs = list[tuple[bytes, str, int, int]]


def _read_one(store: Store, marks: _Verified, digest: bytes, where: tuple[str, int, int] | _Segs | None) -> bytes:
    """Chunk ``digest`` from ``where`` (a frame, or a recipe's pieces): hashed unless it was verified
    in this pack file (every pack file of its pieces) as it is now."""
    if where is None:
        return store.read_chunk(digest)  # raises IntegrityError: missing
    if isinstance(where, list):
        return _read_pieces(store, marks, digest, where)
    pack, offset, length = where
    packs: Any = store.packs
    try:
        fd = packs._fd(pack)
        before = _ident(fd)
        raw = os.pread(fd, length + FRAME_HEADER, offset - FRAME_HEADER)
        after = _ident(fd)
    except OSError:  # gone (a repack moved it): looked up again, always verified
        with contextlib.suppress(Exception):
            packs._forget(pack)
        return store.read_chunk(digest)
    if len(raw) != length + FRAME_HEADER:
        raise IntegrityError(f"pack {pack} is truncated: wanted {length + FRAME_HEADER} bytes at {offset - FRAME_HEADER}")
    head_digest, head_len = parse_frame_header(raw[:FRAME_HEADER])
    data = raw[FRAME_HEADER:]
    if head_digest != digest or head_len != length:
        raise IntegrityError(f"chunk {digest.hex()} in pack {pack} at {offset} is damaged")
    now = time.monotonic()
    if before == after and marks.ok(pack, before, offset, now):
        return data
    if chunk_digest(data) != digest:
        raise IntegrityError(f"chunk {digest.hex()} in pack {pack} at {offset} is damaged")
    if before == after:
        marks.mark(pack, before, offset, now)
    return data


def _read_pieces(store: Store, marks: _Verified, digest: bytes, segs: _Segs) -> bytes:
    """Chunk ``digest`` kept as a recipe, rebuilt from its pieces ``segs`` (adjacent frames of one
    pack read with one ``pread``, each frame header checked against the recipe): not hashed when
    every piece was verified under its pack file's identity now (``fstat`` before and after its
    read, as :func:`_read_one`), else hashed whole against ``digest`` and, when it matches, every
    piece read from an unchanged pack file marked verified. A mismatch, a short read or a pack gone
    (a repack moved it): :meth:`Store.read_chunk <tb5sync.store.store.Store.read_chunk>` reads it
    again, which raises the precise ``IntegrityError`` (naming the damaged piece)."""
    packs: Any = store.packs
    runs: list[list[Any]] = []  # [pack, start, end, [data offsets], [(piece digest, length)]]
    for p, pack, off, n in segs:
        if runs and runs[-1][0] == pack and runs[-1][2] == off - FRAME_HEADER:
            runs[-1][2] = off + n
            runs[-1][3].append(off)
            runs[-1][4].append((p, n))
        else:
            runs.append([pack, off - FRAME_HEADER, off + n, [off], [(p, n)]])
    now = time.monotonic()
    views: list[memoryview] = []
    steady: list[tuple[str, tuple[int, ...], list[int]]] = []
    hot = True
    try:
        for pack, start, end, offs, ps in runs:
            fd = packs._fd(pack)
            before = _ident(fd)
            raw = memoryview(os.pread(fd, end - start, start))
            after = _ident(fd)
            if len(raw) != end - start:
                return store.read_chunk(digest)
            for off, (p, n) in zip(offs, ps):
                pos = off - start
                head_digest, head_len = parse_frame_header(raw[pos - FRAME_HEADER : pos])
                if head_digest != p or head_len != n:
                    return store.read_chunk(digest)
                views.append(raw[pos : pos + n])
            if before == after:
                steady.append((pack, before, offs))
                hot = hot and marks.ok_all(pack, before, offs, now)
            else:
                hot = False
    except OSError:  # a pack gone (a repack moved it): looked up again, always verified
        for r in runs:
            with contextlib.suppress(Exception):
                packs._forget(r[0])
        return store.read_chunk(digest)
    data = b"".join(views)
    if hot:
        return data
    if chunk_digest(data) != digest:
        return store.read_chunk(digest)  # raises, naming the damaged piece (or reads it where it moved to)
    for pack, ident, offs in steady:
        marks.mark(pack, ident, offs, now)
    return data


def read_blob(store: Store, info: BlobInfo) -> Iterator[bytes]:
    """The chunks of ``info`` in order, each checked against its digest (at most two chunks read ahead).

    A chunk of a local pack (a :class:`~tb5sync.store.packs.LocalPackStorage` store) is hashed on
    its first read by this process; later reads skip the hash while the pack file read keeps the
    identity it had then (device, inode, size, mtime and ctime, from ``fstat`` of the descriptor
    read, taken before and after the read) and for at most :data:`VERIFIED_TTL` seconds. Any write
    to the pack file changes its mtime and ctime, so a byte changed through the filesystem after a
    verified read is found on the next read; damage that changes no metadata (the medium below the
    filesystem) is found within :data:`VERIFIED_TTL` seconds of reads. A chunk kept as a recipe of
    pieces (store format v2) is rebuilt from its pieces' frames and skips the hash when every piece
    was so verified under its pack file's identity now; else it is hashed whole and its pieces
    marked (:func:`_read_pieces`). Other stores hash every read.

    Raises
    ------
    IntegrityError
        A chunk is missing or damaged.
    """
    digests = [d for d, _ in info.chunks]
    if type(store.packs) is not LocalPackStorage:  # noqa: E721 - a subclass may read other bytes
        return store.iter_chunks(digests, ahead=2)
    return _iter_marked(store, digests)


def _plans(store: Store, digests: list[bytes]) -> dict[bytes, Any]:
    """Where each of ``digests`` is: its frame ``(pack, offset, length)`` or, for a chunk kept as a
    recipe (format v2) whose pieces are all located, its pieces (:data:`_Segs`); others left out
    (:meth:`Store.read_chunk <tb5sync.store.store.Store.read_chunk>` says why). One index query per
    500 digests, and per 500 pieces."""
    where: dict[bytes, Any] = dict(store.locate(digests))
    rest = [d for d in dict.fromkeys(digests) if d not in where]
    if not rest or getattr(store, "version", 1) < 2:
        return where
    recipes: dict[bytes, list[tuple[bytes, int]]] = {}
    for k in range(0, len(rest), 500):
        part = rest[k : k + 500]
        for d, blob_ in store._q(f"SELECT digest, pieces FROM recipes WHERE digest IN ({','.join('?' * len(part))})", part):
            try:
                recipes[bytes(d)] = blob_to_recipe(bytes(blob_))
            except IntegrityError:
                continue  # read_chunk says so
    locs = store.locate(p for r in recipes.values() for p, _ in r) if recipes else {}
    for d, r in recipes.items():
        segs: _Segs = []
        for p, n in r:
            loc = locs.get(p)
            if loc is None or loc[2] != n:
                break
            segs.append((p, loc[0], loc[1], n))
        else:
            if segs:
                where[d] = segs
    return where


def _iter_marked(store: Store, digests: list[bytes]) -> Iterator[bytes]:
    marks = _verified(store)
    where = _plans(store, digests)
    if len(digests) == 1:  # most entries: no read-ahead, no thread hop
        yield _read_one(store, marks, digests[0], where.get(digests[0]))
        return
    pool = hash_pool()
    futs: list[Any] = []
    i = 0
    while i < len(digests) or futs:
        while i < len(digests) and len(futs) < 2:
            futs.append(pool.submit(_read_one, store, marks, digests[i], where.get(digests[i])))
            i += 1
        yield futs.pop(0).result()


@dataclass(frozen=True)
class FileRange:
    """One verified chunk as a range of its pack file, for ``sendfile``: ``fd`` (a descriptor of
    its own, ``os.dup`` of the pack's, which the taker closes), ``offset`` and ``length`` (bytes
    of chunk data, frame header excluded), ``ident`` (the pack file's identity when the chunk was
    verified, see :func:`read_blob`) and ``pack`` (its name, for messages)."""

    fd: int
    offset: int
    length: int
    ident: tuple[int, ...]
    pack: str

    def unchanged(self) -> bool:
        """Whether the pack file still has the identity under which the range was verified
        (``fstat`` of ``fd``; a closed or failing descriptor is a change)."""
        try:
            return _ident(self.fd) == self.ident
        except OSError:
            return False


def blob_ranges(store: Store, info: BlobInfo) -> list[FileRange] | None:
    """The chunks of ``info`` as ranges of pack files, in order, when every one of them is a
    contiguous uncompressed range of a local pack verified (:func:`read_blob`) under the pack
    file's identity now and within :data:`VERIFIED_TTL` seconds; else ``None`` (read the entry with
    :func:`read_blob`, which verifies and marks its chunks, so that the next call answers ranges).
    No byte of chunk data is read: an index lookup, one ``dup`` and ``fstat`` per pack. With
    :data:`RANGES_OF_PIECES`, a chunk kept as a recipe whose pieces were all verified so is one
    range per piece (ranges of one pack share one descriptor).

    The caller sends each range (``sendfile``), checks :meth:`FileRange.unchanged` before and
    after, and cuts its reader off when it changed (the bytes sent may not be those verified),
    then closes every ``fd``. An empty list: an entry of no chunks.
    """
    if type(store.packs) is not LocalPackStorage:  # noqa: E721 - a subclass may read other bytes
        return None
    digests = [d for d, _ in info.chunks]
    where = _plans(store, digests) if RANGES_OF_PIECES else store.locate(digests)
    marks = _verified(store)
    packs: Any = store.packs
    out: list[FileRange] = []
    fds: dict[str, tuple[int, tuple[int, ...]]] = {}  # pack -> (its dup, its identity): one per pack
    now = time.monotonic()
    try:
        for d in digests:
            w = where.get(d)
            if w is None:  # missing, or a recipe whose pieces are not all located
                break
            segs = w if isinstance(w, list) else [(d, *w)]
            if not _ranges_of(packs, marks, segs, fds, out, now):
                break
        else:
            return out
    except BaseException:
        close_ranges(out, fds)
        raise
    close_ranges(out, fds)
    return None


def _ranges_of(packs: Any, marks: _Verified, segs: _Segs, fds: dict[str, tuple[int, tuple[int, ...]]],
               out: list[FileRange], now: float) -> bool:
    """Append the frames ``segs`` to ``out`` as ranges when each is verified under its pack's identity
    now; whether they all were."""
    for _, pack, offset, length in segs:
        got = fds.get(pack)
        if got is None:
            try:
                fd = os.dup(packs._fd(pack))
            except OSError:
                return False
            try:
                got = fds[pack] = (fd, _ident(fd))
            except OSError:
                os.close(fd)
                return False
        if not marks.ok(pack, got[1], offset, now):
            return False
        out.append(FileRange(got[0], offset, length, got[1], pack))
    return True


def close_ranges(ranges: list[FileRange], extra: Mapping[str, tuple[int, Any]] | None = None) -> None:
    """Close the descriptors of ``ranges`` (from :func:`blob_ranges`; ranges of one pack share one),
    each once, and those of ``extra`` (pack -> (descriptor, ...))."""
    fds = {r.fd for r in ranges} | {v[0] for v in (extra or {}).values()}
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def add_counters(store: Store, deltas: Mapping[str, float]) -> None:
    """Add ``deltas`` to the named counters (one transaction; names created at 0)."""
    if not deltas:
        return
    with store._tx() as db:
        db.executemany("INSERT INTO counters VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
                       list(deltas.items()))


def counters(store: Store, prefix: str = "") -> dict[str, float]:
    """Every counter whose name starts with ``prefix``."""
    return {n: v for n, v in store._q("SELECT name, value FROM counters ORDER BY name") if n.startswith(prefix)}
