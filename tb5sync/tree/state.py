"""Per-root state on disk: the scan cache and chunk index (SQLite), partial files.

Layout under ``ROOT/.tb5sync/``::

    state.sqlite     files(path, size, mtime_ns, ino, params, digest, chunks)
                     chunks(digest, path, offset, length)
    partial/         large files being received, named by a key of the source file (BLAKE3 of
                     its path, size and mtime_ns, see largefile); kept
                     across interruptions so that a re-run sends only what is missing;
                     locked (flock) by the run writing them; pruned after 7 days
                     untouched, and beyond PARTIAL_CAP bytes of idle ones (oldest first)

``.tb5sync`` and ``partial`` are 0700, ``state.sqlite`` 0600.

Blocking functions only: no sockets, no event loop. Async callers use
``asyncio.to_thread``. When ``ROOT`` cannot be written (a read-only source),
the state lives in memory for the life of the object.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Collection, Sequence

from tb5sync.engine.hashing import ChunkRef, blob_to_refs, chunk_fd, file_digest, refs_to_blob
from tb5sync._os.paths import STATE_DIR
from tb5sync.errors import PathError
import tb5sync.engine.chunking as chunking

__all__ = ["TreeState", "PARTIAL_CAP", "PARTIAL_MAX_AGE", "check_own_dir"]

log = logging.getLogger(__name__)

#: Bytes idle partial files may hold under one root (the oldest beyond it are removed).
PARTIAL_CAP = 16 * 1024**3
#: Seconds after which an untouched partial file is removed.
PARTIAL_MAX_AGE = 7 * 86400.0


def check_own_dir(path: str, st: os.stat_result | None = None, *, owned: bool = True) -> bool:
    """Whether tb5sync's own directory ``path`` (a state directory, a store) exists, checked.

    It must be a real directory (not a symlink, not followed), and with ``owned`` one this
    process's effective user owns: a symlink would lead the state or a store elsewhere, and a
    directory planted by someone else is not one to write in (one only read need not be ours).

    Parameters
    ----------
    path : str
        The directory.
    st : os.stat_result, optional
        Its ``lstat`` (or ``fstat``) when the caller has it.
    owned : bool
        Also require this user to own it (directories tb5sync writes in).

    Returns
    -------
    bool
        False when ``path`` does not exist; True when it is fine.

    Raises
    ------
    PathError
        ``path`` is a symlink, not a directory, or owned by another user.
    """
    if st is None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
    if stat.S_ISLNK(st.st_mode):
        raise PathError(path, "is a symlink; tb5sync's own directories are never followed (remove it)")
    if not stat.S_ISDIR(st.st_mode):
        raise PathError(path, "is not a directory (remove it)")
    if owned and st.st_uid != os.geteuid():
        raise PathError(path, f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    return True


def _make_private_dir(path: str) -> None:
    """Create directory ``path`` with mode 0700 (and make an existing one 0700); not through a
    symlink, and only one this user owns (:func:`check_own_dir`)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        check_own_dir(path, st)
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def _make_private_file(path: str, create: bool) -> None:
    """Create file ``path`` with mode 0600 when ``create`` and missing, and make an existing one 0600."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o600)
    except FileNotFoundError:
        return
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) & 0o077:
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def _unlink_quiet(name: str, dfd: int) -> None:
    try:
        os.unlink(name, dir_fd=dfd)
    except OSError:
        pass


_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    path TEXT PRIMARY KEY,
    size INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    ino INTEGER NOT NULL,
    params INTEGER NOT NULL,
    digest BLOB NOT NULL,
    chunks BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS chunks (
    digest BLOB NOT NULL,
    path TEXT NOT NULL,
    offset INTEGER NOT NULL,
    length INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS chunks_digest ON chunks(digest);
CREATE INDEX IF NOT EXISTS chunks_path ON chunks(path);
"""


_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


def _db_int(v: int) -> int | bytes:
    """``v`` as SQLite stores it: an INTEGER when it fits in 64 signed bits, else a BLOB of its
    16-byte two's complement (mtimes after 2262-04-11 or before 1677-09-21 in ns, inodes past
    2^63): one value, one representation, so equality lookups keep working."""
    if _I64_MIN <= v <= _I64_MAX:
        return v
    return v.to_bytes(16, "big", signed=True)


def _db_path(path: str) -> str | bytes:
    """``path`` as SQLite stores it: TEXT when it is valid UTF-8, else (a name that is not, held
    by Python as surrogate escapes) the BLOB of its bytes (``os.fsencode``)."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return os.fsencode(path)
    return path


def _path_of(value: str | bytes) -> str:
    """A path read back from SQLite (see :func:`_db_path`)."""
    return os.fsdecode(value) if isinstance(value, bytes) else value


class TreeState:
    """Scan cache and chunk index of one root.

    Parameters
    ----------
    root : str
        The root directory (absolute) whose files the state describes.
    params : ChunkParams
        Chunk parameter set; cache rows made with another version are ignored.
    writable : bool
        False keeps the state in memory only (for read-only roots).
    state_dir : str, optional
        Where ``state.sqlite`` and ``partial/`` live; ``root/.tb5sync`` by default (a
        server's root). Local and pull destinations keep theirs in the user's cache
        directory instead (:func:`tb5sync.remote.client.local_state`).
    partial_cap : int
        Bytes that idle partial files (kept to resume interrupted transfers) may hold;
        the oldest beyond it are removed (:meth:`prune_partials`).

    Notes
    -----
    Thread-safe: one connection guarded by a lock. Paths are POSIX, relative to ``root``.
    A path that is not valid UTF-8 is stored as a BLOB of its bytes, an integer (mtime in ns,
    inode) beyond 64 signed bits as a 16-byte BLOB: the schema is unchanged, and older
    databases hold only the TEXT and INTEGER forms.
    ``.tb5sync`` and ``partial`` are made 0700 and ``state.sqlite`` 0600 whatever the umask.
    A database that cannot be read (corrupt, truncated) is moved aside and rebuilt empty.
    """

    def __init__(
        self,
        root: str,
        params: chunking.ChunkParams = chunking.DEFAULT_PARAMS,
        *,
        writable: bool = True,
        state_dir: str | None = None,
        partial_cap: int = PARTIAL_CAP,
    ) -> None:
        self.root = root
        self.params = params
        self.state_dir = os.path.join(root, STATE_DIR) if state_dir is None else state_dir
        self._lock = threading.Lock()
        db = ":memory:"
        if writable:
            try:
                os.makedirs(root, exist_ok=True)
                if state_dir is not None:  # e.g. in the user's cache directory: its parents may be missing
                    os.makedirs(os.path.dirname(os.path.abspath(self.state_dir)), exist_ok=True)
                _make_private_dir(self.state_dir)
                _make_private_dir(os.path.join(self.state_dir, "partial"))
                db = os.path.join(self.state_dir, "state.sqlite")
                # created 0600 before SQLite opens it (SQLite gives its -wal and -shm files the
                # database's permission bits): the names of files in private directories stay private
                for name in (db, db + "-wal", db + "-shm"):
                    _make_private_file(name, create=name == db)
            except OSError as exc:
                log.info("state for %s kept in memory: %s", root, exc)
                db = ":memory:"
        try:
            self._db = self._open(db)
        except sqlite3.OperationalError as exc:  # locked, read-only, ...: someone else's, leave it
            log.info("state for %s kept in memory: %s", root, exc)
            self._db = self._open(":memory:")
            db = ":memory:"
        except sqlite3.DatabaseError as exc:  # not a database, malformed
            if db == ":memory:":
                raise
            self._db = self._rebuild(db, exc)
        self.persistent = db != ":memory:"
        self.partial_cap = partial_cap
        if self.persistent:
            self.prune_partials()

    def _rebuild(self, db: str, exc: Exception) -> sqlite3.Connection:
        """A new, empty database in place of the unreadable one at ``db`` (in memory if that fails too).

        The state is a cache (losing it costs speed, never correctness), so a corrupt or
        truncated file is moved aside as ``state.sqlite.corrupt`` and built again.
        """
        log.warning("state database %s is unreadable (%s); rebuilding it", db, exc)
        try:
            for suffix in ("-wal", "-shm"):
                try:
                    os.unlink(db + suffix)
                except FileNotFoundError:
                    pass
            os.replace(db, db + ".corrupt")
            os.close(os.open(db, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
            return self._open(db)
        except (OSError, sqlite3.Error) as exc2:
            log.info("state for %s kept in memory: %s", self.root, exc2)
            return self._open(":memory:")

    def prune_partials(self, max_age: float = PARTIAL_MAX_AGE) -> int:
        """Remove abandoned partial files; return the bytes the kept ones hold.

        A partial file in use (its run holds its ``flock``) is never removed. Of the others,
        those untouched for ``max_age`` seconds are removed, then the oldest ones until the
        kept ones hold at most :attr:`partial_cap` bytes.
        """
        pdir = os.path.join(self.state_dir, "partial")
        now = time.time()
        idle: list[tuple[float, int, str]] = []
        total = 0
        try:
            dfd = os.open(pdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return 0
        try:
            for name in os.listdir(dfd):
                try:
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
                except OSError:
                    continue
                try:
                    st = os.fstat(fd)
                    try:
                        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    except BlockingIOError:
                        total += st.st_blocks * 512  # in use by a live run
                        continue
                    if now - st.st_mtime > max_age:
                        _unlink_quiet(name, dfd)
                        continue
                    idle.append((st.st_mtime, st.st_blocks * 512, name))
                    total += st.st_blocks * 512
                finally:
                    os.close(fd)
            idle.sort()
            for _mtime, nbytes, name in idle:
                if total <= self.partial_cap:
                    break
                log.info("partial file %s removed: partial files over %d bytes", name, self.partial_cap)
                _unlink_quiet(name, dfd)
                total -= nbytes
        finally:
            os.close(dfd)
        return total

    @staticmethod
    def _open(db: str) -> sqlite3.Connection:
        conn = sqlite3.connect(db, check_same_thread=False, isolation_level=None, timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.executescript(_SCHEMA)
        return conn

    def close(self) -> None:
        """Close the database. Safe to call twice."""
        with self._lock:
            self._db.close()

    # ---- scan cache -----------------------------------------------------------------
    def lookup(self, path: str, size: int, mtime_ns: int, ino: int) -> tuple[bytes, list[ChunkRef]] | None:
        """Cached ``(file digest, chunk list)`` for ``path`` if size, mtime_ns and inode still match."""
        with self._lock:
            row = self._db.execute(
                "SELECT digest, chunks FROM files WHERE path=? AND size=? AND mtime_ns=? AND ino=? AND params=?",
                (_db_path(path), size, _db_int(mtime_ns), _db_int(ino), self.params.version),
            ).fetchone()
        if row is None:
            return None
        return row[0], blob_to_refs(row[1])

    def record(self, path: str, size: int, mtime_ns: int, ino: int, refs: Sequence[ChunkRef]) -> bytes:
        """Store ``path``'s chunk list in the scan cache and the chunk index; return the file digest."""
        return self.record_many([(path, size, mtime_ns, ino, refs)])[0]

    def record_many(self, items: Sequence[tuple[str, int, int, int, Sequence[ChunkRef]]]) -> list[bytes]:
        """:meth:`record` for many files in one transaction (``(path, size, mtime_ns, ino, refs)``).

        Returns the file digests, in order.
        """
        digests = []
        last: dict[str | bytes, int] = {}  # a path listed twice keeps its last row, as one statement per file did
        for i, (rel, _size, _mtime_ns, _ino, refs) in enumerate(items):
            digests.append(file_digest(d for d, _ in refs))
            last[_db_path(rel)] = i
        files, chunks = [], []
        for path, i in last.items():
            _rel, size, mtime_ns, ino, refs = items[i]
            files.append((path, size, _db_int(mtime_ns), _db_int(ino), self.params.version, digests[i], refs_to_blob(refs)))
            off = 0
            for d, n in refs:
                chunks.append((d, path, off, n))
                off += n
        with self._lock, self._db:
            self._db.execute("BEGIN")
            # one prepared statement each for the whole batch, not three per file
            self._db.executemany("DELETE FROM chunks WHERE path=?", [(p,) for p in last])
            self._db.executemany("INSERT OR REPLACE INTO files VALUES (?,?,?,?,?,?,?)", files)
            self._db.executemany("INSERT INTO chunks VALUES (?,?,?,?)", chunks)
        return digests

    def forget(self, paths: Sequence[str]) -> None:
        """Drop cache and index rows of ``paths`` (deleted or replaced files) and everything below them."""
        with self._lock, self._db:
            self._db.execute("BEGIN")
            for rel in paths:
                p = _db_path(rel)
                like: str | bytes
                if isinstance(p, bytes):
                    like = p.replace(b"\\", b"\\\\").replace(b"%", b"\\%").replace(b"_", b"\\_") + b"/%"
                else:
                    like = p.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "/%"
                self._db.execute("DELETE FROM files WHERE path=? OR path LIKE ? ESCAPE '\\'", (p, like))
                self._db.execute("DELETE FROM chunks WHERE path=? OR path LIKE ? ESCAPE '\\'", (p, like))

    def known_chunks(self, digests: Sequence[bytes]) -> set[bytes]:
        """Those of ``digests`` that have at least one place in the chunk index (one query per 500).

        A receiver asks this once per chunk-list piece and calls :meth:`find_chunk` only for the
        digests it returns (a cold file: no query per chunk). Like the index, the answer can be stale.
        """
        out: set[bytes] = set()
        todo = list(dict.fromkeys(digests))
        for i in range(0, len(todo), 500):
            batch = todo[i : i + 500]
            sql = f"SELECT DISTINCT digest FROM chunks WHERE digest IN ({','.join('?' * len(batch))})"
            with self._lock:
                out.update(bytes(r[0]) for r in self._db.execute(sql, batch).fetchall())
        return out

    def find_chunk(self, digest: bytes, exclude: Collection[str] = (), limit: int = 4) -> list[tuple[str, int, int]]:
        """Up to ``limit`` places ``(path, offset, length)`` where a chunk with ``digest`` was seen.

        Paths in ``exclude`` (already tried) are left out. The index can be stale (files
        deleted or changed behind the server's back): callers must verify the bytes they read
        against the digest, and should :meth:`forget` the paths that fail.
        """
        marks = ",".join("?" * len(exclude))
        sql = "SELECT path, offset, length FROM chunks WHERE digest=?"
        if exclude:
            sql += f" AND path NOT IN ({marks})"
        with self._lock:
            rows = self._db.execute(sql + " LIMIT ?", (digest, *map(_db_path, exclude), limit)).fetchall()
        return [(_path_of(p), off, n) for p, off, n in rows]

    def chunks_of(self, fd: int, path: str, st: os.stat_result, *, fresh: bool = False) -> tuple[bytes, list[ChunkRef]]:
        """Chunk list and file digest of the open file ``fd`` (whose ``fstat`` is ``st``), from cache or computed.

        Computed lists are recorded in the cache. ``fresh=True`` ignores the cache
        and re-reads the file (``--checksum``: content changed behind an unchanged
        size, mtime and inode is found too).

        Raises
        ------
        SourceChangedError
            The file shrank while it was read.
        OSError
            The file cannot be read.
        """
        hit = None if fresh else self.lookup(path, st.st_size, st.st_mtime_ns, st.st_ino)
        if hit is not None:
            return hit
        refs = chunk_fd(fd, st.st_size, self.params, where=path)
        digest = self.record(path, st.st_size, st.st_mtime_ns, st.st_ino, refs)
        return digest, refs

    def partials_for(self, base: str) -> bool:
        """Whether partial files can live in :attr:`state_dir` for a destination at ``base``: the
        state is on disk and on the same file system as ``base`` (or its nearest existing
        parent), so that the finished file is renamed into place, not copied."""
        if not self.persistent:
            return False
        probe = base
        while True:
            try:
                dev = os.stat(probe).st_dev
                break
            except OSError:
                parent = os.path.dirname(probe)
                if parent == probe:
                    return False
                probe = parent
        try:
            return os.stat(os.path.join(self.state_dir, "partial")).st_dev == dev
        except OSError:
            return False

    def partial_path(self, key: bytes) -> str:
        """Where a large file is assembled before it is renamed into place; ``key`` names it (hex).

        The receiver derives ``key`` from the source file's path, size and mtime, so that an
        interrupted transfer of the same source version finds its partial file again.
        """
        return os.path.join(self.state_dir, "partial", key.hex())
