"""The artifact store on an object store reached through fsspec (S3, GCS, Azure, ``memory://``...).

Layout under the URL's prefix (store format v1 on objects; the pack format is unchanged)::

    PREFIX/config            JSON, as a store directory's ``config`` (created once, if-absent)
    PREFIX/packs/XX/<id>     immutable packs (pack format v1), each one whole PUT
    PREFIX/index/<id>        msgpack ``{"v": 1, "size": bytes, "created": s, "chunks": [[digest, offset, length], ...]}``:
                             the frames of pack <id>; written only after the pack is whole in place
    PREFIX/refs/<name>       JSON ref (as :meth:`RefInfo.as_dict` plus ``mchunks`` hex), written last, conditionally
    PREFIX/locks/refs        the lease object, used only where the backend has no conditional writes

Nothing is referenced before it is whole: a pack object, then its index object, then (after every
chunk a ref reaches is indexed) the ref object. A SQLite index in a local cache directory
(``cache``, default ``<user cache dir>/tb5sync/objstore/<hash of the URL and endpoint>``) is a copy of the
``index/`` objects, brought up to date by :meth:`ObjectStore.sync_index` (at open, and whenever a
chunk or ref is not found); it can be deleted at any time.

Refs: two writers never lose an update. On backends with conditional writes (S3's ``If-None-Match:
*`` and ``If-Match: <etag>`` on PutObject; probed once per store and recorded) a new ref is created
only if absent and a ref is changed only if its ETag is the one read (compare-and-swap, retried).
Elsewhere the ref writes take a *lease object* ``locks/refs``: a writer writes ``{"owner", "expires"}``
there when it is absent or expired, waits ``LEASE_SETTLE`` seconds and reads it back; it holds the
lease only if it still names it. This is mutual exclusion as long as the store reads its own writes
within ``LEASE_SETTLE`` (S3 has been strongly consistent since 2020; SeaweedFS, MinIO are), and a
holder that dies frees it after ``LEASE_TTL_OBJ`` seconds.

gc on an object store marks from every ref object and deletes only packs none of whose chunks is
marked, whose index object is older than ``grace`` seconds, and only while no writer lease
(``locks/writer-*``: every writer's :class:`ObjectLease`, rewritten while it writes) younger than ``LEASE_TTL_OBJ`` exists; the index object goes
first, then the pack. Packs with some live chunks are kept whole (no repack on the shared tier).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgpack

from ..errors import IntegrityError, RefExistsError, RefNotFoundError, Tb5syncError, UsageError
from ..hashing import ChunkRef
from .manifest import Item
from .packs import FsspecPackStorage, iter_frames
from .store import RefInfo, Store, all_digests, check_ref_name
from .writer import Lease

__all__ = ["ObjectStore", "ObjectLease", "open_store", "is_object_url", "RefConflictError", "ObjectStoreError",
           "LEASE_TTL_OBJ"]

log = logging.getLogger(__name__)

#: A lease object (ref lease or writer lease) not renewed for this long is dead, seconds.
LEASE_TTL_OBJ = 60.0
#: Seconds a writer waits between writing the ref lease object and reading it back.
LEASE_SETTLE = 0.2
#: Tries of one ranged pack read before its error is raised.
READ_TRIES = 4
#: Default grace period of gc on an object store: packs indexed more recently are never deleted, seconds.
GC_GRACE = 3600.0


class RefConflictError(Tb5syncError, RuntimeError):
    """A ref changed under a compare-and-swap too many times in a row (another writer keeps winning)."""


class ObjectStoreError(Tb5syncError, OSError):
    """The object store failed a request (unreachable, timed out, refused a write); names the store URL,
    what was being done and the backend's own message. Nothing half-written is referenced."""

    exit_code = 11


class _Precondition(Exception):
    pass


_F = TypeVar("_F", bound=Callable[..., Any])


def _clear_errors(what: str) -> Callable[[_F], _F]:
    """Errors of the object store's client (botocore, aiohttp, OSError) leave as :class:`ObjectStoreError`."""

    def deco(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kw: Any) -> Any:
            try:
                return fn(self, *args, **kw)
            except (Tb5syncError, FileNotFoundError, KeyboardInterrupt):
                raise
            except Exception as exc:
                url = getattr(self, "url", None) or getattr(self, "root", "?")
                raise ObjectStoreError(f"{url}: {what} failed: {type(exc).__name__}: {exc}") from exc

        return wrapper  # type: ignore[return-value]

    return deco


def is_object_url(s: str | os.PathLike[str] | None) -> bool:
    """Whether ``s`` is a URL with a protocol other than ``file``/``local`` (``s3://b/p``, ``memory://x``)."""
    if s is None:
        return False
    s = os.fspath(s)
    if "://" not in s:
        return False
    proto = s.split("://", 1)[0]
    return proto not in ("file", "local", "tb5", "tb5store")


def open_store(url: str | os.PathLike[str] | None = None, storage_options: dict[str, Any] | None = None,
               **kw: Any) -> Store:
    """A :class:`Store` for a directory path (or ``file://``) or an :class:`ObjectStore` for another fsspec URL.

    Raises
    ------
    UsageError
        A ``tb5://`` URL (a server's store is reached with push/pull, not opened), or ``storage_options``
        given with a local path.
    """
    if url is not None and os.fspath(url).startswith(("tb5://", "tb5store://")):
        raise UsageError(f"{url}: a server's store is not opened directly; use pull/push or --from")
    if is_object_url(url):
        return ObjectStore(os.fspath(url), storage_options=storage_options, **kw)  # type: ignore[arg-type]
    if storage_options:
        raise UsageError("storage options apply only to an object store URL (s3://...)")
    path = os.fspath(url) if url is not None else None
    if path is not None and path.startswith("file://"):
        path = path[len("file://"):]
    return Store(path, **kw)


class ObjectPackStorage(FsspecPackStorage):
    """Packs on an fsspec filesystem, each followed by its index object ``INDEX/<id>`` (see the module docstring)."""

    def __init__(self, fs: object, root: str, index_root: str) -> None:
        super().__init__(fs, root)
        self.index_root = index_root

    @_clear_errors("writing a pack")
    def put_file(self, name: str, path: str) -> int:
        with open(path, "rb") as f:
            data = f.read()
        rows = [[d, off, n] for d, off, n in iter_frames(data, name)]
        size = super().put_file(name, path)  # whole PUT; raises on a failed upload and references nothing
        idx = msgpack.packb({"v": 1, "size": size, "created": time.time(), "chunks": rows})
        self.fs.pipe_file(f"{self.index_root}/{name}", idx)
        return size

    def get_range(self, name: str, offset: int, length: int) -> bytes:
        """As :meth:`FsspecPackStorage.get_range`, a failed read tried again ``READ_TRIES`` times in all
        (0.2, 0.4, 0.8 s apart): a replica's server going away mid-read costs a retry, not the read."""
        for attempt in range(READ_TRIES):
            try:
                return super().get_range(name, offset, length)
            except (FileNotFoundError, IntegrityError):
                raise
            except Exception:
                if attempt == READ_TRIES - 1:
                    raise
                time.sleep(0.2 * 2**attempt)
        raise AssertionError("unreachable")

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(f"{self.index_root}/{name}")
        super().delete(name)


class ObjectStore(Store):
    """The artifact store with its packs, index objects and refs on an fsspec URL (module docstring).

    Parameters
    ----------
    url : str
        ``s3://bucket/prefix`` (credentials and endpoint as s3fs reads them: AWS_* variables, or
        ``storage_options``), or any other fsspec URL (``memory://name``...).
    storage_options : dict, optional
        Passed to the fsspec filesystem (``key``, ``secret``, ``client_kwargs``, ``endpoint_url``...).
    cache : str, optional
        Local directory for the index copy and packs being written.
    pack_target, quota
        As :class:`Store`.
    conditional : bool, optional
        Force (True) or forbid (False) conditional writes for refs; default: probed.

    Raises
    ------
    UsageError
        Unknown protocol (its fsspec implementation is not installed), or a config of another format.
    OSError
        The object store cannot be reached (fsspec's/s3fs's errors).
    """

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None, cache: str | None = None,
                 pack_target: int | None = None, quota: int | None = None, conditional: bool | None = None) -> None:
        import fsspec

        try:
            fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except (ImportError, ValueError) as exc:
            raise UsageError(f"{url}: cannot open this store URL: {exc}") from exc
        self.url = url
        self.fs: Any = fs
        self.root = root.rstrip("/")
        if cache is None:
            try:
                from platformdirs import user_cache_dir

                base = user_cache_dir("tb5sync", appauthor=False)
            except ImportError:
                base = os.path.join(os.path.expanduser("~"), ".cache", "tb5sync")
            # one cache per store: the URL and the endpoint it is reached at (one bucket name, two clusters)
            ck = (storage_options or {}).get("client_kwargs") or {}
            endpoint = (ck.get("endpoint_url") or (storage_options or {}).get("endpoint_url")
                        or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "")
            key = f"{url}\n{endpoint}".encode()
            cache = os.path.join(base, "objstore", hashlib.sha256(key).hexdigest()[:24])
        os.makedirs(cache, exist_ok=True)
        self._conditional = conditional
        self._sync_config(cache, pack_target)
        super().__init__(cache, pack_target=pack_target, quota=quota,
                         packs=ObjectPackStorage(fs, f"{self.root}/packs", f"{self.root}/index"))
        self.owner = f"{self.host}:{os.getpid()}:{secrets.token_hex(4)}"
        self.sync_index()

    def _find(self, prefix: str, detail: bool = False) -> Any:
        """Every object under ``prefix``, listed afresh (fsspec's listing cache dropped first)."""
        with contextlib.suppress(AttributeError, TypeError):
            self.fs.invalidate_cache(prefix)
        return self.fs.find(prefix, detail=detail)

    def lease(self, lease_id: str | None = None) -> Lease:
        """A writer's lease (:class:`ObjectLease`): also a ``locks/writer-<id>`` object that gc respects."""
        return ObjectLease(self, lease_id)

    # ---- config and index ----------------------------------------------------------------------
    def _sync_config(self, cache: str, pack_target: int | None) -> None:
        key = f"{self.root}/config"
        try:
            data = self.fs.cat_file(key)
        except FileNotFoundError:
            from .store import PACK_TARGET, STORE_VERSION

            cfg = {"format": "tb5sync-store", "version": STORE_VERSION, "chunk_params": 1,
                   "pack_target": int(pack_target or PACK_TARGET), "quota": None}
            body = json.dumps(cfg).encode()
            try:
                self._put_if_absent(key, body)
            except _Precondition:
                pass
            data = self.fs.cat_file(key)
        local = os.path.join(cache, "config")
        tmp = local + f".{secrets.token_hex(6)}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, local)

    def sync_index(self) -> dict[str, int]:
        """Copy index objects not yet in the local index, drop rows of packs gone from the store.

        Returns ``{"packs_added", "packs_dropped"}``.
        """
        try:
            names = {p.rstrip("/").rsplit("/", 1)[-1] for p in self._find(f"{self.root}/index")}
        except FileNotFoundError:
            names = set()
        known = {r[0] for r in self._q("SELECT id FROM packs")}
        added = 0
        for name in sorted(names - known):
            try:
                meta = msgpack.unpackb(self.fs.cat_file(f"{self.root}/index/{name}"))
            except FileNotFoundError:
                continue
            if not isinstance(meta, dict) or meta.get("v") != 1:
                raise IntegrityError(f"{self.url}: index object {name} is malformed")
            with self._tx() as db:
                db.execute("INSERT OR IGNORE INTO packs VALUES (?,?,?)", (name, meta["size"], meta["created"]))
                db.executemany("INSERT OR IGNORE INTO chunks VALUES (?,?,?,?)",
                               [(bytes(d), name, o, n) for d, o, n in meta["chunks"]])
            added += 1
        gone = known - names
        # a pack this process is writing is indexed locally before its index object exists: keep leased ones
        leased = {r[0] for r in self._q("SELECT pack FROM lease_packs")}
        dropped = 0
        for name in gone - leased:
            with self._tx() as db:
                db.execute("DELETE FROM chunks WHERE pack=?", (name,))
                db.execute("DELETE FROM packs WHERE id=?", (name,))
            dropped += 1
        return {"packs_added": added, "packs_dropped": dropped}

    def read_chunk(self, digest: bytes) -> bytes:
        """As :meth:`Store.read_chunk`; a chunk not in the local index copy is looked up after a sync."""
        try:
            return super().read_chunk(digest)
        except IntegrityError:
            if self.has(digest):
                raise
            self.sync_index()
            return super().read_chunk(digest)

    # ---- conditional writes ---------------------------------------------------------------------
    def _s3_split(self, key: str) -> tuple[str, str]:
        bucket, _, k = key.partition("/")
        return bucket, k

    def _is_s3(self) -> bool:
        return hasattr(self.fs, "call_s3")

    def _put_if_absent(self, key: str, body: bytes) -> None:
        if self._is_s3() and self.conditional:
            b, k = self._s3_split(key)
            self._s3_put(Bucket=b, Key=k, Body=body, IfNoneMatch="*")
            return
        if self.fs.exists(key):
            raise _Precondition(key)
        self.fs.pipe_file(key, body)

    def _s3_put(self, **kw: Any) -> None:
        try:
            self.fs.call_s3("put_object", **kw)
        except Exception as exc:  # botocore ClientError, or s3fs's translation of it
            # s3fs turns 412 into OSError(EINVAL, "At least one of the pre-conditions ... did not hold")
            text = f"{exc!r} {getattr(exc, 'response', '')}".lower()
            if any(s in text for s in ("precondition", "pre-condition", "conditionalrequestconflict")):
                raise _Precondition(kw.get("Key")) from exc
            raise

    def _etag(self, key: str) -> str | None:
        try:
            info = self.fs.info(key, refresh=True) if self._is_s3() else self.fs.info(key)
        except FileNotFoundError:
            return None
        return str(info.get("ETag") or info.get("etag") or "")

    @property
    def conditional(self) -> bool:
        """Whether the backend honours ``If-None-Match``/``If-Match`` on PUT (probed once; recorded in ``locks/``)."""
        if self._conditional is None:
            self._conditional = self._probe_conditional()
        return self._conditional

    def _probe_conditional(self) -> bool:
        """Create-if-absent twice and If-Match with a wrong ETag: both refused means honoured. An error
        other than a refused precondition propagates (and nothing is recorded)."""
        if not self._is_s3():
            return False
        b, k = self._s3_split(f"{self.root}/locks/probe-{secrets.token_hex(8)}")
        try:
            self.fs.call_s3("put_object", Bucket=b, Key=k, Body=b"1", IfNoneMatch="*")
            try:
                self._s3_put(Bucket=b, Key=k, Body=b"2", IfNoneMatch="*")
                return False  # accepted twice: the header is ignored
            except _Precondition:
                pass
            try:
                self._s3_put(Bucket=b, Key=k, Body=b"3", IfMatch='"0123456789abcdef0123456789abcdef"')
                return False
            except _Precondition:
                return True
        finally:
            with contextlib.suppress(Exception):
                self.fs.call_s3("delete_object", Bucket=b, Key=k)

    @contextlib.contextmanager
    def _ref_lease(self) -> Any:
        """The lease object ``locks/refs`` (module docstring), for backends without conditional writes."""
        key = f"{self.root}/locks/refs"
        end = time.monotonic() + 2 * LEASE_TTL_OBJ
        me = f"{self.owner}:{secrets.token_hex(4)}"
        while True:
            try:
                cur = json.loads(self.fs.cat_file(key))
            except FileNotFoundError:
                cur = None
            except ValueError:
                cur = {"expires": 0}
            if cur is None or cur.get("expires", 0) < time.time():
                self.fs.pipe_file(key, json.dumps({"owner": me, "expires": time.time() + LEASE_TTL_OBJ}).encode())
                time.sleep(LEASE_SETTLE)
                with contextlib.suppress(FileNotFoundError, ValueError):
                    if json.loads(self.fs.cat_file(key)).get("owner") == me:
                        break
            if time.monotonic() > end:
                raise RefConflictError(f"{self.url}: the ref lease {key} stays held by {cur and cur.get('owner')}")
            time.sleep(0.05 + secrets.randbelow(100) / 1000)
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError, ValueError):
                if json.loads(self.fs.cat_file(key)).get("owner") == me:
                    self.fs.rm_file(key)

    def _update_ref(self, name: str, fn: Any, create_only: bool = False) -> dict[str, Any] | None:
        """Read ref object ``name``, compute ``fn(old or None)`` (a dict, or None for no change) and write it
        so that no concurrent update is lost; returns what was written."""
        key = f"{self.root}/refs/{name}"
        if not self.conditional:
            with self._ref_lease():
                old = self._ref_obj(name)
                new = fn(old)
                if new is not None:
                    self.fs.pipe_file(key, json.dumps(new).encode())
                return new
        b, k = self._s3_split(key)
        for _ in range(20):
            etag = self._etag(key)
            if etag is not None and create_only:
                raise RefExistsError(f"ref {name!r} already exists in store {self.url}")
            old = self._ref_obj(name) if etag is not None else None
            if etag is not None and old is None:
                time.sleep(0.02)  # removed between the two reads, or not yet readable where it was written
                continue
            new = fn(old)
            if new is None:
                return None
            body = json.dumps(new).encode()
            try:
                if etag is None:
                    self._s3_put(Bucket=b, Key=k, Body=body, IfNoneMatch="*")
                else:
                    self._s3_put(Bucket=b, Key=k, Body=body, IfMatch=etag)
                return new
            except _Precondition:
                if create_only:
                    raise RefExistsError(f"ref {name!r} already exists in store {self.url}") from None
                time.sleep(0.01 + secrets.randbelow(50) / 1000)
        raise RefConflictError(f"ref {name!r} in {self.url} changed under 20 updates in a row")

    # ---- refs as objects ----------------------------------------------------------------------
    def _ref_obj(self, name: str) -> dict[str, Any] | None:
        try:
            data = self.fs.cat_file(f"{self.root}/refs/{name}")
        except FileNotFoundError:
            return None
        try:
            obj = json.loads(data)
            assert isinstance(obj, dict) and obj["name"] == name
        except (ValueError, AssertionError, KeyError) as exc:
            raise IntegrityError(f"{self.url}: ref object {name!r} is malformed") from exc
        return obj

    def _ref_row(self, name: str) -> RefInfo | None:
        obj = self._ref_obj(name)
        return None if obj is None else _info(obj)

    def refs(self, prefix: str = "") -> list[RefInfo]:
        """Refs whose name starts with ``prefix``, sorted by name (one listing of ``refs/``)."""
        base = f"{self.root}/refs/"
        try:
            keys = sorted(self._find(f"{self.root}/refs"))
        except FileNotFoundError:
            return []
        out = []
        for key in keys:
            name = key[len(base):] if key.startswith(base) else key.split("/refs/", 1)[-1]
            if name.startswith(prefix):
                obj = self._ref_obj(name)
                if obj is not None:
                    out.append(_info(obj))
        return out

    def touch(self, name: str) -> None:
        """Record a use (best effort on an object store: the last writer's time stands)."""
        def fn(old: dict[str, Any] | None) -> dict[str, Any] | None:
            if old is None or time.time() - old.get("last_used", 0) < 60:
                return None
            return dict(old, last_used=time.time())

        try:
            self._update_ref(name, fn)
        except Exception as exc:  # a read does not fail because its use could not be recorded
            log.debug("%s: last use of %r not recorded: %s", self.url, name, exc)

    def rm(self, name: str) -> None:
        """Remove ref ``name``.

        Raises
        ------
        RefNotFoundError
        """
        check_ref_name(name)
        key = f"{self.root}/refs/{name}"
        if not self.fs.exists(key):
            raise RefNotFoundError(f"no ref {name!r} in store {self.url}")
        self.fs.rm_file(key)

    def pin(self, name: str, pinned: bool = True) -> None:
        """Pin or unpin ``name`` (compare-and-swap on the ref object).

        Raises
        ------
        RefNotFoundError
        """
        check_ref_name(name)

        def fn(old: dict[str, Any] | None) -> dict[str, Any] | None:
            if old is None:
                raise RefNotFoundError(f"no ref {name!r} in store {self.url}")
            return dict(old, pinned=bool(pinned))

        self._update_ref(name, fn)

    def commit_ref(self, lease: Lease, name: str, manifest: bytes, mchunks: Sequence[ChunkRef], items: Sequence[Item],
                   description: str | None = None, replace: bool = False, created: float | None = None) -> RefInfo:
        """Write ref object ``name`` once every chunk it reaches has an index object; release ``lease``.

        Raises
        ------
        RefExistsError
            ``name`` exists and ``replace`` is False (also when another writer created it first).
        IntegrityError
            Some chunk is not indexed in the store.
        RefConflictError
            The ref kept changing under the compare-and-swap.
        """
        check_ref_name(name)
        needed = {d for d, _ in mchunks} | all_digests(items)
        loc = self.locate(needed)
        if len(loc) != len(needed):
            self.sync_index()
            loc = self.locate(needed)
        missing = needed - set(loc)
        if missing:
            raise IntegrityError(f"ref {name!r}: chunk {next(iter(missing)).hex()} is not in the store")
        packs = {p for p, _, _ in loc.values()}
        present = {p.rstrip("/").rsplit("/", 1)[-1] for p in self._find(f"{self.root}/index")}
        if packs - present:
            raise IntegrityError(f"ref {name!r}: pack {sorted(packs - present)[0]} is not (or no longer) in {self.url}")
        now = time.time()
        obj = {"name": name, "manifest": manifest.hex(), "mchunks": [[d.hex(), n] for d, n in mchunks],
               "created": created or now, "size": sum(it.size for it in items if it.kind == "f"),
               "files": sum(1 for it in items if it.kind == "f"), "description": description,
               "pinned": False, "last_used": now}

        def fn(old: dict[str, Any] | None) -> dict[str, Any]:
            if old is not None and not replace:
                raise RefExistsError(f"ref {name!r} already exists in store {self.url}")
            return dict(obj, pinned=bool(old and old.get("pinned")))

        self._update_ref(name, fn, create_only=not replace)
        lease.release()
        return _info(obj)

    @_clear_errors("put")
    def put(self, name: str, src: str | os.PathLike[str], description: str | None = None,
            replace: bool = False, exclude: Sequence[str] = ()) -> RefInfo:
        """As :meth:`Store.put`; errors of the object store leave as :class:`ObjectStoreError`."""
        return super().put(name, src, description, replace, exclude)

    @_clear_errors("get")
    def get(self, name: str, dest: str | os.PathLike[str], replace: bool = False, hardlink: bool = False) -> RefInfo:
        """As :meth:`Store.get`; errors of the object store leave as :class:`ObjectStoreError`."""
        return super().get(name, dest, replace, hardlink)

    def enforce_quota(self, keep: str | None = None) -> list[str]:
        """No quota on the shared tier (its size is the object store's business): nothing is evicted."""
        return []

    def stats(self) -> dict[str, Any]:
        """As :meth:`Store.stats`, refs counted from the ref objects."""
        s = super().stats()
        refs = self.refs()
        s.update(refs=len(refs), files=sum(r.files for r in refs), logical_bytes=sum(r.size for r in refs))
        s["dedup_ratio"] = round(s["logical_bytes"] / s["unique_bytes"], 3) if s["unique_bytes"] else 1.0
        return s

    def gc(self, repack_below: float = 0.5, grace: float = GC_GRACE) -> dict[str, int]:
        """Delete packs no ref reaches (module docstring); ``repack_below`` is ignored here.

        Returns ``{"chunks_deleted", "packs_deleted", "packs_repacked" (0), "orphans", "bytes_freed",
        "deferred" (1 when a live writer lease stopped the sweep)}``.
        """
        res = {"chunks_deleted": 0, "packs_deleted": 0, "packs_repacked": 0, "orphans": 0, "bytes_freed": 0,
               "deferred": 0}
        if self._live_writers():
            res["deferred"] = 1
            return res
        self.sync_index()
        marked: set[bytes] = set()
        for info in self.refs():
            marked.update(d for d, _ in info.mchunks)
            marked |= all_digests(self.manifest(info, touch=False))
        now = time.time()
        by_pack: dict[str, list[bytes]] = {}
        for d, p in self._q("SELECT digest, pack FROM chunks"):
            by_pack.setdefault(p, []).append(bytes(d))
        created = {p: (c, s) for p, s, c in self._q("SELECT id, size, created FROM packs")}
        dead = [p for p, ds in by_pack.items() if not any(d in marked for d in ds)
                and now - created.get(p, (now, 0))[0] >= grace]
        if self._live_writers():  # a writer began while we marked: its chunks may be in these packs
            res["deferred"] = 1
            return res
        for p in dead:
            self.packs.delete(p)
            with self._tx() as db:
                res["chunks_deleted"] += db.execute("DELETE FROM chunks WHERE pack=?", (p,)).rowcount
                db.execute("DELETE FROM packs WHERE id=?", (p,))
            res["packs_deleted"] += 1
            res["bytes_freed"] += created.get(p, (0, 0))[1]
        # packs without an index object (a writer stopped between the two PUTs), older than the grace
        indexed = {r[0] for r in self._q("SELECT id FROM packs")}
        for name, (size, mtime) in self.packs.list().items():
            if name not in indexed and (mtime == 0.0 or now - mtime >= grace) and not self.fs.exists(
                    f"{self.root}/index/{name}"):
                if grace > 0 and mtime == 0.0:
                    continue  # no modification time known: leave it
                self.packs.delete(name)
                res["orphans"] += 1
                res["bytes_freed"] += size
        return res

    def _live_writers(self) -> bool:
        try:
            found = self._find(f"{self.root}/locks", detail=True)
        except FileNotFoundError:
            return False
        now = time.time()
        for key, info in found.items():
            if not key.rsplit("/", 1)[-1].startswith("writer-"):
                continue
            mt = info.get("LastModified") or info.get("mtime") or info.get("created")
            ts = mt.timestamp() if hasattr(mt, "timestamp") else float(mt or now)
            if now - ts < LEASE_TTL_OBJ:
                return True
        return False

    def verify(self) -> dict[str, Any]:
        """Re-hash every chunk every ref reaches (reads each once from the object store)."""
        from ..hashing import chunk_digest  # noqa: F401 - read_chunk checks each

        self.sync_index()
        report: dict[str, Any] = {"refs": {}, "bad_packs": {}, "chunks": 0, "bytes": 0, "ok": True}
        for info in self.refs():
            missing = damaged = 0
            try:
                items = self.manifest(info, touch=False)
            except IntegrityError:
                report["refs"][info.name] = {"ok": False, "missing": 0, "damaged": 1}
                report["ok"] = False
                continue
            for d in all_digests(items):
                try:
                    report["bytes"] += len(self.read_chunk(d))
                    report["chunks"] += 1
                except IntegrityError as exc:
                    if "missing" in str(exc):
                        missing += 1
                    else:
                        damaged += 1
            report["refs"][info.name] = {"ok": not (missing or damaged), "missing": missing, "damaged": damaged}
            report["ok"] = report["ok"] and not (missing or damaged)
        return report


class ObjectLease(Lease):
    """A :class:`~tb5sync.store.writer.Lease` in the local index plus a writer lease object
    ``locks/writer-<id>`` in the store, rewritten at least every ``LEASE_TTL_OBJ / 3`` seconds while the
    writer protects chunks, removed on release; gc sweeps nothing while a young one exists."""

    def __init__(self, store: ObjectStore, lease_id: str | None = None) -> None:
        super().__init__(store, lease_id)
        self.obj_store = store
        self.key = f"{store.root}/locks/writer-{self.id}"
        self._written = 0.0
        self._renew()

    def _renew(self) -> None:
        self.obj_store.fs.pipe_file(self.key, json.dumps({"owner": self.obj_store.owner, "at": time.time()}).encode())
        self._written = time.monotonic()

    def protect(self, digests: Sequence[bytes]) -> list[bool]:
        if time.monotonic() - self._written > LEASE_TTL_OBJ / 3:
            self._renew()
        return super().protect(digests)

    def release(self) -> None:
        try:
            super().release()
        finally:
            with contextlib.suppress(Exception):
                self.obj_store.fs.rm_file(self.key)


def _info(obj: dict[str, Any]) -> RefInfo:
    return RefInfo(obj["name"], bytes.fromhex(obj["manifest"]),
                   tuple((bytes.fromhex(d), int(n)) for d, n in obj["mchunks"]), float(obj["created"]),
                   int(obj["size"]), int(obj["files"]), obj.get("description"), bool(obj.get("pinned")),
                   float(obj.get("last_used", obj["created"])))
