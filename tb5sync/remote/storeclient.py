"""Moving store refs between nodes: push and pull over a server's store session, on N streams.

Both directions send only the chunks the other side lacks: the receiving side is asked (push:
``have``, with a lease so what it has stays until the commit) or asks itself (pull: a local
lease's ``protect``), then missing chunks travel in batches of at most
:data:`~tb5sync.wire.messages.STORE_MAX_BATCH` bytes, spread over the streams, each checked against
its digest on arrival, and the ref is committed only once every chunk is in place.
Stream 0 carries the control requests; the others (all of them with one stream) carry chunks.

**Pieces.** When the receiving store is format v2 and the server lists the ``"pieces"`` feature in
its OPEN reply (:func:`tb5sync.store.ops.session_reply`), a missing chunk of at least
:data:`~tb5sync.store.pieces.SPLIT_MIN` bytes travels as its recipe plus only the pieces the
receiver lacks: push cuts it (or takes the local recipe), asks ``have_pieces`` (held for the lease)
and sends ``put_recipes``; pull asks ``recipes``, finds the pieces it holds under its own lease and
fetches the others with ``chunks``. The receiver rebuilds each chunk from the pieces sent and the
ones it holds and checks it against the chunk's BLAKE3 digest before it records the recipe. A chunk
none of whose pieces the receiver holds travels whole (the same bytes, no recipe). An older server
(no ``features``), a v1 store on either side, or ``pieces=False`` move whole chunks as before.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

from tb5sync.errors import (
    ConnectError,
    IntegrityError,
    ReadOnlyError,
    RefExistsError,
    RefNotFoundError,
    RemoteProtocolError,
    UsageError,
)
from tb5sync.engine.hashing import ChunkRef, chunk_digest, refs_to_blob
from tb5sync.wire.messages import STORE_MAX_BATCH, STORE_MAX_DIGESTS, STORE_MAX_RECIPES
from tb5sync.wire.rpc import Requester, open_session, split_parts
from tb5sync.store import Store, check_ref_name
from tb5sync.store.store import nesting_error, ref_ancestors
from tb5sync.store.manifest import Item, check_peer_manifest_size, decode_peer_manifest
from tb5sync.store.ops import ref_from_wire
from tb5sync.store.pieces import (PIECE_PARAMS_BY_VERSION, PIECE_PARAMS_V1, SPLIT_MIN, blob_to_recipe, max_recipe_blob,
                                  recipe_shape_error, split)
from tb5sync.store.store import PackWriter, RefInfo
from tb5sync.wire.transport import Channel, connect
from tb5sync.wire.urls import Remote, host_port, token_of

__all__ = ["push_ref", "pull_ref", "remote_refs", "StoreSession"]

#: Requests in flight per data stream.
_WINDOW = 2


class StoreSession:
    """``streams`` connections to a server's store session; a :class:`Requester` over them.

    Raises
    ------
    ConnectError, AuthError
        Reaching the server failed.
    UsageError
        The server has no store.
    """

    def __init__(self, remote: Remote, token: bytes | str | None = None, streams: int = 4) -> None:
        if not isinstance(streams, int) or not 1 <= streams <= 64:
            raise UsageError("streams must be 1..64")
        tok = token_of(token)
        chans: list[Channel] = []
        try:
            for _ in range(streams):
                ch = connect(remote.host, remote.port, tok, family=remote.family)
                chans.append(ch)
                resp = open_session(ch, {"op": "store"})
            self.read_only = bool(resp.get("read_only"))
            feats = resp.get("features")
            #: what the server lists under ``features`` (:data:`~tb5sync.wire.messages.STORE_FEATURES`)
            self.features: frozenset[str] = frozenset(f for f in feats if isinstance(f, str)) \
                if isinstance(feats, list) else frozenset()
            pp = resp.get("piece_params")
            #: the piece parameter version of the server's store (None: it keeps chunks whole)
            self.piece_params: int | None = pp if isinstance(pp, int) and not isinstance(pp, bool) else None
        except BaseException:
            for c in chans:
                c.close()
            raise
        self.req = Requester(chans)
        self.streams = streams

    def data_channels(self) -> list[int]:
        return list(range(1, self.streams)) or [0]

    def call(self, method: str, args: dict[str, Any]) -> Any:
        return self.req.call(method, args, channel=0)

    def close(self) -> None:
        self.req.close(bye=True)

    def __enter__(self) -> StoreSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _batches(refs: Sequence[ChunkRef], limit: int = STORE_MAX_BATCH) -> Iterator[list[ChunkRef]]:
    cur: list[ChunkRef] = []
    size = 0
    for d, n in refs:
        if cur and (size + n > limit or len(cur) >= STORE_MAX_DIGESTS):
            yield cur
            cur, size = [], 0
        cur.append((d, n))
        size += n
    if cur:
        yield cur


def _first_seen(pairs: Iterable[ChunkRef]) -> list[ChunkRef]:
    """``pairs`` ``(digest, length)``, each digest once, in first-seen order."""
    seen: set[bytes] = set()
    out = []
    for d, n in pairs:
        if d not in seen:
            seen.add(d)
            out.append((d, n))
    return out


def unique_chunks(items: Sequence[Item]) -> list[ChunkRef]:
    """The chunks ``(digest, length)`` of ``items``, each once, in first-seen order."""
    return _first_seen(c for it in items for c in it.chunks)


def ref_chunks(mchunks: Sequence[ChunkRef], items: Sequence[Item]) -> list[ChunkRef]:
    """Every chunk a ref reaches, each once: its manifest's chunks, then its files' (first-seen order).
    What push and pull count as a ref's ``chunks`` (and ``store stats``/``verify`` count among indexed chunks)."""
    return _first_seen([*mchunks, *(c for it in items for c in it.chunks)])


#: Digests per ``lease.protect`` call while a pull finds what it lacks.
_PROTECT_BATCH = 10000


def missing_chunks(lease: Any, mrefs: Sequence[ChunkRef], items: Sequence[Item]) -> tuple[int, list[ChunkRef]]:
    """What a pull of a ref still lacks once its manifest is here: ``(total, missing)``, ``total``
    the ref's distinct chunks (the manifest's ``mrefs`` and its files'), ``missing`` the file
    chunks the local store lacks, each once, in first-seen order. Every chunk the store has is
    protected by ``lease`` (a :class:`~tb5sync.store.store.Store` writer lease) in the same step,
    so gc cannot take it before the ref is committed."""
    mset = {d for d, _ in mrefs}
    chunks = [c for c in unique_chunks(items) if c[0] not in mset]
    have: list[bool] = []
    for k in range(0, len(chunks), _PROTECT_BATCH):
        have += lease.protect([d for d, _ in chunks[k : k + _PROTECT_BATCH]])
    return len(mset) + len(chunks), [c for c, h in zip(chunks, have) if not h]


def remote_refs(remote: Remote, prefix: str = "", token: bytes | str | None = None) -> list[RefInfo]:
    """The refs of a server's store whose name starts with ``prefix``."""
    with StoreSession(remote, token, 1) as s:
        got = s.call("refs", {"prefix": prefix}).get("refs")
    if not isinstance(got, list):
        raise RemoteProtocolError("malformed refs reply")
    return [ref_from_wire(r) for r in got]


def _fetch(s: StoreSession, missing: Sequence[ChunkRef], writer: PackWriter | None,
           keep: dict[bytes, bytes] | None = None) -> int:
    """Fetch ``missing`` chunks over the data streams; check and hand each to ``writer``; returns bytes."""
    chans = s.data_channels()
    batches = list(_batches(missing))
    inflight: list[tuple[list[ChunkRef], Future[Any]]] = []
    got = 0
    i = 0
    while i < len(batches) or inflight:
        while i < len(batches) and len(inflight) < _WINDOW * len(chans):
            b = batches[i]
            inflight.append((b, s.req.submit("chunks", {"digests": [d for d, _ in b]}, channel=chans[i % len(chans)])))
            i += 1
        b, fut = inflight.pop(0)
        meta, body = fut.result()
        lengths = meta.get("lengths") if isinstance(meta, dict) else None
        if not isinstance(lengths, list) or len(lengths) != len(b) or any(n != ln for (_, n), ln in zip(b, lengths)):
            raise RemoteProtocolError("chunks reply does not match the request")
        for (d, _), part in zip(b, split_parts(body, lengths)):
            if chunk_digest(part) != d:
                raise IntegrityError(f"chunk {d.hex()} from the server does not match its digest")
            if keep is not None:
                keep[d] = bytes(part)
            if writer is not None:
                writer.add(d, part)
            got += len(part)
    return got


def pull_ref(store: Store, name: str, remote: Remote, *, token: bytes | str | None = None, streams: int = 4,
             as_name: str | None = None, replace: bool = False, pieces: bool | None = None) -> dict[str, Any]:
    """Copy ref ``name`` from the server at ``remote`` into ``store`` (as ``as_name``), fetching only missing chunks.

    Returns
    -------
    dict
        ``ref``, ``chunks`` (every chunk the ref reaches, manifest chunks included, each once: as push
        counts them), ``chunks_fetched`` (chunks the store lacked, whole or as pieces),
        ``bytes_fetched`` (chunk and piece bytes), ``pieces_fetched``, ``wire_bytes`` (bytes on the
        wire both ways, frames included), ``seconds``. ``pieces=False`` fetches whole chunks only (as
        a client older than the ``"pieces"`` feature does); None (the default): pieces unless
        ``TB5SYNC_STORE_PIECES=0``.

    Raises
    ------
    RefNotFoundError
        The server has no such ref.
    RefExistsError
        The local store has ``as_name`` already, with another manifest, and ``replace`` is False (the
        same manifest is a no-op success: ``unchanged`` True).
    IntegrityError
        A chunk or the manifest from the server does not match its digest.
    PeerLimitError, UnsafeManifestError
        The server's manifest is past this client's bounds, or unsafe
        (:func:`~tb5sync.store.manifest.decode_peer_manifest`): nothing is committed.
    ConnectError, AuthError
    """
    t0 = time.perf_counter()
    local_name = check_ref_name(as_name or name)
    mine = store._ref_row(local_name)
    if mine is None:
        store.check_nesting(local_name)
    with StoreSession(remote, token, streams) as s:
        try:
            info = ref_from_wire(s.call("ref", {"name": check_ref_name(name)}).get("ref"))
        except RefNotFoundError:
            raise RefNotFoundError(f"no ref {name!r} on {host_port(remote.host, remote.port)}") from None
        if mine is not None and mine.manifest == info.manifest:  # this very snapshot is here already
            return {"ref": local_name, "chunks": len(ref_chunks(mine.mchunks, store.manifest(mine, touch=False))),
                    "chunks_fetched": 0, "bytes_fetched": 0, "seconds": time.perf_counter() - t0, "unchanged": True}
        if mine is not None and not replace:
            raise RefExistsError(f"ref {local_name!r} already exists in store {store.label} with other content "
                                 "(--force replaces it)")
        where = f"manifest of {name!r} from the server at {host_port(remote.host, remote.port)}"
        check_peer_manifest_size(info.mchunks, where)  # before any of it is fetched
        lease = store.lease()
        writer = PackWriter(store, lease)
        try:
            mrefs = list(info.mchunks)
            have = lease.protect([d for d, _ in mrefs])
            got: dict[bytes, bytes] = {}
            mmissing = list(dict.fromkeys(r for r, h in zip(mrefs, have) if not h))
            nbytes = _fetch(s, mmissing, writer, got)
            data = b"".join(got[d] if d in got else store.read_chunk(d) for d, _ in mrefs)
            from tb5sync.engine.hashing import file_digest

            if file_digest(d for d, _ in mrefs) != info.manifest:
                raise IntegrityError(f"manifest of {name!r} from the server does not match its digest")
            items = decode_peer_manifest(data, where)
            total, missing = missing_chunks(lease, mrefs, items)
            nchunks = len(missing)
            npieces = 0
            if _pieces_wanted(pieces) and "pieces" in s.features and store.piece_params is not None:
                got_pieces, nb, missing = _fetch_pieces(store, s, lease, writer, missing)
                npieces += got_pieces
                nbytes += nb
            nbytes += _fetch(s, missing, writer)
            wire = s.req.wire_bytes
            writer.flush()
            store.commit_ref(lease, local_name, info.manifest, mrefs, items, info.description, replace, info.created)
        except BaseException:
            writer.abort()
            try:
                lease.release()
            except Exception:
                pass
            raise
    store.enforce_quota(keep=local_name)
    return {"ref": local_name, "chunks": total, "chunks_fetched": len(mmissing) + nchunks,
            "bytes_fetched": nbytes, "pieces_fetched": npieces, "wire_bytes": wire,
            "seconds": time.perf_counter() - t0, "unchanged": False}


def push_ref(store: Store, name: str, remote: Remote, *, token: bytes | str | None = None, streams: int = 4,
             as_name: str | None = None, replace: bool = False, pieces: bool | None = None) -> dict[str, Any]:
    """Copy ref ``name`` of ``store`` to the server at ``remote`` (as ``as_name``), sending only chunks it lacks.

    Returns
    -------
    dict
        ``ref``, ``chunks`` (every chunk the ref reaches, manifest chunks included, each once),
        ``chunks_sent`` (chunks the server lacked, whole or as pieces), ``bytes_sent`` (chunk and piece
        bytes), ``pieces_sent``, ``wire_bytes`` (bytes on the wire both ways, frames included),
        ``seconds``, ``unchanged`` (the server had this very ref). ``pieces=False`` sends whole chunks
        only (as a client older than the ``"pieces"`` feature does); None (the default): pieces unless
        ``TB5SYNC_STORE_PIECES=0``.

    Raises
    ------
    RefNotFoundError
        No such local ref.
    ReadOnlyError
        The server is read-only.
    RefExistsError
        The server has the ref already, with another manifest, and ``replace`` is False (the same
        manifest is a no-op success: ``unchanged`` True, nothing sent).
    IntegrityError
        A local chunk is damaged (nothing is committed on the server).
    ConnectError, AuthError
    """
    t0 = time.perf_counter()
    info = store.ref(name)
    remote_name = check_ref_name(as_name or name)
    items = store.manifest(info)
    with StoreSession(remote, token, streams) as s:
        if s.read_only:
            raise ReadOnlyError(f"server {host_port(remote.host, remote.port)} is read-only")
        chunks = ref_chunks(info.mchunks, items)
        try:
            there = ref_from_wire(s.call("ref", {"name": remote_name}).get("ref"))
        except RefNotFoundError:
            there = None
        if there is not None and there.manifest == info.manifest:
            # the server has this very snapshot under this name already: nothing to send, nothing to change
            return {"ref": remote_name, "chunks": len(chunks), "chunks_sent": 0, "bytes_sent": 0,
                    "seconds": time.perf_counter() - t0, "unchanged": True}
        if there is not None and not replace:  # refused now rather than after every chunk has crossed
            raise RefExistsError(f"ref {remote_name!r} already exists on {host_port(remote.host, remote.port)} with "
                                 "other content (--force replaces it)")
        if there is None:  # a ref nesting with another is refused now too (the server's commit would)
            for anc in ref_ancestors(remote_name):
                try:
                    s.call("ref", {"name": anc})
                except RefNotFoundError:
                    continue
                raise nesting_error(remote_name, anc, host_port(remote.host, remote.port))
            kids = s.call("refs", {"prefix": remote_name + "/"}).get("refs") or []
            if kids:
                raise nesting_error(remote_name, ref_from_wire(kids[0]).name, host_port(remote.host, remote.port))
        lease = secrets.token_hex(16)
        have: list[bool] = []
        for k in range(0, len(chunks), STORE_MAX_DIGESTS):
            part = chunks[k : k + STORE_MAX_DIGESTS]
            reply = s.call("have", {"digests": [d for d, _ in part], "lease": lease}).get("have")
            if not isinstance(reply, list) or len(reply) != len(part):
                raise RemoteProtocolError("malformed have reply")
            have += [bool(h) for h in reply]
        missing = [c for c, h in zip(chunks, have) if not h]
        chans = s.data_channels()
        inflight: list[Future[Any]] = []
        turn = [0]

        def submit(method: str, args: dict[str, Any]) -> None:
            if len(inflight) >= _WINDOW * len(chans):
                inflight.pop(0).result()
            inflight.append(s.req.submit(method, args, channel=chans[turn[0] % len(chans)]))
            turn[0] += 1

        sent = npieces = 0
        whole = missing
        if _pieces_wanted(pieces) and "pieces" in s.features and s.piece_params == PIECE_PARAMS_V1.version:
            npieces, sent, whole = _send_pieces(store, s, lease, missing, submit)
        for batch in _batches(whole):
            payload = [[d, data] for (d, _), data in zip(batch, store.iter_chunks([d for d, _ in batch], ahead=8))]
            sent += sum(len(p[1]) for p in payload)
            submit("put_chunks", {"lease": lease, "chunks": payload})
        for fut in inflight:
            fut.result()
        for c in chans:
            s.req.call("flush", {"lease": lease}, channel=c)
        reply = s.call("commit", {"lease": lease, "name": remote_name, "manifest": info.manifest,
                                  "mchunks": refs_to_blob(info.mchunks), "description": info.description,
                                  "created": info.created, "replace": replace})
        if not isinstance(reply, dict) or "ref" not in reply:
            raise ConnectError("server sent no result for the commit")
        wire = s.req.wire_bytes
    return {"ref": remote_name, "chunks": len(chunks), "chunks_sent": len(missing), "bytes_sent": sent,
            "pieces_sent": npieces, "wire_bytes": wire, "seconds": time.perf_counter() - t0, "unchanged": False}


def _pieces_wanted(pieces: bool | None) -> bool:
    """``pieces``, or when None whether ``TB5SYNC_STORE_PIECES`` is not ``0`` (the bench's whole-chunk
    figure, and a way back to the old exchange)."""
    if pieces is not None:
        return pieces
    return os.environ.get("TB5SYNC_STORE_PIECES", "1") != "0"


def _cuts(pairs: Sequence[tuple[bytes, int]]) -> list[tuple[bytes, int, int]]:
    """``[(digest, length), ...]`` as pieces ``(digest, start, end)`` of the chunk they make."""
    out, pos = [], 0
    for p, n in pairs:
        out.append((p, pos, pos + n))
        pos += n
    return out


def _send_pieces(store: Store, s: StoreSession, lease: str, missing: Sequence[ChunkRef],
                 submit: Any) -> tuple[int, int, list[ChunkRef]]:
    """Push ``missing`` chunks of at least SPLIT_MIN bytes as recipes plus the pieces the server lacks
    (module docstring), in groups of at most STORE_MAX_BATCH bytes of chunks, one ``put_recipes`` each,
    through ``submit(method, args)``. Returns ``(pieces sent, piece bytes sent, chunks to send whole)``:
    the short ones, and those none of whose pieces the server holds."""
    whole = [c for c in missing if c[1] < SPLIT_MIN]
    npieces = sent = 0
    for group in _batches([c for c in missing if c[1] >= SPLIT_MIN]):
        recs: dict[bytes, tuple[list[tuple[bytes, int]], dict[bytes, memoryview] | None]] = {}
        for d, _ in group:
            r = store.recipe(d)
            if r is None:  # kept whole here: cut it as the receiver would
                data = memoryview(store.read_chunk(d))
                cut = split(data, PIECE_PARAMS_V1)
                recs[d] = ([(p, b - a) for p, a, b in cut], {p: data[a:b] for p, a, b in cut})
            else:
                recs[d] = (r, None)
        uniq = list(dict.fromkeys(p for pairs, _ in recs.values() for p, _ in pairs))
        have: list[bool] = []
        for k in range(0, len(uniq), STORE_MAX_DIGESTS):
            part = uniq[k : k + STORE_MAX_DIGESTS]
            reply = s.call("have_pieces", {"digests": part, "lease": lease}).get("have")
            if not isinstance(reply, list) or len(reply) != len(part):
                raise RemoteProtocolError("malformed have_pieces reply")
            have += [bool(h) for h in reply]
        had = {p for p, h in zip(uniq, have) if h}
        recipes: list[list[bytes]] = []
        need: dict[bytes, bytes | memoryview | None] = {}
        for d, n in group:
            pairs, mem = recs[d]
            if not any(p in had for p, _ in pairs):
                whole.append((d, n))  # nothing to gain from a recipe
                continue
            recipes.append([d, b"".join(p + k.to_bytes(4, "little") for p, k in pairs)])
            for p, _ in pairs:
                if p not in had and p not in need:
                    need[p] = mem[p] if mem is not None else None
        if not recipes:
            continue
        todo = [p for p, v in need.items() if v is None]
        where = store.locate(todo)
        for p in todo:
            need[p] = store.read_at(p, where.get(p))  # read and checked against its digest
        payload = [[p, bytes(v)] for p, v in need.items() if v is not None]
        npieces += len(payload)
        sent += sum(len(v) for _, v in payload)
        assert len(recipes) <= STORE_MAX_RECIPES
        submit("put_recipes", {"lease": lease, "recipes": recipes, "pieces": payload})
    return npieces, sent, whole


def _fetch_pieces(store: Store, s: StoreSession, lease: Any, writer: PackWriter,
                  missing: Sequence[ChunkRef]) -> tuple[int, int, list[ChunkRef]]:
    """Pull ``missing`` chunks the server keeps as recipes as their recipe plus the pieces this store
    lacks (module docstring); each chunk is rebuilt and checked against its digest before ``writer``
    records it. Returns ``(pieces fetched, piece bytes fetched, chunks to fetch whole)``."""
    whole = [c for c in missing if c[1] < SPLIT_MIN]
    npieces = nbytes = 0
    for group in _batches([c for c in missing if c[1] >= SPLIT_MIN]):
        reply = s.call("recipes", {"digests": [d for d, _ in group]}).get("recipes")
        if not isinstance(reply, list) or len(reply) != len(group):
            raise RemoteProtocolError("malformed recipes reply")
        recs: list[tuple[bytes, list[tuple[bytes, int]]]] = []
        for (d, n), blob in zip(group, reply):
            if blob is None:
                whole.append((d, n))
                continue
            params = PIECE_PARAMS_BY_VERSION.get(s.piece_params or 1, PIECE_PARAMS_V1)
            try:  # a blob too long for its chunk is refused before it is parsed
                pairs = blob_to_recipe(blob) if isinstance(blob, bytes) and len(blob) <= max_recipe_blob(n, params) else None
            except IntegrityError:
                pairs = None
            if not pairs or any(k <= 0 for _, k in pairs) or sum(k for _, k in pairs) != n:
                raise RemoteProtocolError(f"recipe of chunk {d.hex()} from the server is malformed")
            why = recipe_shape_error(pairs, params)
            if why is not None:
                raise RemoteProtocolError(f"recipe of chunk {d.hex()} from the server is malformed: {why}")
            recs.append((d, pairs))
        lengths = {p: k for _, pairs in recs for p, k in pairs}
        uniq = list(lengths)
        have: list[bool] = []
        for k in range(0, len(uniq), _PROTECT_BATCH):
            have += lease.protect(uniq[k : k + _PROTECT_BATCH], frames_only=True)
        had = {p for p, h in zip(uniq, have) if h}
        part = []
        for d, pairs in recs:
            if any(p in had for p, _ in pairs):
                part.append((d, pairs))
            else:
                whole.append((d, sum(k for _, k in pairs)))
        need = list(dict.fromkeys((p, k) for _, pairs in part for p, k in pairs if p not in had))
        given: dict[bytes, bytes] = {}
        nbytes += _fetch(s, need, None, given)  # each piece checked against its digest
        npieces += len(need)
        for d, pairs in part:
            writer.add(d, store.assemble(d, pairs, given), _cuts(pairs))  # checked against d first
    return npieces, nbytes, whole

