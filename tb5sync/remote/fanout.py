"""Fan-out pulls: one ref's missing chunks fetched from several sources at once, in disjoint sets.

A source is a local store directory, an object store URL (``s3://bucket/prefix``: an
:class:`~tb5sync.store.objstore.ObjectStore`), a ``tb5://host[:port]`` server with ``--store``, or an
open :class:`~tb5sync.store.Store`. The missing chunks are cut into batches (``batch`` bytes each)
and put in one queue; every source has its own workers that take the next batch, fetch it, check
each chunk against its digest and append it to the destination's pack writer. So the sets asked of
the sources are disjoint, a faster (nearer) source takes more batches, and a source that fails a
batch (down, or lacks a chunk) hands it back for the others; a batch every source failed fails the
pull. Each puller starts at its own place in the batch list (rotated by a random offset), so N
nodes pulling one ref at once do not all ask the same source for the same chunks first
(the idea of BitTorrent's random-first-piece, without the tracker).

Nothing is referenced before it is whole: the destination's ref is committed last, through its
lease, once every chunk is in its store (:meth:`~tb5sync.store.Store.commit_ref`).
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

from tb5sync.errors import IntegrityError, RefExistsError, RefNotFoundError, Tb5syncError, UsageError
from tb5sync.engine.hashing import ChunkRef, chunk_digest, file_digest
from tb5sync.store.store import PackWriter, RefInfo, Store, check_ref_name
from tb5sync.store.manifest import check_peer_manifest_size, decode_peer_manifest
from tb5sync.store.objstore import open_store

__all__ = ["pull_fanout", "open_source", "StoreSource", "PeerSource"]

log = logging.getLogger(__name__)

#: Bytes of chunks per batch handed to one source.
BATCH = 16 * 1024 * 1024


class StoreSource:
    """A store (directory or object store) read as a pull source; ``workers`` batches at a time."""

    def __init__(self, store: Store, label: str, workers: int = 4, owned: bool = False) -> None:
        self.store, self.label, self.workers, self.owned = store, label, workers, owned

    def ref(self, name: str) -> RefInfo:
        """The ref ``name`` in this source (RefNotFoundError when absent)."""
        return self.store.ref(name)

    def fetch(self, batch: Sequence[ChunkRef]) -> list[bytes]:
        """The checked bytes of each chunk of ``batch`` (IntegrityError when one is missing or damaged)."""
        loc = self.store.locate(d for d, _ in batch)
        return [self.store.read_at(d, loc.get(d)) for d, _ in batch]

    def close(self) -> None:
        """Close the store if this source opened it."""
        if self.owned:
            self.store.close()


class PeerSource:
    """A ``tb5://`` server's store read as a pull source (one store session of ``streams`` streams per worker)."""

    def __init__(self, url: str, token: bytes | str | None = None, streams: int = 2, workers: int = 1) -> None:
        from tb5sync.wire.urls import parse_url, redact_url

        r = parse_url(url)
        if r is None:
            raise UsageError(f"expected a tb5://HOST[:PORT] URL, not {url!r}")
        if r.path.strip("/"):
            raise UsageError(f"pull source {redact_url(url)}: a server has one store, reached without a path: "
                             "give tb5://HOST[:PORT]")
        self.remote, self.label, self.token, self.streams, self.workers = r, url, token, streams, workers
        self._local = threading.local()
        self._sessions: list[Any] = []
        self._lock = threading.Lock()

    def _session(self) -> Any:
        from tb5sync.remote.storeclient import StoreSession

        s = getattr(self._local, "s", None)
        if s is None:
            s = StoreSession(self.remote, self.token, self.streams)
            self._local.s = s
            with self._lock:
                self._sessions.append(s)
        return s

    def ref(self, name: str) -> RefInfo:
        """The server's ref ``name`` (RefNotFoundError when absent; ConnectError when unreachable)."""
        from tb5sync.store.ops import ref_from_wire

        return ref_from_wire(self._session().call("ref", {"name": name}).get("ref"))

    def fetch(self, batch: Sequence[ChunkRef]) -> list[bytes]:
        """The bytes of each chunk of ``batch`` over this worker's session, each checked against its digest."""
        from tb5sync.remote.storeclient import _fetch

        got: dict[bytes, bytes] = {}
        _fetch(self._session(), batch, None, got)
        return [got[d] for d, _ in batch]

    def close(self) -> None:
        """Close every session the workers opened."""
        with self._lock:
            ss, self._sessions = self._sessions, []
        for s in ss:
            try:
                s.close()
            except Exception:  # noqa: S110 - a dead peer's session
                pass


def open_source(src: str | Store, storage_options: dict[str, Any] | None = None,
                token: bytes | str | None = None) -> StoreSource | PeerSource:
    """A pull source for ``src``: a ``tb5://`` URL, an fsspec URL or store directory, or an open Store."""
    if isinstance(src, Store):
        return StoreSource(src, getattr(src, "url", src.path))
    if src.startswith("tb5://"):
        return PeerSource(src, token)
    if "://" not in src and not os.path.isdir(src):
        raise UsageError(f"pull source {src!r}: no such store directory")
    return StoreSource(open_store(src, storage_options if "://" in src else None), src, owned=True)


def _batches(chunks: Sequence[ChunkRef], limit: int) -> list[list[ChunkRef]]:
    out: list[list[ChunkRef]] = []
    cur: list[ChunkRef] = []
    size = 0
    for c in chunks:
        if cur and size + c[1] > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append(c)
        size += c[1]
    if cur:
        out.append(cur)
    return out


def _warn_down(warned: dict[str, str], label: str, exc: BaseException) -> None:
    """Warn once per source that it cannot be used (``warned``: label -> reason, shared by one pull)."""
    if label in warned:
        return
    warned[label] = f"{type(exc).__name__}: {exc}"
    log.warning("pull source %s cannot be used (%s); going on with the other sources", label, warned[label])


def _none_left(warned: dict[str, str], what: str) -> IntegrityError:
    why = "; ".join(f"{k}: {v}" for k, v in warned.items())
    return IntegrityError(f"{what} could be fetched from none of the sources" + (f" ({why})" if why else ""))


def _run(sources: Sequence[StoreSource | PeerSource], chunks: Sequence[ChunkRef], writer: PackWriter | None,
         keep: dict[bytes, bytes] | None, batch: int, stats: dict[str, dict[str, int]],
         warned: dict[str, str] | None = None) -> int:
    """Fetch ``chunks`` from ``sources`` (module docstring); returns bytes fetched. A source that fails
    other than with a bad or missing chunk is warned about once (``warned``) and left out."""
    warned = {} if warned is None else warned
    # at least ~4 batches per worker, so that a small pull is still spread over the sources
    workers = sum(s.workers for s in sources)
    limit = min(batch, max(1024 * 1024, sum(n for _, n in chunks) // (4 * max(1, workers))))
    batches = _batches(chunks, limit)
    if not batches:
        return 0
    k = secrets.randbelow(len(batches))
    batches = batches[k:] + batches[:k]
    q: queue.Queue[tuple[int, list[ChunkRef], frozenset[int]]] = queue.Queue()
    for b in batches:
        q.put((0, b, frozenset()))
    pending = [len(batches)]
    errors: list[BaseException] = []
    lock = threading.Lock()
    done = threading.Event()
    total = [0]

    down: set[int] = set()
    everyone = set(range(len(sources)))

    def give_up(exc: BaseException) -> None:
        with lock:
            errors.append(exc)
            done.set()

    def worker(si: int) -> None:
        src = sources[si]
        with lock:
            st = stats.setdefault(src.label, {"batches": 0, "bytes": 0, "failed": 0})
        while not done.is_set() and si not in down:
            try:
                _, b, failed = q.get(timeout=0.05)
            except queue.Empty:
                continue
            if si in failed:
                q.put((0, b, failed))  # another source's to try
                if everyone <= failed | down:
                    give_up(_none_left(warned, f"{len(b)} chunks"))
                time.sleep(0.01)
                continue
            try:
                datas = src.fetch(b)
                for (d, n), data in zip(b, datas):
                    if len(data) != n or chunk_digest(data) != d:
                        raise IntegrityError(f"chunk {d.hex()} from {src.label} does not match its digest")
                for (d, _), data in zip(b, datas):
                    if keep is not None:
                        keep[d] = data
                    if writer is not None:
                        writer.add(d, data)
            except Exception as exc:
                nf = failed | {si}
                with lock:
                    st["failed"] += 1
                    if not isinstance(exc, IntegrityError):
                        down.add(si)  # unreachable or broken: leave its batches to the others
                        _warn_down(warned, src.label, exc)
                    else:
                        warned.setdefault(src.label, f"{type(exc).__name__}: {exc}")
                if everyone <= nf | down:
                    give_up(_none_left(warned, f"{len(b)} chunks") if len(sources) > 1 else exc)
                    return
                q.put((0, b, nf))
                continue
            with lock:
                st["batches"] += 1
                st["bytes"] += sum(n for _, n in b)
                total[0] += sum(n for _, n in b)
                pending[0] -= 1
                if pending[0] == 0:
                    done.set()

    threads = [threading.Thread(target=worker, args=(si,), daemon=True, name=f"fanout-{si}")
               for si, s in enumerate(sources) for _ in range(s.workers)]
    for t in threads:
        t.start()
    while not done.wait(0.1):
        if not any(t.is_alive() for t in threads):
            break
    done.set()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    if pending[0]:
        raise _none_left(warned, f"{pending[0]} batches of chunks")
    return total[0]


def pull_fanout(store: Store, name: str, sources: Sequence[str | Store | StoreSource | PeerSource], *,
                as_name: str | None = None, replace: bool = False, storage_options: dict[str, Any] | None = None,
                token: bytes | str | None = None, batch: int = BATCH) -> dict[str, Any]:
    """Copy ref ``name`` into ``store`` from every source at once (module docstring).

    Parameters
    ----------
    store : Store
        Destination (a directory store or an :class:`~tb5sync.store.objstore.ObjectStore`).
    name : str
        The ref; its manifest is taken from the first source (in the order given) that has it.
    sources : list
        ``tb5://`` URLs, fsspec URLs or store directories, open stores, or sources.
    as_name, replace
        Name of the ref in ``store``; whether an existing one is replaced.
    storage_options : dict, optional
        For the object store URLs among ``sources``.
    token : bytes or str, optional
        For the ``tb5://`` sources.
    batch : int
        Most bytes of chunks per batch (smaller for a small pull: about 4 batches per worker, at
        least 1 MiB).

    Returns
    -------
    dict
        ``ref``, ``chunks`` (every chunk the ref reaches, manifest chunks included, each once: as push
        counts them), ``chunks_fetched``, ``bytes_fetched`` (bytes), ``seconds``,
        ``sources``: per source label ``{"batches", "bytes", "failed"}``.

    Raises
    ------
    RefNotFoundError
        No source has the ref.
    RefExistsError
        ``store`` has the ref, with another manifest, and ``replace`` is False (the same manifest:
        a no-op success, ``unchanged`` True).
    IntegrityError
        Some chunk could be fetched, checked, from none of the sources (nothing is committed).
    PeerLimitError, UnsafeManifestError
        The manifest the source sent is past this side's bounds, or unsafe
        (:func:`~tb5sync.store.manifest.decode_peer_manifest`): nothing is committed.
    """
    t0 = time.perf_counter()
    if not sources:
        raise UsageError("pull needs at least one source")
    local_name = check_ref_name(as_name or name)
    check_ref_name(name)
    mine = store._ref_row(local_name)
    warned: dict[str, str] = {}
    srcs: list[StoreSource | PeerSource] = []
    for s in sources:
        if isinstance(s, (StoreSource, PeerSource)):
            srcs.append(s)
            continue
        try:
            srcs.append(open_source(s, storage_options, token))
        except UsageError:
            raise
        except Exception as exc:  # unreachable (an object store that cannot be opened): the others may serve
            _warn_down(warned, s if isinstance(s, str) else getattr(s, "label", "?"), exc)
    stats: dict[str, dict[str, int]] = {}
    try:
        info = None
        label = ""
        for s in srcs:
            try:
                info = s.ref(name)
                label = s.label
                break
            except RefNotFoundError:
                continue
            except (OSError, Tb5syncError) as exc:
                _warn_down(warned, s.label, exc)
                continue
        if info is None:
            why = "; ".join(f"{k}: {v}" for k, v in warned.items())
            raise RefNotFoundError(f"no source has ref {name!r} (looked in {', '.join(s.label for s in srcs) or 'none'})"
                                   + (f" ({why})" if why else ""))
        if mine is not None and mine.manifest == info.manifest:  # this very snapshot is here already
            from tb5sync.remote.storeclient import ref_chunks

            return {"ref": local_name, "chunks": len(ref_chunks(mine.mchunks, store.manifest(mine, touch=False))),
                    "chunks_fetched": 0, "bytes_fetched": 0, "seconds": time.perf_counter() - t0, "sources": {},
                    "unchanged": True}
        if mine is not None and not replace:
            raise RefExistsError(f"ref {local_name!r} already exists in store {store.label} with other content "
                                 "(--force replaces it)")
        if mine is None:
            store.check_nesting(local_name)
        where = f"manifest of {name!r} from {label}"
        check_peer_manifest_size(info.mchunks, where)  # before any of it is fetched
        lease = store.lease()
        writer = PackWriter(store, lease)
        try:
            mrefs = list(info.mchunks)
            if file_digest(d for d, _ in mrefs) != info.manifest:
                raise IntegrityError(f"manifest of {name!r}: chunk list does not match its digest")
            have = lease.protect([d for d, _ in mrefs])
            got: dict[bytes, bytes] = {}
            mmissing = list(dict.fromkeys(r for r, h in zip(mrefs, have) if not h))
            nbytes = _run(srcs, mmissing, writer, got, batch, stats, warned)
            data = b"".join(got[d] if d in got else store.read_chunk(d) for d, _ in mrefs)
            items = decode_peer_manifest(data, where)
            from tb5sync.remote.storeclient import missing_chunks

            total, missing = missing_chunks(lease, mrefs, items)
            nbytes += _run(srcs, missing, writer, None, batch, stats, warned)
            writer.flush()
            store.commit_ref(lease, local_name, info.manifest, mrefs, items, info.description, replace, info.created)
        except BaseException:
            writer.abort()
            try:
                lease.release()
            except Exception:  # noqa: S110 - the original error matters
                pass
            raise
    finally:
        for s in srcs:
            if s not in sources:
                s.close()
    store.enforce_quota(keep=local_name)
    return {"ref": local_name, "chunks": total, "chunks_fetched": len(mmissing) + len(missing),
            "bytes_fetched": nbytes, "unchanged": False,
            "seconds": time.perf_counter() - t0, "sources": stats}
