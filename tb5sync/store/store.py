"""The artifact store: immutable snapshots held once, deduplicated by chunk, named by refs.

Layout (store format v2, see docs/ARCHITECTURE.md)::

    STORE/config           JSON: {"format": "tb5sync-store", "version": 2, "chunk_params": 1,
                           "piece_params": 1, "pack_target": bytes, "quota": bytes or null}
                           (format v1: "version": 1 and no "piece_params")
    STORE/index.sqlite     WAL; chunks (pack frames), recipes, packs, refs, leases (schema below)
    STORE/packs/XX/<id>    immutable pack files (:mod:`tb5sync.store.packs`)
    STORE/tmp/             packs being written (<pid>-<id>.tmp), removed by gc when their process is gone
    STORE/gc.lock          flock: one gc (or quota eviction) at a time

Chunks are the sync engine's chunks (FastCDC format v1, BLAKE3-256 addresses), so a file synced
earlier and the same file in the store have the same chunks. Format v2 keeps each chunk of at
least 256 KiB (every chunk but a file's last) as a *recipe* of ~16 KiB FastCDC pieces (:mod:`tb5sync.store.pieces`): packs hold
the pieces, the ``recipes`` table maps a chunk digest to its pieces, and a chunk read is rebuilt
from them and checked against the chunk's digest. A chunk is in the store when it has a frame
(``chunks`` row: v1 chunks, small v2 chunks, v2 pieces) or a recipe; a v2 store reads both, so
a v1 store upgraded by :meth:`Store.upgrade` keeps its old chunks as they are.

Concurrency (threads and processes): every index change is one SQLite ``BEGIN IMMEDIATE``
transaction. A writer holds a *lease*: a row naming its host and pid; each chunk it will
reference is either already indexed, and then recorded under the lease in the same transaction
that found it, or written by it into a new pack, whose name is recorded under the lease before
the pack is put in place. The garbage collector marks from every ref and every live lease in
one transaction and deletes only what is unmarked, so there is no moment at which a chunk that a
ref or an unfinished put needs is gone (the failure restic's ``prune`` lock and borg's exclusive
lock avoid by stopping writers; here writers go on).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import re
import secrets
import sqlite3
import stat
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import blake3 as _blake3

from tb5sync._os.io import durable_sync
from tb5sync.engine.chunking import PARAMS_BY_VERSION, PARAMS_V1, ChunkParams
from tb5sync.tree.excludes import ExcludeRules
from tb5sync.errors import IntegrityError, RefExistsError, RefNotFoundError, RefPinnedError, SourceChangedError, UsageError
from tb5sync.engine.hashing import ChunkRef, blob_to_refs, chunk_digest, cut_buffer, file_digest, hash_pool, refs_to_blob
from tb5sync.store.manifest import Item, decode_manifest, encode_manifest, walk
from tb5sync.store.packs import FRAME_HEADER, LocalPackStorage, PackStorage, parse_frame_header
from tb5sync.store.index import check_entry_fits, require_indexed, stored_size
from tb5sync.store.pieces import SPLIT_MIN, blob_to_recipe, piece_params, split
from tb5sync.store.writer import LEASE_TTL, Lease, PackWriter, _drop_lease, _pid_alive

INLINE_HASH_MAX = 256 * 1024
"""Bytes up to which :meth:`Store.put_bytes` hashes its chunks in the calling thread: a submit to
the hash pool and the wait for its result cost more than BLAKE3 over this much (a 1-16 KiB build
cache entry: ~10 us to hash, ~100 us of hand-offs under load)."""

__all__ = ["Store", "RefInfo", "Lease", "PackWriter", "STORE_VERSION", "STORE_VERSIONS", "default_store_path",
           "check_ref_name"]


log = logging.getLogger(__name__)

#: Store format version written to ``STORE/config`` of a new store (2: chunks kept as recipes of pieces).
STORE_VERSION = 2
#: Store format versions this code reads and writes (1: whole chunks in packs; 2: pieces and recipes).
STORE_VERSIONS = (1, 2)
#: Default target size of a pack, bytes.
PACK_TARGET = 32 * 1024 * 1024
#: Files up to this size are read whole and stored in batches (one index transaction per batch).
SMALL_FILE = 4 * 1024 * 1024
#: Bytes of small files gathered before a batch is stored.
SMALL_BATCH = 32 * 1024 * 1024
#: Bytes read from a file at a time by put (plus the undecided tail of at most one chunk).
READ_WINDOW = 16 * 1024 * 1024

_SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks (
    digest BLOB PRIMARY KEY, pack TEXT NOT NULL, offset INTEGER NOT NULL, length INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS chunks_pack ON chunks(pack);
CREATE TABLE IF NOT EXISTS packs (id TEXT PRIMARY KEY, size INTEGER NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS refs (
    name TEXT PRIMARY KEY, manifest BLOB NOT NULL, mchunks BLOB NOT NULL, created REAL NOT NULL,
    size INTEGER NOT NULL, files INTEGER NOT NULL, description TEXT, pinned INTEGER NOT NULL DEFAULT 0,
    last_used REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS leases (
    id TEXT PRIMARY KEY, host TEXT NOT NULL, pid INTEGER NOT NULL, started REAL NOT NULL, touched REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS lease_chunks (lease TEXT NOT NULL, digest BLOB NOT NULL, PRIMARY KEY (lease, digest)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS lease_packs (lease TEXT NOT NULL, pack TEXT NOT NULL, PRIMARY KEY (lease, pack)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS blobs (
    key TEXT PRIMARY KEY, digest BLOB NOT NULL, chunks BLOB NOT NULL, size INTEGER NOT NULL,
    created REAL NOT NULL, last_used REAL NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS recipes (digest BLOB PRIMARY KEY, length INTEGER NOT NULL, pieces BLOB NOT NULL) WITHOUT ROWID;
"""

_REF_RE = re.compile(r"[A-Za-z0-9._+=@,-]+")


def check_ref_name(name: object) -> str:
    """Check a ref name: ``/``-separated segments of ``A-Z a-z 0-9 . _ + = @ , -``, not ``.``/``..``, at most 255 bytes.

    Raises
    ------
    UsageError
        Anything else, naming the ref.
    """
    if not isinstance(name, str) or not 0 < len(name) <= 255:
        raise UsageError(f"bad ref name {name!r}: 1 to 255 characters")
    for seg in name.split("/"):
        if seg in ("", ".", "..") or not _REF_RE.fullmatch(seg):
            raise UsageError(f"bad ref name {name!r}: segments of A-Z a-z 0-9 . _ + = @ , - separated by /")
    return name


def ref_ancestors(name: str) -> list[str]:
    """The path prefixes of ref name ``name`` that could themselves be refs: ``a/b/c`` -> ``["a", "a/b"]``."""
    segs = name.split("/")
    return ["/".join(segs[:i]) for i in range(1, len(segs))]


def nesting_error(name: str, other: str, where: str) -> RefExistsError:
    """The error for ref ``name`` that would nest with the existing ref ``other`` in ``where`` (a label)."""
    outer, inner = (other, name) if len(other) < len(name) else (name, other)
    return RefExistsError(f"ref {name!r} cannot coexist with ref {other!r} in {where}: {inner!r} would lie inside "
                          f"{outer!r} (a ref name cannot be a path prefix of another); pick another name or rm {other!r}")


def default_store_path() -> str:
    """``$TB5SYNC_STORE``, else ``tb5sync/store`` in the user's data directory.

    The data directory is ``$XDG_DATA_HOME`` (default ``~/.local/share``) on Linux and
    ``~/Library/Application Support`` on macOS, as platformdirs' ``user_data_dir`` gives.
    """
    env = os.environ.get("TB5SYNC_STORE")
    if env:
        return env
    try:
        from platformdirs import user_data_dir

        return os.path.join(user_data_dir("tb5sync", appauthor=False), "store")
    except ImportError:
        pass
    import sys

    if sys.platform == "darwin":
        base = os.path.expanduser("~/Library/Application Support")
    else:
        base = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return os.path.join(base, "tb5sync", "store")


@dataclass(frozen=True)
class RefInfo:
    """A ref: ``name`` -> manifest, with its creation time (s since epoch), logical size (bytes),
    file count, description, pin flag and last use (s since epoch)."""

    name: str
    manifest: bytes
    mchunks: tuple[ChunkRef, ...]
    created: float
    size: int
    files: int
    description: str | None
    pinned: bool
    last_used: float

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (digest as hex)."""
        return {"name": self.name, "manifest": self.manifest.hex(), "created": self.created, "size": self.size,
                "files": self.files, "description": self.description, "pinned": self.pinned,
                "last_used": self.last_used}


class Store:
    """An artifact store in directory ``path`` (created when missing).

    Parameters
    ----------
    path : str or path, optional
        The store directory; default :func:`default_store_path`.
    pack_target : int, optional
        Target pack size in bytes for new packs (default 32 MiB, at least 1 MiB); recorded in
        ``config`` when the store is created, overridable per process.
    quota : int, optional
        Most bytes the packs may take; refs beyond it are evicted least recently used first,
        pinned refs never (see :meth:`enforce_quota`). Overrides the quota in ``config``.
    packs : PackStorage, optional
        Where packs live; default a :class:`LocalPackStorage` in ``path/packs``.
    version : int, optional
        Format version of a store created here (1 or 2; default ``$TB5SYNC_STORE_FORMAT``, else
        :data:`STORE_VERSION`); an existing
        store keeps the version in its ``config`` (:meth:`upgrade` moves a v1 store to v2).
    read_only : bool
        Open an existing store for reading only: nothing is created or written (no directory,
        config, ``tmp/``, ``packs/``; the index is opened by SQLite read-only, ``mode=ro``, or
        ``immutable=1`` when no writer's ``index.sqlite-wal`` exists, so that not even SQLite's
        ``-wal``/``-shm`` files appear). Writes then fail (``sqlite3.OperationalError``); callers
        such as :class:`~tb5sync.store.ops.StoreOps` refuse them before.

    Raises
    ------
    UsageError
        ``path`` holds a store of an unknown format or chunk parameter version; with
        ``read_only``, ``path`` holds no store (``"PATH: no store here"``); ``version`` not 1 or 2.

    Notes
    -----
    Thread-safe (one SQLite connection behind a lock) and safe with other processes using the
    same directory (SQLite transactions, ``flock`` for gc). The layout is documented in
    docs/ARCHITECTURE.md ("On-disk formats": store format v2, and v1).
    """

    #: Opened with ``read_only`` (subclasses such as the object store are always writable).
    read_only = False

    def __init__(self, path: str | os.PathLike[str] | None = None, *, pack_target: int | None = None,
                 quota: int | None = None, packs: PackStorage | None = None, read_only: bool = False,
                 version: int | None = None) -> None:
        if version is not None and version not in STORE_VERSIONS:
            raise UsageError(f"store format version must be one of {STORE_VERSIONS}, got {version!r}")
        if version is None and os.environ.get("TB5SYNC_STORE_FORMAT"):
            env = os.environ["TB5SYNC_STORE_FORMAT"]
            if env not in ("1", "2"):
                raise UsageError(f"TB5SYNC_STORE_FORMAT must be 1 or 2, got {env!r}")
            version = int(env)
        self._new_version = version or STORE_VERSION
        self.path = os.path.abspath(os.fspath(path) if path is not None else default_store_path())
        self.read_only = read_only
        self.tmp_dir = os.path.join(self.path, "tmp")
        index = os.path.join(self.path, "index.sqlite")
        if read_only:
            if not (os.path.isfile(os.path.join(self.path, "config")) and os.path.isfile(index)):
                raise UsageError(f"{self.label}: no store here")
        else:
            os.makedirs(self.path, exist_ok=True)
            os.makedirs(self.tmp_dir, exist_ok=True)
        self.config = self._load_config(pack_target)
        self.params: ChunkParams = PARAMS_BY_VERSION[self.config["chunk_params"]]
        self.version: int = self.config["version"]
        #: Piece parameters of a format v2 store (chunks of >= 256 KiB are kept as recipes), None in v1.
        self.piece_params: ChunkParams | None = (piece_params(self.config.get("piece_params"))
                                                 if self.version >= 2 else None)
        self.pack_target = int(pack_target or self.config["pack_target"])
        if self.pack_target < 1024 * 1024 and pack_target is None:
            raise UsageError(f"{self.label}/config: pack_target below 1 MiB")
        self.quota = quota if quota is not None else self.config.get("quota")
        self.packs = packs or LocalPackStorage(os.path.join(self.path, "packs"), read_only=read_only)
        self.host = os.uname().nodename
        self._lock = threading.RLock()
        # decoded manifests by digest (immutable objects, checked when read): the last few, with a path index
        self._manifests: OrderedDict[bytes, tuple[list[Item], dict[bytes, Item]]] = OrderedDict()
        if read_only:
            # no -wal: no writer is open, and SQLite's mode=ro would leave a -wal and -shm behind
            mode = "mode=ro" if os.path.exists(index + "-wal") else "immutable=1"
            self._db = sqlite3.connect(f"file:{urllib.parse.quote(index)}?{mode}", uri=True, check_same_thread=False,
                                       isolation_level=None, timeout=60)
            return
        self._db = sqlite3.connect(index, check_same_thread=False, isolation_level=None, timeout=60)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA fullfsync=ON")  # macOS: F_FULLFSYNC, as _io.durable_sync (elsewhere no effect)
        with self._lock:
            self._db.executescript(_SCHEMA)

    @property
    def label(self) -> str:
        """What errors call this store: its directory (an object store: the URL the user gave)."""
        return self.path

    # ---- plumbing ----------------------------------------------------------------------------
    def _load_config(self, pack_target: int | None) -> dict[str, Any]:
        cfg_path = os.path.join(self.path, "config")
        shown = cfg_path if self.label == self.path else f"{self.label}/config"
        try:
            with open(cfg_path, "rb") as f:
                cfg = json.loads(f.read())
        except FileNotFoundError:
            cfg = {"format": "tb5sync-store", "version": self._new_version, "chunk_params": PARAMS_V1.version,
                   "pack_target": int(pack_target or PACK_TARGET), "quota": None}
            if self._new_version >= 2:
                cfg["piece_params"] = 1
            tmp = os.path.join(self.tmp_dir, f"config.{secrets.token_hex(8)}")
            with open(tmp, "w") as f:
                json.dump(cfg, f)
                f.flush()
                durable_sync(f.fileno())
            try:
                os.link(tmp, cfg_path)  # first creator wins; a concurrent one reads the winner's
            except FileExistsError:
                pass
            os.unlink(tmp)
            with open(cfg_path, "rb") as f:
                cfg = json.loads(f.read())
        except (ValueError, OSError) as exc:
            raise UsageError(f"{shown}: unreadable store config: {exc}") from exc
        if not isinstance(cfg, dict) or cfg.get("format") != "tb5sync-store" or cfg.get("version") not in STORE_VERSIONS:
            raise UsageError(f"{shown}: not a tb5sync store of format version "
                             f"{' or '.join(map(str, STORE_VERSIONS))}")
        if cfg.get("chunk_params") not in PARAMS_BY_VERSION:
            raise UsageError(f"{shown}: unknown chunk parameter version {cfg.get('chunk_params')!r}")
        if cfg["version"] >= 2:
            try:
                piece_params(cfg.get("piece_params"))
            except UsageError as exc:
                raise UsageError(f"{shown}: {exc}") from None
        return cfg

    def _write_config(self, cfg: dict[str, Any]) -> None:
        """Replace ``config`` by ``cfg`` atomically (a temporary file, fsynced, renamed)."""
        tmp = os.path.join(self.tmp_dir, f"config.{secrets.token_hex(8)}")
        with open(tmp, "w") as f:
            json.dump(cfg, f)
            f.flush()
            durable_sync(f.fileno())
        os.replace(tmp, os.path.join(self.path, "config"))

    def upgrade(self) -> dict[str, Any]:
        """Move a format v1 store to format v2 (``store upgrade``); in a v2 store, write the recipe
        records its packs lack.

        From v1 only ``config`` changes: chunks written from now on are kept as recipes of pieces,
        the chunks already stored stay whole frames (a v2 store reads both); nothing is rewritten.
        Afterwards a tb5sync that reads only v1 refuses the store (its config says version 2).
        Holds the gc lock, so no gc runs meanwhile; a writer of another process that opened the
        store as v1 before goes on writing whole chunks, which v2 reads as well.

        A v2 store written before recipes were recorded in the packs (their records,
        :func:`tb5sync.store.pieces.recipe_record`, are what :meth:`reindex` rebuilds recipes from)
        gets a record for each recipe that has none, in new packs; nothing else changes.

        Returns
        -------
        dict
            ``{"from": old version, "to": 2, "records_written": recipe records added}``.
        """
        from tb5sync.store.gc import gc_lock
        from tb5sync.store.pieces import recipe_record

        old = self.version
        if old < 2:
            with gc_lock(self):
                cfg = dict(self.config, version=2, piece_params=1)
                self._write_config(cfg)
            self.config, self.version, self.piece_params = cfg, 2, piece_params(1)
        written = 0
        rows = [(bytes(d), bytes(b)) for d, b in self._q("SELECT digest, pieces FROM recipes")]
        todo = [(d, recipe_record(d, b)) for d, b in rows]
        todo = [(d, rec) for d, rec in todo if not self._q("SELECT 1 FROM chunks WHERE digest=?", (chunk_digest(rec),))]
        if todo:
            lease = self.lease()
            writer = PackWriter(self, lease)
            try:
                for _, rec in todo:
                    writer.add_frame(chunk_digest(rec), rec)
                    written += 1
                writer.flush()
            except BaseException:
                writer.abort()
                raise
            finally:
                lease.release()
        return {"from": old, "to": self.version, "records_written": written}

    def set_quota(self, quota: int | None) -> None:
        """Record ``quota`` (bytes, None for none) in ``config`` (atomically replaced) and use it."""
        if quota is not None and (not isinstance(quota, int) or quota < 0):
            raise UsageError(f"quota must be a byte count >= 0, got {quota!r}")
        cfg = dict(self.config, quota=quota)
        self._write_config(cfg)
        self.config, self.quota = cfg, quota

    @contextlib.contextmanager
    def _tx(self, durable: bool = False) -> Iterator[sqlite3.Connection]:
        """One ``BEGIN IMMEDIATE`` transaction (the write lock across processes), committed on success.

        The index runs with ``synchronous=NORMAL`` (WAL: a commit survives a crash of the process,
        the last ones may be lost with the power); ``durable`` commits with ``synchronous=FULL``,
        which also makes every earlier commit durable. Ref commits and gc's sweeps are durable, so
        that no pack is deleted on the strength of an index change the disk has not kept.
        """
        with self._lock:
            if durable:
                self._db.execute("PRAGMA synchronous=FULL")
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
            finally:
                if durable:
                    self._db.execute("PRAGMA synchronous=NORMAL")

    def _q(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        with self._lock:
            return list(self._db.execute(sql, args))

    def close(self) -> None:
        """Close the index and the pack handles. Safe to call twice."""
        with self._lock:
            self._db.close()
        self.packs.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def lease(self, lease_id: str | None = None) -> Lease:
        """A new (or re-joined, by id) lease for a writer; release it when done."""
        return Lease(self, lease_id)

    # ---- reading chunks ----------------------------------------------------------------------
    def has(self, digest: bytes) -> bool:
        """Whether the index holds chunk ``digest`` (as a pack frame or, format v2, a recipe)."""
        return bool(self._q("SELECT 1 FROM chunks WHERE digest=?", (digest,))
                    or self._q("SELECT 1 FROM recipes WHERE digest=?", (digest,)))

    def read_chunk(self, digest: bytes) -> bytes:
        """The bytes of chunk ``digest``, checked against it.

        Raises
        ------
        IntegrityError
            The chunk is missing, or its frame or bytes do not match (a damaged pack); for a chunk
            kept as a recipe (format v2): a piece is missing, or the bytes rebuilt from the pieces
            do not hash to ``digest`` (the message names the damaged piece).
        """
        for attempt in range(3):
            rows = self._q("SELECT pack, offset, length FROM chunks WHERE digest=?", (digest,))
            if not rows:
                recipe = self._q("SELECT length, pieces FROM recipes WHERE digest=?", (digest,))
                if recipe:
                    return self._read_recipe(digest, int(recipe[0][0]), bytes(recipe[0][1]))
                raise IntegrityError(f"chunk {digest.hex()} is missing from the store")
            pack, offset, length = rows[0]
            try:
                raw = self.packs.get_range(pack, offset - FRAME_HEADER, length + FRAME_HEADER)
            except FileNotFoundError:
                if attempt < 2:
                    continue  # moved by a concurrent repack: look it up again
                raise IntegrityError(f"chunk {digest.hex()}: pack {pack} is missing") from None
            head_digest, head_len = parse_frame_header(raw[:FRAME_HEADER])
            data = raw[FRAME_HEADER:]
            if head_digest != digest or head_len != length or chunk_digest(data) != digest:
                raise IntegrityError(f"chunk {digest.hex()} in pack {pack} at {offset} is damaged")
            return data
        raise AssertionError("unreachable")

    def _read_recipe(self, digest: bytes, length: int, blob: bytes) -> bytes:
        """Chunk ``digest`` (``length`` bytes) rebuilt from the pieces its recipe ``blob`` names,
        adjacent pieces of one pack read with one ranged read, the result checked against ``digest``.

        Raises
        ------
        IntegrityError
            As :meth:`read_chunk`.
        """
        pieces = blob_to_recipe(blob)
        if sum(n for _, n in pieces) != length:
            raise IntegrityError(f"chunk {digest.hex()}: its recipe does not add up to its length")
        return self.assemble(digest, pieces)

    def recipe(self, digest: bytes) -> list[tuple[bytes, int]] | None:
        """The recipe of chunk ``digest`` (format v2): ``[(piece digest, length in bytes), ...]``, or None
        when the store keeps that chunk whole (or lacks it).

        Raises
        ------
        IntegrityError
            A damaged recipe row.
        """
        rows = self._q("SELECT length, pieces FROM recipes WHERE digest=?", (digest,))
        if not rows:
            return None
        pieces = blob_to_recipe(bytes(rows[0][1]))
        if sum(n for _, n in pieces) != int(rows[0][0]):
            raise IntegrityError(f"chunk {digest.hex()}: its recipe does not add up to its length")
        return pieces

    def assemble(self, digest: bytes, pieces: Sequence[tuple[bytes, int]],
                 given: dict[bytes, bytes | memoryview] | None = None) -> bytes:
        """Chunk ``digest`` rebuilt from ``pieces`` (``[(piece digest, length), ...]``, in order): a
        piece in ``given`` (digest -> bytes the caller has checked against that digest, e.g. just
        received) from there, every other one from its pack frame (adjacent frames of one pack read
        with one ranged read); the result is checked against ``digest``.

        What a read of a chunk kept as a recipe does, and what a receiver of a piece-level push or
        pull (:mod:`tb5sync.remote.storeclient`) does before it records a recipe it was sent.

        Raises
        ------
        IntegrityError
            A piece is neither given nor in the store, a frame is damaged, or the rebuilt bytes do
            not hash to ``digest`` (the message names the damaged piece when one is).
        """
        given = given or {}
        for attempt in range(3):
            where = self.locate(d for d, _ in pieces if d not in given)
            out = bytearray()
            runs: list[tuple[str, int, int, list[tuple[bytes, int]]]] = []  # (pack, start, end, pieces)
            try:
                # runs of adjacent frames, flushed in order; a given piece is a run of its own ("")
                for d, n in pieces:
                    g = given.get(d)
                    if g is not None:
                        if len(g) != n:
                            raise IntegrityError(f"chunk {digest.hex()}: piece {d.hex()} is {len(g)} bytes, "
                                                 f"its recipe says {n}")
                        runs.append(("", 0, 0, [(d, n)]))
                        continue
                    loc = where.get(d)
                    if loc is None or loc[2] != n:
                        raise IntegrityError(f"chunk {digest.hex()}: piece {d.hex()} is missing from the store")
                    pack, off, _ = loc
                    if runs and runs[-1][0] == pack and runs[-1][2] == off - FRAME_HEADER:
                        runs[-1][3].append((d, n))
                        runs[-1] = (pack, runs[-1][1], off + n, runs[-1][3])
                    else:
                        runs.append((pack, off - FRAME_HEADER, off + n, [(d, n)]))
                for pack, start, end, ps in runs:
                    if not pack:
                        out += given[ps[0][0]]
                        continue
                    raw = memoryview(self.packs.get_range(pack, start, end - start))
                    pos = 0
                    for d, n in ps:
                        head_digest, head_len = parse_frame_header(raw[pos : pos + FRAME_HEADER])
                        if head_digest != d or head_len != n:
                            raise IntegrityError(f"chunk {digest.hex()}: piece {d.hex()} in pack {pack} is damaged")
                        out += raw[pos + FRAME_HEADER : pos + FRAME_HEADER + n]
                        pos += FRAME_HEADER + n
            except FileNotFoundError:
                if attempt < 2:
                    continue  # a piece moved by a concurrent repack: look them up again
                raise IntegrityError(f"chunk {digest.hex()}: a pack of its pieces is missing") from None
            if chunk_digest(out) != digest:
                pos = 0
                for d, n in pieces:  # name the damaged piece
                    if chunk_digest(memoryview(out)[pos : pos + n]) != d:
                        if d in given:
                            raise IntegrityError(f"chunk {digest.hex()}: piece {d.hex()} as sent does not match "
                                                 "its digest")
                        raise IntegrityError(f"chunk {digest.hex()}: piece {d.hex()} in pack {where[d][0]} "
                                             f"at {where[d][1]} is damaged")
                    pos += n
                raise IntegrityError(f"chunk {digest.hex()}: rebuilt from its pieces, it does not match its digest")
            return bytes(out)
        raise AssertionError("unreachable")

    def stored_need(self, chunks: dict[bytes, int]) -> int:
        """Bytes the distinct ``chunks`` (digest -> length) take in this store's packs, each frame once,
        plus a pack header: a chunk kept as a frame (or not stored yet) framed whole, a chunk kept as
        a recipe (format v2) by its distinct pieces' frames and its recipe record's frame. What the
        quota's "can this ever fit" check of a ref counts (:func:`~tb5sync.store.index.check_entry_fits`).
        """
        if self.version < 2:
            return stored_size(chunks.values())
        frames: dict[bytes, int] = {}
        ds = list(chunks)
        for k in range(0, len(ds), 500):
            part = ds[k : k + 500]
            marks = ",".join("?" * len(part))
            whole = {bytes(d) for (d,) in self._q(f"SELECT digest FROM chunks WHERE digest IN ({marks})", part)}
            recipes = {bytes(d): bytes(b) for d, b in
                       self._q(f"SELECT digest, pieces FROM recipes WHERE digest IN ({marks})", part)}
            for d in part:
                blob = recipes.get(d) if d not in whole else None
                if blob is None:
                    frames[d] = chunks[d]
                    continue
                for p, n in blob_to_recipe(blob):
                    frames[p] = n
                frames[d + b"record"] = 44 + len(blob)  # its recipe record (pieces.recipe_record)
        return stored_size(frames.values())

    def locate(self, digests: Iterable[bytes]) -> dict[bytes, tuple[str, int, int]]:
        """Where each of ``digests`` is: ``{digest: (pack, offset, length)}`` (missing ones, and chunks kept as
        recipes, left out: :meth:`read_at` reads those by :meth:`read_chunk`), 500 per query."""
        ds = list(dict.fromkeys(digests))
        out: dict[bytes, tuple[str, int, int]] = {}
        for k in range(0, len(ds), 500):
            part = ds[k : k + 500]
            rows = self._q(f"SELECT digest, pack, offset, length FROM chunks WHERE digest IN ({','.join('?' * len(part))})", part)
            out.update((bytes(d), (p, o, n)) for d, p, o, n in rows)
        return out

    def read_at(self, digest: bytes, where: tuple[str, int, int] | None) -> bytes:
        """Chunk ``digest`` read from ``where`` (from :meth:`locate`), checked; looked up again if it moved.

        Raises
        ------
        IntegrityError
            As :meth:`read_chunk`.
        """
        if where is not None:
            pack, offset, length = where
            try:
                raw = self.packs.get_range(pack, offset - FRAME_HEADER, length + FRAME_HEADER)
            except (FileNotFoundError, IntegrityError):
                return self.read_chunk(digest)  # moved by a repack since it was located
            head_digest, head_len = parse_frame_header(raw[:FRAME_HEADER])
            data = raw[FRAME_HEADER:]
            if head_digest == digest and head_len == length and chunk_digest(data) == digest:
                return data
        return self.read_chunk(digest)

    def iter_chunks(self, digests: Sequence[bytes], ahead: int = 4) -> Iterator[bytes]:
        """The bytes of each of ``digests`` in order, read and checked ``ahead`` at a time in the hash pool."""
        pool = hash_pool()
        futs: list[Any] = []
        i = 0
        while i < len(digests) or futs:
            while i < len(digests) and len(futs) < ahead:
                futs.append(pool.submit(self.read_chunk, digests[i]))
                i += 1
            yield futs.pop(0).result()

    def iter_chunk_views(self, digests: Sequence[bytes], ahead: int = 8) -> Iterator[bytes | list[memoryview]]:
        """The bytes of each of ``digests`` in order, each checked against its digest, for a caller
        that only writes them out (``store get``): per chunk either ``bytes`` or a list of
        memoryviews whose concatenation is the chunk.

        With packs in a local directory (:class:`~tb5sync.store.packs.LocalPackStorage`) the
        chunks' frames and pieces are located with one index query per 500 digests (a window of
        :data:`VIEW_WINDOW` chunks at a time), their packs mapped read-only (``mmap``; packs are
        immutable and a mapping outlives a concurrent repack's unlink), and each chunk is hashed
        in the hash pool straight from the mapping, ``ahead`` chunks ahead of the caller: no copy
        into a buffer, no query per chunk. A chunk whose frames cannot be used so (moved by a
        repack since it was located, a damaged frame) is read by :meth:`read_chunk`, which raises
        the precise ``IntegrityError``. Other pack storages: :meth:`iter_chunks`.

        The views stay valid while the caller holds them (each keeps its mapping alive).
        """
        if not isinstance(self.packs, LocalPackStorage):
            yield from self.iter_chunks(digests, ahead)
            return
        maps = _PackMaps(self.packs)
        pool = hash_pool()
        futs: list[Any] = []
        plans = self._view_plans(digests)
        for d, segs in plans:
            futs.append(pool.submit(self._chunk_views, maps, d, segs))
            if len(futs) > ahead:
                yield futs.pop(0).result()
        while futs:
            yield futs.pop(0).result()

    def _view_plans(self, digests: Sequence[bytes]) -> Iterator[tuple[bytes, list[tuple[bytes, str, int, int]] | None]]:
        """Per chunk of ``digests``: its frames ``[(frame digest, pack, data offset, length), ...]`` (one
        whole frame, or its recipe's pieces), None when it has neither (read_chunk says why)."""
        for k in range(0, len(digests), VIEW_WINDOW):
            window = digests[k : k + VIEW_WINDOW]
            frames = self.locate(window)
            rest = list(dict.fromkeys(d for d in window if d not in frames))
            recipes: dict[bytes, list[tuple[bytes, int]]] = {}
            for j in range(0, len(rest), 500):
                part = rest[j : j + 500]
                for d, blob in self._q(f"SELECT digest, pieces FROM recipes WHERE digest IN ({','.join('?' * len(part))})",
                                       part):
                    recipes[bytes(d)] = blob_to_recipe(bytes(blob))
            where = self.locate(p for r in recipes.values() for p, _ in r) if recipes else {}
            for d in window:
                f = frames.get(d)
                if f is not None:
                    yield d, [(d, f[0], f[1], f[2])]
                    continue
                r = recipes.get(d)
                segs: list[tuple[bytes, str, int, int]] | None = []
                for p, n in r or ():
                    loc = where.get(p)
                    if loc is None or loc[2] != n:
                        segs = None
                        break
                    segs.append((p, loc[0], loc[1], n))  # type: ignore[union-attr]
                yield d, (segs if r and segs else None)

    def _chunk_views(self, maps: _PackMaps, digest: bytes, segs: list[tuple[bytes, str, int, int]] | None
                     ) -> bytes | list[memoryview]:
        """Chunk ``digest`` as views of its mapped frames ``segs``, each frame header and the whole
        chunk's BLAKE3 checked; else (no plan, a pack gone, any mismatch) :meth:`read_chunk`."""
        if segs is None:
            return self.read_chunk(digest)
        try:
            views = []
            for p, pack, off, n in segs:
                mv = maps.view(pack)
                if off + n > len(mv) or off < FRAME_HEADER or parse_frame_header(mv[off - FRAME_HEADER : off]) != (p, n):
                    return self.read_chunk(digest)
                views.append(mv[off : off + n])
            if len(views) == 1:
                got = _blake3.blake3(views[0]).digest()
            else:
                # BLAKE3 fed piece by piece runs at a third of its speed (each update starts off a
                # 1 KiB chunk boundary, so few chunks are hashed side by side); gathered into this
                # thread's scratch buffer first, the copy plus one update costs less
                got = _blake3.blake3(_gather(views)).digest()
        except (OSError, ValueError):
            return self.read_chunk(digest)
        if got != digest:
            return self.read_chunk(digest)  # names the damaged frame or piece
        return views

    # ---- refs --------------------------------------------------------------------------------
    def _ref_row(self, name: str) -> RefInfo | None:
        rows = self._q("SELECT name, manifest, mchunks, created, size, files, description, pinned, last_used "
                       "FROM refs WHERE name=?", (name,))
        return _ref_of(rows[0]) if rows else None

    def ref(self, name: str) -> RefInfo:
        """The ref ``name``.

        Raises
        ------
        RefNotFoundError
            No such ref.
        """
        info = self._ref_row(check_ref_name(name))
        if info is None:
            raise RefNotFoundError(f"no ref {name!r} in store {self.label}")
        return info

    def refs(self, prefix: str = "") -> list[RefInfo]:
        """Refs whose name starts with ``prefix`` (plain string prefix), sorted by name."""
        rows = self._q("SELECT name, manifest, mchunks, created, size, files, description, pinned, last_used "
                       "FROM refs ORDER BY name")
        return [_ref_of(r) for r in rows if r[0].startswith(prefix)]

    def manifest(self, name_or_info: str | RefInfo, touch: bool = True) -> list[Item]:
        """The checked manifest of a ref (each chunk verified, the object digest too)."""
        info = name_or_info if isinstance(name_or_info, RefInfo) else self.ref(name_or_info)
        items = self.read_manifest(info.manifest, list(info.mchunks), f"manifest of ref {info.name!r}")
        if touch:
            self.touch(info.name)
        return items

    def read_manifest(self, digest: bytes, mchunks: Sequence[ChunkRef], where: str = "manifest",
                      parallel: bool = True) -> list[Item]:
        """Read a manifest object (chunks ``mchunks``, object digest ``digest``) and check it.

        ``parallel=False`` reads in the calling thread (required while holding a transaction).

        Raises
        ------
        IntegrityError
            A chunk is missing or damaged, the object digest differs, or the manifest is malformed.
        """
        return self._manifest_entry(digest, mchunks, where, parallel)[0]

    def _manifest_entry(self, digest: bytes, mchunks: Sequence[ChunkRef], where: str,
                        parallel: bool = True) -> tuple[list[Item], dict[bytes, Item]]:
        with self._lock:
            hit = self._manifests.get(digest)
            if hit is not None:
                self._manifests.move_to_end(digest)
                return hit
        if file_digest(d for d, _ in mchunks) != digest:
            raise IntegrityError(f"{where}: chunk list does not match the manifest digest")
        if parallel:
            data = b"".join(self.iter_chunks([d for d, _ in mchunks]))
        else:  # in this thread: the caller may hold the index lock, which the pool's threads would wait for
            data = b"".join(self.read_chunk(d) for d, _ in mchunks)
        items = decode_manifest(data, where)
        entry = (items, {it.path: it for it in items})
        with self._lock:
            self._manifests[digest] = entry
            while len(self._manifests) > 8:
                self._manifests.popitem(last=False)
        return entry

    def touch(self, name: str) -> None:
        """Mark ref ``name`` used now (the LRU order of quota eviction; a use within the last 0.1 s is not rewritten)."""
        now = time.time()
        if any(now - t < 0.1 for (t,) in self._q("SELECT last_used FROM refs WHERE name=?", (name,))):
            return
        with self._tx() as db:
            db.execute("UPDATE refs SET last_used=? WHERE name=?", (time.time(), name))

    def rm(self, name: str, force: bool = False) -> None:
        """Remove ref ``name``; its chunks go at the next :meth:`gc` unless another ref holds them.

        A pinned ref is removed only with ``force`` (a pin protects a ref from quota eviction and from rm).

        Raises
        ------
        RefNotFoundError
        RefPinnedError
            ``name`` is pinned and ``force`` is False.
        """
        check_ref_name(name)
        with self._tx() as db:
            row = db.execute("SELECT pinned FROM refs WHERE name=?", (name,)).fetchone()
            if row is None:
                raise RefNotFoundError(f"no ref {name!r} in store {self.label}")
            if row[0] and not force:
                raise pinned_error(name, self.label)
            db.execute("DELETE FROM refs WHERE name=?", (name,))

    def nested_ref(self, name: str) -> str | None:
        """An existing ref whose name is a path prefix of ``name`` (``a`` for ``a/b``) or has ``name`` as
        one (``a/b/c``), or None. Such refs cannot coexist: the path view of a store
        (:mod:`tb5sync.fs.storefs`) would hide the outer ref's files under the inner one."""
        for anc in ref_ancestors(name):
            if self._ref_row(anc) is not None:
                return anc
        kids = self.refs(name + "/")
        return kids[0].name if kids else None

    def check_nesting(self, name: str) -> None:
        """Raise :class:`RefExistsError` if ``name`` would nest with an existing ref (:meth:`nested_ref`)."""
        other = self.nested_ref(name)
        if other is not None:
            raise nesting_error(name, other, f"store {self.label}")

    def pin(self, name: str, pinned: bool = True) -> None:
        """Pin (or unpin) ref ``name``: a pinned ref and all it reaches are never evicted.

        Raises
        ------
        RefNotFoundError
        """
        check_ref_name(name)
        with self._tx() as db:
            if db.execute("UPDATE refs SET pinned=? WHERE name=?", (int(pinned), name)).rowcount == 0:
                raise RefNotFoundError(f"no ref {name!r} in store {self.label}")

    def commit_ref(self, lease: Lease, name: str, manifest: bytes, mchunks: Sequence[ChunkRef], items: Sequence[Item],
                   description: str | None = None, replace: bool = False, created: float | None = None) -> RefInfo:
        """Point ``name`` at a manifest whose chunks are all in the store, and release ``lease``.

        Raises
        ------
        RefExistsError
            ``name`` exists and ``replace`` is False.
        IntegrityError
            Some chunk of the manifest or of its files is not in the store.
        EntryTooLargeError
            The distinct chunks the ref reaches, framed as in a pack, exceed the store's quota
            (:func:`tb5sync.store.gc.check_entry_fits`): the ref is not written, nothing is evicted.
        """
        check_ref_name(name)
        size = sum(it.size for it in items if it.kind == "f")
        files = sum(1 for it in items if it.kind == "f")
        needed = {d: n for d, n in mchunks}
        for it in items:
            needed.update(it.chunks)
        if self.quota is not None:
            check_entry_fits(self.quota, self.stored_need(needed), f"ref {name!r}")
        now = time.time()
        with self._tx(durable=True) as db:
            old = db.execute("SELECT pinned FROM refs WHERE name=?", (name,)).fetchone()
            if old is not None and not replace:
                raise RefExistsError(f"ref {name!r} already exists in store {self.label} with other content "
                                     "(--force replaces it)")
            anc = ref_ancestors(name)
            other = db.execute("SELECT name FROM refs WHERE name IN (%s) OR substr(name, 1, ?) = ? LIMIT 1"
                               % ",".join("?" * len(anc)), (*anc, len(name) + 1, name + "/")).fetchone()
            if other is not None:
                raise nesting_error(name, other[0], f"store {self.label}")
            require_indexed(db, needed, f"ref {name!r}")
            db.execute("INSERT OR REPLACE INTO refs VALUES (?,?,?,?,?,?,?,?,?)",
                       (name, manifest, refs_to_blob(mchunks), created or now, size, files, description,
                        old[0] if old else 0, now))
            _drop_lease(db, lease.id)
        return self.ref(name)

    # ---- put ---------------------------------------------------------------------------------
    def put(self, name: str, src: str | os.PathLike[str], description: str | None = None,
            replace: bool = False, exclude: Sequence[str] = ()) -> RefInfo:
        """Store the directory, file or symlink ``src`` as ref ``name``, reading each file once.

        Each file is read in windows, cut into FastCDC v1 chunks, hashed (BLAKE3) and only the
        chunks the store lacks are appended to packs. The ref appears only once every chunk is
        in place; an interrupted put leaves no ref (its packs are collected by :meth:`gc`).

        If ``name`` exists with the very same manifest (same paths, content, modes and mtimes) nothing
        changes and the existing ref is returned (as push and pull of an identical ref): compare its
        ``manifest`` with the one seen before to tell.

        Raises
        ------
        UsageError
            Bad ref name, or ``src`` missing.
        RefExistsError
            ``name`` exists with other content and ``replace`` is False (found once ``src`` is read);
            or ``name`` would nest with another ref (:meth:`nested_ref`).
        SourceChangedError
            A file changed while it was read.
        EntryTooLargeError
            The ref needs more stored bytes than the quota (checked as its new chunks are written
            and, for all it reaches, before the ref is written): no ref is written, nothing is
            evicted; what was written for it goes at the next gc.

        ``exclude`` takes rsync's exclude patterns (:class:`tb5sync.tree.excludes.ExcludeRules`).
        """
        check_ref_name(name)
        rules = ExcludeRules(tuple(exclude))
        prev = self._ref_row(name)
        if prev is None:
            self.check_nesting(name)
        lease = self.lease()
        writer = PackWriter(self, lease)
        writer.limit = self.quota  # new bytes past the quota: this ref can never fit
        small: list[tuple[Item, bytes]] = []  # small files read, waiting to be chunked and stored together
        small_bytes = 0
        try:
            items = []
            for rel, st, full in walk(os.fspath(src), rules):
                mode, mtime = stat.S_IMODE(st.st_mode), st.st_mtime_ns
                if stat.S_ISDIR(st.st_mode):
                    items.append(Item(rel, "d", mode, 0, mtime))
                elif stat.S_ISLNK(st.st_mode):
                    target = os.readlink(os.fsencode(full))
                    items.append(Item(rel, "l", mode, len(target), mtime, target=target))
                elif st.st_size <= SMALL_FILE:
                    it = Item(rel, "f", mode, st.st_size, mtime)
                    items.append(it)
                    small.append((it, _read_small(full, st)))
                    small_bytes += st.st_size
                    if small_bytes >= SMALL_BATCH or len(small) >= 4096:
                        self._store_small(small, lease, writer)
                        small, small_bytes = [], 0
                else:
                    refs = self._put_file(full, st, lease, writer)
                    items.append(Item(rel, "f", mode, st.st_size, mtime, digest=file_digest(d for d, _ in refs),
                                      chunks=refs))
            self._store_small(small, lease, writer)
            mdigest, mrefs = self.put_bytes(encode_manifest(items), lease, writer)
            writer.flush()
            if prev is not None and prev.manifest == mdigest and not (replace and description != prev.description):
                lease.release()  # this very snapshot is here already: nothing to change
                return prev
            info = self.commit_ref(lease, name, mdigest, mrefs, items, description, replace)
        except BaseException:
            writer.abort()
            with contextlib.suppress(Exception):
                lease.release()
            raise
        self.enforce_quota(keep=name)
        return info

    def put_bytes(self, data: bytes, lease: Lease, writer: PackWriter) -> tuple[bytes, list[ChunkRef]]:
        """Store ``data`` as chunks under ``lease``; returns ``(object digest, chunk list)``."""
        mv = memoryview(data)
        refs = self._store_window(mv, cut_buffer(mv, self.params, True), lease, writer)
        return file_digest(d for d, _ in refs), refs

    def _store_small(self, files: list[tuple[Item, bytes]], lease: Lease, writer: PackWriter) -> None:
        """Chunk, hash and store many small files with one lease transaction (sets their chunks and digests)."""
        if not files:
            return
        spans: list[tuple[int, int, int]] = []  # (file index, start, end)
        for k, (_, data) in enumerate(files):
            prev = 0
            for c in cut_buffer(memoryview(data), self.params, True):
                spans.append((k, prev, c))
                prev = c
        views = [memoryview(data) for _, data in files]
        pool = hash_pool()
        digests = list(pool.map(lambda sp: chunk_digest(views[sp[0]][sp[1] : sp[2]]), spans, chunksize=64))
        fresh = list(dict.fromkeys(d for d in digests if d not in writer.known))
        have = dict(zip(fresh, lease.protect(fresh))) if fresh else {}
        for it, _ in files:
            it.chunks = []
        adds: list[tuple[bytes, memoryview, None]] = []
        for d, (k, a, b) in zip(digests, spans):
            if not have.get(d, True):
                adds.append((d, views[k][a:b], None))
                have[d] = True
            files[k][0].chunks.append((d, b - a))
        writer.add_many(adds)  # the pieces of all their new chunks looked up in one transaction
        for it, _ in files:
            it.digest = file_digest(d for d, _ in it.chunks)

    def _store_window(self, mv: memoryview, cuts: list[int], lease: Lease, writer: PackWriter,
                      digests: list[bytes] | None = None) -> list[ChunkRef]:
        spans = []
        prev = 0
        for c in cuts:
            spans.append((prev, c))
            prev = c
        if digests is None:
            digests = _hash_spans(mv, spans)
        fresh = [d for d in digests if d not in writer.known]
        have = dict(zip(fresh, lease.protect(fresh))) if fresh else {}
        todo = []
        for d, (s, e) in zip(digests, spans):
            if not have.get(d, True):
                todo.append((d, s, e))
                have[d] = True
        pp = writer.pieces
        if pp is not None and todo and all(e - s < SPLIT_MIN for _, s, e in todo):
            for d, s, e in todo:  # no chunk to split into pieces: nothing for the pool
                writer.add(d, mv[s:e], None)
        elif pp is not None and todo:  # format v2: cut and hash the new chunks' pieces in the pool
            cuts = hash_pool().map(lambda t: split(mv[t[1] : t[2]], pp) if t[2] - t[1] >= SPLIT_MIN else None, todo)
            writer.add_many([(d, mv[s:e], pieces) for (d, s, e), pieces in zip(todo, cuts)])
        else:
            for d, s, e in todo:
                writer.add(d, mv[s:e])
        return [(d, e - s) for d, (s, e) in zip(digests, spans)]

    def _put_file(self, full: str, st: os.stat_result, lease: Lease, writer: PackWriter) -> list[ChunkRef]:
        """Store the file ``full`` (``st``: its stat when walked) window by window: a reader thread
        reads, cuts and hashes window k+1 (into the other of two buffers) while this thread looks
        up, cuts into pieces and writes window k. Raises SourceChangedError when the file changed."""
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(full, flags)
        refs: list[ChunkRef] = []
        try:
            fst = os.fstat(fd)
            if (fst.st_ino, fst.st_size, fst.st_mtime_ns) != (st.st_ino, st.st_size, st.st_mtime_ns):
                raise SourceChangedError(full)
            size = READ_WINDOW + self.params.max_size
            bufs: list[bytearray | None] = [bytearray(size), bytearray(size) if st.st_size > READ_WINDOW else None]
            total = 0
            with open(fd, "rb", buffering=0, closefd=False) as f, \
                    concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tb5-put-read") as reader:
                fut = reader.submit(_read_window, f, bufs[0], None, 0, self.params)  # type: ignore[arg-type]
                k = 0
                while True:
                    view, have, n, final, cuts, digests = fut.result()
                    total += n
                    last = cuts[-1] if cuts else 0
                    if not final:  # the next window starts with this one's tail
                        nxt = bufs[(k + 1) % 2]
                        if nxt is None:  # the file grew past one window since it was walked
                            nxt = bufs[(k + 1) % 2] = bytearray(size)
                        fut = reader.submit(_read_window, f, nxt, view[last:have], have - last, self.params)
                    refs += self._store_window(view, cuts, lease, writer, digests)
                    if final:
                        break
                    k += 1  # window k+1 is read into the buffer this one's tail was copied from
            after = os.fstat(fd)
        finally:
            os.close(fd)
        if total != st.st_size or (after.st_size, after.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
            raise SourceChangedError(full)
        return refs

    # ---- reading files -----------------------------------------------------------------------
    def item(self, name: str, path: str | bytes, touch: bool = True) -> Item:
        """The manifest entry of ``path`` (``""`` for the root) in ref ``name``.

        Raises
        ------
        RefNotFoundError
            No such ref, or no such path in it.
        """
        bpath = os.fsencode(path).strip(b"/") if path else b""
        info = self.ref(name)
        if touch:
            self.touch(info.name)
        it = self._manifest_entry(info.manifest, info.mchunks, f"manifest of ref {name!r}")[1].get(bpath)
        if it is not None:
            return it
        raise RefNotFoundError(f"no path {os.fsdecode(bpath)!r} in ref {name!r}")

    def read_range(self, item: Item, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes ``[offset, offset+length)`` of a file entry (to its end when ``length`` is None), chunks checked.

        Raises
        ------
        UsageError
            Negative offset or length, or not a file.
        IntegrityError
            A chunk is missing or damaged.
        """
        if item.kind != "f":
            raise UsageError(f"{os.fsdecode(item.path)!r} is not a file")
        if offset < 0 or (length is not None and length < 0):
            raise UsageError("offset and length must be >= 0")
        end = item.size if length is None else min(item.size, offset + length)
        out = bytearray()
        pos = 0
        want = []
        for d, n in item.chunks:
            if pos + n > offset and pos < end:
                want.append((d, pos))
            pos += n
        for (d, start), data in zip(want, self.iter_chunks([d for d, _ in want])):
            lo = max(offset, start) - start
            hi = min(end, start + len(data)) - start
            out += data[lo:hi]
        return bytes(out)

    def cat(self, name: str, path: str | bytes = "", offset: int = 0, length: int | None = None,
            touch: bool = True) -> bytes:
        """Bytes of file ``path`` in ref ``name`` (see :meth:`read_range`; ``""``, the default, is the root:
        the file of a single-file ref); ``touch`` records the use.

        Raises
        ------
        UsageError
            ``path`` is not a file of the ref (a directory: give a file's path).
        """
        it = self.item(name, path, touch)
        if it.kind != "f":
            what = f"path {os.fsdecode(it.path)!r}" if it.path else "the root"
            kind = {"d": "a directory", "l": "a symlink"}.get(it.kind, "not a file")
            raise UsageError(f"{what} of ref {name!r} is {kind}, not a file: give a file's path "
                             "(store cat REF PATH)")
        return self.read_range(it, offset, length)

    def get(self, name: str, dest: str | os.PathLike[str], replace: bool = False, hardlink: bool = False) -> RefInfo:
        """Materialise ref ``name`` at ``dest`` atomically (see :func:`tb5sync.store.materialise.materialise`)."""
        from tb5sync.store.materialise import materialise

        info = self.ref(name)
        materialise(self, self.manifest(info), os.fspath(dest), replace=replace, hardlink=hardlink)
        return info

    def diff(self, a: str, b: str) -> list[tuple[str, str]]:
        """Paths that differ between refs ``a`` and ``b``: ``("+", path)`` only in b, ``("-", path)`` only
        in a, ``("M", path)`` content, kind or target differs, ``("m", path)`` mode or mtime only."""
        ma = {it.path: it for it in self.manifest(a, touch=False)}
        mb = {it.path: it for it in self.manifest(b, touch=False)}
        out = []
        for p in sorted(set(ma) | set(mb)):
            x, y = ma.get(p), mb.get(p)
            s = os.fsdecode(p) or "."
            if x is None:
                out.append(("+", s))
            elif y is None:
                out.append(("-", s))
            elif (x.kind, x.digest, x.target) != (y.kind, y.digest, y.target):
                out.append(("M", s))
            elif (x.mode, x.mtime_ns) != (y.mode, y.mtime_ns) and x.kind != "d":
                out.append(("m", s))
        return out

    # ---- keyed blobs (blobs.py) ----
    def put_blob(self, key: str, src: str | os.PathLike[str] | bytes) -> Any:
        """Store a file or bytes as blob ``key``; see :func:`tb5sync.store.blobs.put_blob`."""
        from tb5sync.store.blobs import put_blob

        return put_blob(self, key, src)

    def blob(self, key: str, touch: bool = True) -> Any:
        """Blob ``key`` (a :class:`tb5sync.store.blobs.BlobInfo`) or None; see :func:`tb5sync.store.blobs.blob`."""
        from tb5sync.store.blobs import blob

        return blob(self, key, touch)

    def delete_blob(self, key: str) -> bool:
        """Remove blob ``key``; whether it was there. See :func:`tb5sync.store.blobs.delete_blob`."""
        from tb5sync.store.blobs import delete_blob

        return delete_blob(self, key)

    # ---- housekeeping (gc.py) ----------------------------------------------------------------
    def gc(self, repack_below: float = 0.5) -> dict[str, Any]:
        """Sweep chunks no ref or live writer needs and repack sparse packs; see :func:`tb5sync.store.gc.gc`."""
        from tb5sync.store.gc import gc

        return gc(self, repack_below)

    def verify(self) -> dict[str, Any]:
        """Re-hash every chunk of every pack and report damage per ref; see :func:`tb5sync.store.gc.verify`."""
        from tb5sync.store.gc import verify

        return verify(self)

    def reindex(self) -> dict[str, int]:
        """Rebuild the chunk index from the packs; see :func:`tb5sync.store.gc.reindex`."""
        from tb5sync.store.gc import reindex

        return reindex(self)

    def enforce_quota(self, keep: str | None = None, keep_blobs: Iterable[str] = ()) -> list[str]:
        """Over the quota, evict unpinned refs and blobs, least recently used first, down to the
        low-water mark (never ``keep`` nor ``keep_blobs``); see :func:`tb5sync.store.gc.enforce_quota`."""
        from tb5sync.store.gc import enforce_quota

        return enforce_quota(self, keep, keep_blobs)

    def stats(self) -> dict[str, Any]:
        """Refs, keyed blobs and their bytes, logical bytes (sum of ref sizes), unique chunk bytes, stored bytes (pack files), dedup ratio, counts.

        ``chunks`` counts pack frames (format v2: pieces, small chunks and the recipes' records),
        ``unique_bytes`` their content bytes (the records left out: ``record_bytes``, 44 + 36 per piece
        for each recipe), ``recipes`` the chunks kept as recipes of pieces (0 in a v1 store),
        ``format`` the store format version.
        """
        with self._lock:
            logical, files = self._db.execute("SELECT COALESCE(SUM(size),0), COALESCE(SUM(files),0) FROM refs").fetchone()
            unique, nchunks = self._db.execute("SELECT COALESCE(SUM(length),0), COUNT(*) FROM chunks").fetchone()
            stored, npacks = self._db.execute("SELECT COALESCE(SUM(size),0), COUNT(*) FROM packs").fetchone()
            nrefs = self._db.execute("SELECT COUNT(*) FROM refs").fetchone()[0]
            nblobs, blob_bytes = self._db.execute("SELECT COUNT(*), COALESCE(SUM(size),0) FROM blobs").fetchone()
            nrecipes, record_bytes = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(44 + length(pieces)), 0) FROM recipes").fetchone()
        unique = max(0, unique - record_bytes)  # content only: each recipe's record frame left out
        return {"format": self.version, "recipes": nrecipes, "record_bytes": record_bytes, "refs": nrefs, "blobs": nblobs, "blob_bytes": blob_bytes, "files": files, "logical_bytes": logical, "unique_bytes": unique,
                "stored_bytes": stored, "chunks": nchunks, "packs": npacks,
                "dedup_ratio": round(logical / unique, 3) if unique else 1.0, "quota": self.quota}

    def live_leases(self, db: sqlite3.Connection) -> list[str]:
        """Ids of leases whose writer may still run (same host: pid alive; any host: touched within LEASE_TTL)."""
        now = time.time()
        out = []
        for lid, host, pid, touched in db.execute("SELECT id, host, pid, touched FROM leases"):
            if now - touched > LEASE_TTL:
                continue
            if host == self.host and not _pid_alive(pid):
                continue
            out.append(lid)
        return out


#: Chunks located with one round of index queries by :meth:`Store.iter_chunk_views` (~256 MiB).
VIEW_WINDOW = 256



_scratch = threading.local()


def _gather(views: Sequence[memoryview]) -> memoryview:
    """``views`` copied one after another into this thread's scratch buffer (kept, grown as
    needed), as a view valid until this thread's next call."""
    n = sum(len(v) for v in views)
    buf = getattr(_scratch, "buf", None)
    if buf is None or len(buf) < n:
        buf = _scratch.buf = bytearray(max(n, 1 << 20))
    out = memoryview(buf)
    pos = 0
    for v in views:
        out[pos : pos + len(v)] = v
        pos += len(v)
    return out[:n]


def _hash_spans(mv: memoryview, spans: list[tuple[int, int]]) -> list[bytes]:
    """BLAKE3-256 of each ``(start, end)`` span of ``mv``: in the calling thread for a small entry
    (``len(mv) <= INLINE_HASH_MAX``: hashing it costs less than two thread hops), else in the hash pool."""
    if len(mv) <= INLINE_HASH_MAX:
        return [chunk_digest(mv[s:e]) for s, e in spans]
    return list(hash_pool().map(lambda se: chunk_digest(mv[se[0] : se[1]]), spans))


def _read_window(f: Any, buf: bytearray, tail: memoryview | None, keep: int, params: ChunkParams
                 ) -> tuple[memoryview, int, int, bool, list[int], list[bytes]]:
    """Fill ``buf``: first ``tail`` (``keep`` bytes carried from the previous window), then reads
    from ``f`` until full or end of file; cut and hash it. Returns ``(view, bytes in buf, bytes
    read, final, cuts, chunk digests)``."""
    view = memoryview(buf)
    if keep:
        assert tail is not None
        view[:keep] = tail
    have = keep
    n = 0
    while have < len(buf):
        r = f.readinto(view[have:])
        if not r:
            break
        have += r
        n += r
    final = have < len(buf)
    cuts = cut_buffer(view[:have], params, final)
    spans = []
    prev = 0
    for c in cuts:
        spans.append((prev, c))
        prev = c
    return view, have, n, final, cuts, _hash_spans(view, spans)



class _PackMaps:
    """Read-only mappings of the packs of a :class:`LocalPackStorage`, the last :attr:`MAX` used kept
    (a dropped one closes once no view of it is left). Thread-safe."""

    MAX = 64

    def __init__(self, packs: LocalPackStorage) -> None:
        self.packs = packs
        self._maps: OrderedDict[str, memoryview] = OrderedDict()
        self._lock = threading.Lock()

    def view(self, pack: str) -> memoryview:
        """A memoryview of the whole of pack ``pack``. Raises ``OSError`` (FileNotFoundError: gone)."""
        with self._lock:
            mv = self._maps.get(pack)
            if mv is not None:
                self._maps.move_to_end(pack)
                return mv
        import mmap

        fd = os.open(self.packs.path(pack), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            mv = memoryview(mmap.mmap(fd, 0, access=mmap.ACCESS_READ))
        finally:
            os.close(fd)
        with self._lock:
            self._maps[pack] = mv
            while len(self._maps) > self.MAX:
                self._maps.popitem(last=False)
        return mv


def _read_small(full: str, st: os.stat_result) -> bytes:
    """The whole content of a small file that ``lstat`` saw as ``st``.

    Raises
    ------
    SourceChangedError
        It is another file now, or its size or mtime changed while it was read.
    """
    fd = os.open(full, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        fst = os.fstat(fd)
        if (fst.st_ino, fst.st_size, fst.st_mtime_ns) != (st.st_ino, st.st_size, st.st_mtime_ns):
            raise SourceChangedError(full)
        parts = []
        got = 0
        while True:
            b = os.read(fd, st.st_size + 1 - got if got <= st.st_size else 1)
            if not b:
                break
            parts.append(b)
            got += len(b)
            if got > st.st_size:
                break
        after = os.fstat(fd)
    finally:
        os.close(fd)
    if got != st.st_size or (after.st_size, after.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
        raise SourceChangedError(full)
    return b"".join(parts)


def pinned_error(name: str, where: str) -> RefPinnedError:
    """The error for removing pinned ref ``name`` of store ``where`` (a label)."""
    return RefPinnedError(f"ref {name!r} in store {where} is pinned: run 'tb5sync store unpin {name}' first, "
                          "or rm --force")


def _ref_of(row: Sequence[Any]) -> RefInfo:
    return RefInfo(row[0], bytes(row[1]), tuple(blob_to_refs(bytes(row[2]))), row[3], row[4], row[5], row[6],
                   bool(row[7]), row[8])


def all_digests(items: Iterable[Item]) -> set[bytes]:
    """Every chunk digest the file entries of ``items`` reference."""
    out: set[bytes] = set()
    for it in items:
        out.update(d for d, _ in it.chunks)
    return out
