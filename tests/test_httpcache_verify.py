"""What a hot read of the build cache re-verifies (tb5sync.store.blobs.read_blob, docs/ARCHITECTURE.md).

The guarantee: a chunk is hashed against its digest on its first read by the serving process; a
later read skips the hash only while the pack file keeps the identity it had then (device, inode,
size, mtime, ctime) and for at most ``VERIFIED_TTL`` seconds. So a byte flipped on disk after a
verified read, through the filesystem, is found on the next read and the entry dropped, as before.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tb5sync.cache.httpcache import HttpCache
from tb5sync.store import blobs as blobs_mod

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def cache(tmp_path: Any) -> Iterator[HttpCache]:
    with HttpCache(tmp_path / "store") as c:
        yield c

@pytest.fixture
def cache_v1(tmp_path: Any) -> Iterator[HttpCache]:
    """A cache over a store of format v1, where every chunk is kept whole in a pack frame (the
    marks apply to chunks kept whole; a v2 store keeps a chunk of 256 KiB or more as pieces,
    rebuilt and hashed on every read)."""
    from tb5sync.store import Store

    Store(str(tmp_path / "store"), version=1).close()
    with HttpCache(tmp_path / "store") as c:
        yield c



def get(c: HttpCache, path: str) -> tuple[int, bytes]:
    h = http.client.HTTPConnection("127.0.0.1", c.port, timeout=30)
    try:
        h.request("GET", path)
        r = h.getresponse()
        try:
            return r.status, r.read()
        except http.client.IncompleteRead as exc:
            return -r.status, exc.partial
    finally:
        h.close()


def put(c: HttpCache, data: bytes) -> str:
    path = f"/cas/{hashlib.sha256(data).hexdigest()}"
    h = http.client.HTTPConnection("127.0.0.1", c.port, timeout=30)
    try:
        h.request("PUT", path, body=data)
        r = h.getresponse()
        r.read()
        assert r.status == 200
    finally:
        h.close()
    return path


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the chunks read_blob hashes."""
    n = [0]
    real = blobs_mod.chunk_digest

    def counting(data: Any) -> bytes:
        n[0] += 1
        return real(data)

    monkeypatch.setattr(blobs_mod, "chunk_digest", counting)
    return n


def flip(c: HttpCache, path: str, chunk: int = 0, keep_mtime: bool = False) -> None:
    info = blobs_mod.blob(c.store, path.lstrip("/"), False)
    assert info is not None
    digest = info.chunks[chunk][0]
    pack, offset, length = c.store._q("SELECT pack, offset, length FROM chunks WHERE digest=?", (digest,))[0]
    p = c.store.packs.path(pack)
    time.sleep(0.03)  # past the filesystem's timestamp tick (a few ms) since the pack last changed
    st = os.stat(p)
    with open(p, "r+b") as f:
        f.seek(offset + length // 2)
        b = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([b[0] ^ 0x10]))
    if keep_mtime:  # mtime put back: ctime still moves (no one can set it)
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_hot_entry_is_hashed_once(cache_v1: HttpCache, hashes: list[int]) -> None:
    cache = cache_v1
    data = os.urandom(5 * 1024 * 1024)  # several chunks
    path = put(cache, data)
    assert get(cache, path) == (200, data)
    first = hashes[0]
    assert first >= 2
    for _ in range(3):
        assert get(cache, path) == (200, data)
    assert hashes[0] == first  # verified since its pack last changed: not hashed again


@pytest.mark.parametrize("keep_mtime", [False, True])
def test_a_byte_flipped_after_the_first_read_is_found(cache: HttpCache, hashes: list[int], keep_mtime: bool) -> None:
    small = os.urandom(4096)
    path = put(cache, small)
    assert get(cache, path) == (200, small)
    assert get(cache, path) == (200, small)
    flip(cache, path, keep_mtime=keep_mtime)
    assert get(cache, path)[0] == 404  # damaged: a miss, never the flipped byte
    assert blobs_mod.blob(cache.store, path.lstrip("/"), False) is None  # and dropped
    assert get(cache, path)[0] == 404


def test_a_flip_in_a_later_chunk_of_a_hot_entry_cuts_it_short(cache_v1: HttpCache) -> None:
    cache = cache_v1
    data = os.urandom(5 * 1024 * 1024)
    path = put(cache, data)
    assert get(cache, path) == (200, data)
    flip(cache, path, chunk=-1)
    status, body = get(cache, path)
    assert status == -200 and len(body) < len(data)  # the status was sent: cut short of its length
    assert get(cache, path)[0] == 404


def test_marks_expire_after_the_ttl(cache: HttpCache, hashes: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    small = os.urandom(4096)
    path = put(cache, small)
    monkeypatch.setattr(blobs_mod, "VERIFIED_TTL", 0.0)
    assert get(cache, path) == (200, small)
    n = hashes[0]
    assert get(cache, path) == (200, small)
    assert hashes[0] == n + 1  # expired at once: hashed again


def test_a_reopened_store_verifies_again(tmp_path: Any, hashes: list[int]) -> None:
    small = os.urandom(4096)
    with HttpCache(tmp_path / "store") as c:
        path = put(c, small)
        assert get(c, path) == (200, small)
    n = hashes[0]
    with HttpCache(tmp_path / "store") as c:
        assert get(c, path) == (200, small)
    assert hashes[0] == n + 1  # marks live in memory, per opened store


# ---- format v2: chunks of 256 KiB or more are kept as recipes of pieces ----
@pytest.fixture
def all_hashes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts every BLAKE3 a read does, by read_blob and by the store's own chunk reads (a chunk
    kept as a recipe was rebuilt and hashed by ``Store.assemble``)."""
    from tb5sync.store import store as store_mod

    n = [0]
    real = blobs_mod.chunk_digest

    def counting(data: Any) -> bytes:
        n[0] += 1
        return real(data)

    monkeypatch.setattr(blobs_mod, "chunk_digest", counting)
    monkeypatch.setattr(store_mod, "chunk_digest", counting)
    return n


def flip_piece(c: Any, key: str, chunk: int = 0, piece: int = 3) -> None:
    """Flip one byte of piece ``piece`` of chunk ``chunk`` (a chunk kept as a recipe; -1: the last such) of blob ``key``
    in its pack file, through the filesystem."""
    info = blobs_mod.blob(c.store, key, False)
    assert info is not None
    if chunk < 0:  # the last chunk kept as a recipe (a blob's last chunk may be under 256 KiB, kept whole)
        chunk = max(k for k, (d, _) in enumerate(info.chunks) if c.store.recipe(d) is not None)
    pieces = c.store.recipe(info.chunks[chunk][0])
    assert pieces is not None and len(pieces) > piece, "the chunk is not kept as a recipe"
    pack, offset, length = c.store._q("SELECT pack, offset, length FROM chunks WHERE digest=?", (pieces[piece][0],))[0]
    p = c.store.packs.path(pack)
    time.sleep(0.03)  # past the filesystem's timestamp tick since the pack last changed
    with open(p, "r+b") as f:
        f.seek(offset + length // 2)
        b = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.fixture(params=[False, True], ids=["gathered", "piece-ranges"])
def ranges_of_pieces(request: Any, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both ways a hot v2 hit may go out: gathered from its pieces, or as ranges of their frames."""
    monkeypatch.setattr(blobs_mod, "RANGES_OF_PIECES", request.param)
    return bool(request.param)


def test_a_hot_v2_entry_of_pieces_is_hashed_once(cache: HttpCache, all_hashes: list[int], ranges_of_pieces: bool) -> None:
    assert cache.store.version == 2
    data = os.urandom(3 * 1024 * 1024 + 77)  # several chunks, each kept as a recipe of pieces
    path = put(cache, data)
    info = blobs_mod.blob(cache.store, path.lstrip("/"), False)
    assert info is not None and cache.store.recipe(info.chunks[0][0]) is not None
    assert get(cache, path) == (200, data)
    first = all_hashes[0]
    assert first >= 2
    for _ in range(3):
        assert get(cache, path) == (200, data)
    assert all_hashes[0] == first  # verified since its pieces' packs last changed: not hashed again
    ranges = blobs_mod.blob_ranges(cache.store, info)
    try:
        assert (ranges is not None) == ranges_of_pieces  # one range per piece's frame, when asked
        assert ranges is None or sum(r.length for r in ranges) == len(data)
    finally:
        blobs_mod.close_ranges(ranges or [])


def test_a_hot_v2_entry_is_hashed_again_after_the_ttl(cache: HttpCache, all_hashes: list[int],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(1024 * 1024 + 5)
    path = put(cache, data)
    monkeypatch.setattr(blobs_mod, "VERIFIED_TTL", 0.0)
    assert get(cache, path) == (200, data)
    n = all_hashes[0]
    assert get(cache, path) == (200, data)
    assert all_hashes[0] > n  # expired at once: hashed again


@pytest.mark.parametrize("chunk", [0, -1])
def test_a_flipped_piece_of_a_hot_v2_entry_is_found_and_dropped(cache: HttpCache, chunk: int, ranges_of_pieces: bool) -> None:
    data = os.urandom(3 * 1024 * 1024 + 77)
    path = put(cache, data)
    assert get(cache, path) == (200, data)
    assert get(cache, path) == (200, data)  # hot
    flip_piece(cache, path.lstrip("/"), chunk=chunk)
    status, body = get(cache, path)
    assert body != data and status in (404, -200)  # a miss, or cut short of its length: never the flipped byte
    if status == -200:
        assert len(body) < len(data)
    assert blobs_mod.blob(cache.store, path.lstrip("/"), False) is None  # dropped
    assert get(cache, path)[0] == 404


def test_a_piece_changed_during_the_sendfile_loop_cuts_the_connection(cache: HttpCache,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blobs_mod, "RANGES_OF_PIECES", True)
    data = os.urandom(3 * 1024 * 1024 + 77)
    path = put(cache, data)
    assert get(cache, path) == (200, data)  # verified: the next GET is sent from the pieces' ranges
    real = os.sendfile
    calls = [0]

    def changing(out: int, fd: int, offset: Any, count: int) -> int:
        calls[0] += 1
        if calls[0] == 1:  # a piece's pack changes (through the filesystem) while the bytes go out
            flip_piece(cache, path.lstrip("/"), chunk=-1)
        return real(out, fd, offset, count)

    monkeypatch.setattr(os, "sendfile", changing)
    status, body = get(cache, path)
    monkeypatch.setattr(os, "sendfile", real)
    assert calls[0] >= 1 and status == -200 and len(body) < len(data)  # never a whole body
    for _ in range(2):  # the next read hashes: found, dropped (cut short or a miss), then a clean miss
        status, body = get(cache, path)
        assert body != data
    assert blobs_mod.blob(cache.store, path.lstrip("/"), False) is None


def test_a_hot_v2_entry_larger_than_the_socket_buffer_is_sent_whole(cache: HttpCache, ranges_of_pieces: bool) -> None:
    data = os.urandom(12 * 1024 * 1024 + 3)  # more than loopback's socket buffers: the send waits for the reader
    path = put(cache, data)
    for _ in range(3):
        h = http.client.HTTPConnection("127.0.0.1", cache.port, timeout=30)
        try:
            h.request("GET", path)
            r = h.getresponse()
            time.sleep(0.2)  # a slow reader: the socket fills
            assert (r.status, r.read()) == (200, data)
        finally:
            h.close()
