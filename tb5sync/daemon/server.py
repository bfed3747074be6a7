"""The tb5sync daemon: authentication, allow-list, path jail, read-only mode, sessions.

Each TCP connection authenticates (HMAC challenge-response, see
:mod:`tb5sync.wire.protocol`), then sends OPEN naming what it wants:

``{"op": "pull", "path", "options", "streams"}``
    The server hosts a :class:`~tb5sync.roles.sender.Sender` for ``path``; the client's receiver drives.
``{"op": "push", "path", "name", "src_kind", "dst_slash", "options", "streams"}``
    The server hosts a :class:`~tb5sync.roles.receiver.Receiver` writing under ``path``;
    it drives the client's sender over the session's streams.
``{"op": "join", "session", "index"}``
    An extra stream for an open session (push or pull).
``{"op": "ls", "path"}``
    One directory level (or one entry) under ``path``.
``{"op": "fs"}``
    A file-system session for :mod:`tb5sync.fs.filesystem`: requests as in
    :class:`~tb5sync.daemon.fsops.FsOps` until BYE.

Every error in one connection ends that connection (after an ERROR frame to
the peer); the server itself keeps serving.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tb5sync._os.diskbench import remove_stale
from tb5sync._os.paths import STATE_DIR
from tb5sync.daemon.admission import AuthLimiter, Janitor, is_loopback, peer_key
from tb5sync.daemon.benchops import disk, ping, sink, source
from tb5sync.daemon.services import StoreSessions, serve_fs
from tb5sync.daemon.sessions import Session, TransferSessions, ls
from tb5sync.errors import (
    shown,
    ArgumentTypeError,
    AuthError,
    BusyError,
    ConnectError,
    RefusedError,
    Tb5syncError,
    UsageError,
)
from tb5sync.daemon.fsops import Pages, Puts
from tb5sync.roles.generator import MAX_ENTRIES, MAX_LISTING_BYTES, ListingLimits
from tb5sync.wire.messages import DEFAULT_PORT
from tb5sync.tree.quota import WriteQuota
from tb5sync.tree.entry import path_from_wire
from tb5sync._os.netif import AllowList, bind_host, peer_address
from tb5sync.tree.options import SyncOptions
from tb5sync.wire.protocol import FrameType
from tb5sync.tree.state import TreeState, check_own_dir
from tb5sync.wire.transport import IO_TIMEOUT, KEEPALIVE, Channel, host_port, server_handshake, set_keepalive, tune_socket
import tb5sync.wire.protocol as P

# The sessions have modules of their own (sessions, benchops, services); every name this module
# offered before them stays importable from it. Patch a name where it is used: in the session's module.
import dataclasses  # noqa: F401
import secrets  # noqa: F401
from tb5sync._os.paths import Jail, follow_slash, resolve_in_root  # noqa: F401
from tb5sync.daemon.benchops import SOURCE_BLOCK as _SOURCE_BLOCK, Ping as _Ping  # noqa: F401
from tb5sync.daemon.fsops import FsOps, args_from_wire  # noqa: F401
from tb5sync.daemon.services import FS_CAPABILITIES  # noqa: F401
from tb5sync.daemon.sessions import JOIN_TIMEOUT as _JOIN_TIMEOUT, Session as _Session  # noqa: F401
from tb5sync.errors import DestinationError, PathError, ReadOnlyError, RemoteNotFoundError, RemoteProtocolError  # noqa: F401
from tb5sync.wire.messages import BENCH_MAX_BYTES, BENCH_MAX_DISK, FS_DATA_METHODS, FS_METHODS, PING_METHODS, SENDER_METHODS, result_pages  # noqa: F401
from tb5sync.tree.entry import DIR, FILE, LINK, path_to_wire  # noqa: F401
from tb5sync.tree.scan import scan  # noqa: F401
from tb5sync.tree.options import known_options  # noqa: F401
from tb5sync.remote.links import RemoteLink  # noqa: F401
from tb5sync.roles.receiver import Receiver, dest_base, prepare_dest_dir, scan_in_background  # noqa: F401
from tb5sync.roles.sender import Sender  # noqa: F401
from tb5sync.wire.rpc import Requester, serve  # noqa: F401
from tb5sync.wire.transport import hide_root, peer_closed  # noqa: F401

__all__ = ["Server"]

log = logging.getLogger(__name__)

#: accept() errors that mean "out of descriptors or memory": wait, do not spin.
_ACCEPT_BACKOFF_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_BACKOFF_MIN = 0.05
_BACKOFF_MAX = 1.0


def _check_server_arguments(
    root: object, host: object, port: object, token: object, allow: object, read_only: object, state_dir: object
) -> None:
    """Check the types of :class:`Server`'s arguments, naming the first wrong one.

    Raises
    ------
    ArgumentTypeError
        (a ``TypeError`` and a ``UsageError``) e.g. ``allow="10.0.0.0/8"`` (a str, not a list
        of networks), ``port="8873"``.
    """

    def bad(name: str, want: str, got: object) -> ArgumentTypeError:
        return ArgumentTypeError(f"Server(): {name} must be {want}, not {type(got).__name__} {got!r:.80}")

    if not isinstance(root, (str, os.PathLike)):
        raise bad("root", "a str or os.PathLike", root)
    if not isinstance(host, str):
        raise bad("host", "a str", host)
    if isinstance(port, bool) or not isinstance(port, int):
        raise bad("port", "an int", port)
    if token is not None and not isinstance(token, (str, bytes)):
        raise bad("token", "bytes, str or None", token)
    if isinstance(allow, (str, bytes)) or not isinstance(allow, Iterable) or not all(isinstance(c, str) for c in allow):
        raise bad("allow", "a list of CIDR strings (allow=['10.0.0.0/8'])", allow)
    if not isinstance(read_only, bool):
        raise bad("read_only", "a bool", read_only)
    if state_dir is not None and not isinstance(state_dir, (str, os.PathLike)):
        raise bad("state_dir", "a str, os.PathLike or None", state_dir)


class Server(TransferSessions, StoreSessions):
    """Serve ``root`` over TCP (optionally TLS).

    Parameters
    ----------
    root : str or path
        Directory to serve; nothing outside it is read or written.
    host : str
        Address to bind (default 127.0.0.1), an IPv6 link-local one with its zone
        (``fe80::1%bridge0``), or an interface's name (its address, :func:`tb5sync._os.netif.bind_host`).
    port : int
        TCP port; 0 picks a free one (read :attr:`port` after :meth:`start`).
    token : bytes or str or None
        Shared secret for HMAC authentication; None accepts any client (loopback use).
    allow : sequence of str
        CIDR networks clients may connect from, or interface names (their subnets, IPv4 and IPv6,
        followed as they change: :class:`tb5sync._os.netif.AllowList`); empty allows all.
    read_only : bool
        Refuse pushes (writes) with :class:`~tb5sync.errors.ReadOnlyError`.
    state_dir : str or path, optional
        Where the root's scan cache, chunk index and partial files live; ``ROOT/.tb5sync``
        by default.
    store : str or path or None
        An artifact store (:class:`tb5sync.store.Store`) to serve to ``{"op": "store"}`` sessions
        (``tb5sync store push/pull``); None: such sessions are refused.
    no_auth : bool
        Allow ``token=None`` on an address that is not loopback. Without it, :meth:`bind`
        refuses: a daemon reachable from a network serves only those who hold the token.
    max_connections : int
        Connections open at once (handshaking or in a session, every stream counted);
        more are refused at once with :class:`~tb5sync.errors.BusyError`. Each holds
        one thread and, after authentication, at most one frame of
        :data:`tb5sync.wire.protocol.MAX_PAYLOAD` bytes (64 MiB) in memory; before it, at most
        :data:`tb5sync.wire.protocol.MAX_HANDSHAKE` (512) bytes.
    max_sessions : int
        Sessions (OPENs other than ``join``) at once; more get ``BusyError``.
    max_entries : int
        Entries of a pushing peer's source listing held for one session (directory summaries and
        listed entries together, :class:`tb5sync.roles.generator.ListingLimits`); a listing past it, or
        whose first page announces more directories, ends the session with ``UsageError``.
    max_listing_bytes : int
        Bytes of that listing held (:data:`tb5sync.roles.generator.ENTRY_COST` per entry plus
        :data:`tb5sync.roles.generator.STRING_COST` per byte of its path, link target and extended
        attributes: what the server really holds, measured); past it, the same.
    max_session_bytes : int or None
        Bytes one session (a push, an fs or a store connection) may write, counted as the sizes
        of the files it writes, each charged before any byte of it is written
        (:class:`tb5sync.tree.quota.WriteQuota`); past it the write is refused with
        :class:`~tb5sync.errors.QuotaError` (a push stops; an fs request fails). None: no limit.
    min_free_space : int
        Free bytes a session's write must leave on ROOT's file system; 0: not checked.
    max_unauthenticated_per_address : int
        Connections from one peer (an IPv4 address or an IPv6 /64) that have not completed the
        handshake yet; more from it are refused at once with ``BusyError``, so one address
        cannot hold every ``max_connections`` slot for ``handshake_timeout`` seconds at a time.
    handshake_timeout : float
        Seconds from accept to a complete handshake and OPEN (TLS's included); a whole
        deadline, not per read.
    io_timeout : float or None
        Progress timeout of a started frame, seconds, both directions; also the longest sent
        data may stay unacknowledged (``TCP_USER_TIMEOUT``). None: none.
    idle_timeout : float or None
        Seconds a session may wait for the peer's next frame (a request, or a reply it owes);
        then it is ended and its resources released. None: no limit (keepalive still ends
        sessions whose peer died).
    keepalive : float or None
        TCP keepalive idle time, seconds (see :func:`tb5sync.wire.transport.set_keepalive`); a dead
        peer is found in about twice this. None: off.
    auth_limit : int
        Failed authentications allowed per peer (an IPv4 address or an IPv6 /64) within
        ``auth_window`` seconds; past it the peer is refused before its MAC is checked until
        the oldest failure is older than the window. 0: no limit. Each failure is logged
        (WARNING) with the peer's address.
    auth_window : float
        The window of ``auth_limit``, seconds.
    tls_cert, tls_key : str or None
        PEM certificate chain and private key: serve over TLS (``ssl`` module, TLS >= 1.2).
        Clients connect with ``tb5s://`` URLs. The token is still required as configured.
    upstream : str or None
        With ``store``: a shared store (``s3://bucket/prefix``, any fsspec URL, or a directory) the
        local store caches: refs it lacks are read through, pushes written through
        (:mod:`tb5sync.remote.tiers`).
    peers : sequence of str
        ``tb5://HOST[:PORT]`` servers whose stores a read-through also fetches from, in parallel.
    storage_options : dict or None
        fsspec options for ``upstream``.
    fs_workers : int
        0..64 worker processes answering fs (tb5://) sessions (:mod:`tb5sync.daemon.fsworkers`),
        started with :meth:`serve_forever`; 0 (default), or where a socket cannot be passed to
        another process (no ``socket.send_fds``, ``TB5SYNC_FS_WORKERS_PORTABLE=1``): in this process.

    Raises
    ------
    UsageError
        ``root`` is not a directory, a CIDR is malformed, a cap is not positive, the TLS
        files cannot be loaded, or ``$TB5SYNC_HASH_THREADS`` / ``$TB5SYNC_CHUNK_THREADS`` is not
        a valid thread count.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        token: bytes | str | None = None,
        allow: Sequence[str] = (),
        read_only: bool = False,
        state_dir: str | os.PathLike[str] | None = None,
        store: str | os.PathLike[str] | None = None,
        *,
        no_auth: bool = False,
        max_connections: int = 256,
        max_sessions: int = 64,
        max_unauthenticated_per_address: int = 16,
        max_entries: int = MAX_ENTRIES,
        max_listing_bytes: int = MAX_LISTING_BYTES,
        max_session_bytes: int | None = None,
        min_free_space: int = 0,
        handshake_timeout: float = 10.0,
        io_timeout: float | None = IO_TIMEOUT,
        idle_timeout: float | None = 3600.0,
        keepalive: float | None = KEEPALIVE,
        auth_limit: int = 10,
        auth_window: float = 60.0,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        upstream: str | None = None,
        peers: Sequence[str] = (),
        storage_options: dict[str, Any] | None = None,
        fs_workers: int = 0,
    ) -> None:
        from tb5sync.engine.chunking import warn_if_pure_python
        from tb5sync.engine.hashing import check_environment

        check_environment()  # a bad $TB5SYNC_HASH_THREADS is reported as the server starts
        warn_if_pure_python()
        _check_server_arguments(root, host, port, token, allow, read_only, state_dir)
        if not isinstance(fs_workers, int) or isinstance(fs_workers, bool) or not 0 <= fs_workers <= 64:
            raise UsageError(f"fs_workers must be 0..64, got {fs_workers!r}")
        given_root = os.path.abspath(os.fspath(root))
        root = os.path.realpath(os.fspath(root))
        if not os.path.isdir(root):
            raise UsageError(f"server root is not a directory: {root}")
        self.root = root
        self.host = bind_host(host)  # an interface name -> its address (tb5sync._os.netif)
        self._port = port
        self.token = token.encode() if isinstance(token, str) else token
        if self.token == b"":
            raise UsageError("the token is empty")
        self.allow = AllowList(allow)  # CIDRs and interface names (tb5sync._os.netif)
        for name, value in (("max_connections", max_connections), ("max_sessions", max_sessions),
                            ("max_unauthenticated_per_address", max_unauthenticated_per_address),
                            ("max_entries", max_entries), ("max_listing_bytes", max_listing_bytes)):
            if not isinstance(value, int) or value < 1:
                raise UsageError(f"{name} must be a positive integer, not {value!r}")
        for name, secs in (("handshake_timeout", handshake_timeout), ("io_timeout", io_timeout),
                           ("idle_timeout", idle_timeout), ("keepalive", keepalive), ("auth_window", auth_window)):
            if secs is not None and not secs > 0:
                raise UsageError(f"{name} must be positive seconds, not {secs!r}")
        self.read_only = read_only
        self.no_auth = no_auth
        self.max_connections = max_connections
        self.max_sessions = max_sessions
        self.listing_limits = ListingLimits(max_entries, max_listing_bytes)
        WriteQuota(root, max_session_bytes, min_free_space)  # checks the limits once, here
        self.max_session_bytes = max_session_bytes
        self.min_free_space = min_free_space
        self.max_unauthenticated_per_address = max_unauthenticated_per_address
        self.handshake_timeout = handshake_timeout
        self.io_timeout = io_timeout
        self.idle_timeout = idle_timeout
        self.keepalive = keepalive
        self._auth = AuthLimiter(auth_limit, auth_window)
        self.tls: ssl.SSLContext | None = None
        if (tls_cert is None) != (tls_key is None):
            raise UsageError("TLS needs both a certificate (--tls-cert) and its key (--tls-key)")
        if tls_cert is not None and tls_key is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            try:
                ctx.load_cert_chain(os.fspath(tls_cert), os.fspath(tls_key))
            except (OSError, ssl.SSLError) as exc:
                raise UsageError(f"cannot load the TLS certificate {os.fspath(tls_cert)} and key: {getattr(exc, 'strerror', None) or exc}") from exc
            self.tls = ctx
        # a read-only server writes nothing under its root, not even its own scan cache
        sdir = None if state_dir is None else os.path.abspath(os.fspath(state_dir))
        writable = not read_only and (os.access(root, os.W_OK) if sdir is None else True)
        # tb5sync's own directories (ROOT/.tb5sync, --state-dir): real directories (this user's
        # when the server writes its state there), or missing; else the server stops (PathError)
        check_own_dir(os.path.join(root, STATE_DIR), owned=writable and sdir is None)
        if sdir is not None:
            check_own_dir(sdir, owned=writable)
        self.state = TreeState(root, writable=writable, state_dir=sdir)
        if writable:
            remove_stale(self.state.state_dir)  # disk-test files of a server killed mid-test
        self.fs_workers = fs_workers
        #: the worker processes answering fs sessions (started with the server; None: in process)
        self._fs_pool: Any = None
        self._sdir = sdir
        self._writable = writable
        self._sessions: dict[str, Session] = {}
        self._open_sessions = 0
        self._pages = Pages()
        self._puts = Puts()
        self._lock = threading.Lock()
        self._disk_lock = threading.Lock()  # one disk test at a time
        self._conns: set[Channel] = set()
        self._handlers: set[threading.Thread] = set()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        #: the store's components below ROOT when it lies there (``--store`` alone: ROOT/.tb5sync/store):
        #: each is looked up without following symlinks; a store elsewhere is resolved once, here
        self._store_parts: list[str] | None = None
        self.store_path: str | None = None
        if store is not None:
            sp = os.path.abspath(os.fspath(store))
            for r in (given_root, root):
                if sp.startswith(r.rstrip("/") + "/"):
                    self._store_parts = sp[len(r.rstrip("/")) + 1 :].split("/")
                    sp = os.path.join(root, *self._store_parts)
                    break
            else:
                sp = os.path.realpath(sp)
            self.store_path = sp
        self._store: Any = None
        self._janitor: Janitor | None = None
        self._logged: dict[str, float] = {}
        if upstream is not None and store is None:
            raise UsageError("--upstream needs --store (the local tier)")
        self.upstream, self.peers, self.storage_options = upstream, list(peers), storage_options
        self._tier: Any = None
        self._log_lock = threading.Lock()
        self._pending: dict[str, int] = {}  # peer_key -> connections not authenticated yet

    @property
    def port(self) -> int:
        """The bound port (the real one when constructed with port 0)."""
        return self._port

    @property
    def connections(self) -> int:
        """Connections open now (handshaking or in a session)."""
        with self._lock:
            return len(self._conns)

    @property
    def threads(self) -> int:
        """Connection threads alive now."""
        with self._lock:
            return len(self._handlers)

    def bind(self) -> None:
        """Create the listening socket.

        Raises
        ------
        UsageError
            No token, an address that is not loopback, and ``no_auth`` not given.
        ConnectError
            The address cannot be bound (in use, not local).
        """
        if self.token is None and not self.no_auth and not is_loopback(self.host):
            raise UsageError(
                f"refusing to serve {self.host} without a token: anyone who can reach it could read and write "
                f"the tree; give a token (--token-file or TB5SYNC_TOKEN), or --no-auth to allow it"
            )
        try:
            infos = socket.getaddrinfo(self.host, self._port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            family, _, _, _, addr = infos[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(128)
        except OSError as exc:
            raise ConnectError(f"cannot listen on {host_port(self.host, self._port)}: {exc.strerror or exc}") from exc
        self._sock = sock
        self._port = int(sock.getsockname()[1])  # the real port, also after stop() closed the socket

    def start(self) -> Server:
        """Bind (if needed) and serve in a background thread; returns self."""
        if self._sock is None:
            self.bind()
        self._start_fs_workers()  # before it returns: the caller may look at fs_worker_pids at once
        self._thread = threading.Thread(target=self.serve_forever, name="tb5-server", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Accept connections until :meth:`stop`; each connection gets its own thread.

        Never ends on a peer's doing: at the connection cap, or when a thread cannot be
        started, the connection is refused with ``BusyError``; when ``accept`` runs out of
        descriptors or memory (``EMFILE``, ``ENFILE``, ``ENOBUFS``, ``ENOMEM``) it waits,
        50 ms doubling up to 1 s, instead of spinning.
        """
        if self._sock is None:
            self.bind()
        assert self._sock is not None
        if self._janitor is None:
            self._janitor = Janitor()
        self._start_fs_workers()
        log.info("serving %s on %s%s", self.root, host_port(self.host, self.port), " (TLS)" if self.tls else "")
        backoff = 0.0
        while not self._stopping.is_set():
            try:
                conn, addr = self._sock.accept()
            except OSError as exc:
                if self._stopping.is_set():
                    break
                if exc.errno in _ACCEPT_BACKOFF_ERRNOS:
                    backoff = min(_BACKOFF_MAX, max(_BACKOFF_MIN, backoff * 2))
                    if backoff == _BACKOFF_MIN:
                        log.warning("cannot accept connections: %s; backing off (lower --max-connections "
                                    "or raise the descriptor limit)", exc.strerror or exc)
                    self._stopping.wait(backoff)
                continue
            backoff = 0.0
            self._accepted(conn, addr)

    def _start_fs_workers(self) -> None:
        """Start the ``fs_workers`` processes (once; :mod:`tb5sync.daemon.fsworkers`), or log why
        fs sessions stay in this process where they cannot be handed over here."""
        with self._lock:
            if not self.fs_workers or self._fs_pool is not None or self._stopping.is_set():
                return
            from tb5sync.daemon import fsworkers

            why = fsworkers.available()
            if why is not None:
                log.warning("fs sessions served in the server's process, not by %d workers: %s", self.fs_workers, why)
                self.fs_workers = 0
                return
            try:
                self._fs_pool = fsworkers.FsWorkers(self.fs_workers, {
                    "root": self.root, "state_dir": self._sdir, "writable": self._writable, "read_only": self.read_only,
                    "max_session_bytes": self.max_session_bytes, "min_free_space": self.min_free_space,
                    "io_timeout": self.io_timeout, "idle_timeout": self.idle_timeout})
            except OSError as exc:
                log.warning("fs sessions served in the server's process: cannot start %d workers: %s", self.fs_workers, exc)
                self.fs_workers = 0

    @property
    def fs_worker_pids(self) -> list[int]:
        """Process ids of the fs worker processes running (empty: fs sessions served in this process)."""
        pool = self._fs_pool
        return pool.pids if pool is not None else []

    def _refuse(self, conn: socket.socket, exc: Tb5syncError) -> None:
        assert self._janitor is not None
        self._janitor.refuse(conn, P.error_frame(0, exc))

    def _log_once(self, what: str, msg: str, *args: Any) -> None:
        """Log a refusal at most once per 10 s per kind (a flood of refused connections is not a flood of log lines)."""
        now = time.monotonic()
        with self._log_lock:
            if now - self._logged.get(what, -1e9) <= 10:
                return
            self._logged[what] = now
        log.warning(msg, *args)

    def _accepted(self, conn: socket.socket, addr: Any) -> None:
        ip = peer_address(addr)  # with its zone when link-local (fe80::2%bridge0)
        if not self._allowed(ip):  # refused before a thread exists
            self._log_once("allow", "refused %s: not in --allow (such refusals are logged once per 10 s)", ip)
            self._refuse(conn, RefusedError(f"client address {ip} is not allowed (not in the server's --allow)"))
            return
        wait = self._auth.blocked_for(ip)
        if wait:
            if self._auth.first_refusal(ip):  # once per lockout: an attacker cannot flood the log
                log.warning("refusing %s for %.0f s: too many failed authentications", ip, wait)
            self._refuse(conn, AuthError(f"too many failed authentications from {ip}; try again in {wait:.0f} s"))
            return
        key = peer_key(ip)
        with self._lock:
            busy = len(self._conns) >= self.max_connections
            crowded = not busy and self._pending.get(key, 0) >= self.max_unauthenticated_per_address
            if not busy and not crowded:
                try:
                    ch = Channel(conn, io_timeout=self.handshake_timeout)
                except OSError:
                    conn.close()
                    return
                self._conns.add(ch)
                self._pending[key] = self._pending.get(key, 0) + 1
        if crowded:
            self._log_once("pending", "refusing connections from %s: %d not authenticated yet "
                           "(--max-pending-per-address; such refusals are logged once per 10 s)",
                           ip, self.max_unauthenticated_per_address)
            self._refuse(conn, BusyError(f"server busy: {self.max_unauthenticated_per_address} connections from "
                                         f"{ip} not authenticated yet (its --max-pending-per-address); try again later"))
            return
        if busy:
            self._log_once("busy", "refusing connections: %d open (--max-connections)", self.max_connections)
            self._refuse(conn, BusyError(f"server busy: {self.max_connections} connections open (its --max-connections); try again later"))
            return
        t = threading.Thread(target=self._handle, args=(ch, addr), name=f"tb5-conn-{addr[1]}", daemon=True)
        with self._lock:
            self._handlers.add(t)
        try:
            t.start()
        except RuntimeError as exc:  # the process is out of threads
            with self._lock:
                self._handlers.discard(t)
                self._conns.discard(ch)
            self._authenticated(ip)
            log.warning("refusing a connection from %s: cannot start a thread: %s", ip, exc)
            self._refuse(conn, BusyError("server busy: cannot start a thread for the connection; try again later"))

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, close every connection, wait for every connection thread.

        Sessions in progress end as a broken connection would end them (a push's partial
        file stays in the resumable partial store; nothing half-written reaches a final path).

        Parameters
        ----------
        timeout : float
            Seconds to wait for connection threads to finish; one still running after it is
            logged (its daemon thread ends with the process).
        """
        self._stopping.set()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        with self._lock:
            conns = list(self._conns)
            pool, self._fs_pool = self._fs_pool, None
        for ch in conns:
            ch.close()
        if pool is not None:  # the workers close the sessions they serve; their threads here return
            pool.close(timeout)
        if self._thread is not None:
            self._thread.join(timeout=5)
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                left = list(self._handlers)
                conns = list(self._conns)
            for ch in conns:  # channels a session took over meanwhile
                ch.close()
            if not left:
                break
            if time.monotonic() >= deadline:
                log.warning("stop: %d connection threads still running after %.0f s", len(left), timeout)
                break
            left[0].join(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
        if self._janitor is not None:
            self._janitor.close()
        self.state.close()
        if self._tier is not None:
            self._tier.close()
        if self._store is not None:
            self._store.close()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- one connection ---------------------------------------------------------------
    def _allowed(self, ip: str) -> bool:
        return not self.allow or (ip or "") in self.allow

    def _authenticated(self, ip: str) -> None:
        """``ip``'s connection is no longer pending authentication (it passed, or it ended)."""
        key = peer_key(ip)
        with self._lock:
            n = self._pending.get(key, 0) - 1
            if n > 0:
                self._pending[key] = n
            else:
                self._pending.pop(key, None)

    def _handle(self, ch: Channel, addr: Any) -> None:
        keep = False
        assert self._janitor is not None
        current = [ch]  # the channel the deadline closes (the TLS one once it is wrapped)
        timed_out = threading.Event()

        def expire() -> None:
            timed_out.set()
            current[-1].close()

        deadline = self._janitor.deadline(self.handshake_timeout, expire)
        pending = True
        counted = False
        try:
            tune_socket(ch.sock)
            set_keepalive(ch.sock, self.keepalive, self.io_timeout)
            ch.hide_root = self.root
            if self.tls is not None:
                ch = self._wrap_tls(ch)
                current.append(ch)
            charged = [0]  # failures in the window counting this attempt; 0: its MAC was not checked
            try:
                server_handshake(ch, self.token, lambda: self._auth_gate(addr[0], charged))
            except AuthError as exc:
                if charged[0]:
                    log.warning("authentication failed from %s port %s (%d in the last %.0f s): %s",
                                addr[0], addr[1], charged[0], self._auth.window, exc)
                raise
            pending = False
            self._authenticated(addr[0])
            ch.max_payload = P.MAX_PAYLOAD
            ch.max_decoded = P.SERVER_MAX_DECODED
            got = ch.recv_frame()
            if got is None:
                return
            header, payload = got
            if header.type is not FrameType.OPEN:
                raise UsageError(f"expected OPEN, got {header.type.name}")
            msg = P.decode_control(payload, max_decoded=ch.max_decoded)
            self._janitor.cancel(deadline)
            if ch.closed:  # the deadline passed just now
                return
            ch.set_io_timeout(self.io_timeout)
            ch.idle_timeout = self.idle_timeout
            if msg.get("op") != "join":
                with self._lock:
                    if self._open_sessions >= self.max_sessions:
                        raise BusyError(f"server busy: {self.max_sessions} sessions open (its --max-sessions); try again later")
                    self._open_sessions += 1
                    counted = True
            keep = self._open(ch, msg)
        except (Tb5syncError, OSError) as exc:
            if not timed_out.is_set():  # a timeout is logged below
                log.info("connection from %s ended: %s", addr[0], exc)
            if not isinstance(exc, OSError) or isinstance(exc, Tb5syncError):
                ch.send_error(0, exc)
        except Exception as exc:  # a bug must not take the server down
            log.exception("internal error serving %s", addr[0])
            ch.send_error(0, exc)
        finally:
            self._janitor.cancel(deadline)
            if timed_out.is_set() and not self._stopping.is_set():
                self._log_once("handshake-timeout", "closed a connection from %s: handshake not done within %g s "
                               "(--handshake-timeout; such closes are logged once per 10 s)", addr[0], self.handshake_timeout)
            if pending:
                self._authenticated(addr[0])
            with self._lock:
                if counted:
                    self._open_sessions -= 1
                if not keep:
                    self._conns.discard(ch)
                self._handlers.discard(threading.current_thread())
            if not keep:
                ch.close()

    def _auth_gate(self, ip: str, charged: list[int]) -> Callable[[], None]:
        """Right before an AUTH's MAC is checked: refuse ``ip`` when it is over its failure limit
        (whatever it was when it connected), else count a failure now, refunded when the MAC
        proves right (so parallel handshakes cannot each pass the limit before any fails).

        Raises
        ------
        AuthError
            ``ip`` has ``auth_limit`` failures in the window; its MAC is not checked.
        """
        n, wait = self._auth.charge(ip)
        if wait:
            if self._auth.first_refusal(ip):
                log.warning("refusing %s for %.0f s: too many failed authentications", ip, wait)
            raise AuthError(f"too many failed authentications from {ip}; try again in {wait:.0f} s")
        charged[0] = n
        return lambda: self._auth.refund(ip)

    def _wrap_tls(self, ch: Channel) -> Channel:
        """``ch``'s socket wrapped in TLS (handshake within the connection's deadline)."""
        assert self.tls is not None
        ch.set_io_timeout(ch.io_timeout, kernel=False)  # the ssl module expects Python's socket timeout
        try:
            tls_sock = self.tls.wrap_socket(ch.sock, server_side=True)
        except (ssl.SSLError, OSError) as exc:
            raise ConnectError(f"TLS handshake failed: {getattr(exc, 'reason', None) or exc}") from exc
        new = Channel(tls_sock)
        new.hide_root = ch.hide_root
        with self._lock:
            self._conns.discard(ch)
            self._conns.add(new)
        ch.closed = True  # the TLS channel owns the socket now
        return new

    def _quota(self) -> WriteQuota | None:
        """A new session's write limits (``max_session_bytes``, ``min_free_space``); None without them."""
        quota = WriteQuota(self.root, self.max_session_bytes, self.min_free_space)
        return quota if quota.active else None

    def _open(self, ch: Channel, msg: dict[str, Any]) -> bool:
        """Run the session ``msg`` asks for. Returns True when ``ch`` now belongs to someone else."""
        op = msg.get("op")
        if op == "join":
            return self._join(ch, msg)
        path = msg.get("path", "")
        if isinstance(path, bytes):  # a path that is not valid UTF-8 (entry.path_to_wire)
            path = path_from_wire(path)
        if not isinstance(path, str):
            raise UsageError("path must be a string")
        if op == "ls":
            ls(ch, self.root, path)
            return False
        if op == "fs":
            pool, group = self._fs_pool, msg.get("group")
            # a client's connections (one group) go to one worker; TLS and older clients stay here
            if pool is not None and isinstance(group, str) and not ch.tls and not ch.buffered and pool.serve(ch, group):
                return False
            serve_fs(ch, self.root, self.state, self.read_only, self._pages, self._quota(), self._puts)
            return False
        if op == "store":
            self._serve_store(ch)
            return False
        if op == "ping":
            ping(ch)
            return False
        if op == "source":
            source(ch, msg.get("bytes"))
            return False
        if op == "sink":
            sink(ch, msg.get("bytes"))
            return False
        if op == "disk":
            disk(ch, msg.get("bytes"), read_only=self.read_only, lock=self._disk_lock, state_dir=self.state.state_dir,
                 root=self.root, stopping=self._stopping)
            return False
        options = SyncOptions.from_wire(msg.get("options", {}))
        streams = msg.get("streams", 1)
        if not isinstance(streams, int) or not 1 <= streams <= 64:
            raise UsageError("streams must be 1..64")
        if op == "pull":
            self._pull(ch, path, options, streams)
            return False
        if op == "push":
            self._push(ch, msg, path, options, streams)
            return False
        raise UsageError(f"unknown session op {shown(op)}")
