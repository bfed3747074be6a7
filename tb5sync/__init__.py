"""tb5sync: move files between machines at link speed.

FastCDC chunking, BLAKE3-verified chunks, rsync-like sync over parallel TCP
streams. Public API::

    stats = tb5sync.sync(src, dst, delete=False, exclude=(), checksum=False,
                         dry_run=False, streams=None, compress="auto",
                         progress=None, token=None)

    with tb5sync.Store(path) as st:      # the artifact store (tb5sync.store)
        st.put("models/m/v1", "out/")

Importing the package has no side effects; the server and the store are loaded on first use.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from tb5sync.errors import (
    AuthError,
    ConnectError,
    ConnectionClosedError,
    DestinationError,
    DestinationNotADirectoryError,
    IntegrityError,
    MissingDirectoryError,
    MissingParentError,
    PartialTransferError,
    PathError,
    ProtocolError,
    ReadOnlyError,
    RemoteError,
    RemoteNotFoundError,
    RemoteProtocolError,
    SourceNotFoundError,
    DeleteLimitError,
    SourceChangedError,
    SourceError,
    Tb5syncError,
    UsageError,
    VanishedSourceError,
    VersionMismatchError,
)

from tb5sync.tree.options import Failure, SyncOptions, SyncStats
from tb5sync.api.sync import sync  # the function; its module is tb5sync.api.sync
from tb5sync import _moved

# Module paths from before the layer folders (tb5sync.destination, tb5sync.storeclient, ...) still
# import: the same module objects, found at their new places (tb5sync._moved). The old module
# tb5sync.sync is bound here, so that importing it never rebinds tb5sync.sync, the function.
_moved.install()
sys.modules.setdefault("tb5sync.sync", sys.modules["tb5sync.api.sync"])

if TYPE_CHECKING:
    from tb5sync.daemon.server import Server
    from tb5sync.store import Store

__version__ = "0.1.0"

__all__ = [
    "sync",
    "SyncStats",
    "SyncOptions",
    "Failure",
    "Server",
    "Store",
    "Tb5syncError",
    "UsageError",
    "ProtocolError",
    "RemoteProtocolError",
    "VersionMismatchError",
    "AuthError",
    "ConnectError",
    "ConnectionClosedError",
    "PathError",
    "RemoteNotFoundError",
    "SourceNotFoundError",
    "DeleteLimitError",
    "ReadOnlyError",
    "IntegrityError",
    "SourceChangedError",
    "DestinationError",
    "MissingParentError",
    "MissingDirectoryError",
    "DestinationNotADirectoryError",
    "SourceError",
    "PartialTransferError",
    "VanishedSourceError",
    "RemoteError",
    "__version__",
]

_LAZY = {"Server": "daemon.server", "Store": "store"}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'tb5sync' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value
