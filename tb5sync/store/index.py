"""What the store's helpers need of a store, as narrow interfaces, and the index check they share.

The helpers (:mod:`~tb5sync.store.writer`, :mod:`~tb5sync.store.materialise`,
:mod:`~tb5sync.store.blobs`, :mod:`~tb5sync.store.gc`) are handed an object with these
attributes (in practice a :class:`tb5sync.store.store.Store` or an object-store subclass) and
never import the facade, so the facade imports them and nothing imports back.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from tb5sync.errors import EntryTooLargeError, IntegrityError
from tb5sync.store.packs import FRAME_HEADER, PackStorage

if TYPE_CHECKING:
    from tb5sync.engine.hashing import ChunkRef
    from tb5sync.store.manifest import Item
    from tb5sync.store.writer import Lease, PackWriter

__all__ = ["PackIndex", "ChunkReader", "StoreCore", "require_indexed", "stored_size", "check_entry_fits"]


def stored_size(lengths: Iterable[int]) -> int:
    """Bytes that chunks of these ``lengths`` (each distinct) take in packs: each framed, plus one pack header."""
    return sum(n + FRAME_HEADER for n in lengths) + 8


def check_entry_fits(quota: int | None, need: int, what: str, limit: int | None = None) -> None:
    """Refuse an entry that can never fit: ``need`` bytes (as :func:`stored_size` counts them, or a
    body's length) over the store's ``quota`` or over ``limit`` (a cache's ``--max-entry-size``).

    Raises
    ------
    EntryTooLargeError
        ``need`` exceeds ``quota`` or ``limit`` (bytes); naming ``what``, the size and the bound.
    """
    for bound, name in ((limit, "the largest entry allowed"), (quota, "the store's quota")):
        if bound is not None and need > bound:
            raise EntryTooLargeError(f"{what} needs {need} bytes, more than {name} ({bound} bytes): refused, nothing evicted")


class PackIndex(Protocol):
    """What a lease and a pack writer need: the SQLite index (one transaction at a time), the
    pack storage, where temporary packs go, the target pack size in bytes, this host's name."""

    host: str
    tmp_dir: str
    pack_target: int
    packs: PackStorage

    def _tx(self, durable: bool = False) -> AbstractContextManager[sqlite3.Connection]: ...


class ChunkReader(Protocol):
    """What rebuilding a snapshot needs: where chunks are, and their bytes (verified)."""

    def locate(self, digests: Iterable[bytes]) -> dict[bytes, tuple[str, int, int]]: ...

    def read_at(self, digest: bytes, where: tuple[str, int, int] | None) -> bytes: ...

    def iter_chunks(self, digests: Sequence[bytes], ahead: int = 4) -> Iterator[bytes]: ...


class StoreCore(PackIndex, ChunkReader, Protocol):
    """What keyed blobs and gc/verify/repack need on top: queries, leases, writes of bytes and
    files as chunks, refs and manifests (each as :class:`tb5sync.store.store.Store` defines it)."""

    path: str
    quota: int | None
    version: int

    def _q(self, sql: str, args: Sequence[Any] = ()) -> list[Any]: ...

    def lease(self, lease_id: str | None = None) -> Lease: ...

    def put_bytes(self, data: bytes, lease: Lease, writer: PackWriter) -> tuple[bytes, list[ChunkRef]]: ...

    def _put_file(self, full: str, st: os.stat_result, lease: Lease, writer: PackWriter) -> list[ChunkRef]: ...

    def read_chunk(self, digest: bytes) -> bytes: ...

    def assemble(self, digest: bytes, pieces: Sequence[tuple[bytes, int]],
                 given: dict[bytes, bytes | memoryview] | None = None) -> bytes: ...

    def read_manifest(self, digest: bytes, mchunks: Sequence[ChunkRef], where: str = "manifest",
                      parallel: bool = True) -> list[Item]: ...

    def refs(self, prefix: str = "") -> list[Any]: ...

    def live_leases(self, db: sqlite3.Connection) -> list[str]: ...

    def gc(self, repack_below: float = 0.5) -> dict[str, Any]: ...

    def stats(self) -> dict[str, Any]: ...


def require_indexed(db: sqlite3.Connection, digests: Iterable[bytes], what: str) -> None:
    """Check, inside a transaction on the index ``db``, that every chunk of ``digests`` is indexed
    (as a pack frame, or as a recipe of pieces in a format v2 store).

    Raises
    ------
    IntegrityError
        ``"{what}: chunk HEX is not in the store"`` for the first one that is not.
    """
    for d in digests:
        if (db.execute("SELECT 1 FROM chunks WHERE digest=?", (d,)).fetchone() is None
                and db.execute("SELECT 1 FROM recipes WHERE digest=?", (d,)).fetchone() is None):
            raise IntegrityError(f"{what}: chunk {d.hex()} is not in the store")
