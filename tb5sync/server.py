"""The tb5sync daemon: authentication, allow-list, path jail, read-only mode, sessions.

Each TCP connection authenticates (HMAC challenge-response, see
:mod:`tb5sync.protocol`), then sends OPEN naming what it wants:

``{"op": "pull", "path", "options", "streams"}``
    The server hosts a :class:`~tb5sync.sender.Sender` for ``path``; the client's receiver drives.
``{"op": "push", "path", "name", "src_kind", "dst_slash", "options", "streams"}``
    The server hosts a :class:`~tb5sync.receiver.Receiver` writing under ``path``;
    it drives the client's sender over the session's streams.
``{"op": "join", "session", "index"}``
    An extra stream for an open session (push or pull).
``{"op": "ls", "path"}``
    One directory level (or one entry) under ``path``.
``{"op": "fs"}``
    A file-system session for :mod:`tb5sync.fs`: requests as in
    :class:`~tb5sync.fsops.FsOps` until BYE.

Every error in one connection ends that connection (after an ERROR frame to
the peer); the server itself keeps serving.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import socket
import threading
from collections.abc import Sequence
from typing import Any

from ._paths import resolve_in_root
from .errors import (
    AuthError,
    ConnectError,
    PathError,
    ReadOnlyError,
    RemoteNotFoundError,
    Tb5syncError,
    UsageError,
)
from .fsops import FsOps, Pages
from .messages import DEFAULT_PORT, FS_METHODS, PING_METHODS, SENDER_METHODS
from .entry import DIR, FILE, LINK, kind_of
from .scan import scan
from .options import SyncOptions
from .protocol import FrameType
from .links import RemoteLink
from .receiver import Receiver, dest_base, scan_in_background
from .sender import Sender
from .state import TreeState
from .rpc import Requester, serve
from .transport import Channel, hide_root, server_handshake, tune_socket
from . import protocol as P

__all__ = ["Server"]

log = logging.getLogger(__name__)

_HANDSHAKE_TIMEOUT = 30.0
_JOIN_TIMEOUT = 30.0
_SOURCE_MAX = 1 << 36
_SOURCE_BLOCK = 4 * 1024 * 1024


class _Ping:
    """Handler for the link test's round trips."""

    def ping(self) -> dict[str, Any]:
        return {}


class _Session:
    def __init__(self, op: str, streams: int) -> None:
        self.op = op
        self.streams = streams
        self.channels: list[Channel | None] = [None] * streams
        self.joined = threading.Condition()
        self.sender: Sender | None = None
        self.users = 0
        self.lock = threading.Lock()


class Server:
    """Serve ``root`` over TCP.

    Parameters
    ----------
    root : str or path
        Directory to serve; nothing outside it is read or written.
    host : str
        Address to bind (default 127.0.0.1).
    port : int
        TCP port; 0 picks a free one (read :attr:`port` after :meth:`start`).
    token : bytes or str or None
        Shared secret for HMAC authentication; None accepts any client (loopback use).
    allow : sequence of str
        CIDR networks clients may connect from; empty allows all.
    read_only : bool
        Refuse pushes (writes) with :class:`~tb5sync.errors.ReadOnlyError`.
    store : str or path or None
        An artifact store (:class:`tb5sync.store.Store`) to serve to ``{"op": "store"}`` sessions
        (``tb5sync store push/pull``); None: such sessions are refused.
    upstream : str or None
        With ``store``: a shared store (``s3://bucket/prefix``, any fsspec URL, or a directory) the
        local store caches: refs it lacks are read through, pushes written through
        (:mod:`tb5sync.tiers`).
    peers : sequence of str
        ``tb5://HOST[:PORT]`` servers whose stores a read-through also fetches from, in parallel.
    storage_options : dict or None
        fsspec options for ``upstream``.

    Raises
    ------
    UsageError
        ``root`` is not a directory, or a CIDR is malformed.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        token: bytes | str | None = None,
        allow: Sequence[str] = (),
        read_only: bool = False,
        store: str | os.PathLike[str] | None = None,
        upstream: str | None = None,
        peers: Sequence[str] = (),
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        root = os.path.realpath(os.fspath(root))
        if not os.path.isdir(root):
            raise UsageError(f"server root is not a directory: {root}")
        self.root = root
        self.host = host
        self._port = port
        self.token = token.encode() if isinstance(token, str) else token
        try:
            self.allow = [ipaddress.ip_network(c, strict=False) for c in allow]
        except ValueError as exc:
            raise UsageError(f"bad --allow network: {exc}") from exc
        self.read_only = read_only
        # a read-only server writes nothing under its root, not even its own scan cache
        self.state = TreeState(root, writable=not read_only and os.access(root, os.W_OK))
        self._sessions: dict[str, _Session] = {}
        self._pages = Pages()
        self._lock = threading.Lock()
        self._conns: set[Channel] = set()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.store_path = os.path.abspath(os.fspath(store)) if store is not None else None
        self._store: Any = None
        if upstream is not None and store is None:
            raise UsageError("--upstream needs --store (the local tier)")
        self.upstream, self.peers, self.storage_options = upstream, list(peers), storage_options
        self._tier: Any = None

    @property
    def port(self) -> int:
        """The bound port (the real one when constructed with port 0)."""
        return self._port

    def bind(self) -> None:
        """Create the listening socket.

        Raises
        ------
        ConnectError
            The address cannot be bound (in use, not local).
        """
        try:
            infos = socket.getaddrinfo(self.host, self._port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            family, _, _, _, addr = infos[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(128)
        except OSError as exc:
            raise ConnectError(f"cannot listen on {self.host}:{self._port}: {exc.strerror or exc}") from exc
        self._sock = sock
        self._port = int(sock.getsockname()[1])  # the real port, also after stop() closed the socket

    def start(self) -> Server:
        """Bind (if needed) and serve in a background thread; returns self."""
        if self._sock is None:
            self.bind()
        self._thread = threading.Thread(target=self.serve_forever, name="tb5-server", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Accept connections until :meth:`stop`; each connection gets its own thread."""
        if self._sock is None:
            self.bind()
        assert self._sock is not None
        log.info("serving %s on %s:%d", self.root, self.host, self.port)
        while not self._stopping.is_set():
            try:
                conn, addr = self._sock.accept()
            except OSError:
                if self._stopping.is_set():
                    break
                continue
            threading.Thread(target=self._handle, args=(conn, addr), name=f"tb5-conn-{addr[1]}", daemon=True).start()

    def stop(self) -> None:
        """Stop accepting, close every connection, wait for the accept thread."""
        self._stopping.set()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for ch in conns:
            ch.close()
        if self._thread is not None:
            self._thread.join(timeout=5)
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
        if not self.allow:
            return True
        try:
            addr = ipaddress.ip_address(ip.split("%")[0])
        except ValueError:
            return False
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        return any(addr in net for net in self.allow)

    def _handle(self, conn: socket.socket, addr: Any) -> None:
        tune_socket(conn)
        ch = Channel(conn)
        ch.hide_root = self.root
        with self._lock:
            self._conns.add(ch)
        keep = False
        try:
            if not self._allowed(addr[0]):
                log.warning("refused %s: not in --allow", addr[0])
                ch.send_error(0, AuthError(f"client address {addr[0]} is not allowed"))
                return
            conn.settimeout(_HANDSHAKE_TIMEOUT)
            server_handshake(ch, self.token)
            got = ch.recv_frame()
            if got is None:
                return
            header, payload = got
            if header.type is not FrameType.OPEN:
                raise UsageError(f"expected OPEN, got {header.type.name}")
            msg = P.decode_control(payload)
            conn.settimeout(None)
            keep = self._open(ch, msg)
        except (Tb5syncError, OSError) as exc:
            log.info("connection from %s ended: %s", addr[0], exc)
            if not isinstance(exc, OSError) or isinstance(exc, Tb5syncError):
                ch.send_error(0, exc)
        except Exception as exc:  # a bug must not take the server down
            log.exception("internal error serving %s", addr[0])
            ch.send_error(0, exc)
        finally:
            if not keep:
                with self._lock:
                    self._conns.discard(ch)
                ch.close()

    def _open(self, ch: Channel, msg: dict[str, Any]) -> bool:
        """Run the session ``msg`` asks for. Returns True when ``ch`` now belongs to someone else."""
        op = msg.get("op")
        if op == "join":
            return self._join(ch, msg)
        path = msg.get("path", "")
        if not isinstance(path, str):
            raise UsageError("path must be a string")
        if op == "ls":
            self._ls(ch, path)
            return False
        if op == "fs":
            ops = FsOps(self.root, self.state, self.read_only, self._pages)
            try:
                ch.send_control(FrameType.RESPONSE, 0, {"read_only": self.read_only})
                serve(ch, ops, FS_METHODS)
            finally:
                ops.close()
            return False
        if op == "store":
            self._serve_store(ch)
            return False
        if op == "ping":
            ch.send_control(FrameType.RESPONSE, 0, {})
            serve(ch, _Ping(), PING_METHODS)
            return False
        if op == "source":
            self._source(ch, msg.get("bytes"))
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
        raise UsageError(f"unknown session op {op!r}")

    def _serve_store(self, ch: Channel) -> None:
        """A store session: :data:`~tb5sync.messages.STORE_METHODS` answered from ``--store``."""
        from .messages import STORE_METHODS
        from .store import Store
        from .store.ops import StoreOps

        if self.store_path is None:
            raise UsageError("this server has no artifact store (start it with --store DIR)")
        with self._lock:
            if self._store is None:
                self._store = Store(self.store_path)
            if self.upstream is not None and self._tier is None:
                from .tiers import Tier

                self._tier = Tier(self._store, self.upstream, self.peers, self.storage_options, self.token)
        if self._tier is not None:
            from .tiers import TieredStoreOps

            ops: StoreOps = TieredStoreOps(self._store, self.read_only, self._tier)
        else:
            ops = StoreOps(self._store, self.read_only)
        try:
            ch.send_control(FrameType.RESPONSE, 0, {"read_only": self.read_only})
            serve(ch, ops, STORE_METHODS)
        finally:
            ops.close()

    def _new_session(self, op: str, streams: int) -> tuple[str, _Session]:
        sid = secrets.token_hex(16)
        s = _Session(op, streams)
        with self._lock:
            self._sessions[sid] = s
        return sid, s

    def _join(self, ch: Channel, msg: dict[str, Any]) -> bool:
        sid, idx = msg.get("session"), msg.get("index")
        with self._lock:
            s = self._sessions.get(sid) if isinstance(sid, str) else None
        if s is None or not isinstance(idx, int) or not 1 <= idx < s.streams:
            raise UsageError("join: unknown session or bad stream index")
        with s.joined:
            if s.channels[idx] is not None:
                raise UsageError("join: stream index already taken")
            s.channels[idx] = ch
            s.joined.notify_all()
        ch.send_control(FrameType.RESPONSE, 0, {})
        if s.op == "pull":
            assert s.sender is not None
            self._serve_sender(ch, s)
            return False
        return True  # push: the session's receiver owns this channel now

    def _source(self, ch: Channel, nbytes: object) -> None:
        """Link test: send ``nbytes`` of zeros in DATA frames (no disk, no hashing), then BYE."""
        if not isinstance(nbytes, int) or not 0 <= nbytes <= _SOURCE_MAX:
            raise UsageError(f"source bytes must be 0..{_SOURCE_MAX}")
        ch.send_control(FrameType.RESPONSE, 0, {})
        block = bytes(_SOURCE_BLOCK)
        while nbytes > 0:
            n = min(nbytes, _SOURCE_BLOCK)
            ch.send_data(0, {}, [memoryview(block)[:n]])
            nbytes -= n
        ch.send_control(FrameType.BYE, 0, {})

    def _rel(self, path: str) -> str:
        rel = os.path.relpath(path, self.root)
        return "" if rel == "." else rel

    def _ls(self, ch: Channel, path: str) -> None:
        base = resolve_in_root(self.root, path)
        entries = scan(base, recursive=False)
        ch.send_control(FrameType.RESPONSE, 0, {"entries": [list(e) for e in entries]})

    def _pull(self, ch: Channel, path: str, options: SyncOptions, streams: int) -> None:
        base = resolve_in_root(self.root, path)
        if not os.path.lexists(base):
            raise RemoteNotFoundError(f"no such file or directory: {path}")
        sid, s = self._new_session("pull", streams)
        try:
            s.sender = Sender(base, options, self.state, self._rel(base), zero_copy=True)  # replies go out through sockets only
            s.sender.prepare()  # scan while the client joins its other streams
            kind = kind_of(base)
            s.channels[0] = ch
            ch.send_control(FrameType.RESPONSE, 0, {"session": sid, "kind": kind})
            self._serve_sender(ch, s)
        finally:
            self._end_session(sid, s)

    def _serve_sender(self, ch: Channel, s: _Session) -> None:
        with s.lock:
            s.users += 1
        try:
            serve(ch, s.sender, SENDER_METHODS)
        finally:
            with s.lock:
                s.users -= 1

    def _end_session(self, sid: str, s: _Session) -> None:
        with self._lock:
            self._sessions.pop(sid, None)
        # wait briefly for joined streams to finish before releasing the sender
        if s.sender is not None:
            for _ in range(50):
                with s.lock:
                    if s.users == 0:
                        break
                threading.Event().wait(0.05)
            s.sender.close()

    def _push(self, ch: Channel, msg: dict[str, Any], path: str, options: SyncOptions, streams: int) -> None:
        if self.read_only:
            raise ReadOnlyError(f"server is read-only; cannot write {path!r}")
        name = msg.get("name")
        src_kind = msg.get("src_kind")
        if name is not None and (not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name):
            raise PathError(str(name), "bad source name")
        if src_kind not in (DIR, FILE, LINK):
            raise UsageError("src_kind must be d, f or l")
        dst = resolve_in_root(self.root, path)
        dest = dest_base(dst, bool(msg.get("dst_slash")), name, str(src_kind))
        if dest != dst:
            # dest_base looked through a symlink at dst: resolve again and refuse if it leaves ROOT
            dest = resolve_in_root(self.root, os.path.relpath(dest, self.root))
        sid, s = self._new_session("push", streams)
        s.channels[0] = ch
        # the destination is scanned while the other streams join and the client scans its source
        # (a session that fails before its receiver runs leaves this daemon scan to finish unread)
        dst_scan = scan_in_background(dest, options.rules)
        ch.send_control(FrameType.RESPONSE, 0, {"session": sid})
        requester: Requester | None = None
        try:
            with s.joined:
                ok = s.joined.wait_for(lambda: all(c is not None for c in s.channels), timeout=_JOIN_TIMEOUT)
            if not ok:
                raise ConnectError("not all streams of the session joined in time")
            channels = [c for c in s.channels if c is not None]
            requester = Requester(channels)
            receiver = Receiver(dest, RemoteLink(requester), options, self.state, self._rel(dest), dst_scan=dst_scan)
            try:
                stats = receiver.run()
                result: dict[str, Any] = {"stats": stats.as_dict()}
                if "changes" in stats.extra:
                    result["changes"] = stats.extra["changes"]
            except Tb5syncError as exc:
                log.info("push to %s failed: %s", path, exc)
                result = {"error": {"kind": type(exc).__name__, "message": hide_root(str(exc), self.root)}}
            except OSError as exc:
                log.info("push to %s failed: %s", path, exc)
                message = hide_root(f"{exc.strerror or exc}: {exc.filename or path}", self.root)
                result = {"error": {"kind": "DestinationError", "message": message}}
            try:
                requester.call("finish", result, timeout=30)
            except (Tb5syncError, OSError, TimeoutError) as exc:
                log.info("push session %s: could not report the result: %s", sid, exc)
        finally:
            with self._lock:
                self._sessions.pop(sid, None)
                for c in s.channels:
                    if c is not None:
                        self._conns.discard(c)
            if requester is not None:
                requester.close(bye=True)
            else:
                for c in s.channels:
                    if c is not None and c is not ch:
                        c.close()

