"""Admission control for the daemon: who may connect, and what a refused or slow peer may hold.

Kept apart from :mod:`tb5sync.daemon.server` (which runs sessions) so that the rules a stranger meets
before authentication read in one place: :func:`is_loopback` (the no-token rule),
:class:`AuthLimiter` (failed authentications per peer), :class:`Janitor` (refusals that the
client can read, and whole-handshake deadlines).
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

__all__ = ["is_loopback", "peer_key", "AuthLimiter", "Janitor"]

log = logging.getLogger(__name__)

#: A refused connection is kept this long (seconds) to read what the client sent before it is
#: closed, so that the client reads the ERROR frame instead of a reset.
_REFUSE_LINGER = 2.0
_REFUSE_HELD_MAX = 256


def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback address (127/8, ::1)."""
    try:
        infos = socket.getaddrinfo(host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return False
    for info in infos:
        try:
            addr = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        except ValueError:
            return False
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        if not addr.is_loopback:
            return False
    return bool(infos)


def peer_key(ip: str) -> str:
    """The unit of per-peer rate limits: an IPv4 address, or an IPv6 /64 (one host's share)."""
    try:
        addr = ipaddress.ip_address(ip.split("%")[0])
    except ValueError:
        return ip
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.ip_network(f"{addr}/64", strict=False))
    return str(addr)


class AuthLimiter:
    """Failed authentications per peer in a sliding window (fail2ban's rule, in process).

    A peer with ``limit`` failures in the last ``window`` seconds is refused before its MAC is
    checked until the oldest of them leaves the window. At most ``max_peers`` peers are
    remembered (the stalest are forgotten first), so the table is bounded too.
    """

    def __init__(self, limit: int, window: float, max_peers: int = 4096) -> None:
        self.limit = limit
        self.window = window
        self.max_peers = max_peers
        self._fails: collections.OrderedDict[str, collections.deque[float]] = collections.OrderedDict()
        self._logged: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _prune(self, key: str, now: float) -> collections.deque[float] | None:
        q = self._fails.get(key)
        if q is None:
            return None
        while q and q[0] <= now - self.window:
            q.popleft()
        if not q:
            del self._fails[key]
            return None
        return q

    def blocked_for(self, ip: str) -> float:
        """Seconds until ``ip`` may try again (0.0: it may now)."""
        if self.limit <= 0:
            return 0.0
        now = time.monotonic()
        with self._lock:
            q = self._prune(peer_key(ip), now)
            if q is None or len(q) < self.limit:
                return 0.0
            return max(0.0, q[-self.limit] + self.window - now)

    def first_refusal(self, ip: str) -> bool:
        """True for the first refusal of ``ip``'s current lockout (log that one, not every one)."""
        now = time.monotonic()
        key = peer_key(ip)
        with self._lock:
            last = self._logged.get(key)
            if last is not None and now - last < self.window:
                return False
            self._logged[key] = now
            self._logged.move_to_end(key)
            while len(self._logged) > self.max_peers:
                self._logged.popitem(last=False)
            return True

    def charge(self, ip: str) -> tuple[int, float]:
        """Count a failure of ``ip`` *before* its MAC is checked, unless it is over its limit.

        The check and the count are one step under the lock, so parallel handshakes from one
        peer cannot all pass the limit before any of them fails: at most ``limit`` MACs are
        checked per window. A MAC that proves right is then :meth:`refund` ed.

        Parameters
        ----------
        ip : str
            The peer's address.

        Returns
        -------
        (int, float)
            ``(failures in the window counting this one, 0.0)`` when the MAC may be checked;
            ``(0, seconds until it may try again)`` when it is refused (nothing counted).
            With ``limit <= 0``: always ``(0, 0.0)``.
        """
        if self.limit <= 0:
            return 0, 0.0
        now = time.monotonic()
        key = peer_key(ip)
        with self._lock:
            q = self._prune(key, now)
            if q is not None and len(q) >= self.limit:
                return 0, max(0.001, q[-self.limit] + self.window - now)
            return self._append(key, q, now), 0.0

    def refund(self, ip: str) -> None:
        """Take back the newest failure :meth:`charge` counted for ``ip`` (its MAC was right)."""
        if self.limit <= 0:
            return
        with self._lock:
            key = peer_key(ip)
            q = self._fails.get(key)
            if q:
                q.pop()
                if not q:
                    del self._fails[key]

    def failed(self, ip: str) -> int:
        """Count a failure of ``ip``; returns its failures in the window."""
        if self.limit <= 0:
            return 0
        now = time.monotonic()
        key = peer_key(ip)
        with self._lock:
            return self._append(key, self._prune(key, now), now)

    def _append(self, key: str, q: collections.deque[float] | None, now: float) -> int:
        """Record a failure of ``key`` at ``now`` in its window ``q`` (made when None), keep at most
        ``max_peers`` peers (the oldest dropped); returns the failures in the window. Under ``_lock``."""
        if q is None:
            q = self._fails[key] = collections.deque(maxlen=self.limit)
        q.append(now)
        self._fails.move_to_end(key)
        while len(self._fails) > self.max_peers:
            self._fails.popitem(last=False)
        return len(q)


class Janitor:
    """One thread that (1) keeps refused connections open briefly, reading and dropping what the
    client sends, so it reads the ERROR frame rather than a reset; (2) closes connections whose
    handshake deadline passed (a slow peer cannot stretch it byte by byte).

    Bounded: at most :data:`_REFUSE_HELD_MAX` refused sockets are held; more are closed at once.
    """

    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()
        self._held: dict[socket.socket, float] = {}
        self._deadlines: dict[int, tuple[float, Callable[[], None]]] = {}
        self._ids = iter(range(1 << 62))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tb5-janitor", daemon=True)
        self._thread.start()

    def refuse(self, sock: socket.socket, frame: bytes) -> None:
        """Send ``frame`` (an ERROR) on ``sock`` without blocking, then close it after a linger."""
        try:
            sock.setblocking(False)
            sock.send(frame)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            sock.close()
            return
        with self._lock:
            if len(self._held) >= _REFUSE_HELD_MAX or self._stop.is_set():
                sock.close()
                return
            self._held[sock] = time.monotonic() + _REFUSE_LINGER
            try:
                self._sel.register(sock, selectors.EVENT_READ)
            except (ValueError, OSError):
                del self._held[sock]
                sock.close()

    def deadline(self, seconds: float, expire: Callable[[], None]) -> int:
        """Call ``expire()`` in ``seconds`` unless :meth:`cancel` is called first; returns a handle."""
        with self._lock:
            h = next(self._ids)
            self._deadlines[h] = (time.monotonic() + seconds, expire)
        return h

    def cancel(self, handle: int) -> None:
        with self._lock:
            self._deadlines.pop(handle, None)

    def _drop(self, sock: socket.socket) -> None:
        self._held.pop(sock, None)
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError, OSError):
            pass
        sock.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                empty = not self._held
            if empty:
                self._stop.wait(0.2)
                events = []
            else:
                events = self._sel.select(0.2)
            now = time.monotonic()
            with self._lock:
                for key, _ in events:
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    try:
                        data = sock.recv(4096)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        self._drop(sock)
                for sock, until in list(self._held.items()):
                    if until <= now:
                        self._drop(sock)
                due = [h for h, (t, _) in self._deadlines.items() if t <= now]
                expired = [self._deadlines.pop(h)[1] for h in due]
            for fn in expired:
                try:
                    fn()
                except Exception:  # a closer must not end the janitor
                    log.exception("handshake deadline")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            for sock in list(self._held):
                self._drop(sock)
            self._deadlines.clear()
        self._sel.close()
