"""The server side of a store session: answers :data:`tb5sync.wire.messages.STORE_METHODS` from a Store.

One :class:`StoreOps` per connection (a push or pull opens several, one per stream). Writes
go through a lease named by the client (``lease``: 32 lowercase hex digits), shared by the
session's streams: every chunk a stream writes or the client is told the server has stays
protected from gc until ``commit`` turns it into a ref or the connection ends. Each stream has
its own pack writer; the client sends ``flush`` on every stream before ``commit``.
Knows no sockets: :func:`tb5sync.wire.rpc.serve` calls these methods.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from typing import Any, TypeVar

from tb5sync.errors import IntegrityError, ReadOnlyError, Tb5syncError, UsageError
from tb5sync.engine.hashing import blob_to_refs, chunk_digest, refs_to_blob
from tb5sync.wire.messages import (
    MAX_CHUNK,
    STORE_FEATURES,
    STORE_MAX_BATCH,
    STORE_MAX_DIGESTS,
    STORE_MAX_RECIPE_BYTES,
    STORE_MAX_RECIPE_REPLY,
    STORE_MAX_RECIPES,
)
from tb5sync.tree.quota import WriteQuota
from tb5sync.store.pieces import SPLIT_MIN, blob_to_recipe, max_recipe_blob, recipe_shape_error
from tb5sync.store.store import Lease, PackWriter, RefInfo, Store, check_ref_name

__all__ = ["StoreOps", "ref_to_wire", "ref_from_wire", "session_reply"]

_LEASE_RE = re.compile(r"[0-9a-f]{32}")


def ref_to_wire(info: RefInfo) -> list[Any]:
    """A ref on the wire: ``[name, manifest, mchunks blob, created, size, files, description, pinned]``."""
    return [info.name, info.manifest, refs_to_blob(info.mchunks), info.created, info.size, info.files,
            info.description, info.pinned]


def ref_from_wire(v: object) -> RefInfo:
    """Check and rebuild a ref sent by a peer.

    Raises
    ------
    IntegrityError
        Malformed.
    """
    if not isinstance(v, list) or len(v) != 8:
        raise IntegrityError("malformed ref from peer")
    name, manifest, mchunks, created, size, files, desc, pinned = v
    if not (isinstance(manifest, bytes) and len(manifest) == 32 and isinstance(mchunks, bytes)
            and isinstance(created, (int, float)) and isinstance(size, int) and isinstance(files, int)
            and (desc is None or isinstance(desc, str))):
        raise IntegrityError("malformed ref from peer")
    try:
        check_ref_name(name)
        refs = tuple(blob_to_refs(mchunks))
    except (UsageError, ValueError) as exc:
        raise IntegrityError(f"malformed ref from peer: {exc}") from exc
    return RefInfo(name, manifest, refs, float(created), size, files, desc, bool(pinned), float(created))


def session_reply(store: Store, read_only: bool) -> dict[str, Any]:
    """The OPEN reply of a store session: ``{"read_only", "features", "piece_params"}``.

    ``features`` lists :data:`~tb5sync.wire.messages.STORE_FEATURES` (an older server sends only
    ``read_only``); ``piece_params`` is the store's piece parameter version, None for a format v1
    store (which keeps chunks whole: a client then sends it whole chunks).
    """
    pp = store.config.get("piece_params") if store.version >= 2 else None
    return {"read_only": read_only, "features": list(STORE_FEATURES), "piece_params": pp}


def _digests(v: object, what: str) -> list[bytes]:
    if not isinstance(v, list) or len(v) > STORE_MAX_DIGESTS or not all(isinstance(d, bytes) and len(d) == 32 for d in v):
        raise UsageError(f"{what}: expected at most {STORE_MAX_DIGESTS} 32-byte digests")
    return v


_F = TypeVar("_F", bound=Callable[..., Any])


def _hiding(fn: _F) -> _F:
    """Errors leave with the store's directory named ``<store>``: a peer never learns the server's paths."""

    @functools.wraps(fn)
    def wrapper(self: StoreOps, *args: Any, **kw: Any) -> Any:
        try:
            return fn(self, *args, **kw)
        except Tb5syncError as exc:
            text = str(exc)
            if self.store.path in text:
                exc.args = (text.replace(self.store.path, "<store>"),)
            raise

    return wrapper  # type: ignore[return-value]


class StoreOps:
    """Answers one connection's store requests. ``read_only`` refuses every write."""

    #: the session's write limits (a server's ``--max-session-bytes``/``--min-free-space``):
    #: ``put_chunks`` charges its chunks' bytes before adding them; None: none
    quota: WriteQuota | None = None

    def __init__(self, store: Store, read_only: bool = False) -> None:
        self.store = store
        self.read_only = read_only
        self._lease: Lease | None = None
        self._writer: PackWriter | None = None

    def _join(self, lease: object) -> Lease:
        if self.read_only:
            raise ReadOnlyError("server is read-only; the store cannot be written")
        if not isinstance(lease, str) or not _LEASE_RE.fullmatch(lease):
            raise UsageError("lease must be 32 lowercase hex digits")
        if self._lease is None or self._lease.id != lease:
            self._lease = self.store.lease(lease)
            self._writer = PackWriter(self.store, self._lease)
            self._writer.limit = self.store.quota  # a push that can never fit is refused as it arrives
        return self._lease

    @_hiding
    def refs(self, prefix: str = "") -> dict[str, Any]:
        """``{"refs": [ref, ...]}``: refs whose name starts with ``prefix``."""
        if not isinstance(prefix, str):
            raise UsageError("prefix must be a string")
        return {"refs": [ref_to_wire(r) for r in self.store.refs(prefix)]}

    @_hiding
    def ref(self, name: str) -> dict[str, Any]:
        """``{"ref": ref}`` (a use: the ref's last use is now, unless read-only). Raises ``RefNotFoundError``."""
        info = self.store.ref(name)
        if not self.read_only:  # a read-only server writes nothing, not even the last use
            self.store.touch(info.name)
        return {"ref": ref_to_wire(info)}

    @_hiding
    def have(self, digests: list[bytes], lease: str | None = None) -> dict[str, Any]:
        """``{"have": [bool, ...]}``; with ``lease`` (a writable server) what is had is held for it."""
        ds = _digests(digests, "have")
        if lease is None or self.read_only:
            return {"have": [self.store.has(d) for d in ds]}
        return {"have": self._join(lease).protect(ds)}

    @_hiding
    def chunks(self, digests: list[bytes]) -> tuple[dict[str, Any], list[Any]]:
        """DATA: the chunks' bytes (each checked as it is read), meta ``{"lengths"}``; at most ~16 MiB."""
        parts = []
        total = 0
        ds = _digests(digests, "chunks")
        for data in self.store.iter_chunks(ds, ahead=8):  # read and checked ahead in the hash pool
            total += len(data)
            if total > STORE_MAX_BATCH + 4 * 1024 * 1024:
                raise UsageError(f"chunks: more than {STORE_MAX_BATCH} bytes asked for")
            parts.append(data)
        return {"lengths": [len(p) for p in parts]}, parts

    @_hiding
    def put_chunks(self, lease: str, chunks: list[list[Any]]) -> dict[str, Any]:
        """Store ``[[digest, bytes], ...]`` under ``lease``; every chunk is checked first (``IntegrityError``).

        Chunks new to the store past its quota raise ``EntryTooLargeError`` before they are written
        (the push can never fit); ``commit`` checks the whole ref again."""
        self._join(lease)
        assert self._writer is not None
        if not isinstance(chunks, list):
            raise UsageError("put_chunks: chunks must be a list")
        total = 0
        for c in chunks:
            if not (isinstance(c, list) and len(c) == 2 and isinstance(c[0], bytes) and isinstance(c[1], bytes)):
                raise UsageError("put_chunks: each chunk is [digest, bytes]")
            total += len(c[1])
            if total > STORE_MAX_BATCH + 4 * 1024 * 1024:
                raise UsageError(f"put_chunks: more than {STORE_MAX_BATCH} bytes")
            if chunk_digest(c[1]) != c[0]:
                raise IntegrityError(f"put_chunks: chunk {c[0].hex()} does not match its digest")
        if self.quota is not None:
            self.quota.charge(total, f"put_chunks of {len(chunks)} chunks")
        for d, data in chunks:
            self._writer.add(d, data)
        return {}

    @_hiding
    def recipes(self, digests: list[bytes]) -> dict[str, Any]:
        """``{"recipes": [blob or None, ...]}``: per chunk its recipe (per piece its digest (32) and
        length (u32 LE)) when the store keeps it as one, else None (kept whole, or missing); at most
        :data:`~tb5sync.wire.messages.STORE_MAX_RECIPES` digests."""
        ds = _digests(digests, "recipes")
        if len(ds) > STORE_MAX_RECIPES:
            raise UsageError(f"recipes: at most {STORE_MAX_RECIPES} digests")
        out: list[bytes | None] = []
        total = 0
        for d in ds:
            r = self.store.recipe(d)
            out.append(None if r is None else b"".join(p + n.to_bytes(4, "little") for p, n in r))
            total += len(out[-1] or b"")
            if total > STORE_MAX_RECIPE_REPLY:
                raise UsageError(f"recipes: more than {STORE_MAX_RECIPE_REPLY} bytes of recipes asked for")
        return {"recipes": out}

    @_hiding
    def have_pieces(self, digests: list[bytes], lease: str) -> dict[str, Any]:
        """``{"have": [bool, ...]}``: which of the pieces ``digests`` the store holds as pack frames; those
        it holds are held for ``lease`` (a writable server) until the commit."""
        ds = _digests(digests, "have_pieces")
        return {"have": self._join(lease).protect(ds, frames_only=True)}

    @_hiding
    def put_recipes(self, lease: str, recipes: list[list[Any]], pieces: list[list[Any]]) -> dict[str, Any]:
        """Store chunks sent as recipes under ``lease`` (format v2 stores only).

        ``recipes``: ``[[chunk digest, recipe blob], ...]`` (at most
        :data:`~tb5sync.wire.messages.STORE_MAX_RECIPES`, their lengths summing to at most
        :data:`~tb5sync.wire.messages.STORE_MAX_RECIPE_BYTES`); ``pieces``: ``[[digest, bytes], ...]``,
        the pieces the store lacks (at most ~16 MiB), each checked against its digest. Every chunk is
        rebuilt from the pieces sent and those the store holds (``have_pieces`` held them for the
        lease) and checked against its BLAKE3 digest before any of it is written
        (``IntegrityError`` otherwise, and the request stops there: what it wrote before is held by
        the lease only, and goes at the next gc once the session ends uncommitted); then its new
        pieces are framed and its recipe recorded as a local put does. The pieces' bytes are charged to the
        session quota first.
        """
        self._join(lease)
        assert self._writer is not None
        if self.store.piece_params is None:
            raise UsageError("put_recipes: this store keeps chunks whole (format v1): send them with put_chunks")
        if not isinstance(recipes, list) or not isinstance(pieces, list) or len(recipes) > STORE_MAX_RECIPES:
            raise UsageError(f"put_recipes: recipes (at most {STORE_MAX_RECIPES}) and pieces must be lists")
        given: dict[bytes, bytes] = {}
        total = 0
        for p in pieces:
            if not (isinstance(p, list) and len(p) == 2 and isinstance(p[0], bytes) and isinstance(p[1], bytes)):
                raise UsageError("put_recipes: each piece is [digest, bytes]")
            total += len(p[1])
            if total > STORE_MAX_BATCH + 4 * 1024 * 1024:
                raise UsageError(f"put_recipes: more than {STORE_MAX_BATCH} bytes of pieces")
            if chunk_digest(p[1]) != p[0]:
                raise IntegrityError(f"put_recipes: piece {p[0].hex()} does not match its digest")
            given[p[0]] = p[1]
        parsed = []
        length = 0
        longest = max_recipe_blob(MAX_CHUNK, self.store.piece_params)
        for r in recipes:
            if not (isinstance(r, list) and len(r) == 2 and isinstance(r[0], bytes) and len(r[0]) == 32
                    and isinstance(r[1], bytes)):
                raise UsageError("put_recipes: each recipe is [chunk digest, recipe blob]")
            if len(r[1]) > longest:  # refused before it is parsed into one tuple per piece
                raise UsageError(f"put_recipes: recipe of chunk {r[0].hex()} is malformed: "
                                 f"{len(r[1])} bytes, over {longest}")
            try:
                ps = blob_to_recipe(r[1])
            except IntegrityError:
                raise UsageError(f"put_recipes: recipe of chunk {r[0].hex()} is malformed") from None
            n = sum(k for _, k in ps)
            if not ps or any(k <= 0 for _, k in ps) or not SPLIT_MIN <= n <= MAX_CHUNK:
                raise UsageError(f"put_recipes: recipe of chunk {r[0].hex()} is malformed")
            why = recipe_shape_error(ps, self.store.piece_params)
            if why is not None:
                raise UsageError(f"put_recipes: recipe of chunk {r[0].hex()} is malformed: {why}")
            length += n
            if length > STORE_MAX_RECIPE_BYTES:
                raise UsageError(f"put_recipes: more than {STORE_MAX_RECIPE_BYTES} bytes of chunks")
            parsed.append((r[0], ps))
        if self.quota is not None:
            self.quota.charge(total, f"put_recipes of {len(parsed)} chunks")
        for d, ps in parsed:  # one chunk at a time: checked, then written
            data = self.store.assemble(d, ps, given)
            cuts, pos = [], 0
            for p, k in ps:
                cuts.append((p, pos, pos + k))
                pos += k
            self._writer.add(d, data, cuts)
        return {}

    @_hiding
    def flush(self, lease: str) -> dict[str, Any]:
        """Put this stream's open pack in place and index it."""
        self._join(lease)
        assert self._writer is not None
        self._writer.flush()
        return {}

    @_hiding
    def commit(self, lease: str, name: str, manifest: bytes, mchunks: bytes, description: str | None = None,
               created: float | None = None, replace: bool = False) -> dict[str, Any]:
        """Write ref ``name`` once its manifest reads back whole and every chunk it reaches is stored."""
        le = self._join(lease)
        assert self._writer is not None
        self._writer.flush()
        if not isinstance(manifest, bytes) or not isinstance(mchunks, bytes):
            raise UsageError("commit: manifest and mchunks must be bytes")
        try:
            refs = blob_to_refs(mchunks)
        except ValueError as exc:
            raise UsageError(f"commit: {exc}") from exc
        items = self.store.read_manifest(manifest, refs, f"manifest of pushed ref {name!r}")
        info = self.store.commit_ref(le, name, manifest, refs, items, description, bool(replace),
                                     float(created) if isinstance(created, (int, float)) else None)
        self._lease = self._writer = None
        self.store.enforce_quota(keep=name)
        return {"ref": ref_to_wire(info)}

    @_hiding
    def list(self, name: str) -> dict[str, Any]:
        """The manifest of ``name``: ``{"entries": [[path, kind, mode, size, mtime_ns, target], ...]}``."""
        items = self.store.manifest(name, touch=not self.read_only)
        return {"entries": [[os.fsdecode(it.path), it.kind, it.mode, it.size, it.mtime_ns,
                             os.fsdecode(it.target) if it.target is not None else None] for it in items]}

    @_hiding
    def read(self, name: str, path: str, offset: int = 0, length: int | None = None) -> tuple[dict[str, Any], list[Any]]:
        """DATA: bytes ``[offset, offset+length)`` of file ``path`` in ref ``name`` (at most 16 MiB), meta ``{"length"}``."""
        if not isinstance(offset, int) or offset < 0 or (length is not None and (not isinstance(length, int) or length < 0)):
            raise UsageError("read: offset and length must be ints >= 0")
        length = STORE_MAX_BATCH if length is None else min(length, STORE_MAX_BATCH)
        data = self.store.cat(name, path, offset, length, touch=not self.read_only)
        return {"length": len(data)}, [data]

    def close(self) -> None:
        """End of the connection: drop an unfinished pack and this stream's hold on the lease."""
        if self._writer is not None:
            self._writer.abort()
        if self._lease is not None:
            try:
                self._lease.release()
            except Exception:  # the store may be closing
                pass
