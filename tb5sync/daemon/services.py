"""The daemon's request-answering sessions: fs (:class:`~tb5sync.daemon.fsops.FsOps` over ROOT)
and store (``--store``'s :class:`~tb5sync.store.ops.StoreOps`, a tier's with ``--upstream``).

:class:`StoreSessions` is a mixin of :class:`~tb5sync.daemon.server.Server` (it holds the shared store).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tb5sync.errors import PathError, UsageError
from tb5sync.daemon.fsops import FsOps, Pages, Puts, args_from_wire
from tb5sync.wire.messages import FS_DATA_METHODS, FS_METHODS
from tb5sync.tree.quota import WriteQuota
from tb5sync.tree.state import TreeState, check_own_dir
from tb5sync.wire.protocol import FrameType
from tb5sync.wire.rpc import serve
from tb5sync.wire.transport import Channel, hide_root

__all__ = ["FS_CAPABILITIES", "StoreSessions", "serve_fs"]

#: What an fs session's OPEN reply announces beyond ``read_only``: ``pieces``, the server takes
#: ``put_open``/``put_piece``/``put_close`` (a client sends a file in pieces only to a server that says so).
FS_CAPABILITIES: dict[str, Any] = {"pieces": True}


def serve_fs(ch: Channel, root: str, state: TreeState, read_only: bool, pages: Pages,
             quota: WriteQuota | None, puts: Puts) -> None:
    """An fs session: requests as in :class:`~tb5sync.daemon.fsops.FsOps` on ``root`` until BYE
    (``pages`` and ``puts`` shared with the server's other connections, ``quota`` this session's)."""
    ops = FsOps(root, state, read_only, pages, quota=quota, puts=puts)
    try:
        # "pieces": this server takes put_open/put_piece/put_close (older ones lack the key)
        ch.send_control(FrameType.RESPONSE, 0, {"read_only": read_only, **FS_CAPABILITIES})
        serve(ch, ops, FS_METHODS, args_from_wire, data_methods=FS_DATA_METHODS)
    finally:
        ops.close()


class StoreSessions:
    """Store sessions and the ``--store`` directory, for :class:`~tb5sync.daemon.server.Server`."""

    root: str
    read_only: bool
    token: bytes | None
    store_path: str | None
    upstream: str | None
    peers: Sequence[str]
    storage_options: dict[str, Any] | None
    _store_parts: list[str] | None
    _store: Any
    _tier: Any
    _lock: threading.Lock

    if TYPE_CHECKING:
        def _quota(self) -> WriteQuota | None: ...

    def _serve_store(self, ch: Channel) -> None:
        """A store session: :data:`~tb5sync.wire.messages.STORE_METHODS` answered from ``--store``."""
        from tb5sync.wire.messages import STORE_METHODS
        from tb5sync.store import Store
        from tb5sync.store.ops import StoreOps, session_reply

        if self.store_path is None:
            raise UsageError("this server has no artifact store (start it with --store DIR)")
        # read-only without a tier to fill: the store opened read-only for this session only (so
        # it sees what a local writer added since), never created (a missing one: "no store yet")
        session_store = self.read_only and self.upstream is None
        with self._lock:
            if session_store:
                store = Store(self.store_dir(create=False), read_only=True)
            else:
                if self._store is None:
                    self._store = Store(self.store_dir(create=True))
                store = self._store
            if self.upstream is not None and self._tier is None:
                from tb5sync.remote.tiers import Tier

                self._tier = Tier(self._store, self.upstream, self.peers, self.storage_options, self.token)
        try:
            if self._tier is not None:
                from tb5sync.remote.tiers import TieredStoreOps

                ops: StoreOps = TieredStoreOps(store, self.read_only, self._tier)
            else:
                ops = StoreOps(store, self.read_only)
            ops.quota = self._quota()
            try:
                ch.send_control(FrameType.RESPONSE, 0, session_reply(store, self.read_only))
                serve(ch, ops, STORE_METHODS)
            finally:
                ops.close()
        finally:
            if session_store:
                store.close()

    def store_dir(self, create: bool) -> str:
        """The ``--store`` directory, checked (and created, mode 0700, when ``create``); for the
        store sessions and ``serve --http-cache``.

        Below ROOT each component is looked up without following a symlink and must be a
        directory this user owns (:func:`~tb5sync.tree.state.check_own_dir`); a store elsewhere
        (resolved when the server started) must be such a directory too.

        Raises
        ------
        PathError
            A component is a symlink, not a directory or someone else's (the message hides ROOT).
        UsageError
            Missing and not ``create`` (a read-only server has no store yet).
        """
        assert self.store_path is not None
        if self._store_parts is None:
            steps = [self.store_path]
        else:
            steps = [os.path.join(self.root, *self._store_parts[: i + 1]) for i in range(len(self._store_parts))]
        try:
            for i, path in enumerate(steps):
                # written in: this user's; only read (read-only) or the admin's own --store DIR: any owner
                owned = create and self._store_parts is not None
                if check_own_dir(path, owned=owned):
                    continue
                if not create:
                    raise UsageError("this server's artifact store is empty (a read-only server does not create it)")
                try:
                    if i == 0 and self._store_parts is None:
                        os.makedirs(os.path.dirname(path), exist_ok=True)
                    os.mkdir(path, 0o700)
                except FileExistsError:
                    pass
                check_own_dir(path, owned=owned)  # made meanwhile by someone else: checked again
        except PathError as exc:
            raise PathError(hide_root(exc.path, self.root), str(exc).split(": ", 1)[-1]) from None
        return self.store_path
