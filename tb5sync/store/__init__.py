"""The artifact store: immutable snapshots (trees or files) kept once, deduplicated by chunk.

``Store(path)`` holds packs of FastCDC v1 chunks (the sync engine's chunks), a SQLite index
(digest -> pack, offset, length), manifests stored as chunked objects, and refs (names such as
``builds/main/3f2c1e``) pointing at manifests. See :mod:`tb5sync.store.store` for the API and
docs/ARCHITECTURE.md ("Store format v1") for the layout. The store knows no sockets: moving refs
between nodes is :mod:`tb5sync.remote.storeclient` (client) and :mod:`tb5sync.store.ops` (server side).
"""

from __future__ import annotations

from tb5sync.store.manifest import Item
from tb5sync.store.packs import FsspecPackStorage, LocalPackStorage, PackStorage
from tb5sync.store.store import RefInfo, Store, check_ref_name, default_store_path

__all__ = ["Store", "RefInfo", "Item", "PackStorage", "LocalPackStorage", "FsspecPackStorage", "check_ref_name", "default_store_path"]
