"""Writers' side of the store: leases (what an unfinished write holds) and the pack writer.

See :mod:`tb5sync.store.store` for the rules these implement: a chunk a writer will reference is
recorded under its lease in the same transaction that found it indexed, or written by it to a
pack whose name is recorded under the lease before the pack is put in place.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

from tb5sync._os.io import durable_sync
from tb5sync.engine.params import ChunkParams
from tb5sync.store.index import check_entry_fits
from tb5sync.engine.hashing import chunk_digest
from tb5sync.store.pieces import SPLIT_MIN, Piece, recipe_record, recipe_to_blob, split
from tb5sync.store.packs import FRAME_HEADER, PACK_MAGIC, frame_header

if TYPE_CHECKING:
    from tb5sync.store.index import PackIndex

__all__ = ["Lease", "PackWriter", "LEASE_TTL"]

#: A lease not touched for this long is dead even if its process seems alive (pid reuse, other hosts).
LEASE_TTL = 24 * 3600.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Lease:
    """A writer's claim on chunks it will reference; see the module docstring. Thread-safe."""

    def __init__(self, store: PackIndex, lease_id: str | None = None) -> None:
        self.store = store
        self.id = lease_id or secrets.token_hex(16)
        now = time.time()
        with store._tx() as db:
            db.execute("INSERT OR REPLACE INTO leases VALUES (?,?,?,?,?)", (self.id, store.host, os.getpid(), now, now))

    def protect(self, digests: Sequence[bytes], frames_only: bool = False) -> list[bool]:
        """Which of ``digests`` the store holds; those it holds are recorded under this lease (one transaction).

        A chunk is held as a pack frame (format v1, and small chunks in v2) or as a recipe of
        pieces (format v2); ``frames_only`` asks for frames only (the pieces a recipe will name).
        """
        uniq = list(dict.fromkeys(digests))
        hit: set[bytes] = set()
        with self.store._tx() as db:
            for k in range(0, len(uniq), 500):  # one query per 500 digests (a put asks per window)
                part = uniq[k : k + 500]
                hit.update(bytes(d) for (d,) in
                           db.execute(f"SELECT digest FROM chunks WHERE digest IN ({','.join('?' * len(part))})", part))
                rest = [d for d in part if d not in hit] if not frames_only else []
                if rest:
                    hit.update(bytes(d) for (d,) in db.execute(
                        f"SELECT digest FROM recipes WHERE digest IN ({','.join('?' * len(rest))})", rest))
            db.executemany("INSERT OR IGNORE INTO lease_chunks VALUES (?,?)", [(self.id, d) for d in uniq if d in hit])
            db.execute("UPDATE leases SET touched=? WHERE id=?", (time.time(), self.id))
        return [d in hit for d in digests]

    def release(self) -> None:
        """Drop the lease and what it protects."""
        with self.store._tx() as db:
            _drop_lease(db, self.id)


def _drop_lease(db: sqlite3.Connection, lease: str) -> None:
    db.execute("DELETE FROM lease_chunks WHERE lease=?", (lease,))
    db.execute("DELETE FROM lease_packs WHERE lease=?", (lease,))
    db.execute("DELETE FROM leases WHERE id=?", (lease,))


class PackWriter:
    """Appends chunks to a new pack under a lease; a full pack is put in place and indexed.

    ``add`` skips a digest this writer already holds. In a format v2 store (``store.piece_params``
    set) a chunk of at least :data:`~tb5sync.store.pieces.SPLIT_MIN` bytes is cut into pieces
    (:func:`tb5sync.store.pieces.split`): only the pieces the store lacks are framed into the
    pack, and the chunk's recipe is indexed in the same transaction as the pack that holds the
    last of its new pieces (pieces it found indexed are held under the lease meanwhile), so a
    recipe never names a piece that is not indexed. ``placed`` lists, per finished pack,
    ``(digest, pack, offset, length)`` of the frames it wrote. ``written`` counts the framed bytes
    it added (bytes); with ``limit`` set (bytes: a store's quota), a frame that would take
    ``written`` past it is refused with :class:`tb5sync.errors.EntryTooLargeError` before it is
    written: what one writer adds is new to the store, so an entry needing more than the quota
    can never fit.

    A full pack is finished (fsync, rename, index) by a thread of the writer's own while the next
    pack is written, at most one at a time; :meth:`flush` waits for it (and raises its error), so
    after ``flush`` everything added is indexed, as before.
    """

    #: Most framed bytes one writer may add (bytes), or None.
    limit: int | None = None

    def __init__(self, store: PackIndex, lease: Lease) -> None:
        self.store = store
        self.lease = lease
        self.known: set[bytes] = set()  # chunk digests added (v1: also the frames)
        self._frames: set[bytes] = set()  # frame digests written by this writer
        self.placed: list[tuple[bytes, str, int, int]] = []
        self.pieces: ChunkParams | None = getattr(store, "piece_params", None)
        self._f: BinaryIO | None = None
        self._tmp = ""
        self._id = ""
        self._pos = 0
        self._rows: list[tuple[bytes, str, int, int]] = []
        self._recipes: list[tuple[bytes, int, bytes]] = []  # (chunk digest, length, recipe blob) to index
        self._lock = threading.Lock()
        self.written = 0
        self._finisher: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future[None] | None = None  # the pack being finished
        self._behind = threading.Lock()  # one hand-over at a time (add may be called from threads)

    def add(self, digest: bytes, data: bytes | memoryview, pieces: Sequence[Piece] | None = None) -> None:
        """Append one chunk (its digest already computed from these very bytes); ``pieces``: its
        :func:`~tb5sync.store.pieces.split` when the caller cut it already (v2 stores only)."""
        self.add_many([(digest, data, pieces)])

    def add_many(self, chunks: Sequence[tuple[bytes, bytes | memoryview, Sequence[Piece] | None]]) -> None:
        """:meth:`add` of each ``(digest, data, pieces or None)``, the pieces of them all looked up
        (and held under the lease) in one index transaction rather than one per chunk."""
        split_up: list[tuple[bytes, bytes | memoryview, Sequence[Piece]]] = []
        for digest, data, pieces in chunks:
            if digest in self.known:
                continue
            if self.pieces is None or len(data) < SPLIT_MIN:
                self.add_frame(digest, data)
                self.known.add(digest)
                continue
            if pieces is None:
                pieces = split(data, self.pieces)
            if len(pieces) == 1:  # one piece is the chunk itself: a frame, no recipe
                self.add_frame(digest, data)
                self.known.add(digest)
                continue
            split_up.append((digest, data, pieces))
        if not split_up:
            return
        fresh = list(dict.fromkeys(p for _, _, ps in split_up for p, _, _ in ps if p not in self._frames))
        had = dict(zip(fresh, self.lease.protect(fresh, frames_only=True))) if fresh else {}
        for digest, data, pieces in split_up:
            if digest not in self.known:
                self._add_recipe(digest, data, pieces, had)

    def _add_recipe(self, digest: bytes, data: bytes | memoryview, pieces: Sequence[Piece], had: dict[bytes, bool]) -> None:
        """Frame the pieces of chunk ``digest`` that ``had`` (piece -> indexed and held; absent: this
        writer framed it) says are missing, then queue its recipe and frame its record."""
        mv = memoryview(data)
        for p, s, e in pieces:
            if not had.get(p, True):
                self.add_frame(p, mv[s:e])
                had[p] = True
        blob = recipe_to_blob(pieces)
        with self._lock:
            self._recipes.append((digest, len(data), blob))
            self.known.add(digest)
        rec = recipe_record(digest, blob)  # the recipe in the packs too: reindex rebuilds it from there
        self.add_frame(chunk_digest(rec), rec)

    def add_frame(self, digest: bytes, data: bytes | memoryview) -> None:
        """Append ``data`` as one frame named ``digest`` (a whole chunk, or a piece), unless this
        writer wrote that frame already."""
        with self._lock:
            if digest in self._frames:
                return
            if self.limit is not None and self.written + FRAME_HEADER + len(data) + len(PACK_MAGIC) > self.limit:
                check_entry_fits(self.limit, self.written + FRAME_HEADER + len(data) + len(PACK_MAGIC), "an entry")
            self.written += FRAME_HEADER + len(data)
            if self._f is None:
                self._id = secrets.token_hex(16)
                self._tmp = os.path.join(self.store.tmp_dir, f"{os.getpid()}-{self._id}.tmp")
                self._f = open(self._tmp, "xb", buffering=1024 * 1024)  # noqa: SIM115 - closed in _flush
                self._f.write(PACK_MAGIC)
                self._pos = len(PACK_MAGIC)
            self._f.write(frame_header(digest, len(data)))
            self._f.write(data)
            self._rows.append((digest, self._id, self._pos + FRAME_HEADER, len(data)))
            self._pos += FRAME_HEADER + len(data)
            self._frames.add(digest)
            full = self._pos >= self.store.pack_target
        if full:
            self._flush_behind()

    def _take(self) -> tuple[Any, list[tuple[bytes, str, int, int]], str, str, list[tuple[bytes, int, bytes]]]:
        """The open pack (file or None, rows, id, temporary path) and the recipes waiting for it,
        taken from the writer (which then starts a new pack on the next frame)."""
        with self._lock:
            f, self._f = self._f, None
            recipes, self._recipes = self._recipes, []
            if f is None:
                rows: list[tuple[bytes, str, int, int]] = []
                pack = tmp = ""
            else:
                rows, self._rows = self._rows, []
                pack, tmp = self._id, self._tmp
        return f, rows, pack, tmp, recipes

    def _wait(self) -> None:
        """Wait for the pack being finished behind (raises what finishing it raised)."""
        fut, self._pending = self._pending, None
        if fut is not None:
            fut.result()

    def _flush_behind(self) -> None:
        """Finish the open pack in the writer's thread (after the previous one) and go on."""
        with self._behind:
            self._wait()
            taken = self._take()
            if self._finisher is None:
                self._finisher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tb5-pack-finish")
            self._pending = self._finisher.submit(self._finish, *taken)

    def flush(self) -> None:
        """Finish the open pack (fsync, put in place, index its frames under the lease) and index
        the recipes waiting for it, after the pack being finished behind, if any."""
        with self._behind:
            self._wait()
            self._finish(*self._take())
            if self._finisher is not None:
                self._finisher.shutdown(wait=True)
                self._finisher = None

    def _finish(self, f: Any, rows: list[tuple[bytes, str, int, int]], pack: str, tmp: str,
                recipes: list[tuple[bytes, int, bytes]]) -> None:
        if f is None and not recipes:
            return
        st = self.store
        if f is not None:
            try:
                f.flush()
                durable_sync(f.fileno())
            finally:
                f.close()
            with st._tx() as db:
                db.execute("INSERT OR IGNORE INTO lease_packs VALUES (?,?)", (self.lease.id, pack))
            size = st.packs.put_file(pack, tmp)
        with st._tx() as db:
            if f is not None:
                db.execute("INSERT INTO packs VALUES (?,?,?)", (pack, size, time.time()))
                db.executemany("INSERT OR IGNORE INTO chunks VALUES (?,?,?,?)", rows)
                db.executemany("INSERT OR IGNORE INTO lease_chunks VALUES (?,?)", [(self.lease.id, r[0]) for r in rows])
                db.execute("DELETE FROM lease_packs WHERE lease=? AND pack=?", (self.lease.id, pack))
            if recipes:
                db.executemany("INSERT OR IGNORE INTO recipes VALUES (?,?,?)", recipes)
                db.executemany("INSERT OR IGNORE INTO lease_chunks VALUES (?,?)", [(self.lease.id, r[0]) for r in recipes])
            db.execute("UPDATE leases SET touched=? WHERE id=?", (time.time(), self.lease.id))
        self.placed += rows

    def abort(self) -> None:
        """Drop an unfinished pack (and the recipes waiting for it); a full pack being finished
        behind is waited for (it is indexed under the lease, which its owner releases)."""
        with self._behind:
            with contextlib.suppress(Exception):  # abort runs on error paths: the first error is the one to see
                self._wait()
            if self._finisher is not None:
                self._finisher.shutdown(wait=True)
                self._finisher = None
        with self._lock:
            f, self._f = self._f, None
            self._recipes = []
        if f is not None:
            f.close()
            with contextlib.suppress(OSError):
                os.unlink(self._tmp)


