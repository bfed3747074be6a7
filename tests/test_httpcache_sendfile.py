"""Hits sent with the kernel's ``sendfile`` (tb5sync.cache.httpcache, docs/ARCHITECTURE.md).

A hit whose chunks are all whole frames of local packs verified under their pack file's identity
now goes out with ``loop.sendfile``; every other hit, and every hit with
``TB5SYNC_CACHE_SENDFILE_PORTABLE=1``, is read and written through the transport. Expected
bodies are the bytes PUT (the reference: what the client stored); a pack changed between its
verification and the send is never served as the entry.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tb5sync.cache import httpcache as hc
from tb5sync.cache.httpcache import HttpCache
from tb5sync.store import Store
from tb5sync.store import blobs as blobs_mod

pytestmark = pytest.mark.timeout(90)


def _cache(tmp_path: Any) -> HttpCache:
    # format v1: every chunk kept whole in one frame (a v2 store keeps chunks of 256 KiB or
    # more as recipes of pieces, always read and hashed: never sent as a file range)
    Store(str(tmp_path / "store"), version=1).close()
    return HttpCache(tmp_path / "store")


@pytest.fixture
def sends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the hits found sendable as pack ranges (before any byte of their response is sent)."""
    n = [0]
    real = hc.blob_ranges

    def counting(*a: Any) -> Any:
        got = real(*a)
        if got is not None:
            n[0] += 1
        return got

    monkeypatch.setattr(hc, "blob_ranges", counting)
    return n


@pytest.fixture
def cache(tmp_path: Any, sends: list[int]) -> Iterator[HttpCache]:
    with _cache(tmp_path) as c:
        assert c.sendfile
        yield c


@pytest.fixture
def portable_cache(tmp_path: Any, sends: list[int], monkeypatch: pytest.MonkeyPatch) -> Iterator[HttpCache]:
    monkeypatch.setenv(hc.SENDFILE_PORTABLE_ENV, "1")
    with _cache(tmp_path) as c:
        assert not c.sendfile
        yield c


def request(c: HttpCache, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    h = http.client.HTTPConnection("127.0.0.1", c.port, timeout=30)
    try:
        h.request(method, path, body=body, headers=headers or {})
        r = h.getresponse()
        hdrs = dict(r.getheaders())
        try:
            return r.status, r.read(), hdrs
        except http.client.IncompleteRead as exc:
            return -r.status, exc.partial, hdrs
    except (ConnectionError, http.client.RemoteDisconnected):
        return -1, b"", {}
    finally:
        h.close()


def put(c: HttpCache, data: bytes) -> str:
    path = f"/cas/{hashlib.sha256(data).hexdigest()}"
    assert request(c, "PUT", path, data)[0] == 200
    return path


SIZES = [40 * 1024, 300 * 1024, 3 * 1024 * 1024 + 17]


@pytest.mark.parametrize("size", SIZES)
def test_bodies_are_the_bytes_put_on_both_paths(cache: HttpCache, portable_cache: HttpCache, sends: list[int],
                                                size: int) -> None:
    data = os.urandom(size)
    for c in (cache, portable_cache):
        path = put(c, data)
        for _ in range(3):  # the first read verifies, the next ones may go out with sendfile
            status, body, hdrs = request(c, "GET", path)
            assert (status, body) == (200, data)
            assert int(hdrs["Content-Length"]) == size
        status, body, hdrs = request(c, "HEAD", path)
        assert status == 200 and body == b"" and int(hdrs["Content-Length"]) == size
    assert sends[0] == 2  # the 2nd and 3rd GET of the sendfile cache; never the portable one


def test_a_hot_multi_chunk_entry_is_one_range_per_chunk(cache: HttpCache) -> None:
    data = os.urandom(5 * 1024 * 1024)
    path = put(cache, data)
    info = blobs_mod.blob(cache.store, path.lstrip("/"), False)
    assert info is not None and len(info.chunks) >= 2
    assert blobs_mod.blob_ranges(cache.store, info) is None  # not verified yet by this process
    assert request(cache, "GET", path)[:2] == (200, data)
    ranges = blobs_mod.blob_ranges(cache.store, info)
    assert ranges is not None and [r.length for r in ranges] == [n for _, n in info.chunks]
    try:
        assert b"".join(os.pread(r.fd, r.length, r.offset) for r in ranges) == data
    finally:
        blobs_mod.close_ranges(ranges)


def test_a_range_header_gets_the_whole_entry(cache: HttpCache) -> None:
    # the cache serves no ranges: a Range header is ignored (RFC 9110, 14.2: a server MAY ignore it)
    data = os.urandom(2 * 1024 * 1024)
    path = put(cache, data)
    for _ in range(2):
        status, body, hdrs = request(cache, "GET", path, headers={"Range": "bytes=10-99"})
        assert (status, body) == (200, data) and "Content-Range" not in hdrs


def _flip(c: HttpCache, path: str, chunk: int) -> None:
    info = blobs_mod.blob(c.store, path.lstrip("/"), False)
    assert info is not None
    pack, offset, length = c.store._q("SELECT pack, offset, length FROM chunks WHERE digest=?",
                                      (info.chunks[chunk][0],))[0]
    time.sleep(0.03)  # past the filesystem's timestamp tick (a few ms) since the pack last changed
    with open(c.store.packs.path(pack), "r+b") as f:
        f.seek(offset + length // 2)
        b = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([b[0] ^ 0x10]))


def test_a_pack_changed_after_verification_is_not_sent(cache: HttpCache, sends: list[int]) -> None:
    data = os.urandom(3 * 1024 * 1024)
    path = put(cache, data)
    assert request(cache, "GET", path)[:2] == (200, data)  # verified
    _flip(cache, path, 0)
    status, body, _ = request(cache, "GET", path)
    assert status == 404 and sends[0] == 0  # read again, hashed, found damaged, dropped
    assert blobs_mod.blob(cache.store, path.lstrip("/"), False) is None


def test_a_pack_changed_during_the_send_cuts_the_connection(cache: HttpCache, sends: list[int],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(3 * 1024 * 1024)
    path = put(cache, data)
    assert request(cache, "GET", path)[:2] == (200, data)
    info = blobs_mod.blob(cache.store, path.lstrip("/"), False)
    assert info is not None and len(info.chunks) >= 2
    real = asyncio.BaseEventLoop.sendfile
    calls = [0]

    async def changing(self: Any, transport: Any, file: Any, offset: int = 0, count: int | None = None,
                       **kw: Any) -> int:
        calls[0] += 1
        if calls[0] == 1:  # the pack changes (through the filesystem) while the bytes go out
            _flip(cache, path, -1)
        return await real(self, transport, file, offset, count, **kw)  # type: ignore[no-any-return]

    monkeypatch.setattr(asyncio.BaseEventLoop, "sendfile", changing)
    status, body, _ = request(cache, "GET", path)
    assert status < 0 and len(body) < len(data)  # never a whole body
    assert calls[0] >= 1
    monkeypatch.setattr(asyncio.BaseEventLoop, "sendfile", real)
    # the next read hashes: the flip in the last chunk is found after the status line (cut short,
    # dropped), so the one after is a clean miss
    status, body, _ = request(cache, "GET", path)
    assert status == -200 and len(body) < len(data)
    assert request(cache, "GET", path)[0] == 404


def test_a_transport_without_sendfile_gets_the_ranges_written(cache: HttpCache, sends: list[int],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    async def unavailable(self: Any, *a: Any, **kw: Any) -> int:
        raise asyncio.SendfileNotAvailableError("not here")

    monkeypatch.setattr(asyncio.BaseEventLoop, "sendfile", unavailable)
    data = os.urandom(3 * 1024 * 1024)
    path = put(cache, data)
    for _ in range(3):
        assert request(cache, "GET", path)[:2] == (200, data)
    assert sends[0] == 2


def test_a_one_chunk_entry_changed_during_its_send_is_never_whole(cache: HttpCache, sends: list[int],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(200 * 1024)  # one chunk (under the 256 KiB minimum), over WHOLE_RESPONSE
    path = put(cache, data)
    assert request(cache, "GET", path)[:2] == (200, data)
    real = asyncio.BaseEventLoop.sendfile

    async def changing(self: Any, transport: Any, file: Any, offset: int = 0, count: int | None = None,
                       **kw: Any) -> int:
        _flip(cache, path, 0)  # the only range's pack changes while its bytes go out
        return await real(self, transport, file, offset, count, **kw)  # type: ignore[no-any-return]

    monkeypatch.setattr(asyncio.BaseEventLoop, "sendfile", changing)
    status, body, _ = request(cache, "GET", path)
    assert status < 0 and len(body) < len(data)  # cut before the last byte: never a whole body
    assert sends[0] == 1
