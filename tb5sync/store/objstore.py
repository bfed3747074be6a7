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
While it runs, gc holds ``locks/gc-<id>``; a writer about to commit a ref waits until no live one
exists before it checks its packs, and gc marks again from the refs written while it marked (see
:meth:`ObjectStore.gc`), so no ref can be written to a chunk gc deletes.

Requests are bounded (``timeout``, default :data:`REQUEST_TIMEOUT` s, CLI ``--timeout``): on S3,
botocore makes at most 3 attempts, each waiting at most ``timeout / 6`` s to connect and as long for
each reply, with its standard backoff (at most 1 + 2 s) between them, and s3fs does not retry on
top; a request with no answer fails after about ``timeout + 3`` s as :class:`ObjectStoreError`,
naming the store URL and the step. Lock objects a failed or killed writer leaves (``writer-*``,
``probe-*``, ``gc-*``) expire after ``LEASE_TTL_OBJ`` s and are removed by the next gc.

This module holds :class:`ObjectStore` (config, index copy, refs as objects) and :func:`open_store`; the
conditional writes are in :mod:`~tb5sync.store.condwrite`, the lock objects and gc in
:mod:`~tb5sync.store.objlocks`, the packs in :mod:`~tb5sync.store.objpacks`, the errors in
:mod:`~tb5sync.store.objerrors`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgpack

from tb5sync.errors import IntegrityError, RefExistsError, RefNotFoundError, Tb5syncError, UsageError
from tb5sync.engine.hashing import ChunkRef
from tb5sync.store.condwrite import ConditionalWrites, _Precondition
from tb5sync.store.manifest import Item
from tb5sync.store.objerrors import REQUEST_ATTEMPTS, _clear_errors, _name_store, describe_error
from tb5sync.store.objlocks import ObjectLease, ObjectLocks
from tb5sync.store.objpacks import ObjectPackStorage
from tb5sync.store.store import RefInfo, Store, all_digests, check_ref_name, pinned_error
from tb5sync.store.writer import Lease

# What moved to condwrite, objerrors, objlocks and objpacks (and what it imported), importable from here as before
from tb5sync.errors import DestinationError  # noqa: F401
from tb5sync.store.condwrite import LEASE_SETTLE, LEASE_TTL_OBJ, RefConflictError  # noqa: F401
from tb5sync.store.objerrors import (  # noqa: F401
    _AUTH, _AUTH_WORDS, _BUCKET, _BUCKET_WORDS, _CONNECT, _CONNECT_WORDS, _F, _PATH_TOKEN, _TIMEOUT, _TIMEOUT_WORDS,
    ObjectStoreError, _nesting, _words)
from tb5sync.store.objlocks import GC_GRACE, GC_WAIT  # noqa: F401
from tb5sync.store.objpacks import READ_TRIES, _mtime  # noqa: F401
from tb5sync.store.packs import FsspecPackStorage, iter_frames  # noqa: F401

__all__ = ["ObjectStore", "ObjectLease", "open_store", "is_object_url", "RefConflictError", "ObjectStoreError",
           "LEASE_TTL_OBJ", "REQUEST_TIMEOUT"]

log = logging.getLogger(__name__)

#: Default bound of one request to the object store with its retries, seconds (module docstring).
REQUEST_TIMEOUT = 60.0
#: Seconds :meth:`ObjectStore.close` waits for a last-use record still being written.
TOUCH_WAIT = 2.0
#: A use of a ref within this many seconds of the recorded one is not written again.
TOUCH_EVERY = 60.0


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


class ObjectStore(ObjectLocks, ConditionalWrites, Store):
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
        Force (True) or forbid (False) conditional writes for refs; default: probed once per store and
        recorded in ``cache`` (``conditional.json``).
    timeout : float, optional
        Bound of one request with its retries, seconds (default :data:`REQUEST_TIMEOUT`; S3 only: 3
        attempts, each waiting at most ``timeout / 6`` s to connect and per reply; module docstring).

    Raises
    ------
    UsageError
        Unknown protocol (its fsspec implementation is not installed), a config of another format, or
        a timeout that is not > 0.
    ObjectStoreError
        The object store cannot be reached, refuses the credentials, or does not answer in time (an
        ``OSError``; the message names the URL, the step and what to check).
    """

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None, cache: str | None = None,
                 pack_target: int | None = None, quota: int | None = None, conditional: bool | None = None,
                 timeout: float | None = None) -> None:
        import fsspec

        self.url = url
        self.timeout = float(timeout if timeout is not None else REQUEST_TIMEOUT)
        if not self.timeout > 0:
            raise UsageError(f"{url}: the request timeout must be > 0 seconds, got {timeout!r}")
        opts = dict(storage_options or {})
        if url.startswith(("s3://", "s3a://")):
            # bounded requests (module docstring); options the caller gave win
            per_wait = max(0.5, self.timeout / (2 * REQUEST_ATTEMPTS))
            ck = {"connect_timeout": per_wait, "read_timeout": per_wait,
                  "retries": {"max_attempts": REQUEST_ATTEMPTS, "mode": "standard"}}
            opts["config_kwargs"] = {**ck, **(opts.get("config_kwargs") or {})}
        try:
            fs, root = fsspec.core.url_to_fs(url, **opts)
        except (ImportError, ValueError, TypeError) as exc:
            raise UsageError(f"{url}: cannot open this store URL: {exc}") from exc
        if url.startswith(("s3://", "s3a://")) and hasattr(fs, "retries"):
            fs.retries = 1  # botocore retries (above); s3fs would multiply them
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
        self.cache_dir = cache
        self._conditional = conditional if conditional is not None else self._cached_probe()
        self._touched: dict[str, float] = {}
        self._touches: list[threading.Thread] = []
        try:
            with self._doing(f"reading the store config {self.root}/config"):
                self._sync_config(cache, pack_target)
            super().__init__(cache, pack_target=pack_target, quota=quota,
                             packs=ObjectPackStorage(fs, f"{self.root}/packs", f"{self.root}/index", url, self.timeout))
            if self.version != 1:
                raise UsageError(f"{self.url}: {self.root}/config says store format {self.version}; an object store "
                                 "is format v1 (whole chunks in packs; pieces and recipes are for local stores)")
        except Tb5syncError as exc:
            _name_store(self, exc)
            raise
        except Exception as exc:
            raise describe_error(self, "opening the store", exc) from exc
        self.owner = f"{self.host}:{os.getpid()}:{secrets.token_hex(4)}"
        self._open_sync()

    @_clear_errors("opening the store")
    def _open_sync(self) -> None:
        with self._doing(f"listing {self.root}/index"):
            self.sync_index()

    @property
    def label(self) -> str:
        """The store's URL (what errors name)."""
        return self.url

    @contextlib.contextmanager
    def _doing(self, step: str) -> Any:
        """Record ``step`` on an error passing through (the innermost step is what the error names)."""
        try:
            yield
        except Exception as exc:
            if getattr(exc, "_tb5_step", None) is None:
                with contextlib.suppress(AttributeError, TypeError):
                    exc._tb5_step = step  # type: ignore[attr-defined]
            raise

    def close(self) -> None:
        """Wait at most ``TOUCH_WAIT`` s for last-use records still being written, then close the index."""
        end = time.monotonic() + TOUCH_WAIT
        for t in list(self._touches):
            t.join(max(0.0, end - time.monotonic()))
        super().close()

    def _find(self, prefix: str, detail: bool = False) -> Any:
        """Every object under ``prefix``, listed afresh: fsspec's listing cache is dropped for ``prefix`` and
        every folder under it, before and after (s3fs's find fills that cache, and a later read of an
        object written meanwhile would be refused from the stale listing)."""
        self._drop_listings(prefix)
        try:
            return self.fs.find(prefix, detail=detail)
        finally:
            self._drop_listings(prefix)

    def _drop_listings(self, prefix: str) -> None:
        with contextlib.suppress(AttributeError, TypeError):
            self.fs.invalidate_cache(prefix)
        cache = getattr(self.fs, "dircache", None)
        if cache is not None:
            with contextlib.suppress(Exception):
                under = prefix.rstrip("/") + "/"
                for k in [k for k in list(cache) if isinstance(k, str) and k.startswith(under)]:
                    cache.pop(k, None)

    @_clear_errors("starting a writer lease")
    def lease(self, lease_id: str | None = None) -> Lease:
        """A writer's lease (:class:`ObjectLease`): also a ``locks/writer-<id>`` object that gc respects."""
        return ObjectLease(self, lease_id)

    # ---- config and index ----------------------------------------------------------------------
    def _sync_config(self, cache: str, pack_target: int | None) -> None:
        key = f"{self.root}/config"
        try:
            data = self.fs.cat_file(key)
        except FileNotFoundError:
            from tb5sync.store.store import PACK_TARGET

            # format v1 on objects: the index/ objects list pack frames only, no recipes (v2 is local stores only)
            cfg = {"format": "tb5sync-store", "version": 1, "chunk_params": 1,
                   "pack_target": int(pack_target or PACK_TARGET), "quota": None}
            body = json.dumps(cfg).encode()
            try:
                self._put_if_absent(key, body)
            except _Precondition:
                pass
            data = self.fs.cat_file(key)
        try:
            cfg = json.loads(data)
        except ValueError:
            cfg = None
        if not isinstance(cfg, dict) or cfg.get("format") != "tb5sync-store":
            raise UsageError(f"{self.url}: {key} is not a tb5sync store config")
        local = os.path.join(cache, "config")
        tmp = local + f".{secrets.token_hex(6)}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, local)

    def upgrade(self) -> dict[str, Any]:
        """Refused: an object store stays format v1 (its ``index/`` objects list frames, not recipes).

        Raises
        ------
        UsageError
            Always.
        """
        raise UsageError(f"{self.url}: an object store stays store format v1; upgrade works on local stores")

    def sync_index(self) -> dict[str, int]:
        """Copy index objects not yet in the local index, drop rows of packs gone from the store.
        A malformed index object is skipped with a warning (``reindex`` writes it again from its pack).

        Returns ``{"packs_added", "packs_dropped", "malformed"}``.
        """
        try:
            names = {p.rstrip("/").rsplit("/", 1)[-1] for p in self._find(f"{self.root}/index")}
        except FileNotFoundError:
            names = set()
        known = {r[0] for r in self._q("SELECT id FROM packs")}
        added = malformed = 0
        for name in sorted(names - known):
            try:
                meta = msgpack.unpackb(self.fs.cat_file(f"{self.root}/index/{name}"))
                rows = [(bytes(d), name, int(o), int(n)) for d, o, n in meta["chunks"]]
                size, created = int(meta["size"]), float(meta["created"])
                if meta.get("v") != 1:
                    raise ValueError("unknown version")
            except FileNotFoundError:
                continue
            except Exception as exc:  # noqa: BLE001 - any malformed content: skipped, reindex rewrites it
                if not isinstance(exc, (ValueError, TypeError, KeyError, msgpack.UnpackException)):
                    raise
                log.warning("%s: index object %s is malformed (%s); its pack is not used until "
                            "`tb5sync store reindex` rewrites it", self.url, name, exc)
                malformed += 1
                continue
            with self._tx() as db:
                db.execute("INSERT OR IGNORE INTO packs VALUES (?,?,?)", (name, size, created))
                db.executemany("INSERT OR IGNORE INTO chunks VALUES (?,?,?,?)", rows)
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
        return {"packs_added": added, "packs_dropped": dropped, "malformed": malformed}

    def read_chunk(self, digest: bytes) -> bytes:
        """As :meth:`Store.read_chunk`; a chunk not in the local index copy is looked up after a sync."""
        try:
            return super().read_chunk(digest)
        except IntegrityError:
            if self.has(digest):
                raise
            self.sync_index()
            return super().read_chunk(digest)

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

    @_clear_errors("listing refs")
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
        """Record a use of ref ``name``, best effort and in the background: the caller (a read) never waits
        for it. A use within ``TOUCH_EVERY`` s of the last one recorded (by this process, or in the ref
        object) is not written; :meth:`close` waits at most ``TOUCH_WAIT`` s for a write still running."""
        now = time.time()
        with self._lock:
            if now - self._touched.get(name, 0.0) < TOUCH_EVERY:
                return
            self._touched[name] = now
            self._touches = [t for t in self._touches if t.is_alive()]
            t = threading.Thread(target=self._touch_now, args=(name,), daemon=True, name="tb5sync-touch")
            self._touches.append(t)
        t.start()

    def _touch_now(self, name: str) -> None:
        def fn(old: dict[str, Any] | None) -> dict[str, Any] | None:
            if old is None or time.time() - old.get("last_used", 0) < TOUCH_EVERY:
                return None
            return dict(old, last_used=time.time())

        try:
            self._update_ref(name, fn)
        except Exception as exc:  # a read does not fail because its use could not be recorded
            log.debug("%s: last use of %r not recorded: %s", self.url, name, exc)

    @_clear_errors("removing a ref")
    def rm(self, name: str, force: bool = False) -> None:
        """Remove ref ``name`` (a pinned one only with ``force``).

        Raises
        ------
        RefNotFoundError
        RefPinnedError
            ``name`` is pinned and ``force`` is False.
        """
        check_ref_name(name)
        key = f"{self.root}/refs/{name}"
        obj = self._ref_obj(name)
        if obj is None:
            raise RefNotFoundError(f"no ref {name!r} in store {self.url}")
        if obj.get("pinned") and not force:
            raise pinned_error(name, self.url)
        self.fs.rm_file(key)

    @_clear_errors("pinning a ref")
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

    @_clear_errors("writing the ref")
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
        if isinstance(lease, ObjectLease):
            lease._renew()  # live from here to the ref PUT: a gc starting meanwhile defers
        waited = self._wait_for_gc()  # a gc that began before: its deletions are over (and seen below)
        needed = {d for d, _ in mchunks} | all_digests(items)
        loc = self.locate(needed)
        if len(loc) != len(needed) or waited:
            self.sync_index()
            loc = self.locate(needed)
        missing = needed - set(loc)
        if missing:
            why = " (a gc that ran meanwhile deleted it; put it again)" if waited else ""
            raise IntegrityError(f"ref {name!r}: chunk {next(iter(missing)).hex()} is not in the store{why}")
        packs = {p for p, _, _ in loc.values()}
        with self._doing(f"listing {self.root}/index"):
            present = {p.rstrip("/").rsplit("/", 1)[-1] for p in self._find(f"{self.root}/index")}
        if packs - present:
            self.sync_index()  # forget the deleted packs' chunks: putting it again writes them anew
            raise IntegrityError(f"ref {name!r}: pack {sorted(packs - present)[0]} is not (or no longer) in {self.url}"
                                 " (deleted by a gc meanwhile); put it again")
        now = time.time()
        obj = {"name": name, "manifest": manifest.hex(), "mchunks": [[d.hex(), n] for d, n in mchunks],
               "created": created or now, "size": sum(it.size for it in items if it.kind == "f"),
               "files": sum(1 for it in items if it.kind == "f"), "description": description,
               "pinned": False, "last_used": now}

        def fn(old: dict[str, Any] | None) -> dict[str, Any]:
            if old is not None and not replace:
                raise RefExistsError(f"ref {name!r} already exists in store {self.url} with other content "
                                     "(--force replaces it)")
            return dict(obj, pinned=bool(old and old.get("pinned")))

        if self._ref_obj(name) is None:
            self.check_nesting(name)  # a listing: not atomic with the write below, as git's loose refs
        self._update_ref(name, fn, create_only=not replace)
        lease.release()
        return _info(obj)

    @_clear_errors("reading a ref")
    def ref(self, name: str) -> RefInfo:
        """As :meth:`Store.ref` (the ref object)."""
        return super().ref(name)

    @_clear_errors("reading a manifest")
    def manifest(self, name_or_info: str | RefInfo, touch: bool = True) -> list[Item]:
        """As :meth:`Store.manifest`; the use is recorded in the background (:meth:`touch`)."""
        return super().manifest(name_or_info, touch)

    @_clear_errors("cat")
    def cat(self, name: str, path: str | bytes = "", offset: int = 0, length: int | None = None,
            touch: bool = True) -> bytes:
        """As :meth:`Store.cat`."""
        return super().cat(name, path, offset, length, touch)

    @_clear_errors("diff")
    def diff(self, a: str, b: str) -> list[tuple[str, str]]:
        """As :meth:`Store.diff`."""
        return super().diff(a, b)

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

    @_clear_errors("stats")
    def stats(self) -> dict[str, Any]:
        """As :meth:`Store.stats`, refs counted from the ref objects."""
        s = super().stats()
        refs = self.refs()
        s.update(refs=len(refs), files=sum(r.files for r in refs), logical_bytes=sum(r.size for r in refs))
        s["dedup_ratio"] = round(s["logical_bytes"] / s["unique_bytes"], 3) if s["unique_bytes"] else 1.0
        return s

    @_clear_errors("verify")
    def verify(self) -> dict[str, Any]:
        """As :meth:`Store.verify` (:func:`tb5sync.store.gc.verify`): every pack read whole once, every
        indexed chunk re-hashed, each ref's chunks accounted for. ``chunks`` counts the indexed chunks
        checked (``stats()["chunks"]`` when nothing changed in between), ``frames`` the pack frames read."""
        from tb5sync.store.gc import verify

        with self._doing(f"listing {self.root}/index"):
            self.sync_index()
        return verify(self)

    @_clear_errors("reindex")
    def reindex(self) -> dict[str, int]:
        """Rebuild the local index from the packs in the bucket, and write the index object of every pack
        that lacks one (or whose index object is malformed), with the pack's modification time as its
        ``created``; see :func:`tb5sync.store.gc.reindex`.

        Returns ``{"packs", "chunks_added", "rows_dropped", "damaged", "index_objects_written"}``.
        """
        from tb5sync.store.gc import reindex

        with self._doing(f"listing {self.root}/index"):
            self.sync_index()
        return reindex(self)


def _info(obj: dict[str, Any]) -> RefInfo:
    return RefInfo(obj["name"], bytes.fromhex(obj["manifest"]),
                   tuple((bytes.fromhex(d), int(n)) for d, n in obj["mchunks"]), float(obj["created"]),
                   int(obj["size"]), int(obj["files"]), obj.get("description"), bool(obj.get("pinned")),
                   float(obj.get("last_used", obj["created"])))
