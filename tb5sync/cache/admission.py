"""Admission of the HTTP build cache's connections: the rules a client meets before its request
is served (docs/guide/cache-limits.md). Defaults are named after nginx's directives.

:class:`Conn` is aiohttp's connection handler with a per-address connection cap and a deadline for
each request head; the per-request rules (``limit_conn``, auth, the body's minimum rate) are in
:mod:`tb5sync.cache.httpcache`.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from aiohttp.web_protocol import RequestHandler

from tb5sync._os.netif import peer_address

if TYPE_CHECKING:
    from tb5sync.cache.httpcache import HttpCache

__all__ = ["Conn", "CLIENT_HEADER_TIMEOUT", "KEEPALIVE_TIMEOUT", "CLIENT_BODY_TIMEOUT", "CLIENT_BODY_MIN_RATE",
           "MAX_CONNECTIONS_PER_ADDRESS", "LIMIT_CONN"]

#: Admission defaults, named after nginx's directives where one exists (seconds, bytes, counts).
CLIENT_HEADER_TIMEOUT = 60.0   # nginx client_header_timeout: the whole request head, from the first byte
KEEPALIVE_TIMEOUT = 75.0       # nginx keepalive_timeout: an idle connection between requests
CLIENT_BODY_TIMEOUT = 60.0     # nginx client_body_timeout: the window of the body's minimum rate
CLIENT_BODY_MIN_RATE = 1024    # bytes per second a body must average over each window
MAX_CONNECTIONS_PER_ADDRESS = 512  # open connections of one client address (idle ones included)
LIMIT_CONN = 128               # nginx limit_conn: requests in progress of one client address

_REFUSED_503 = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
_TIMEOUT_408 = b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class Conn(RequestHandler):
    """aiohttp's connection handler with the cache's admission rules: a per-address connection
    cap (503 and closed at once), a deadline for each request head (``client_header_timeout``,
    armed at accept and at the first byte of each later head; 408 and closed), nothing while a
    request is being served (its body has its own rate rule)."""

    def __init__(self, *args: Any, cache: HttpCache, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._tb5 = cache
        self._tb5_peer = ""
        self._tb5_timer: asyncio.TimerHandle | None = None
        self.tb5_busy = 0
        self._tb5_counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cache = self._tb5
        self._tb5_peer = peer_address(transport.get_extra_info("peername")) or ""
        n = cache._conns.get(self._tb5_peer, 0)
        if cache.max_connections_per_address and n >= cache.max_connections_per_address:
            cache.metrics.add("all.connections_refused")
            with contextlib.suppress(Exception):
                transport.write(_REFUSED_503)  # type: ignore[attr-defined]
            transport.close()
            return
        cache._conns[self._tb5_peer] = n + 1
        self._tb5_counted = True
        super().connection_made(transport)
        self._tb5_arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._tb5_counted:
            return
        self._tb5_counted = False
        self._tb5_disarm()
        cache = self._tb5
        n = cache._conns.get(self._tb5_peer, 1) - 1
        if n > 0:
            cache._conns[self._tb5_peer] = n
        else:
            cache._conns.pop(self._tb5_peer, None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._tb5_counted:
            return
        before = self._request_count
        super().data_received(data)
        if self._request_count > before:
            self._tb5_disarm()  # a whole head arrived
        elif not self.tb5_busy:
            self._tb5_arm()  # bytes of a head: its deadline runs from the first one

    def _tb5_arm(self) -> None:
        if self._tb5_timer is None and not self.tb5_busy and self._tb5.client_header_timeout:
            self._tb5_timer = self._loop.call_later(self._tb5.client_header_timeout, self._tb5_expire)

    def _tb5_disarm(self) -> None:
        if self._tb5_timer is not None:
            self._tb5_timer.cancel()
            self._tb5_timer = None

    def tb5_enter(self) -> None:
        """A request of this connection is being served (its head is whole)."""
        self.tb5_busy += 1
        self._tb5_disarm()

    def tb5_leave(self) -> None:
        self.tb5_busy -= 1

    def _tb5_expire(self) -> None:
        self._tb5_timer = None
        if self.tb5_busy or self.transport is None:
            return
        self._tb5.metrics.add("all.header_timeouts")
        with contextlib.suppress(Exception):
            self.transport.write(_TIMEOUT_408)
        self.force_close()
