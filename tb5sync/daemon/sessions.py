"""The daemon's transfer sessions: pull (a hosted Sender), push (a hosted Receiver), their joined
streams, and ls; every request path is placed under ROOT through its jail.

:class:`TransferSessions` is a mixin of :class:`~tb5sync.daemon.server.Server` (it needs the session table).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import secrets
import threading
from typing import TYPE_CHECKING, Any

from tb5sync._os.paths import STATE_DIR, Jail, follow_slash, resolve_in_root
from tb5sync.errors import (
    shown,
    ConnectError,
    PathError,
    ReadOnlyError,
    RemoteNotFoundError,
    Tb5syncError,
    UsageError,
)
from tb5sync.roles.generator import ListingLimits
from tb5sync.wire.messages import SENDER_METHODS, result_pages
from tb5sync.tree.quota import WriteQuota
from tb5sync.tree.entry import DIR, FILE, LINK, path_from_wire, path_to_wire
from tb5sync.tree.scan import scan
from tb5sync.tree.options import SyncOptions, known_options
from tb5sync.wire.protocol import FrameType
from tb5sync.remote.links import RemoteLink
from tb5sync.roles.receiver import Receiver, dest_base, prepare_dest_dir, scan_in_background
from tb5sync.roles.sender import Sender
from tb5sync.tree.state import TreeState
from tb5sync.wire.rpc import Requester, serve
from tb5sync.wire.transport import Channel, hide_root, peer_closed

__all__ = ["JOIN_TIMEOUT", "Session", "TransferSessions", "locate", "ls", "makedirs_in", "rel"]

#: the server's logger: these lines are the daemon's, as before the sessions had a module of their own
log = logging.getLogger("tb5sync.daemon.server")

JOIN_TIMEOUT = 30.0


class Session:
    def __init__(self, op: str, streams: int) -> None:
        self.op = op
        self.streams = streams
        self.channels: list[Channel | None] = [None] * streams
        self.joined = threading.Condition()
        self.sender: Sender | None = None
        self.users = 0
        self.lock = threading.Lock()


def rel(root: str, path: str) -> str:
    """``path`` (absolute, under ``root``) relative to ``root``; ``""`` for ``root`` itself."""
    r = os.path.relpath(path, root)
    return "" if r == "." else r


def locate(root: str, path: str, *, follow: bool = False) -> tuple[str, tuple[int, str]]:
    """Request ``path``'s place under ROOT, opened through ROOT's jail: ``(full, (dir_fd, name))``.

    ``full`` (absolute; only shown and used for state paths) is computed as
    :func:`resolve_in_root` and :func:`follow_slash` do (``follow``: ``-L``); then the
    directory holding it is opened from ROOT's descriptor with no symlink on the way
    (:meth:`tb5sync._os.paths.Jail.locate`), so a parent swapped for a symlink after the
    computation is refused, never followed. The caller owns ``dir_fd``.

    Raises
    ------
    PathError
        ``path`` is unsafe, leads outside ROOT or into its state, or a directory on the way
        was swapped for a symlink.
    RemoteNotFoundError
        Nothing is there.
    """
    base = resolve_in_root(root, path)
    if not os.path.lexists(base):
        raise RemoteNotFoundError(f"no such file or directory: {path}")
    base = follow_slash(base, path, root, follow=follow)  # "link/": the directory, if it is inside ROOT
    with Jail(root) as jail:
        try:
            return base, jail.locate(rel(root, base))
        except (FileNotFoundError, NotADirectoryError):
            raise RemoteNotFoundError(f"no such file or directory: {path}") from None


def ls(ch: Channel, root: str, path: str) -> None:
    """An ls session: one directory level (or one entry) under ROOT/``path``."""
    base, (dfd, name) = locate(root, path)
    try:
        entries = scan(base, recursive=False, at=(dfd, name))
    finally:
        os.close(dfd)
    ch.send_control(FrameType.RESPONSE, 0, {"entries": [e.to_wire() for e in entries]})


def makedirs_in(root: str, path: str) -> None:
    """Create the directory ``path`` (absolute, under ROOT) and its missing parents, through
    the ROOT's jail: no symlink on the way is followed (``--mkpath`` of a push)."""
    with Jail(root) as jail:
        os.close(jail.open_dir(os.path.relpath(path, root), create=True))


class TransferSessions:
    """Pull and push sessions and their joined streams, for :class:`~tb5sync.daemon.server.Server`."""

    root: str
    state: TreeState
    read_only: bool
    idle_timeout: float | None
    listing_limits: ListingLimits
    _sessions: dict[str, Session]
    _lock: threading.Lock
    _conns: set[Channel]
    _stopping: threading.Event

    if TYPE_CHECKING:
        def _quota(self) -> WriteQuota | None: ...

    def _new_session(self, op: str, streams: int) -> tuple[str, Session]:
        sid = secrets.token_hex(16)
        s = Session(op, streams)
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

    def _pull(self, ch: Channel, path: str, options: SyncOptions, streams: int) -> None:
        base, at = locate(self.root, path, follow=options.copy_links)
        try:
            sender = Sender(base, options, self.state, rel(self.root, base), zero_copy=True, root=self.root, at=at)  # replies go out through sockets only
        except (FileNotFoundError, NotADirectoryError):
            raise RemoteNotFoundError(f"no such file or directory: {path}") from None
        sid, s = self._new_session("pull", streams)
        try:
            s.sender = sender
            s.sender.prepare()  # scan while the client joins its other streams
            s.channels[0] = ch
            ch.send_control(FrameType.RESPONSE, 0, {"session": sid, "kind": sender.kind, "options": known_options()})
            self._serve_sender(ch, s)
        finally:
            self._end_session(sid, s)

    def _pace_stop(self, ch: Channel) -> str | None:
        """Why a ``--bwlimit`` wait of ``ch``'s requests should end now (None: it goes on)."""
        if self._stopping.is_set():
            return "the server is stopping"
        if ch.closed or peer_closed(ch.sock):
            return "the client closed the connection"
        return None

    def _serve_sender(self, ch: Channel, s: Session) -> None:
        assert s.sender is not None
        with s.lock:
            s.users += 1
        try:
            # --bwlimit waits end when this peer goes, the server stops or the session ends
            # (Sender.close), and none lasts longer than the idle timeout
            s.sender.pace_guard(lambda: self._pace_stop(ch), self.idle_timeout)
            serve(ch, s.sender, SENDER_METHODS)
        finally:
            with s.lock:
                s.users -= 1

    def _end_session(self, sid: str, s: Session) -> None:
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
            raise ReadOnlyError(f"server is read-only; cannot write {shown(path)}")
        name = msg.get("name")
        if isinstance(name, bytes):
            name = path_from_wire(name)
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
        if STATE_DIR in os.path.relpath(dest, self.root).split("/"):
            # a scan never lists a directory of that name, at any depth: a push into one (or of a
            # source so named) is refused, as is every listed path naming it (check_peer_path)
            raise PathError(os.path.relpath(dest, self.root), f"{STATE_DIR} is tb5sync's own state directory name")
        created = prepare_dest_dir(dst, path, bool(msg.get("dst_slash")), str(src_kind), mkpath=options.mkpath,
                                   dry_run=options.dry_run, makedirs=functools.partial(makedirs_in, self.root))
        sid, s = self._new_session("push", streams)
        s.channels[0] = ch
        # the destination is scanned while the other streams join and the client scans its source
        # (a session that fails before its receiver runs leaves this daemon scan to finish unread)
        dst_scan = scan_in_background(dest, options.dest_rules, unlock=not options.dry_run, root=self.root)
        ch.send_control(FrameType.RESPONSE, 0, {"session": sid, "options": known_options()})
        requester: Requester | None = None
        try:
            with s.joined:
                ok = s.joined.wait_for(lambda: all(c is not None for c in s.channels), timeout=JOIN_TIMEOUT)
            if not ok:
                raise ConnectError("not all streams of the session joined in time")
            channels = [c for c in s.channels if c is not None]
            requester = Requester(channels, peer="client")
            quota = self._quota()
            if quota is not None:  # a single-file push (put_file) is named by its path under ROOT, not ""
                quota.root_name = os.path.relpath(dest, self.root)
            receiver = Receiver(dest, RemoteLink(requester), options, self.state, rel(self.root, dest), dst_scan=dst_scan,
                                link_dest_root=self.root, listing_limits=self.listing_limits, quota=quota)
            try:
                stats = dataclasses.replace(receiver.run(), created=created)
                result: dict[str, Any] = {"stats": stats.as_dict()}
                if "changes" in stats.extra:  # paths as they travel (bytes when not valid UTF-8)
                    result["changes"] = {k: [path_to_wire(p) for p in v] for k, v in stats.extra["changes"].items()}
            except Tb5syncError as exc:
                log.info("push to %s failed: %s", path, exc)
                result = {"error": {"kind": type(exc).__name__, "message": hide_root(str(exc), self.root)}}
            except OSError as exc:
                log.info("push to %s failed: %s", path, exc)
                message = hide_root(f"{exc.strerror or exc}: {exc.filename or path}", self.root)
                result = {"error": {"kind": "DestinationError", "message": message}}
            if "error" in result and self._stopping.is_set():
                # The server is stopping (SIGTERM): its own closing of the session's streams is what
                # failed the run. The client is told nothing but the close, as of a server that went
                # away ("server closed the connection mid-transfer", exit 12), never "client closed".
                log.info("push session %s: not reported, the server is stopping", sid)
                return
            try:
                result, pages = result_pages(result)  # a long result goes ahead in pages
                for page in pages:
                    requester.call("finish_part", page, timeout=30)
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
