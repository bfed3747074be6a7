"""The Remote Execution API's cache services over gRPC (Bazel's ``--remote_cache=grpc://HOST:PORT``),
served beside an :class:`~tb5sync.cache.httpcache.HttpCache` over the same store, rules and counters.

``tb5sync http-cache STORE --grpc HOST:PORT`` (or ``tb5sync serve ROOT --http-cache ... --grpc
HOST:PORT``) answers, with grpcio's asyncio server on the HTTP cache's own event loop:

- ``Capabilities.GetCapabilities``: SHA-256 only, AC updates enabled unless read-only, the batch
  limit :data:`MAX_BATCH` (bytes), API version 2.0.
- ``ActionCache.GetActionResult`` / ``UpdateActionResult``: the HTTP cache's ``[INSTANCE/]ac/<sha256>``
  entries. A hit only when every output the ActionResult names is in the CAS (and a hit touches
  them), as on HTTP; else ``NOT_FOUND``.
- ``ContentAddressableStorage.FindMissingBlobs``, ``BatchUpdateBlobs`` (each blob must hash to its
  digest and have its size, else ``INVALID_ARGUMENT`` for that blob), ``BatchReadBlobs``
  (``NOT_FOUND`` per missing blob); ``GetTree`` is not offered (``UNIMPLEMENTED``).
- ``google.bytestream.ByteStream.Read`` (``{instance}/blobs/{hash}/{size}``, ``read_offset`` and
  ``read_limit``), ``Write`` (``{instance}/uploads/{uuid}/blobs/{hash}/{size}``, each
  ``write_offset`` the bytes committed so far, committed on ``finish_write`` once the bytes hash to
  the digest) and ``QueryWriteStatus`` (a write cut off before ``finish_write`` can be resumed from
  its ``committed_size`` for :data:`PARTIAL_TTL` seconds).

The keys are the HTTP cache's, so one build may upload over gRPC and another read over HTTP. An
instance name must be empty or one declared with ``bazel_instances`` (``--bazel-instance``), as
on HTTP. Access is the HTTP cache's: ``--allow`` (``PERMISSION_DENIED``), the same bearer token or
basic credentials in the ``authorization`` metadata (``UNAUTHENTICATED`` without them),
``--read-only`` (writes ``PERMISSION_DENIED``). An entry over ``--max-entry-size`` or the store's
quota is refused before it is stored: ``RESOURCE_EXHAUSTED``. Counters go to the HTTP cache's
:class:`_Metrics` under the same names (``cas.hits``, ``ac.misses``, ``cas.bytes_received``, ...),
plus ``grpc.requests`` and a latency histogram per RPC; ``/metrics`` shows them.

grpcio and protobuf (the ``grpc`` extra) are imported when a :class:`GrpcCache` is made, never by
``import tb5sync``. The stubs are generated from the API's own ``.proto`` files (proto/, ``make protos``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
import re
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from tb5sync.errors import EntryTooLargeError, IntegrityError, Tb5syncError, UsageError
from tb5sync.cache.httpcache import EMPTY_SHA256, MAX_AC, SPOOL_MEMORY, HttpCache
from tb5sync.cache.reapi import ActionResultError, parse_action_result
from tb5sync.store.blobs import has_blobs, put_blob

__all__ = ["GrpcCache", "RpcRefused", "MAX_BATCH", "READ_CHUNK", "parse_resource_name"]


#: Largest total of blob bytes in one BatchUpdateBlobs / BatchReadBlobs (bytes), advertised in the
#: capabilities; larger blobs go through ByteStream.
MAX_BATCH = 4 * 1024 * 1024
#: Largest gRPC message accepted or sent (bytes): a full batch plus its framing.
MAX_MESSAGE = MAX_BATCH + 1024 * 1024
#: Bytes of blob data per ByteStream ReadResponse.
READ_CHUNK = 1024 * 1024
#: Seconds an unfinished ByteStream write is kept for a resume (QueryWriteStatus, write_offset).
PARTIAL_TTL = 600.0
#: Most unfinished writes kept at once, and finished ones remembered for QueryWriteStatus.
MAX_PARTIAL = 256
MAX_DONE = 4096

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class RpcRefused(Tb5syncError):
    """An RPC (or one blob of a batch) refused with a gRPC status: ``code`` is the
    ``grpc.StatusCode`` name (``"INVALID_ARGUMENT"``, ``"NOT_FOUND"``, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _check_digest(hash_: str, size: int) -> tuple[str, int]:
    if not _SHA256_RE.match(hash_):
        raise RpcRefused("INVALID_ARGUMENT", f"digest hash {hash_[:80]!r} is not 64 lowercase hex digits (SHA-256)")
    if size < 0:
        raise RpcRefused("INVALID_ARGUMENT", f"digest size {size} is negative")
    return hash_, size


def parse_resource_name(name: str, upload: bool) -> tuple[str, str, int, str]:
    """A ByteStream resource name -> ``(instance, sha256 hex, size in bytes, upload id)``.

    Reads are ``{instance}/blobs/{hash}/{size}``, writes ``{instance}/uploads/{uuid}/blobs/{hash}/{size}``
    optionally followed by more segments (ignored, as the REAPI allows); ``instance`` may be empty.
    The upload id is ``""`` for a read.

    Raises
    ------
    RpcRefused
        ``INVALID_ARGUMENT``: not of that shape, a hash that is not SHA-256 hex, a bad size;
        ``UNIMPLEMENTED``: ``compressed-blobs``.
    """
    parts = name.split("/")
    word = "uploads" if upload else "blobs"
    for i, p in enumerate(parts):
        if p == "compressed-blobs":
            raise RpcRefused("UNIMPLEMENTED", "compressed blobs are not served")
        if p != word:
            continue
        instance = "/".join(parts[:i])
        rest = parts[i + 1:]
        uid = ""
        if upload:
            if len(rest) < 4 or rest[1] != "blobs" or not rest[0]:
                break
            uid, rest = rest[0], rest[2:]
        elif len(rest) != 2:
            break
        h, size_s = rest[0], rest[1]
        if not size_s.isdigit():
            raise RpcRefused("INVALID_ARGUMENT", f"size {size_s[:40]!r} in resource name is not a byte count")
        return (instance, *_check_digest(h, int(size_s)), uid)
    shape = "{instance}/uploads/{uuid}/blobs/{hash}/{size}" if upload else "{instance}/blobs/{hash}/{size}"
    raise RpcRefused("INVALID_ARGUMENT", f"resource name {name[:200]!r} is not {shape}")


@dataclass
class _Upload:
    """A ByteStream write in progress (or cut off, kept for a resume)."""

    key: str
    hash: str
    size: int
    sha: Any = field(default_factory=hashlib.sha256)
    committed: int = 0
    mem: bytearray = field(default_factory=bytearray)
    spool: Any = None  # the spool file (a blob larger than SPOOL_MEMORY), written by _spool_out
    spool_path: str = ""
    touched: float = field(default_factory=time.monotonic)


class GrpcCache:
    """The REAPI cache services (see the module docstring) served beside a started :class:`HttpCache`.

    Parameters
    ----------
    cache : HttpCache
        The HTTP cache whose store, access rules, limits, counters and event loop are shared;
        :meth:`start` needs it started.
    host, port : str, int
        Address to listen on (port 0 picks a free one; :attr:`port` holds it after :meth:`start`).
    tls_cert, tls_key : str, optional
        PEM files of a certificate chain and its key: serve TLS (``grpcs://``). Both or neither.

    Raises
    ------
    UsageError
        grpcio or protobuf is missing (the ``grpc`` extra), or only one of ``tls_cert``/``tls_key``.
    """

    def __init__(self, cache: HttpCache, host: str = "127.0.0.1", port: int = 0, *,
                 tls_cert: str | os.PathLike[str] | None = None, tls_key: str | os.PathLike[str] | None = None) -> None:
        try:
            import grpc
            import grpc.aio  # noqa: F401
            from google.rpc import status_pb2
            from tb5sync.cache._reapi_pb import (bytestream_pb2, bytestream_pb2_grpc, remote_execution_pb2,
                                                 remote_execution_pb2_grpc, semver_pb2)
        except ImportError as exc:
            raise UsageError(f"the gRPC cache needs grpcio, protobuf and googleapis-common-protos "
                             f"(pip install 'tb5sync[grpc]'): {exc}") from None
        self._grpc, self._status_pb2 = grpc, status_pb2
        self._re, self._re_grpc, self._bs, self._bs_grpc, self._semver = (
            remote_execution_pb2, remote_execution_pb2_grpc, bytestream_pb2, bytestream_pb2_grpc, semver_pb2)
        if (tls_cert is None) != (tls_key is None):
            raise UsageError("TLS needs both --tls-cert and --tls-key")
        self.cache = cache
        self.store = cache.store
        self.host, self.port = host, port
        self.tls_cert, self.tls_key = tls_cert, tls_key
        self.tls = tls_cert is not None
        self._server: Any = None
        self._partial: OrderedDict[str, _Upload] = OrderedDict()  # upload resource name -> state
        self._done: OrderedDict[str, int] = OrderedDict()  # finished upload resource name -> size

    # ---- life cycle ----
    def start(self) -> GrpcCache:
        """Listen and serve on the HTTP cache's event loop; returns once the port is bound.

        Raises
        ------
        UsageError
            The HTTP cache is not started.
        OSError
            The TLS files cannot be read.
        RuntimeError
            The address cannot be bound (grpcio's error).
        """
        loop = self.cache._loop
        if loop is None or not loop.is_running():
            raise UsageError("start the HTTP cache before its gRPC face")
        asyncio.run_coroutine_threadsafe(self._start(), loop).result(60)
        return self

    def stop(self, grace: float = 5.0) -> None:
        """Stop serving: RPCs in flight get ``grace`` seconds to finish, then are cancelled; unfinished
        writes are dropped. Call before the HTTP cache's :meth:`~HttpCache.stop`."""
        loop = self.cache._loop
        if self._server is None or loop is None or not loop.is_running():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._stop(grace), loop).result(grace + 30)
        self._server = None

    def __enter__(self) -> GrpcCache:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _start(self) -> None:
        g = self._grpc
        server = g.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE),
                                       ("grpc.max_send_message_length", MAX_MESSAGE),
                                       ("grpc.so_reuseport", 0)])
        self._re_grpc.add_CapabilitiesServicer_to_server(self, server)
        self._re_grpc.add_ActionCacheServicer_to_server(self, server)
        self._re_grpc.add_ContentAddressableStorageServicer_to_server(self, server)
        self._bs_grpc.add_ByteStreamServicer_to_server(self, server)
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        addr = f"{host}:{self.port}"
        if self.tls:
            assert self.tls_cert is not None and self.tls_key is not None
            with open(self.tls_cert, "rb") as f:
                cert = f.read()
            with open(self.tls_key, "rb") as f:
                key = f.read()
            port = server.add_secure_port(addr, g.ssl_server_credentials([(key, cert)]))
        else:
            port = server.add_insecure_port(addr)
        if not port:
            raise RuntimeError(f"cannot bind the gRPC cache to {addr}")
        self.port = port
        await server.start()
        self._server = server

    async def _stop(self, grace: float) -> None:
        await self._server.stop(grace)
        for up in list(self._partial.values()):
            await self._drop(up)
        self._partial.clear()

    # ---- access, errors, counters ----
    def _admit(self, context: Any, write: bool) -> None:
        c = self.cache
        if c.allow:
            peer = context.peer() or ""  # "ipv4:127.0.0.1:5555", "ipv6:[::1]:5555"
            kind, _, rest = peer.partition(":")
            ip = rest.rpartition(":")[0].strip("[]") if kind in ("ipv4", "ipv6") else ""
            if not c._allowed(ip):
                raise RpcRefused("PERMISSION_DENIED", f"client address {ip or peer} is not allowed")
        if c._basic is not None or c._bearer is not None:
            got = ""
            for k, v in context.invocation_metadata() or ():
                if k == "authorization":
                    got = v if isinstance(v, str) else v.decode("latin-1")
                    break
            if not any(want is not None and hmac.compare_digest(got.encode(), want.encode())
                       for want in (c._basic, c._bearer)):
                raise RpcRefused("UNAUTHENTICATED", "authorization required (metadata authorization: Bearer TOKEN)")
        if write and c.read_only:
            raise RpcRefused("PERMISSION_DENIED", "read-only cache")

    def _prefix(self, instance: str) -> str:
        if not instance:
            return ""
        if instance in self.cache.bazel_instances:
            return instance + "/"
        raise RpcRefused("INVALID_ARGUMENT", f"unknown instance name {instance[:80]!r} (declare it with --bazel-instance)")

    def _status(self, code: str, message: str = "") -> Any:
        return self._status_pb2.Status(code=self._grpc.StatusCode[code].value[0], message=message)

    async def _call(self, name: str, write: bool, context: Any, fn: Any, *args: Any) -> Any:
        """Run one unary RPC's body with the access checks, a slot, the counters and its refusals."""
        t0 = time.perf_counter()
        m = self.cache.metrics
        m.add("grpc.requests")
        try:
            self._admit(context, write)
            if not write:  # a read's store work takes a read slot itself (HttpCache.fetch, _store)
                return await fn(*args)
            async with self.cache._sem:  # a body slot for the whole write, as an HTTP PUT
                return await fn(*args)
        except RpcRefused as exc:
            m.add(f"grpc.{exc.code.lower()}")
            await context.abort(self._grpc.StatusCode[exc.code], exc.message)
        finally:
            m.observe(name, time.perf_counter() - t0)

    # ---- Capabilities ----
    async def GetCapabilities(self, request: Any, context: Any) -> Any:  # noqa: N802 (the REAPI's name)
        """``ServerCapabilities``: SHA-256, AC updates unless read-only, :data:`MAX_BATCH`, API 2.0."""
        async def body() -> Any:
            re_ = self._re
            v2 = self._semver.SemVer(major=2)
            return re_.ServerCapabilities(
                cache_capabilities=re_.CacheCapabilities(
                    digest_function=[re_.DigestFunction.SHA256],
                    action_cache_update_capabilities=re_.ActionCacheUpdateCapabilities(update_enabled=not self.cache.read_only),
                    max_batch_total_size_bytes=MAX_BATCH,
                    symlink_absolute_path_strategy=re_.SymlinkAbsolutePathStrategy.DISALLOWED),
                low_api_version=v2, high_api_version=v2)
        return await self._call("GetCapabilities", False, context, body)

    # ---- ActionCache ----
    async def GetActionResult(self, request: Any, context: Any) -> Any:  # noqa: N802
        """The ActionResult of ``action_digest``; ``NOT_FOUND`` on a miss or when an output it names is gone."""
        return await self._call("GetActionResult", False, context, self._get_ac, request)

    async def _get_ac(self, request: Any) -> Any:
        c, m = self.cache, self.cache.metrics
        prefix = self._prefix(request.instance_name)
        h, _ = _check_digest(request.action_digest.hash, request.action_digest.size_bytes)
        key = f"{prefix}ac/{h}"
        try:
            info, _, data, valid = await c.fetch(key, "ac" if c.ac_validation else "whole", prefix)
        except IntegrityError as exc:
            await self._damaged(key, "ac", exc)
            raise RpcRefused("NOT_FOUND", f"no ActionResult for {h}") from None
        if info is None or info.size > MAX_AC:
            m.add("ac.misses")
            raise RpcRefused("NOT_FOUND", f"no ActionResult for {h}")
        if not valid:
            m.add("ac.misses")
            m.add("ac.ac_incomplete")
            raise RpcRefused("NOT_FOUND", f"the ActionResult for {h} names outputs the cache no longer holds")
        try:
            result = self._re.ActionResult.FromString(data)
        except Exception:  # protobuf's DecodeError: an opaque entry stored over HTTP with --no-ac-validation
            m.add("ac.misses")
            raise RpcRefused("NOT_FOUND", f"the entry for {h} is not an ActionResult") from None
        m.add("ac.hits")
        m.add("ac.bytes_sent", len(data))
        return result

    async def UpdateActionResult(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Store ``action_result`` under ``action_digest``; ``RESOURCE_EXHAUSTED`` over the entry limit."""
        return await self._call("UpdateActionResult", True, context, self._put_ac, request)

    async def _put_ac(self, request: Any) -> Any:
        c, m = self.cache, self.cache.metrics
        prefix = self._prefix(request.instance_name)
        h, _ = _check_digest(request.action_digest.hash, request.action_digest.size_bytes)
        data = request.action_result.SerializeToString()
        if c.ac_validation:
            try:
                parse_action_result(data)
            except ActionResultError as exc:
                m.add("ac.puts_refused")
                raise RpcRefused("INVALID_ARGUMENT", f"not a valid ActionResult: {exc}") from None
        key = f"{prefix}ac/{h}"
        await self._store_small(key, data, "ac")
        return request.action_result

    # ---- ContentAddressableStorage ----
    async def FindMissingBlobs(self, request: Any, context: Any) -> Any:  # noqa: N802
        """The digests of ``blob_digests`` the CAS does not hold (the empty blob is always held); those held are touched."""
        return await self._call("FindMissingBlobs", False, context, self._find_missing, request)

    async def _find_missing(self, request: Any) -> Any:
        c, m = self.cache, self.cache.metrics
        prefix = self._prefix(request.instance_name)
        want: dict[str, Any] = {}
        for d in request.blob_digests:
            h, _ = _check_digest(d.hash, d.size_bytes)
            if h != EMPTY_SHA256:
                want.setdefault(f"{prefix}cas/{h}", d)
        held = await c._store(has_blobs, self.store, list(want)) if want else set()
        c._touch(sorted(held))  # written with the next batch of touches
        missing = [d for k, d in want.items() if k not in held]
        m.add("cas.found", len(want) - len(missing))
        m.add("cas.missing", len(missing))
        return self._re.FindMissingBlobsResponse(missing_blob_digests=missing)

    async def BatchUpdateBlobs(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Store each blob that hashes to its digest; a status per blob (``INVALID_ARGUMENT``,
        ``RESOURCE_EXHAUSTED``); more than :data:`MAX_BATCH` bytes in all is ``INVALID_ARGUMENT``."""
        return await self._call("BatchUpdateBlobs", True, context, self._batch_update, request)

    async def _batch_update(self, request: Any) -> Any:
        c, m = self.cache, self.cache.metrics
        prefix = self._prefix(request.instance_name)
        total = sum(len(r.data) for r in request.requests)
        if total > MAX_BATCH:
            raise RpcRefused("INVALID_ARGUMENT", f"{total} bytes in one batch, more than {MAX_BATCH}; use ByteStream")
        limit = c.entry_limit()

        async def one(r: Any) -> Any:
            d = r.digest
            try:
                h, size = _check_digest(d.hash, d.size_bytes)
                if len(r.data) != size:
                    m.add("cas.puts_refused")
                    raise RpcRefused("INVALID_ARGUMENT", f"{len(r.data)} bytes, digest says {size}")
                if hashlib.sha256(r.data).hexdigest() != h:
                    m.add("cas.puts_refused")
                    raise RpcRefused("INVALID_ARGUMENT", f"data does not hash to {h}")
                if limit is not None and size > limit:
                    self._too_large("cas", size, limit)
                if h != EMPTY_SHA256:
                    await self._store_small(f"{prefix}cas/{h}", bytes(r.data), "cas", quota=False)
                status = self._status("OK")
            except RpcRefused as exc:
                status = self._status(exc.code, exc.message)
            return self._re.BatchUpdateBlobsResponse.Response(digest=d, status=status)

        out = await asyncio.gather(*(one(r) for r in request.requests))
        c._maybe_enforce_quota()
        return self._re.BatchUpdateBlobsResponse(responses=out)

    async def BatchReadBlobs(self, request: Any, context: Any) -> Any:  # noqa: N802
        """The bytes of each digest, or ``NOT_FOUND`` per missing blob; more than :data:`MAX_BATCH`
        bytes asked in all is ``INVALID_ARGUMENT``."""
        return await self._call("BatchReadBlobs", False, context, self._batch_read, request)

    async def _batch_read(self, request: Any) -> Any:
        m = self.cache.metrics
        prefix = self._prefix(request.instance_name)
        total = sum(max(0, d.size_bytes) for d in request.digests)
        if total > MAX_BATCH:
            raise RpcRefused("INVALID_ARGUMENT", f"{total} bytes asked in one batch, more than {MAX_BATCH}; use ByteStream")

        async def one(d: Any) -> Any:
            data = b""
            try:
                h, size = _check_digest(d.hash, d.size_bytes)
                if h != EMPTY_SHA256:
                    info, _, data = await self._fetch_cas(prefix, h, "whole", f"no blob {h}")
                    if len(data) != info.size:  # larger than MAX_AC: never a batch's
                        raise RpcRefused("INVALID_ARGUMENT", f"blob {h} has {info.size} bytes; use ByteStream")
                m.add("cas.hits")
                m.add("cas.bytes_sent", len(data))
                status = self._status("OK")
            except RpcRefused as exc:
                status = self._status(exc.code, exc.message)
            return self._re.BatchReadBlobsResponse.Response(digest=d, data=data, status=status)

        return self._re.BatchReadBlobsResponse(responses=await asyncio.gather(*(one(d) for d in request.digests)))

    async def GetTree(self, request: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        """Not offered: ``UNIMPLEMENTED`` (Bazel's remote cache does not call it)."""
        self.cache.metrics.add("grpc.requests")
        await context.abort(self._grpc.StatusCode.UNIMPLEMENTED, "GetTree is not offered by this cache")
        yield  # an async generator, as grpcio's unary-stream handlers are

    # ---- ByteStream ----
    async def Read(self, request: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        """The bytes of ``{instance}/blobs/{hash}/{size}`` from ``read_offset``, at most ``read_limit``
        (0: all), in messages of :data:`READ_CHUNK` bytes. ``NOT_FOUND`` on a miss, ``OUT_OF_RANGE``
        for an offset past the size, ``DATA_LOSS`` when a damaged chunk is found after bytes were sent."""
        t0 = time.perf_counter()
        c, m = self.cache, self.cache.metrics
        m.add("grpc.requests")
        try:
            self._admit(context, False)
            # a read slot for each piece of store work (fetch, next chunk), never held while a
            # message waits for its reader: a client that stops reading holds no slot
            instance, h, size, _ = parse_resource_name(request.resource_name, upload=False)
            prefix = self._prefix(instance)
            off, limit = request.read_offset, request.read_limit
            if off < 0 or off > size:
                raise RpcRefused("OUT_OF_RANGE", f"read_offset {off} outside 0..{size}")
            if limit < 0:
                raise RpcRefused("INVALID_ARGUMENT", f"negative read_limit {limit}")
            end = size if limit == 0 else min(size, off + limit)
            if h == EMPTY_SHA256:
                m.add("cas.hits")
                return
            key = f"{prefix}cas/{h}"
            info, chunks, first = await self._fetch_cas(prefix, h, "first", f"blob {h} is damaged")
            if info.size != size:
                raise RpcRefused("INVALID_ARGUMENT", f"blob {h} has {info.size} bytes, not {size}")
            pos = sent = 0
            hit = False
            while pos < end:
                try:
                    piece, first = (first, b"") if first else (await c._store(next, chunks, b""), b"")
                except IntegrityError as exc:
                    await self._damaged(key, "cas", exc)
                    raise RpcRefused("DATA_LOSS" if sent else "NOT_FOUND", f"blob {h} is damaged") from None
                if not piece:
                    break
                if not hit:
                    m.add("cas.hits")
                    hit = True
                lo, hi = max(off - pos, 0), min(len(piece), end - pos)
                pos += len(piece)
                if lo >= hi:
                    continue
                view = memoryview(piece)[lo:hi]
                for i in range(0, len(view), READ_CHUNK):
                    part = bytes(view[i:i + READ_CHUNK])
                    yield self._bs.ReadResponse(data=part)
                    sent += len(part)
            if not hit:
                m.add("cas.hits")
            m.add("cas.bytes_sent", sent)
        except RpcRefused as exc:
            m.add(f"grpc.{exc.code.lower()}")
            await context.abort(self._grpc.StatusCode[exc.code], exc.message)
        finally:
            m.observe("Read", time.perf_counter() - t0)

    async def Write(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802
        """Receive ``{instance}/uploads/{uuid}/blobs/{hash}/{size}``; committed on ``finish_write``.

        Each ``write_offset`` must be the bytes committed so far (the first: 0, or what
        QueryWriteStatus says for a write being resumed), else ``INVALID_ARGUMENT``; so must more
        bytes than the size, a finished write of another size, or bytes that do not hash to the
        digest (nothing stored). A size over ``--max-entry-size`` or the quota is
        ``RESOURCE_EXHAUSTED`` before a byte is kept. A stream that ends without ``finish_write``
        is kept for a resume (:data:`PARTIAL_TTL`)."""
        return await self._call("Write", True, context, self._write, request_iterator)

    async def _write(self, request_iterator: Any) -> Any:
        c, m = self.cache, self.cache.metrics
        self._expire()
        up: _Upload | None = None
        name = first = ""
        finished = False
        arriving = False
        try:
            async for req in request_iterator:
                if up is None:
                    instance, h, size, uid = parse_resource_name(req.resource_name, upload=True)
                    prefix = self._prefix(instance)
                    limit = c.entry_limit()
                    if limit is not None and size > limit:
                        self._too_large("cas", size, limit)
                    name = f"{instance}/uploads/{uid}/blobs/{h}/{size}"
                    up = self._partial.pop(name, None) or _Upload(key=f"{prefix}cas/{h}", hash=h, size=size)
                    first = req.resource_name
                    if size > SPOOL_MEMORY and up.committed == 0 and await c._run(has_blobs, self.store, [up.key]):
                        # already stored: answered at once with the full size (the REAPI's early
                        # return), the rest of the stream is not read
                        c._touch([up.key])
                        m.add("cas.puts_skipped")
                        self._done[name] = size
                        return self._bs.WriteResponse(committed_size=size)
                    arriving = c._arrive(size <= SPOOL_MEMORY)  # may join the next batch
                elif req.resource_name and req.resource_name != first:
                    raise RpcRefused("INVALID_ARGUMENT", "resource_name changed within one write")
                if req.write_offset != up.committed:
                    raise RpcRefused("INVALID_ARGUMENT", f"write_offset {req.write_offset}, but {up.committed} bytes are committed")
                data = req.data
                if up.committed + len(data) > up.size:
                    m.add("cas.puts_refused")
                    raise RpcRefused("INVALID_ARGUMENT", f"more than the {up.size} bytes of the digest")
                if data:
                    await self._keep(up, data)
                    up.committed += len(data)
                up.touched = time.monotonic()
                if req.finish_write:
                    finished = True
                    break
            if up is None:
                raise RpcRefused("INVALID_ARGUMENT", "a write without a request")
            if not finished:  # the client may resume it (QueryWriteStatus)
                self._keep_partial(name, up)
                up = None
                return self._bs.WriteResponse(committed_size=self._partial[name].committed)
            arriving = c._leave(arriving)
            if up.committed != up.size:
                m.add("cas.puts_refused")
                raise RpcRefused("INVALID_ARGUMENT", f"{up.committed} bytes written, the digest says {up.size}")
            if up.size > SPOOL_MEMORY:
                await c._run(self._spool_out, up, True)
            else:
                up.sha.update(up.mem)
            if up.sha.hexdigest() != up.hash:
                m.add("cas.puts_refused")
                raise RpcRefused("INVALID_ARGUMENT", f"the bytes hash to {up.sha.hexdigest()}, not {up.hash}")
            if up.hash != EMPTY_SHA256:
                if up.spool_path:
                    try:
                        await c._run(put_blob, self.store, up.key, up.spool_path)
                    except EntryTooLargeError:
                        self._too_large("cas", up.size, c.entry_limit() or up.size)
                    c._recent.add(up.key)
                    m.add("cas.puts")
                    m.add("cas.bytes_received", up.size)
                    c._maybe_enforce_quota()
                else:
                    await self._store_small(up.key, bytes(up.mem), "cas")
            self._done[name] = up.size
            while len(self._done) > MAX_DONE:
                self._done.popitem(last=False)
            return self._bs.WriteResponse(committed_size=up.size)
        except asyncio.CancelledError:  # the client went away mid-stream: keep what arrived for a resume
            if up is not None and not finished:
                self._keep_partial(name, up)
                up = None
            raise
        finally:
            c._leave(arriving)
            if up is not None:
                await self._drop(up)

    async def QueryWriteStatus(self, request: Any, context: Any) -> Any:  # noqa: N802
        """``committed_size`` and ``complete`` of an upload resource name; ``NOT_FOUND`` when unknown."""
        return await self._call("QueryWriteStatus", False, context, self._query_write, request)

    async def _query_write(self, request: Any) -> Any:
        instance, h, size, uid = parse_resource_name(request.resource_name, upload=True)
        prefix = self._prefix(instance)
        name = f"{instance}/uploads/{uid}/blobs/{h}/{size}"
        if name in self._partial:
            return self._bs.QueryWriteStatusResponse(committed_size=self._partial[name].committed, complete=False)
        if name in self._done or h == EMPTY_SHA256 or await self.cache._store(
                has_blobs, self.store, [f"{prefix}cas/{h}"]):
            return self._bs.QueryWriteStatusResponse(committed_size=size, complete=True)
        raise RpcRefused("NOT_FOUND", f"no write of {request.resource_name[:200]!r}")

    # ---- storing ----
    async def _keep(self, up: _Upload, data: bytes) -> None:
        """Append a write's bytes: in memory for a blob of at most :data:`SPOOL_MEMORY` bytes (hashed
        when it is complete); a larger one is gathered to :data:`SPOOL_MEMORY` in memory, then
        hashed and written to a file in the store's ``tmp/`` in one step of a worker thread (so a
        stream of 16 KiB messages costs one hop per MiB, and no hashing on the event loop)."""
        up.mem += data
        if up.size > SPOOL_MEMORY and len(up.mem) >= SPOOL_MEMORY:
            await self.cache._run(self._spool_out, up, False)

    def _spool_out(self, up: _Upload, close: bool) -> None:
        """In a worker: hash and write what ``up`` holds in memory to its spool file (made on first
        use); ``close`` closes the file after."""
        if up.spool is None and up.mem:
            up.spool_path = os.path.join(self.store.tmp_dir, f"{os.getpid()}-grpc-{secrets.token_hex(8)}.body")
            up.spool = open(up.spool_path, "xb")  # noqa: SIM115 - closed here or by _drop
        if up.mem:
            up.sha.update(up.mem)
            up.spool.write(up.mem)
            up.mem = bytearray()
        if close and up.spool is not None:
            up.spool.close()
            up.spool = None

    def _keep_partial(self, name: str, up: _Upload) -> None:
        self._partial[name] = up
        self._partial.move_to_end(name)
        while len(self._partial) > MAX_PARTIAL:
            _, old = self._partial.popitem(last=False)
            asyncio.ensure_future(self._drop(old))

    def _expire(self) -> None:
        now = time.monotonic()
        for name, up in list(self._partial.items()):
            if now - up.touched > PARTIAL_TTL:
                del self._partial[name]
                asyncio.ensure_future(self._drop(up))

    async def _drop(self, up: _Upload) -> None:
        if up.spool is not None:
            with contextlib.suppress(Exception):
                up.spool.close()
            up.spool = None
        if up.spool_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(up.spool_path)
        up.mem = bytearray()

    async def _store_small(self, key: str, data: bytes, kind: str, quota: bool = True) -> None:
        """Store one in-memory entry with the HTTP cache's group commit, counted as its PUTs are.

        Raises
        ------
        RpcRefused
            ``RESOURCE_EXHAUSTED``: over ``--max-entry-size`` or the store's quota.
        """
        c = self.cache
        limit = c.entry_limit()
        if limit is not None and len(data) > limit:
            self._too_large(kind, len(data), limit)
        try:
            await c._put_small(key, data)
        except EntryTooLargeError:
            self._too_large(kind, len(data), c.entry_limit() or len(data))
        c._recent.add(key)
        c.metrics.add(f"{kind}.puts")
        c.metrics.add(f"{kind}.bytes_received", len(data))
        if quota:
            c._maybe_enforce_quota()

    def _too_large(self, kind: str, size: int, limit: int) -> None:
        self.cache.metrics.add(f"{kind}.puts_too_large")
        what = "the largest entry allowed" if limit == self.cache.max_entry_size else "the cache's quota"
        raise RpcRefused("RESOURCE_EXHAUSTED", f"entry of {size} bytes is larger than {what} ({limit} bytes)")

    async def _fetch_cas(self, prefix: str, h: str, mode: str, damaged: str) -> tuple[Any, Any, bytes]:
        """The CAS blob ``h`` (SHA-256 hex) under ``prefix``, read as :meth:`HttpCache.fetch` reads it in
        ``mode``: ``(info, chunks, data)``. A miss is ``NOT_FOUND`` (counted); a damaged chunk drops
        the entry and is ``NOT_FOUND`` with the message ``damaged``.

        Raises
        ------
        RpcRefused
            ``NOT_FOUND``, as above.
        """
        key = f"{prefix}cas/{h}"
        try:
            info, chunks, data, _ = await self.cache.fetch(key, mode)
        except IntegrityError as exc:
            await self._damaged(key, "cas", exc)
            raise RpcRefused("NOT_FOUND", damaged) from None
        if info is None:
            self.cache.metrics.add("cas.misses")
            raise RpcRefused("NOT_FOUND", f"no blob {h}")
        return info, chunks, data

    async def _damaged(self, key: str, kind: str, exc: Exception) -> None:
        await self.cache.drop_damaged(key, kind, exc, "grpc")
