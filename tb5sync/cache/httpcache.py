"""A build cache over HTTP/1.1 (ccache's and Bazel's remote cache protocols) backed by the artifact store.

``tb5sync http-cache STORE --bind HOST:PORT`` (or ``tb5sync serve ROOT --http-cache HOST:PORT``)
answers, on an aiohttp server:

A request is routed by its first path segment only, so no client's keys collide with a route:

- ``/ac/<sha256>`` and ``/cas/<sha256>``: Bazel's HTTP remote cache (``--remote_cache=http://HOST:PORT``),
  and ``/NAME/ac/...``, ``/NAME/cas/...`` for each Bazel instance name declared with
  ``bazel_instances`` (``--bazel-instance NAME``). 200 hit, 404 miss, PUT answered 200. Below
  ``/ac/`` and ``/cas/`` a name that is not one lowercase SHA-256 hex digest is no Bazel request:
  it is a client's opaque key (ccache's ``subdirs`` layout without a URL prefix puts a key beginning
  ``ac`` at ``/ac/<31 characters>``); below a declared instance it is refused (400). A ``/cas`` PUT whose body's SHA-256 is
  not its key is refused (400) and stores nothing; a body cut off before its ``Content-Length``
  stores nothing. An ``/ac`` entry is an ``ActionResult`` protobuf: a PUT that does not parse as
  one is refused (400), and a GET whose ActionResult names CAS blobs the cache no longer holds is
  a miss (bazel-remote's rule). ``--no-ac-validation`` turns both off (bazel-remote's
  ``--disable_http_ac_validation``).
- ``/metrics`` and ``/status``: GET and HEAD only (405 otherwise); nothing below them.
- any other first segment: a client's namespace of opaque keys, whatever follows it: ccache's
  HTTP remote storage (``remote_storage = http://HOST:PORT/PREFIX|layout=...``, in its ``subdirs``
  (``PREFIX/ab/cdef...``, including ``PREFIX/ac/...``), ``flat`` and ``bazel``
  (``PREFIX/ac/<64 hex>``) layouts), sccache's WebDAV keys, any URL prefix. ``GET``, ``HEAD``,
  ``PUT`` and ``DELETE``; a miss is 404; "parent directories" need no creating.

Entries are the store's keyed blobs (:mod:`tb5sync.store.blobs`): chunked, deduplicated, checked
against their digests on every read, evicted least recently used under the store's quota.

Request bodies are read in pieces: up to :data:`SPOOL_MEMORY` in memory, beyond that into a
temporary file in the store's ``tmp/`` written with aiofiles, then stored from a worker thread.
Responses are written a chunk at a time (at most a few chunks of 1 MiB average in memory). All
file and index work runs in a bounded thread pool, never on the event loop; at most
``concurrency`` uploads and ``concurrency`` other requests are served at once (the rest wait).

Admission (docs/guide/cache-limits.md): a deadline per request head (``client_header_timeout``),
an idle keep-alive timeout, a minimum body rate per ``client_body_timeout`` window, per-address
caps on connections and on requests in progress (``limit_conn``), authentication before any slot.
An entry over ``max_entry_size`` or the store's quota is refused before it is stored (413 / 507).

Access: ``--allow CIDR`` (403 for other addresses), optional HTTP basic (``user:password``) and/or
bearer token (401 without one), ``--read-only`` (hits served, PUT and DELETE refused with 403).
``/metrics`` serves Prometheus text (hits, misses, bytes, a latency histogram per method);
``/status`` JSON. Counters are also added to the store's ``counters`` table every few seconds, so
``tb5sync store stats`` shows them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiofiles
from aiohttp import HttpVersion11, web

from tb5sync.errors import EntryTooLargeError, IntegrityError, UsageError
from tb5sync._os.io import portable
from tb5sync._os.netif import AllowList, bind_host, peer_address
from tb5sync.cache.admission import (CLIENT_BODY_MIN_RATE, CLIENT_BODY_TIMEOUT, CLIENT_HEADER_TIMEOUT,
                                     KEEPALIVE_TIMEOUT, LIMIT_CONN, MAX_CONNECTIONS_PER_ADDRESS, Conn as _Conn)
from tb5sync.cache.reapi import ActionResultError, parse_action_result, tree_files
from tb5sync.store import Store
from tb5sync.store.blobs import (BlobInfo, FileRange, add_counters, blob, blob_ranges, check_blob_key, close_ranges,
                                 delete_blob, has_blobs, put_blob, put_blobs, read_blob, touch_blobs)

__all__ = ["HttpCache", "parse_action_result", "ActionResultError", "SPOOL_MEMORY", "EMPTY_SHA256"]

log = logging.getLogger(__name__)

#: Request bodies up to this size are held in memory; larger ones are spooled to a file (bytes).
SPOOL_MEMORY = 1024 * 1024
#: Bytes read from a request body at a time.
READ_PIECE = 256 * 1024
#: Largest ActionResult read for validation (bytes); bazel-remote caps AC entries similarly.
MAX_AC = 64 * 1024 * 1024
#: SHA-256 of the empty string: Bazel never uploads the empty blob and treats it as always present.
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
#: Upper bounds of the latency histogram (seconds), Prometheus' default buckets.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: Most in-memory PUTs, and bytes, written together as one batch (one pack, one transaction).
BATCH_COUNT = 256
BATCH_BYTES = 32 * 1024 * 1024
#: Longest a batch waits for more small entries before it is written (seconds), while uploads
#: overlap (one arrived while another was arriving, waiting or being written) now or within
#: :data:`OVERLAP_MEMORY` seconds. A client alone, one entry at a time, never waits.
BATCH_LINGER = 0.010
OVERLAP_MEMORY = 0.5
#: Seconds between two flushes of the counters to the store.
FLUSH_EVERY = 5.0
#: Largest entry (bytes, one chunk) read on the event loop itself, without a hop to a worker thread.
INLINE_MAX = 256 * 1024
#: What ``HttpCache._fetch(inline=True)`` answers for an entry to be read in a worker.
_LATER = object()
#: Seconds between two writes of the recorded uses (LRU order) of the entries read.
TOUCH_EVERY = 1.0
#: A response write that makes no progress for this long is cut (seconds): a stalled reader.
IDLE_TIMEOUT = 60.0
#: A response is written in slices of this many bytes, each to be taken by its reader within
#: ``client_body_timeout`` seconds.
SEND_SLICE = 256 * 1024
#: A hit of at most this many bytes, read whole, is answered as one ``web.Response`` (one write
#: of headers and body, when nothing is queued on the connection: with the headers it stays under
#: the transport's 64 KiB high-water mark, so it never waits for the reader) instead of a
#: ``StreamResponse`` written through :meth:`HttpCache._send`'s timed slices.
WHOLE_RESPONSE = 32 * 1024
_OCTETS = {"Content-Type": "application/octet-stream"}
#: Set to anything but ``0`` (or ``$TB5SYNC_PORTABLE``): hits are never sent with ``sendfile``,
#: always read and written through the transport (the path of TLS and of systems without it).
SENDFILE_PORTABLE_ENV = "TB5SYNC_CACHE_SENDFILE_PORTABLE"
#: A hit sent with ``sendfile`` goes in calls of at most this many bytes (the largest chunk of
#: chunking format v1: one call per chunk), each to be taken by its reader within
#: ``client_body_timeout`` seconds (the buffer path's windows are :data:`SEND_SLICE`). One call
#: per 1 MiB instead cost 1.92 ms of server CPU per 3.5 MB GET against 1.62 (benches/README.md).
SENDFILE_SLICE = 4 * 1024 * 1024

#: The routes a first path segment names; every other first segment is a client's namespace of
#: opaque keys (ccache's ``PREFIX``, sccache's, a URL prefix), whatever follows it.
BAZEL_ROUTES = ("ac", "cas")
RESERVED_ROUTES = ("metrics", "status")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
#: A Bazel instance name declared with ``bazel_instances`` (one path segment).
_INSTANCE_RE = re.compile(r"^[^/\x00-\x1f\x7f]+$")


def route(path: str, instances: frozenset[str] | set[str] = frozenset()) -> tuple[str, str, str | None]:
    """The route of a request path (without its leading ``/``), decided by its first segment only.

    Returns ``(kind, prefix, digest)``: ``kind`` is ``"ac"`` or ``"cas"`` (Bazel's, ``digest`` its
    SHA-256 hex, ``prefix`` ``""`` or ``"INSTANCE/"``), ``"metrics"``/``"status"`` (the reserved
    routes, whole first segment), ``"kv"`` (a client's opaque key, ``digest`` None), or
    ``"bad"`` (a Bazel route whose rest is not one lowercase SHA-256 hex digest: ``digest`` is the
    reason). A first segment in ``instances`` (Bazel's ``--remote_cache=http://HOST/INSTANCE``)
    routes its second segment as Bazel's.
    """
    first, _, rest = path.partition("/")
    prefix = ""
    if first in instances:
        prefix = first + "/"
        first, _, rest = rest.partition("/")
        if first not in BAZEL_ROUTES:
            return "bad", prefix, f"below Bazel instance {prefix[:-1]!r} only ac/ and cas/ are served"
    elif first in RESERVED_ROUTES:
        return first, "", None
    if first in BAZEL_ROUTES:
        if _SHA256_RE.match(rest):
            return first, prefix, rest
        if prefix:  # a declared instance's namespace is Bazel's alone
            return "bad", prefix, f"not a lowercase SHA-256 hex digest: {rest[:80]} (below a Bazel instance)"
        # No Bazel request has this shape (its names are 64 hex digits): a client's opaque key, such as
        # ccache's subdirs layout without a URL prefix (a key beginning "ac" is "ac/<31 characters>").
        # Stored as kv, it is never taken for an ActionResult nor read back as a CAS blob.
    return "kv", "", None


def _peer(request: web.Request) -> str | None:
    """The client's address as ``--allow`` and the per-address caps count it (an IPv6 zone kept)."""
    return peer_address(request.transport.get_extra_info("peername")) if request.transport else request.remote


class _Bazel:
    """A Bazel route's parts, as the handlers read them (``group("prefix")``, ``group("hash")``)."""

    __slots__ = ("prefix", "hash")

    def __init__(self, prefix: str, digest: str) -> None:
        self.prefix, self.hash = prefix, digest

    def group(self, name: str) -> str:
        return self.prefix if name == "prefix" else self.hash


# ---- metrics ------------------------------------------------------------------------------------
class _Metrics:
    """Counters and latency histograms; updated on the event loop only, read from any thread."""

    def __init__(self) -> None:
        self.counts: dict[str, float] = {}
        self.unflushed: dict[str, float] = {}
        self.hist: dict[str, list[int]] = {}
        self.lat_sum: dict[str, float] = {}
        self.lock = threading.Lock()

    def add(self, name: str, n: float = 1) -> None:
        with self.lock:
            self.counts[name] = self.counts.get(name, 0) + n
            self.unflushed[name] = self.unflushed.get(name, 0) + n

    def observe(self, method: str, seconds: float) -> None:
        with self.lock:
            h = self.hist.setdefault(method, [0] * (len(BUCKETS) + 1))
            for i, b in enumerate(BUCKETS):
                if seconds <= b:
                    h[i] += 1
                    break
            else:
                h[-1] += 1
            self.lat_sum[method] = self.lat_sum.get(method, 0.0) + seconds

    def take(self) -> dict[str, float]:
        with self.lock:
            out, self.unflushed = self.unflushed, {}
        return out

    def prometheus(self) -> str:
        lines = []
        with self.lock:
            counts = dict(self.counts)
            hist = {k: list(v) for k, v in self.hist.items()}
            sums = dict(self.lat_sum)
        by_metric: dict[str, list[tuple[str, float]]] = {}
        for name, v in sorted(counts.items()):
            kind, metric = name.split(".", 1)
            by_metric.setdefault(metric, []).append((kind, v))
        for metric, rows in by_metric.items():
            full = f"tb5sync_httpcache_{metric}_total"
            lines.append(f"# TYPE {full} counter")
            lines += [f'{full}{{kind="{k}"}} {int(v) if float(v).is_integer() else v}' for k, v in rows]
        full = "tb5sync_httpcache_request_seconds"
        lines.append(f"# TYPE {full} histogram")
        for method, h in sorted(hist.items()):
            acc = 0
            for b, n in zip(BUCKETS, h):
                acc += n
                lines.append(f'{full}_bucket{{method="{method}",le="{b:g}"}} {acc}')
            acc += h[-1]
            lines.append(f'{full}_bucket{{method="{method}",le="+Inf"}} {acc}')
            lines.append(f'{full}_sum{{method="{method}"}} {sums.get(method, 0.0):.6f}')
            lines.append(f'{full}_count{{method="{method}"}} {acc}')
        return "\n".join(lines) + "\n"


# ---- the server ---------------------------------------------------------------------------------
class HttpCache:
    """A ccache / Bazel HTTP remote cache over a :class:`tb5sync.store.Store`.

    Parameters
    ----------
    store : Store or str
        The store (or its directory; then it is opened here and closed by :meth:`stop`).
    host, port : str, int
        Address to listen on (port 0 picks a free one; :attr:`port` holds it after :meth:`start`).
    read_only : bool
        Serve hits; refuse PUT and DELETE with 403. The counters are added to the store unless
        the store itself was opened read-only (``Store(..., read_only=True)``, as ``serve
        --read-only`` does): then they stay in memory (``/metrics``, ``/status``).
    allow : sequence of str
        CIDR networks or interface names (:class:`tb5sync._os.netif.AllowList`) clients may connect
        from (403 for others); empty allows all.
    basic : str, optional
        ``"user:password"`` for HTTP basic authentication.
    bearer : str, optional
        A token accepted as ``Authorization: Bearer TOKEN``. With ``basic`` and/or ``bearer`` set,
        a request without valid credentials is answered 401.
    ac_validation : bool
        Check ``/ac/`` entries as ActionResults (see the module docstring).
    concurrency : int
        Requests served at once (others wait), and the worker threads for store I/O.
    bazel_instances : sequence of str
        First path segments that are Bazel instance names (``--remote_cache=http://HOST/NAME``):
        ``/NAME/ac/<sha256>`` and ``/NAME/cas/<sha256>`` follow Bazel's rules. Any other first
        segment but ``ac``, ``cas``, ``metrics`` and ``status`` is a client's namespace of opaque keys.
    max_entry_size : int, optional
        Largest entry accepted (bytes of body); None: only the store's quota bounds it. A PUT over
        it, or over the quota, is refused before anything is stored: 413 when its Content-Length
        says so up front (the body is not read), 507 Insufficient Storage once a body without one
        passes it (bazel-remote's answer); nothing is evicted for it.
    client_header_timeout : float
        Seconds a request head may take, from the connection's accept (first request) or from the
        first byte of a later one; then 408 and the connection is closed. 0: none.
    keepalive_timeout : float
        Seconds an idle connection is kept open between requests (and before its first byte). 0: none.
    client_body_timeout : float
        The window (seconds) of the body's minimum rate: a PUT body that, within any such window,
        delivers less than ``client_body_min_rate * client_body_timeout`` bytes (or the rest of its
        Content-Length, if less) is cut: 408, the connection closed, nothing stored.
    client_body_min_rate : int
        Bytes per second a body must average over each ``client_body_timeout`` window (0: any
        progress within the window is enough).
    max_connections_per_address : int
        Open connections (idle ones included) one client address may hold; a connection past it
        is answered 503 and closed at once. 0: no cap.
    limit_conn : int
        Requests in progress one client address may have (nginx's ``limit_conn``); past it, 503
        at once. 0: no cap.

    GET, HEAD and DELETE are served in ``concurrency`` slots of their own: uploads in progress
    (each holding one of the ``concurrency`` body slots) never delay them. Authentication and
    the address checks come before a slot is taken.

    Raises
    ------
    UsageError
        A bad ``allow`` network or ``basic`` value.
    """

    def __init__(self, store: Store | str | os.PathLike[str], host: str = "127.0.0.1", port: int = 0, *,
                 read_only: bool = False, allow: Sequence[str] = (), basic: str | None = None,
                 bearer: str | None = None, ac_validation: bool = True, concurrency: int = 64,
                 bazel_instances: Sequence[str] = (), max_entry_size: int | None = None,
                 client_header_timeout: float = CLIENT_HEADER_TIMEOUT, keepalive_timeout: float = KEEPALIVE_TIMEOUT,
                 client_body_timeout: float = CLIENT_BODY_TIMEOUT, client_body_min_rate: int = CLIENT_BODY_MIN_RATE,
                 max_connections_per_address: int = MAX_CONNECTIONS_PER_ADDRESS, limit_conn: int = LIMIT_CONN) -> None:
        self._own_store = not isinstance(store, Store)
        self.store = Store(store) if not isinstance(store, Store) else store
        self.host, self.port = bind_host(host), port  # an interface name -> its address
        self.read_only = read_only
        self.allow = AllowList(allow)  # CIDRs and interface names (tb5sync._os.netif)
        if basic is not None and ":" not in basic:
            raise UsageError("--http-basic takes USER:PASSWORD")
        self._basic = ("Basic " + base64.b64encode(basic.encode()).decode()) if basic else None
        self._bearer = f"Bearer {bearer}" if bearer else None
        self.ac_validation = ac_validation
        for name in bazel_instances:
            if not _INSTANCE_RE.match(name) or name in (".", "..") or name in BAZEL_ROUTES + RESERVED_ROUTES:
                raise UsageError(f"--bazel-instance takes one path segment other than ac, cas, metrics, status: {name!r}")
        self.bazel_instances = frozenset(bazel_instances)
        self._warned_instances: set[str] = set()
        if max_entry_size is not None and (not isinstance(max_entry_size, int) or max_entry_size < 0):
            raise UsageError(f"--max-entry-size takes a byte count >= 0, got {max_entry_size!r}")
        self.max_entry_size = max_entry_size
        self._recent: set[str] = set()  # keys stored since the last quota run: never evicted by it
        for name, v in (("--client-header-timeout", client_header_timeout), ("--keepalive-timeout", keepalive_timeout),
                        ("--client-body-timeout", client_body_timeout), ("--client-body-min-rate", client_body_min_rate),
                        ("--max-connections-per-address", max_connections_per_address), ("--limit-conn", limit_conn)):
            if not isinstance(v, (int, float)) or v < 0:
                raise UsageError(f"{name} takes a number >= 0, got {v!r}")
        self.client_header_timeout = float(client_header_timeout)
        self.keepalive_timeout = float(keepalive_timeout)
        self.client_body_timeout = float(client_body_timeout) or CLIENT_BODY_TIMEOUT
        self.client_body_min_rate = int(client_body_min_rate)
        self.max_connections_per_address = int(max_connections_per_address)
        self.limit_conn = int(limit_conn)
        self._conns: dict[str, int] = {}  # open connections per client address (event loop only)
        self._inflight: dict[str, int] = {}  # requests in progress per client address
        self.concurrency = max(1, int(concurrency))
        self.idle_timeout = IDLE_TIMEOUT
        self.metrics = _Metrics()
        self.started = time.time()
        self._pool = ThreadPoolExecutor(max_workers=min(32, self.concurrency), thread_name_prefix="tb5-httpcache")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._stop_ev: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._pending: list[tuple[str, bytes, asyncio.Future[None]]] = []
        self._drain_task: asyncio.Task[None] | None = None
        self._pending_bytes = 0
        self._arriving = 0  # small uploads whose bodies are still arriving (event loop only)
        self._writing = False  # a batch is being written
        self._first_pending = 0.0  # loop time the oldest waiting entry arrived
        self._overlap_until = 0.0  # loop time until which batches linger (uploads overlapped lately)
        self._batch_wake: asyncio.Event | None = None
        self._quota_running = False
        self._quota_again = False
        self._quota_lock = threading.Lock()
        self._touched: set[str] = set()  # keys read since the last _flush_touches
        self._touch_lock = threading.Lock()
        self.grpc: Any = None  # its gRPC face (cache/grpccache.GrpcCache) when the command serves one
        # hits verified before go out with sendfile (os.sendfile through loop.sendfile), unless
        # the system has none or the portable path is forced; TLS transports are checked per request
        self.sendfile = hasattr(os, "sendfile") and not portable(SENDFILE_PORTABLE_ENV)

    # ---- life cycle ----
    def start(self) -> HttpCache:
        """Listen and serve in a background thread; returns once the port is bound.

        Raises
        ------
        OSError
            The address cannot be bound.
        """
        self._thread = threading.Thread(target=self._run_thread, name="tb5-httpcache-loop", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def serve_forever(self) -> None:
        """Serve in the calling thread until :meth:`stop` (or KeyboardInterrupt)."""
        if self._thread is None:
            self.start()
        assert self._thread is not None
        while self._thread.is_alive():
            self._thread.join(0.5)

    def stop(self) -> None:
        """Stop serving (requests in flight are finished or cut), flush the counters, close what it opened."""
        if self._loop is not None and self._stop_ev is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop_ev.set)
            self._thread.join(30)
        self._pool.shutdown(wait=True)
        if not self.store.read_only:
            with contextlib.suppress(Exception):
                self._flush_touches()
            with contextlib.suppress(Exception):
                add_counters(self.store, self.metrics.take())
        if self._own_store:
            self.store.close()

    def __enter__(self) -> HttpCache:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run_thread(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported to start()
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_ev = asyncio.Event()
        self._sem = asyncio.Semaphore(self.concurrency)  # body slots: PUT
        self._rsem = asyncio.Semaphore(self.concurrency)  # GET, HEAD, DELETE: never behind uploads
        # No middleware: the guard wraps the one handler itself (an Application with middlewares
        # runs aiohttp's current-app wrapper and a partial per request as well).
        app = web.Application(client_max_size=MAX_AC)
        app.router.add_route("*", "/{tail:.*}", self._guarded, expect_handler=self._expect)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     keepalive_timeout=self.keepalive_timeout or 1e9)
        await self._runner.setup()
        web_server = self._runner.server
        assert web_server is not None

        def factory() -> _Conn:
            return _Conn(web_server, loop=self._loop, cache=self, **web_server._kwargs)

        server = await self._loop.create_server(factory, self.host, self.port, reuse_address=True, backlog=1024)
        if server.sockets:
            self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        flusher = asyncio.create_task(self._flush_loop())
        try:
            await self._stop_ev.wait()
        finally:
            flusher.cancel()
            server.close()
            await self._runner.cleanup()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 5)

    async def _flush_loop(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(TOUCH_EVERY)
            if self._touched:
                try:
                    await self._run(self._flush_touches)
                except Exception as exc:  # best effort: the LRU order only
                    log.warning("http cache: uses not recorded: %s", exc)
            if self.store.read_only or time.monotonic() - last < FLUSH_EVERY:
                continue  # counted in memory only
            last = time.monotonic()
            deltas = self.metrics.take()
            if deltas:
                try:
                    await self._run(add_counters, self.store, deltas)
                except Exception as exc:  # the counters are best effort; the cache goes on
                    log.warning("http cache: counters not recorded: %s", exc)

    async def _run(self, fn: Any, *args: Any) -> Any:
        assert self._loop is not None
        return await self._loop.run_in_executor(self._pool, fn, *args)

    async def _expect(self, request: web.Request) -> None:
        """``Expect: 100-continue``: invite the body only of a request that may send one (its address
        allowed, authenticated, a size under the entry limit); the others get their refusal from the
        middleware without being asked for a byte of body (RFC 9110, 10.1.1)."""
        expect = request.headers.get("Expect", "")
        if expect.lower() != "100-continue":
            raise web.HTTPExpectationFailed(text=f"unknown Expect: {expect}")
        peer = _peer(request)
        want, limit = request.content_length, self.entry_limit()
        if (not self._allowed(peer) or not self._authorized(request)
                or (want is not None and limit is not None and want > limit)):
            return
        if request.version == HttpVersion11:
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0

    async def _store(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` in the worker pool under a read slot (at most ``concurrency`` at once)."""
        async with self._rsem:
            return await self._run(fn, *args)

    async def _send(self, resp: web.StreamResponse, data: bytes) -> None:
        """Write ``data`` to a response in slices of :data:`SEND_SLICE` bytes. A slice the reader
        does not take within ``client_body_timeout`` seconds cuts the connection (nginx's
        ``send_timeout``): a stalled reader holds one piece of memory for one window, and no slot.

        Raises
        ------
        TimeoutError
            The reader took nothing for a window (aiohttp then closes the connection).
        """
        view = memoryview(data)
        for off in range(0, len(view), SEND_SLICE):
            async with asyncio.timeout(self.client_body_timeout):  # no task per slice (wait_for makes one)
                await resp.write(view[off:off + SEND_SLICE])

    # ---- access ----
    def _allowed(self, ip: str | None) -> bool:
        return not self.allow or (ip or "") in self.allow

    def _authorized(self, request: web.Request) -> bool:
        if self._basic is None and self._bearer is None:
            return True
        got = request.headers.get("Authorization", "")
        return any(want is not None and hmac.compare_digest(got.encode(), want.encode())
                   for want in (self._basic, self._bearer))

    async def _guarded(self, request: web.Request) -> web.StreamResponse:
        return await self._guard(request, self._dispatch)

    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        t0 = time.perf_counter()
        try:
            peer = _peer(request)
            if not self._allowed(peer):
                return web.Response(status=403, text=f"client address {peer} is not allowed\n")
            conn = request.protocol if isinstance(request.protocol, _Conn) else None
            key = peer or ""
            if self.limit_conn and self._inflight.get(key, 0) >= self.limit_conn:
                self.metrics.add("all.requests_refused")
                resp = web.Response(status=503, text=f"more than {self.limit_conn} requests in progress from {peer}\n")
                resp.force_close()
                return resp
            if not self._authorized(request):  # before any slot, before a byte of the body
                resp = web.Response(status=401, text="authorization required\n",
                                    headers={"WWW-Authenticate": 'Basic realm="tb5sync"'})
                if request.can_read_body:
                    resp.force_close()
                return resp
            self._inflight[key] = self._inflight.get(key, 0) + 1
            if conn is not None:
                conn.tb5_enter()
            try:
                if request.method == "PUT":
                    async with self._sem:  # a body slot, for the whole upload
                        return await handler(request)  # type: ignore[no-any-return]
                # GET/HEAD/DELETE take a read slot for each piece of store work only (_store), never
                # while a response waits for its reader: a client that never reads holds no slot.
                return await handler(request)  # type: ignore[no-any-return]
            finally:
                if conn is not None:
                    conn.tb5_leave()
                n = self._inflight.get(key, 1) - 1
                if n > 0:
                    self._inflight[key] = n
                else:
                    self._inflight.pop(key, None)
        finally:
            self.metrics.observe(request.method, time.perf_counter() - t0)

    # ---- requests ----
    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path = request.match_info["tail"]
        path = path[:-1] if path.endswith("/") and path != "/" else path  # ccache's "directories"
        kind, prefix, digest = route(path, self.bazel_instances)
        if kind in RESERVED_ROUTES:
            if path == kind and request.method in ("GET", "HEAD"):
                return await (self._metrics(request) if kind == "metrics" else self._status(request))
            return web.Response(status=405 if path == kind else 404, headers={"Allow": "GET, HEAD"})
        if kind == "bad":
            return web.Response(status=400, text=f"{digest}\n")
        try:
            key = check_blob_key(path)
        except UsageError as exc:
            return web.Response(status=400, text=f"{exc}\n")
        m = _Bazel(prefix, digest) if digest is not None else None
        if kind == "kv" and request.method == "PUT":
            self._warn_undeclared_instance(path)
        if request.method in ("GET", "HEAD"):
            return await self._get(request, key, kind, m)
        if request.method == "PUT":
            return await self._put(request, key, kind, m)
        if request.method == "DELETE":
            if self.read_only:
                return web.Response(status=403, text="read-only cache\n")
            gone = await self._store(delete_blob, self.store, key)
            return web.Response(status=200 if gone else 404)
        return web.Response(status=405, headers={"Allow": "GET, HEAD, PUT, DELETE"})

    def _warn_undeclared_instance(self, path: str) -> None:
        """Log once per first segment when a PUT to ``NAME/ac/<sha256>`` (Bazel's shape) is kept as an
        opaque key because ``NAME`` was not declared with ``--bazel-instance``: its ActionResults then
        go unchecked, which is what ccache's ``bazel`` layout needs and a Bazel URL prefix does not."""
        first, _, rest = path.partition("/")
        seg, _, name = rest.partition("/")
        if seg in BAZEL_ROUTES and _SHA256_RE.match(name) and first not in self._warned_instances:
            self._warned_instances.add(first)
            log.warning("http cache: %s/%s/... is kept as opaque keys (no ActionResult check): if %r is a Bazel "
                        "--remote_cache URL prefix, start the cache with --bazel-instance %s", first, seg, first, first)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics.prometheus(), content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def _status(self, request: web.Request) -> web.Response:
        stats = await self._run(self.store.stats)
        with self.metrics.lock:
            counts = dict(self.metrics.counts)
        return web.json_response({"uptime": time.time() - self.started, "read_only": self.read_only,
                                  "ac_validation": self.ac_validation, "counters": counts, "store": stats})

    async def _ac_valid(self, prefix: str, data: bytes) -> bool:
        """Whether every CAS blob an ActionResult references is held (trees: the tree and its files)."""
        return bool(await self._run(self._ac_valid_sync, prefix, data))

    def _ac_valid_sync(self, prefix: str, data: bytes) -> bool:
        """:meth:`_ac_valid` in a worker thread (one hop for the whole check); its uses are recorded
        with the next batch of touches."""
        try:
            blobs, trees = parse_action_result(data)
        except ActionResultError:
            return False
        keys = [f"{prefix}cas/{h}" for h, n in blobs + trees if h != EMPTY_SHA256]
        if not keys:
            return True
        held = has_blobs(self.store, keys)
        if len(held) < len(set(keys)):
            return False
        self._touch(keys)  # a hit is a use of what it names (bazel-remote reads them too): LRU keeps them together
        for h, _ in trees:
            if h == EMPTY_SHA256:
                continue
            info = blob(self.store, f"{prefix}cas/{h}", False)
            if info is None or info.size > MAX_AC:
                return False
            try:
                files = tree_files(b"".join(read_blob(self.store, info)))
            except (IntegrityError, ActionResultError):
                return False
            fkeys = [f"{prefix}cas/{fh}" for fh, _ in files if fh != EMPTY_SHA256]
            if fkeys and len(has_blobs(self.store, fkeys)) < len(set(fkeys)):
                return False
            self._touch(fkeys)
        return True

    def _touch(self, keys: Sequence[str]) -> None:
        """Record a use of ``keys``: written in one transaction by the next :meth:`_flush_touches`
        (within :data:`TOUCH_EVERY` seconds, and before any quota run)."""
        if not self.read_only:
            with self._touch_lock:
                self._touched.update(keys)

    def _flush_touches(self) -> None:
        with self._touch_lock:
            keys, self._touched = self._touched, set()
        if keys:
            touch_blobs(self.store, sorted(keys))

    async def fetch(self, key: str, mode: str, prefix: str = "") -> tuple[BlobInfo | None, Any, bytes, bool]:
        """:meth:`_fetch`, on the event loop itself when the store's lock is free and the entry is
        at most :data:`INLINE_MAX` bytes (an index lookup and one ``pread`` of a chunk verified
        before: tens of microseconds, less than a hop to a worker thread and back), else in a worker.

        Raises
        ------
        IntegrityError
            A chunk read is damaged.
        """
        lock = self.store._lock
        if lock.acquire(blocking=False):
            try:
                got = self._fetch(key, mode, prefix, inline=True)
            finally:
                lock.release()
            if got[0] is None or got[1] is not _LATER:
                return got
            return await self._store(self._fetch, key, "first" if mode == "send" else mode,  # type: ignore[no-any-return]
                                     prefix, got[0])
        return await self._store(self._fetch, key, mode, prefix)  # type: ignore[no-any-return]

    def _fetch(self, key: str, mode: str, prefix: str = "", info: BlobInfo | None = None,
               inline: bool = False) -> tuple[BlobInfo | None, Any, bytes, bool]:
        """One hop of a read, in a worker thread: the row of ``key`` (its use recorded), and with
        ``mode`` ``"row"`` nothing more, ``"first"`` the chunk iterator and its first chunk, ``"send"``
        a list of :class:`~tb5sync.store.blobs.FileRange` when every chunk is a range of a pack verified
        under its identity now (:func:`~tb5sync.store.blobs.blob_ranges`, no byte read; the caller
        closes them), else as ``"first"``, ``"whole"`` the whole body
        (at most :data:`MAX_AC` bytes, else ``(info, None, b"", False)``), ``"ac"`` the whole body
        and whether its ActionResult is complete (:meth:`_ac_valid`). ``(None, None, b"", False)``: a miss.
        ``inline``: only an entry of at most :data:`INLINE_MAX` bytes is read, a larger one is
        ``(info, _LATER, b"", False)`` (pass ``info`` back to go on).

        Raises
        ------
        IntegrityError
            A chunk read is damaged.
        """
        if info is None:
            info = blob(self.store, key, False)
            if info is None:
                return None, None, b"", False
            self._touch((key,))
        if mode == "row":
            return info, None, b"", True
        if mode == "send":  # verified chunks as ranges of their packs (no byte read), else as "first"
            if info.size > WHOLE_RESPONSE:  # a small hit goes out as one Response anyway
                ranges = blob_ranges(self.store, info)
                if ranges is not None:
                    return info, ranges, b"", True
            mode = "first"
        if inline and (info.size > INLINE_MAX or len(info.chunks) > 1):
            return info, _LATER, b"", False
        chunks = read_blob(self.store, info)
        if mode == "first":
            return info, chunks, next(chunks, b""), True
        if info.size > MAX_AC:
            return info, None, b"", False
        data = b"".join(chunks)
        return info, None, data, (self._ac_valid_sync(prefix, data) if mode == "ac" else True)

    async def _get(self, request: web.Request, key: str, kind: str, m: _Bazel | None) -> web.StreamResponse:
        head = request.method == "HEAD"
        if kind == "cas" and m is not None and m.group("hash") == EMPTY_SHA256:
            self.metrics.add(f"{kind}.hits")
            return web.Response(body=b"" if not head else None, content_type="application/octet-stream")
        ac = kind == "ac" and self.ac_validation
        tr = request.transport
        send = (self.sendfile and not head and not ac and tr is not None and tr.get_extra_info("sslcontext") is None)
        try:
            info, chunks, first, valid = await self.fetch(key, "ac" if ac else "row" if head else "send" if send else "first",
                                                          m.group("prefix") if m is not None else "")
        except IntegrityError as exc:
            return await self._damaged(key, kind, exc)
        if info is None:
            self.metrics.add(f"{kind}.misses")
            return web.Response(status=404)
        if ac and (info.size > MAX_AC or not valid):
            self.metrics.add(f"{kind}.misses")
            if info.size <= MAX_AC:
                self.metrics.add(f"{kind}.ac_incomplete")
            return web.Response(status=404)
        if isinstance(chunks, list):
            try:
                done = await self._send_ranges(request, key, info, chunks)
            finally:
                close_ranges(chunks)
            if done is not None:
                self.metrics.add(f"{kind}.hits")
                self.metrics.add(f"{kind}.bytes_sent", info.size)
                return done
            # nothing sent (the transport cannot sendfile, or a pack changed before the first byte):
            # read and verified as any hit
            try:
                info, chunks, first, valid = await self.fetch(key, "first")
            except IntegrityError as exc:
                return await self._damaged(key, kind, exc)
            if info is None:
                self.metrics.add(f"{kind}.misses")
                return web.Response(status=404)
        if chunks is None:
            chunks = iter(())
        self.metrics.add(f"{kind}.hits")
        if not head and len(first) == info.size <= WHOLE_RESPONSE and tr is not None and not tr.get_write_buffer_size():
            # all in hand and small, nothing of an earlier reply still queued: one Response, headers
            # and body in one write, which stays under the transport's high-water mark (64 KiB), so
            # its drain never waits for the reader (a stalled reader holds no window, no slot)
            self.metrics.add(f"{kind}.bytes_sent", info.size)
            return web.Response(body=first, headers=_OCTETS)
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/octet-stream"})
        resp.content_length = info.size
        if head:
            await resp.prepare(request)
            return resp
        await resp.prepare(request)
        sent = 0
        if first:
            await self._send(resp, first)
            sent += len(first)
        while sent < info.size:
            try:
                piece = await self._store(next, chunks, b"")
            except IntegrityError as exc:
                # The status line is sent: a body cut short of its Content-Length is how HTTP says
                # "failed" now. The entry is dropped so that the next GET is a clean miss.
                await self._damaged(key, kind, exc)
                raise
            if not piece:
                break
            await self._send(resp, piece)  # a stalled reader is cut
            sent += len(piece)
        await resp.write_eof()
        self.metrics.add(f"{kind}.bytes_sent", sent)
        return resp

    async def _send_ranges(self, request: web.Request, key: str, info: BlobInfo,
                           ranges: list[FileRange]) -> web.StreamResponse | None:
        """Answer a hit whose chunks are ``ranges`` of pack files verified under their identity now
        (:func:`~tb5sync.store.blobs.blob_ranges`) with the kernel's ``sendfile`` (``loop.sendfile``,
        no copy through Python), as nginx sends files. ``None``, before any byte, when a pack's
        identity changed since (the caller reads and verifies the entry as any hit).

        Each range's pack file is checked (``fstat``) before and after it is sent, and the body's
        last byte is read before the last check and written after it: a change while bytes were
        going out (they may not be the bytes verified) cuts the connection before the body is
        complete, so no client takes it as the entry. A transport that cannot ``sendfile``
        gets the same ranges read (``pread``) and written, checked the same way.

        Raises
        ------
        IntegrityError
            A pack file changed while its range was sent; the connection is cut.
        TimeoutError
            The reader took nothing for ``client_body_timeout`` seconds (the connection is cut).
        """
        if not all(r.unchanged() for r in ranges):
            return None
        tr = request.transport
        if tr is None:
            raise ConnectionResetError("connection lost")
        assert self._loop is not None
        resp = web.StreamResponse(status=200, headers=_OCTETS)
        resp.content_length = info.size
        await resp.prepare(request)
        if (len(ranges) > len(info.chunks) and hasattr(tr, "_make_empty_waiter")
                and hasattr(self._loop, "_add_writer")):
            # more ranges than chunks: a v2 entry's ~16 KiB pieces, one os.sendfile loop in this
            # task rather than one loop.sendfile (and its per-call setup) per piece
            tail = await self._sendfile_loop(tr, key, ranges)
            if tail:
                await resp.write(tail)
            await resp.write_eof()
            return resp
        native = True
        tail = b""
        for i, r in enumerate(ranges):
            end = r.offset + r.length
            if i == len(ranges) - 1 and r.length:
                # the body's last byte is held back until the pack is found unchanged after the
                # rest went out: a client never holds a whole body sent from a changed pack
                end -= 1
                tail = os.pread(r.fd, 1, end)
            with open(r.fd, "rb", buffering=0, closefd=False) as f:
                for off in range(r.offset, end, SENDFILE_SLICE):
                    n = min(SENDFILE_SLICE, end - off)
                    if not r.unchanged():
                        self._cut(tr, key, r)
                    async with asyncio.timeout(self.client_body_timeout):
                        if native:
                            try:
                                await self._loop.sendfile(tr, f, off, n, fallback=False)
                                continue
                            except asyncio.SendfileNotAvailableError:
                                native = False  # nothing of this slice was sent
                        piece = await self._run(os.pread, r.fd, n, off)
                        if len(piece) != n or not r.unchanged():
                            self._cut(tr, key, r)
                        await resp.write(piece)
                if not r.unchanged() or (end < r.offset + r.length and len(tail) != 1):
                    self._cut(tr, key, r)
        if tail:
            await resp.write(tail)
        await resp.write_eof()
        return resp

    async def _sendfile_loop(self, tr: Any, key: str, ranges: list[FileRange]) -> bytes:
        """Send ``ranges`` (many, small: the pieces of a v2 entry) with ``os.sendfile`` on the
        transport's socket in one loop, as ``loop.sendfile`` does for one range (the transport's
        buffer drained and its reading paused first), without its per-call setup. Each pack's
        identity is checked before its first range; the body's last byte is read, every pack's
        identity checked again once the rest went out, and the byte returned for the caller to
        write: a client never holds a whole body sent from a changed pack.

        Raises
        ------
        IntegrityError
            A pack changed; the connection is cut.
        TimeoutError
            The socket took nothing for ``client_body_timeout`` seconds (the connection is cut).
        """
        assert self._loop is not None
        loop = self._loop
        sock = tr.get_extra_info("socket")
        if sock is None:
            raise ConnectionResetError("connection lost")
        sfd = sock.fileno()
        tr.pause_reading()
        try:
            await tr._make_empty_waiter()
            checked: set[int] = set()
            last = len(ranges) - 1
            tail = b""
            for i, r in enumerate(ranges):
                if r.fd not in checked:
                    if not r.unchanged():
                        self._cut(tr, key, r)
                    checked.add(r.fd)
                off, end = r.offset, r.offset + r.length
                if i == last and r.length:
                    end -= 1  # the body's last byte: read now, sent once every pack is found unchanged
                    tail = os.pread(r.fd, 1, end)
                while off < end:
                    try:
                        n = os.sendfile(sfd, r.fd, off, end - off)
                    except BlockingIOError:
                        fut = loop.create_future()
                        # the transport's own socket: asyncio's sock_sendfile waits on it the same way
                        loop._add_writer(sfd, lambda f=fut: f.done() or f.set_result(None))  # type: ignore[attr-defined]
                        try:
                            async with asyncio.timeout(self.client_body_timeout):
                                await fut
                        finally:
                            loop._remove_writer(sfd)  # type: ignore[attr-defined]
                        continue
                    if n == 0:
                        raise ConnectionResetError("connection lost")
                    off += n
            for q in {x.fd: x for x in ranges}.values():
                if not q.unchanged():
                    self._cut(tr, key, q)
            if ranges and ranges[-1].length and len(tail) != 1:
                self._cut(tr, key, ranges[-1])
            return tail
        except (TimeoutError, OSError):
            tr.abort()
            raise
        finally:
            tr._reset_empty_waiter()
            if not tr.is_closing():
                tr.resume_reading()

    def _cut(self, tr: asyncio.BaseTransport, key: str, r: FileRange) -> None:
        """Cut a response sent from pack ranges whose pack ``r.pack`` changed: the client sees a body
        short of its ``Content-Length`` (how HTTP says "failed" once the status line is out)."""
        log.warning("http cache: pack %s changed while entry %s was sent from it; connection cut", r.pack, key)
        self.metrics.add("all.sends_cut")
        tr.abort()  # type: ignore[attr-defined]
        raise IntegrityError(f"pack {r.pack} changed while entry {key} was sent from it")

    async def _damaged(self, key: str, kind: str, exc: Exception) -> web.Response:
        await self.drop_damaged(key, kind, exc, "http")
        return web.Response(status=404)

    async def drop_damaged(self, key: str, kind: str, exc: Exception, face: str) -> None:
        """Entry ``key`` held a damaged or missing chunk (``exc``): logged, counted as a miss and as
        damaged under ``kind``, and deleted (not on a read-only cache), so the next read is a clean
        miss. ``face`` ("http", "grpc") names the front end in the log line."""
        log.warning("%s cache: dropping damaged entry %s: %s", face, key, exc)
        self.metrics.add(f"{kind}.misses")
        self.metrics.add(f"{kind}.damaged")
        if not self.read_only:
            await self._store(delete_blob, self.store, key)

    async def _put(self, request: web.Request, key: str, kind: str, m: _Bazel | None) -> web.Response:
        if self.read_only:
            self.metrics.add(f"{kind}.puts_refused")
            return web.Response(status=403, text="read-only cache\n")
        want = request.content_length
        limit = self.entry_limit()
        if want is not None and limit is not None and want > limit:
            return self._too_large(request, kind, 413, want, limit)  # told up front: not a byte read
        sha = hashlib.sha256() if kind == "cas" else None
        mem = bytearray()
        spool: Any = None
        arriving = self._arrive(want is None or want <= SPOOL_MEMORY)  # may join the next batch
        spool_path = os.path.join(self.store.tmp_dir, f"{os.getpid()}-http-{secrets.token_hex(8)}.body")
        got = 0
        try:
            loop = asyncio.get_running_loop()
            window = self.client_body_timeout
            rate_need = max(1, int(self.client_body_min_rate * window))
            win_start, win_got = loop.time(), 0
            try:
                while True:
                    left = win_start + window - loop.time()
                    try:
                        async with asyncio.timeout(max(left, 0.001)):  # no task per piece (wait_for makes one)
                            piece: bytes | None = await request.content.read(READ_PIECE)
                    except asyncio.TimeoutError:
                        piece = None
                    now = loop.time()
                    if piece:
                        win_got += len(piece)
                    if piece is None or now - win_start >= window:
                        # one window is over: it must have brought the minimum rate's bytes (or the rest)
                        need = rate_need if want is None else min(rate_need, max(1, want - (got + len(piece or b"")) + win_got))
                        if win_got < need:
                            self.metrics.add(f"{kind}.puts_cut")
                            self.metrics.add("all.body_too_slow")
                            log.info("http cache: upload of %s cut: %d bytes in %.1f s, below %d bytes/s",
                                     key, win_got, window, self.client_body_min_rate)
                            resp = web.Response(status=408, text=f"request body slower than {self.client_body_min_rate} bytes/s\n")
                            resp.force_close()
                            await resp.prepare(request)
                            await resp.write_eof()
                            if request.protocol is not None:  # not lingering on the rest: the peer is too slow
                                request.protocol.force_close()
                            return resp
                        win_start, win_got = now, 0
                    if piece is None:
                        continue
                    if not piece:
                        break
                    got += len(piece)
                    if limit is not None and got > limit:
                        return self._too_large(request, kind, 507, got, limit)
                    if sha is not None:
                        sha.update(piece)
                    if spool is None and len(mem) + len(piece) <= SPOOL_MEMORY:
                        mem += piece
                        continue
                    if spool is None:
                        arriving = self._leave(arriving)  # stored alone, not in a batch
                        spool = await aiofiles.open(spool_path, "xb")
                        await spool.write(bytes(mem))
                        mem = bytearray()
                    await spool.write(piece)
            except (ConnectionError, asyncio.IncompleteReadError, OSError, asyncio.TimeoutError) as exc:
                self.metrics.add(f"{kind}.puts_cut")
                log.info("http cache: upload of %s cut off: %s", key, exc)
                return web.Response(status=400, text="body cut off\n")
            except Exception as exc:  # aiohttp's payload errors (ContentLengthError, ...)
                if type(exc).__module__.startswith("aiohttp"):
                    self.metrics.add(f"{kind}.puts_cut")
                    return web.Response(status=400, text="body cut off\n")
                raise
            if want is not None and got != want:
                self.metrics.add(f"{kind}.puts_cut")
                return web.Response(status=400, text=f"body of {got} bytes, Content-Length {want}\n")
            if sha is not None and m is not None and sha.hexdigest() != m.group("hash"):
                self.metrics.add(f"{kind}.puts_refused")
                return web.Response(status=400, text=f"body hashes to {sha.hexdigest()}, not {m.group('hash')}\n")
            if kind == "ac" and self.ac_validation:
                if got > MAX_AC:
                    return web.Response(status=413, text="ActionResult too large\n")
                data = bytes(mem)
                if spool is not None:
                    await spool.close()
                    spool = None
                    async with aiofiles.open(spool_path, "rb") as f:
                        data = await f.read()
                try:
                    parse_action_result(data)
                except ActionResultError as exc:
                    self.metrics.add(f"{kind}.puts_refused")
                    return web.Response(status=400, text=f"not an ActionResult: {exc}\n")
            try:
                if spool is not None:
                    await spool.flush()
                    await spool.close()
                    spool = None
                    await self._run(put_blob, self.store, key, spool_path)
                else:
                    arriving = self._leave(arriving)
                    await self._put_small(key, bytes(mem))
            except EntryTooLargeError:
                return self._too_large(request, kind, 507, got, self.entry_limit() or got)
            self._recent.add(key)
            self.metrics.add(f"{kind}.puts")
            self.metrics.add(f"{kind}.bytes_received", got)
        finally:
            self._leave(arriving)
            if spool is not None:
                await spool.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(spool_path)
        self._maybe_enforce_quota()
        return web.Response(status=200)

    def entry_limit(self) -> int | None:
        """Largest entry a PUT may store now (bytes): ``max_entry_size`` or the store's quota, the
        smaller; None for no bound."""
        bounds = [b for b in (self.max_entry_size, self.store.quota) if b is not None]
        return min(bounds) if bounds else None

    def _too_large(self, request: web.Request, kind: str, status: int, size: int, limit: int) -> web.Response:
        self.metrics.add(f"{kind}.puts_too_large")
        what = "the largest entry allowed" if limit == self.max_entry_size else "the cache's quota"
        resp = web.Response(status=status, text=f"entry of {size} bytes or more is larger than {what} ({limit} bytes)\n")
        resp.force_close()  # the rest of its body is not read
        return resp

    def _arrive(self, small: bool) -> bool:
        """Count an upload whose body is still arriving and may join the next batch (``small``);
        returns whether it was counted (pass it to :meth:`_leave`)."""
        if small:
            self._arriving += 1
        return small

    def _leave(self, counted: bool) -> bool:
        """Uncount an upload counted by :meth:`_arrive` (its body is in, or it is stored alone, or
        it failed) and wake a batch that waits for it; returns False (no longer counted)."""
        if counted:
            self._arriving -= 1
            if self._batch_wake is not None:
                self._batch_wake.set()
        return False

    async def _put_small(self, key: str, data: bytes) -> None:
        """Store an in-memory body in the open batch (one pack, one ``fsync`` pair, one index
        transaction per batch); returns once it is stored and indexed.

        A batch is written :data:`BATCH_LINGER` seconds after its first entry while uploads overlap
        (see there), at once when they do not, or once it holds :data:`BATCH_COUNT` entries or
        :data:`BATCH_BYTES` bytes; the next batch fills while one is written. A client that uploads
        one entry at a time is never kept waiting.

        Raises
        ------
        Exception
            What storing its batch raised.
        """
        assert self._loop is not None
        fut: asyncio.Future[None] = self._loop.create_future()
        now = self._loop.time()
        if self._pending or self._arriving or self._writing:  # uploads overlap: batches may wait for more
            self._overlap_until = now + OVERLAP_MEMORY
        if not self._pending:
            self._first_pending = now
        self._pending.append((key, data, fut))
        self._pending_bytes += len(data)
        if self._batch_wake is not None:
            self._batch_wake.set()
        if self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain())
        await fut

    async def _drain(self) -> None:
        assert self._loop is not None
        loop = self._loop
        if self._batch_wake is None:
            self._batch_wake = asyncio.Event()
        wake = self._batch_wake
        try:
            while self._pending:
                # Linger (from the first entry waiting) while uploads overlap now or did lately: the
                # entries of several clients then share one pack. A lone client never waits.
                deadline = self._first_pending + BATCH_LINGER
                while (len(self._pending) < BATCH_COUNT and self._pending_bytes < BATCH_BYTES and loop.time() < deadline
                       and (self._arriving > 0 or loop.time() < self._overlap_until)):
                    wake.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(wake.wait(), max(deadline - loop.time(), 0.0))
                batch: list[tuple[str, bytes, asyncio.Future[None]]] = []
                size = 0
                while self._pending and len(batch) < BATCH_COUNT and size < BATCH_BYTES:
                    batch.append(self._pending.pop(0))
                    size += len(batch[-1][1])
                self._pending_bytes -= size
                self._first_pending = loop.time()
                self._writing = True
                try:
                    await self._run(put_blobs, self.store, [(k, d) for k, d, _ in batch])
                except Exception as exc:
                    for _, _, f in batch:
                        if not f.done():
                            f.set_exception(exc)
                else:
                    for _, _, f in batch:
                        if not f.done():
                            f.set_result(None)
                finally:
                    self._writing = False
        finally:
            self._drain_task = None

    def _maybe_enforce_quota(self) -> None:
        """Run quota checks in the pool while the packs exceed the store's quota (one runner at a time;
        a PUT finishing while it runs makes it look again)."""
        if self.store.quota is None:
            return
        with self._quota_lock:
            self._quota_again = True
            if self._quota_running:
                return
            self._quota_running = True

        def run() -> None:
            while True:
                with self._quota_lock:
                    if not self._quota_again:
                        self._quota_running = False
                        return
                    self._quota_again = False
                recent, self._recent = self._recent, set()  # the PUTs that asked for this check
                try:
                    self._flush_touches()  # the hits so far count in the LRU order

                    while self.store.quota is not None and self.store.stats()["stored_bytes"] > self.store.quota:
                        evicted = self.store.enforce_quota(keep_blobs=recent)
                        self.metrics.add("all.evicted", len(evicted))
                        if not evicted:
                            break  # nothing evictable left (pinned refs); logged by enforce_quota
                except Exception as exc:
                    log.warning("http cache: quota check failed: %s", exc)

        self._pool.submit(run)
