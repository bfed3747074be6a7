"""A server's store as a cache tier in front of a shared one (``tb5sync serve --store DIR --upstream URL``).

Read-through: a ref the local store lacks (asked by ``ref``, ``list`` or ``read``) is first pulled into it
(:func:`tb5sync.remote.fanout.pull_fanout`): chunks already local are kept, the rest are fetched at once from
the ``--peer`` servers and the upstream in disjoint batches, the nearest answering fastest and so
taking the most. The ref itself is looked up in the upstream first (the shared tier is the authority),
then in the peers. A ref being filled here is not offered to a peer that asks for it meanwhile
(two tiers naming each other as peers do not wait on each other).

Write-through: a ``commit`` (a push into this server) is copied into the upstream before the push
is answered; if that fails the push fails with the upstream's error (the local ref stays: it is whole).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from tb5sync.errors import RefNotFoundError
from tb5sync.remote.fanout import PeerSource, StoreSource, pull_fanout
from tb5sync.store.objstore import open_store
from tb5sync.store.ops import StoreOps
from tb5sync.store.store import Store

__all__ = ["Tier", "TieredStoreOps"]


class Tier:
    """The upstream store and peers of one server; shared by its connections.

    Parameters
    ----------
    local : Store
        The server's own store (the cache).
    upstream : str
        fsspec URL or directory of the shared store.
    peers : list of str
        ``tb5://HOST[:PORT]`` servers with stores (other nodes of the farm).
    storage_options : dict, optional
        For ``upstream``.
    token : bytes or str, optional
        For the peers.
    """

    def __init__(self, local: Store, upstream: str, peers: Sequence[str] = (),
                 storage_options: dict[str, Any] | None = None, token: bytes | str | None = None) -> None:
        self.local = local
        self.upstream = open_store(upstream, storage_options)
        self.upstream_label = upstream
        self.peers = list(peers)
        self.token = token
        self._lock = threading.Lock()
        self._filling: dict[str, threading.Lock] = {}

    def fill(self, name: str) -> bool:
        """Pull ref ``name`` into the local store (module docstring); False when it is being filled by this
        server already in another request that is waiting on a peer (the caller answers "not found")."""
        with self._lock:
            lk = self._filling.setdefault(name, threading.Lock())
        if not lk.acquire(blocking=False):
            return False
        try:
            if self.local._ref_row(name) is not None:
                return True
            sources = [StoreSource(self.upstream, self.upstream_label)] + [PeerSource(p, self.token) for p in self.peers]
            try:
                pull_fanout(self.local, name, sources)
            finally:
                for s in sources[1:]:
                    s.close()
            return True
        finally:
            lk.release()

    def write_through(self, name: str, replace: bool) -> None:
        """Copy ref ``name`` of the local store into the upstream (only the chunks it lacks)."""
        up = self.upstream._ref_row(name)
        if up is not None and up.manifest == self.local.ref(name).manifest:
            return
        pull_fanout(self.upstream, name, [StoreSource(self.local, "local")], replace=replace)

    def close(self) -> None:
        """Close the upstream store."""
        self.upstream.close()


class TieredStoreOps(StoreOps):
    """:class:`~tb5sync.store.ops.StoreOps` with read-through and write-through to a :class:`Tier`."""

    def __init__(self, store: Store, read_only: bool, tier: Tier) -> None:
        super().__init__(store, read_only)
        self.tier = tier

    def _through(self, fn: Any, name: str, *args: Any) -> Any:
        try:
            return fn(name, *args)
        except RefNotFoundError:
            if not self.tier.fill(name):
                raise
            return fn(name, *args)

    def ref(self, name: str) -> dict[str, Any]:
        return self._through(super().ref, name)

    def list(self, name: str) -> dict[str, Any]:
        return self._through(super().list, name)

    def read(self, name: str, path: str, offset: int = 0, length: int | None = None) -> tuple[dict[str, Any], list[Any]]:
        return self._through(lambda n: super(TieredStoreOps, self).read(n, path, offset, length), name)

    def refs(self, prefix: str = "") -> dict[str, Any]:
        """Local refs and the upstream's, by name (a local one wins)."""
        from tb5sync.store.ops import ref_to_wire

        out = {r[0]: r for r in super().refs(prefix)["refs"]}
        for info in self.tier.upstream.refs(prefix):
            out.setdefault(info.name, ref_to_wire(info))
        return {"refs": [out[k] for k in sorted(out)]}

    def commit(self, lease: str, name: str, manifest: bytes, mchunks: bytes, description: str | None = None,
               created: float | None = None, replace: bool = False) -> dict[str, Any]:
        res = super().commit(lease, name, manifest, mchunks, description, created, replace)
        self.tier.write_through(name, bool(replace))
        return res
