"""Lock objects of the artifact store on an object store: the writer leases (:class:`ObjectLease`,
``locks/writer-*``), the gc lock ``locks/gc-*`` and gc itself, which sweeps only while no young writer
lease exists. See :mod:`tb5sync.store.objstore`.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tb5sync.store.condwrite import LEASE_TTL_OBJ
from tb5sync.store.objerrors import ObjectStoreError, _clear_errors
from tb5sync.store.objpacks import _mtime
from tb5sync.store.store import all_digests
from tb5sync.store.writer import Lease

if TYPE_CHECKING:
    from tb5sync.store.objstore import ObjectStore

#: Default grace period of gc on an object store: packs indexed more recently are never deleted, seconds.
GC_GRACE = 3600.0
#: Most seconds a ref commit waits for a running gc (its ``locks/gc-*`` object) to finish.
GC_WAIT = 600.0


class ObjectLocks:
    """gc and the lock objects of :class:`~tb5sync.store.objstore.ObjectStore` (mixed into it): they use its
    ``fs``, ``root``, ``url``, ``owner``, ``packs``, ``_doing``, ``_find``, ``_q``, ``_tx``, ``sync_index``,
    ``refs`` and ``manifest``."""

    @_clear_errors("gc")
    def gc(self, repack_below: float = 0.5, grace: float = GC_GRACE) -> dict[str, Any]:
        """Delete packs no ref reaches (module docstring); ``repack_below`` is ignored here.

        gc holds ``locks/gc-<id>`` while it runs (ref commits wait for it before checking their packs).
        It does nothing while a writer lease object younger than ``LEASE_TTL_OBJ`` exists (checked before
        and after marking); after the second check it marks again from every ref written meanwhile (their
        writers were done before that check), so a ref committed during the mark keeps its chunks. Lock
        objects (``writer-*``, ``probe-*``, ``gc-*``) older than ``LEASE_TTL_OBJ`` are removed.

        Returns ``{"chunks_deleted", "packs_deleted", "packs_repacked" (0), "orphans", "bytes_freed" (bytes),
        "locks_removed", "deferred" (1 when a live writer lease stopped the sweep), "blocked_by"}``;
        ``blocked_by`` lists the writer leases that stopped it: ``{"lease", "owner", "since", "expires"}``
        (seconds since the epoch).
        """
        res: dict[str, Any] = {"chunks_deleted": 0, "packs_deleted": 0, "packs_repacked": 0, "orphans": 0,
                               "bytes_freed": 0, "locks_removed": 0, "deferred": 0, "blocked_by": []}
        gc_key = f"{self.root}/locks/gc-{secrets.token_hex(8)}"
        with self._doing("writing the gc lock object"):
            self._write_lock(gc_key)
        try:
            with self._doing("listing the lock objects"):
                res["locks_removed"] = self._remove_stale_locks(keep=gc_key)
                blockers = self._writers()
            if blockers:
                res.update(deferred=1, blocked_by=blockers)
                return res
            self.sync_index()
            marked: set[bytes] = set()
            seen: dict[str, bytes] = {}
            for info in self.refs():
                seen[info.name] = info.manifest
                marked.update(d for d, _ in info.mchunks)
                marked |= all_digests(self.manifest(info, touch=False))
            if self._hook_marked is not None:
                self._hook_marked()
            blockers = self._writers()
            if blockers:  # a writer began while we marked: its chunks may be in the dead packs
                res.update(deferred=1, blocked_by=blockers)
                return res
            # a writer that committed while we marked is done (its lease object gone): mark what its ref reaches
            for info in self.refs():
                if seen.get(info.name) != info.manifest:
                    marked.update(d for d, _ in info.mchunks)
                    marked |= all_digests(self.manifest(info, touch=False))
            now = time.time()
            by_pack: dict[str, list[bytes]] = {}
            for d, p in self._q("SELECT digest, pack FROM chunks"):
                by_pack.setdefault(p, []).append(bytes(d))
            created = {p: (c, s) for p, s, c in self._q("SELECT id, size, created FROM packs")}
            dead = [p for p, ds in by_pack.items() if not any(d in marked for d in ds)
                    and now - created.get(p, (now, 0))[0] >= grace]
            renewed = time.monotonic()
            for p in dead:
                if time.monotonic() - renewed > LEASE_TTL_OBJ / 3:
                    self._write_lock(gc_key)
                    renewed = time.monotonic()
                with self._doing(f"deleting pack {p}"):
                    self.packs.delete(p)
                with self._tx() as db:
                    res["chunks_deleted"] += db.execute("DELETE FROM chunks WHERE pack=?", (p,)).rowcount
                    db.execute("DELETE FROM packs WHERE id=?", (p,))
                res["packs_deleted"] += 1
                res["bytes_freed"] += created.get(p, (0, 0))[1]
            # packs without an index object (a writer stopped between the two PUTs), older than the grace
            indexed = {r[0] for r in self._q("SELECT id FROM packs")}
            for name, (size, mtime) in self.packs.list().items():
                if name in indexed or self.fs.exists(f"{self.root}/index/{name}"):
                    continue
                if mtime == 0.0 and grace > 0:
                    continue  # no modification time known: leave it
                if now - mtime >= grace:
                    with self._doing(f"deleting orphan pack {name}"):
                        self.packs.delete(name)
                    res["orphans"] += 1
                    res["bytes_freed"] += size
            return res
        finally:
            with contextlib.suppress(Exception):
                self.fs.rm_file(gc_key)

    #: Called (tests) between gc's mark and its second look at the writer leases.
    _hook_marked: Callable[[], None] | None = None

    def _write_lock(self, key: str, started: float | None = None) -> None:
        body = {"owner": self.owner, "at": time.time(), "started": started or time.time()}
        self.fs.pipe_file(key, json.dumps(body).encode())

    def _locks(self, kind: str) -> list[dict[str, Any]]:
        """Lock objects ``locks/<kind>-*``: ``{"key", "lease", "owner", "since", "modified", "expires", "live"}``."""
        try:
            found = self._find(f"{self.root}/locks", detail=True)
        except FileNotFoundError:
            return []
        now = time.time()
        out = []
        for key, info in found.items():
            base = key.rsplit("/", 1)[-1]
            if not base.startswith(kind + "-"):
                continue
            mt = _mtime(info) or now
            entry = {"key": key, "lease": base, "owner": None, "since": None, "modified": mt,
                     "expires": mt + LEASE_TTL_OBJ, "live": now - mt < LEASE_TTL_OBJ}
            out.append(entry)
        return out

    def _writers(self) -> list[dict[str, Any]]:
        """The live writer leases (``locks/writer-*`` younger than ``LEASE_TTL_OBJ``), with owner and start."""
        out = []
        for e in self._locks("writer"):
            if not e["live"]:
                continue
            with contextlib.suppress(Exception):
                body = json.loads(self.fs.cat_file(e["key"]))
                e["owner"], e["since"] = body.get("owner"), body.get("started", body.get("at"))
            out.append({k: e[k] for k in ("lease", "owner", "since", "expires")})
        return out

    def _live_writers(self) -> bool:
        return bool(self._writers())

    def _remove_stale_locks(self, keep: str = "") -> int:
        """Remove lock objects (writer, probe, gc; not ``keep``) not renewed for ``LEASE_TTL_OBJ`` s; how many."""
        n = 0
        for kind in ("writer", "probe", "gc"):
            for e in self._locks(kind):
                if not e["live"] and e["key"].rstrip("/") != keep:
                    with contextlib.suppress(FileNotFoundError):
                        self.fs.rm_file(e["key"])
                        n += 1
        return n

    def _wait_for_gc(self) -> bool:
        """Wait (at most ``GC_WAIT`` s) until no live ``locks/gc-*`` object exists; whether it had to wait.

        Raises
        ------
        ObjectStoreError
            A gc is still running after ``GC_WAIT`` s.
        """
        end = time.monotonic() + GC_WAIT
        waited = False
        while True:
            live = [e for e in self._locks("gc") if e["live"]]
            if not live:
                return waited
            waited = True
            if time.monotonic() > end:
                raise ObjectStoreError(f"{self.url}: a gc ({live[0]['lease']}) has held the store for more than "
                                       f"{GC_WAIT:g} s; the ref was not written")
            time.sleep(0.2)


class ObjectLease(Lease):
    """A :class:`~tb5sync.store.writer.Lease` in the local index plus a writer lease object
    ``locks/writer-<id>`` (JSON ``{"owner", "at", "started"}``) in the store, rewritten at least every
    ``LEASE_TTL_OBJ / 3`` seconds while the writer protects chunks and before its ref commit, removed on
    release (if that removal fails, the object expires after ``LEASE_TTL_OBJ`` s and gc removes it);
    gc sweeps nothing while a young one exists.

    Raises
    ------
    ObjectStoreError
        The lease object cannot be written (the local lease row is dropped again).
    """

    def __init__(self, store: ObjectStore, lease_id: str | None = None) -> None:
        super().__init__(store, lease_id)
        self.obj_store = store
        self.key = f"{store.root}/locks/writer-{self.id}"
        self._written = 0.0
        self.started = time.time()
        try:
            self._renew()
        except BaseException:
            with contextlib.suppress(Exception):
                super().release()
            raise

    def _renew(self) -> None:
        with self.obj_store._doing(f"writing the writer lease object {self.key}"):
            self.obj_store._write_lock(self.key, self.started)
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
