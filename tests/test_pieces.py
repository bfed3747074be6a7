"""Windowed chunking, chunk lists in pieces, and the reusable read/receive buffers."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import blake3
import pytest

import tb5sync.engine.hashing as hashing
from tb5sync.engine.chunking import ChunkParams
from tb5sync.errors import SourceChangedError, UsageError
from tb5sync.tree.options import SyncOptions
from tb5sync._os.buffers import ReadBuffers
from tb5sync.roles.sender import Sender
from tb5sync.tree.state import TreeState
from tb5sync._os.buffers import BufferPool

SMALL = ChunkParams(version=0, min_size=64, avg_size=256, max_size=1024)


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[str, bytes]:
    data = os.urandom(100_000) + bytes(5000) + os.urandom(20_000)  # a run of zeros forces max-size cuts
    p = tmp_path / "src" / "f.bin"
    p.parent.mkdir()
    p.write_bytes(data)
    return str(p), data


def _blake3_refs(data: bytes, refs: list[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
    """``refs`` with each digest recomputed here, by the blake3 package over the same byte range."""
    out, off = [], 0
    for _, n in refs:
        out.append((blake3.blake3(data[off : off + n]).digest(), n))
        off += n
    return out


def _offsets(refs: list[tuple[bytes, int]]) -> list[int]:
    out, off = [], 0
    for _, n in refs:
        out.append(off)
        off += n
    return out


@pytest.mark.parametrize("window", [1024, 4096, 5000, 65536, 1 << 20])
def test_windowed_chunking_matches_whole_buffer(data_file: tuple[str, bytes], window: int) -> None:
    path, data = data_file
    whole = hashing.chunk_buffer(data, SMALL)
    fd = os.open(path, os.O_RDONLY)
    try:
        windows = list(hashing.iter_chunk_fd(fd, len(data), SMALL, window=window))
    finally:
        os.close(fd)
    assert [r for w in windows for r in w] == whole
    assert sum(n for _, n in whole) == len(data)
    assert whole == _blake3_refs(data, whole)  # digests checked independently of the product's helpers
    if window < len(data) // 2:
        assert len(windows) > 1


def test_windowed_chunking_from_a_cut_point_and_with_stop(data_file: tuple[str, bytes]) -> None:
    path, data = data_file
    whole = hashing.chunk_buffer(data, SMALL)
    offs = _offsets(whole)
    k = len(whole) // 3
    fd = os.open(path, os.O_RDONLY)
    try:
        tail = [r for w in hashing.iter_chunk_fd(fd, len(data), SMALL, start=offs[k], window=4096) for r in w]
        assert tail == whole[k:]
        head = [r for w in hashing.iter_chunk_fd(fd, len(data), SMALL, window=4096, stop=10_000) for r in w]
        assert head == whole[: len(head)]
        assert 10_000 <= sum(n for _, n in head) < len(data)
        assert list(hashing.iter_chunk_fd(fd, len(data), SMALL, start=len(data))) == []
    finally:
        os.close(fd)


@pytest.mark.parametrize("with_state", [False, True], ids=["stateless", "state"])
@pytest.mark.parametrize("limit", [1, 3000, 50_000])
def test_chunk_list_pieces_join_into_the_whole_list(data_file: tuple[str, bytes], with_state: bool, limit: int) -> None:
    path, data = data_file
    root = os.path.dirname(path)
    state = TreeState(root, SMALL) if with_state else None
    sender = Sender(root, state=state, params=SMALL)
    try:
        whole = sender.chunk_list("f.bin", fresh=True)
        assert whole["start"] == 0 and whole["end"] == len(data) == whole["size"]
        pieces = []
        pos = 0
        while True:
            piece = sender.chunk_list("f.bin", start=pos, limit=limit)
            assert piece["start"] == pos and piece["end"] > pos
            assert piece["end"] - pos >= min(limit, len(data) - pos)
            pieces += piece["chunks"]
            pos = piece["end"]
            if pos == len(data):
                break
            assert "digest" not in piece
        assert pieces == whole["chunks"]
        refs = [(bytes(d), n) for d, n in pieces]
        assert refs == hashing.chunk_buffer(data, SMALL)
        assert refs == _blake3_refs(data, refs)
        assert bytes(whole["digest"]) == blake3.blake3(b"".join(d for d, _ in refs)).digest()
    finally:
        sender.close()
        if state is not None:
            state.close()


def test_pieces_listed_in_order_fill_the_scan_cache(data_file: tuple[str, bytes]) -> None:
    path, data = data_file
    root = os.path.dirname(path)
    state = TreeState(root, SMALL)
    sender = Sender(root, state=state, params=SMALL)
    try:
        st = os.stat(path)
        pos = 0
        while pos < len(data):
            assert state.lookup("f.bin", st.st_size, st.st_mtime_ns, st.st_ino) is None
            pos = sender.chunk_list("f.bin", start=pos, limit=20_000)["end"]
        hit = state.lookup("f.bin", st.st_size, st.st_mtime_ns, st.st_ino)
        assert hit is not None and hit[1] == hashing.chunk_buffer(data, SMALL)
        # a cached list is sliced; a start that is not a cut point of it, or past the end, is
        # an earlier piece's end of another version: the source changed (exit 24, the receiver retries)
        second = sender.chunk_list("f.bin", start=0, limit=5000)
        assert [(bytes(d), n) for d, n in second["chunks"]] == hit[1][: len(second["chunks"])]
        with pytest.raises(SourceChangedError):
            sender.chunk_list("f.bin", start=hit[1][0][1] + 1, limit=5000)
        with pytest.raises(SourceChangedError):
            sender.chunk_list("f.bin", start=len(data) + 1, limit=5000)
    finally:
        sender.close()
        state.close()


def test_read_ranges_never_reuses_a_buffer_still_viewed(data_file: tuple[str, bytes]) -> None:
    path, data = data_file
    root = os.path.dirname(path)
    sender = Sender(root, SyncOptions(compress="none"), params=SMALL)
    st = os.stat(path)
    try:
        kept = []
        for off in range(0, 60_000, 6000):
            _meta, parts = sender.read_ranges("f.bin", [[off, 2000], [off + 2000, 4000]], st.st_size, st.st_mtime_ns)
            kept.append((off, parts))
        for off, parts in kept:  # every earlier reply still holds its own bytes
            assert bytes(parts[0]) == data[off : off + 2000]
            assert bytes(parts[1]) == data[off + 2000 : off + 6000]
    finally:
        sender.close()


def test_read_buffers_hand_out_only_unviewed_buffers() -> None:
    bufs = ReadBuffers(max_buffers=2)
    a = bufs.get(100)
    a_buf = a.obj
    part = a[10:20]
    b = bufs.get(100)
    assert b.obj is not a_buf
    a.release()
    c = bufs.get(100)
    c_buf = c.obj
    assert c_buf is not a_buf  # a slice of it is still alive
    part.release()
    c.release()
    d = bufs.get(100)
    assert d.obj is a_buf or d.obj is c_buf
    assert len(bufs.get(10_000)) == 10_000


def test_read_ranges_from_many_threads_at_once(data_file: tuple[str, bytes]) -> None:
    # the buffer a thread gets must be busy before another thread can be handed it
    path, data = data_file
    sender = Sender(os.path.dirname(path), SyncOptions(compress="none"), params=SMALL)
    st = os.stat(path)
    errors: list[str] = []

    def worker(k: int) -> None:
        for j in range(200):
            off = (k * 7919 + j * 104_729) % (len(data) - 6000)
            _meta, parts = sender.read_ranges("f.bin", [[off, 3000], [off + 3000, 3000]], st.st_size, st.st_mtime_ns)
            time.sleep(0)  # let another thread run while these views are alive
            if bytes(parts[0]) + bytes(parts[1]) != data[off : off + 6000]:
                errors.append(f"thread {k} read {j} at {off} was overwritten")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), f"{t.name} hung"
    sender.close()
    assert errors == []


def test_buffer_pool_reuses_what_was_given_back() -> None:
    pool = BufferPool(max_buffers=1, min_size=16)
    a = pool.get(3 * 1024 * 1024 + 1)
    assert len(a) == 4 * 1024 * 1024
    pool.put(a)
    assert pool.get(3 * 1024 * 1024) is a
    assert pool.get(3 * 1024 * 1024) is not a  # handed out once only
    pool.put(a)
    pool.put(bytearray(10))  # beyond max_buffers: dropped
    assert pool.get(1024 * 1024) is not a  # a 4 MiB buffer is not used for a frame of a quarter its size


@pytest.mark.parametrize("portable", [False, True])
def test_receive_buffers_are_populated_mappings_or_bytearrays_and_come_back(
    portable: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session's receive buffers are anonymous mappings made with MAP_POPULATE where the system has
    it, bytearrays on the portable path (macOS, ``$TB5SYNC_PORTABLE=1``); either kind is zeros, holds
    what is written into it and is taken back by ``give_back`` (other objects and small ones are not)."""
    import mmap

    from tb5sync._os.io import populated_buffer

    if portable:
        monkeypatch.setenv("TB5SYNC_PORTABLE", "1")
    else:
        monkeypatch.delenv("TB5SYNC_PORTABLE", raising=False)
    buf = populated_buffer(3 * 1024 * 1024)
    if portable or not hasattr(mmap, "MAP_POPULATE"):
        assert isinstance(buf, bytearray)
    else:
        assert isinstance(buf, mmap.mmap)
    assert len(buf) == 3 * 1024 * 1024 and memoryview(buf)[::4096].tobytes() == bytes(768)
    memoryview(buf)[100:104] = b"abcd"
    assert bytes(memoryview(buf)[100:104]) == b"abcd"

    pool = BufferPool(max_buffers=2, min_size=1024 * 1024, make=populated_buffer)
    a = pool.get(2 * 1024 * 1024 + 1)
    assert type(a) is type(buf) and len(a) == 3 * 1024 * 1024
    pool.give_back(memoryview(a)[:10].obj)
    assert pool.get(2 * 1024 * 1024) is a
    pool.give_back(b"x" * (2 << 20))  # not a pool's kind of buffer
    pool.give_back(bytearray(10))  # below min_size
    pool.give_back(None)
    assert pool.get(2 * 1024 * 1024) is not a and not pool._free


def test_hash_threads_setting(data_file: tuple[str, bytes]) -> None:
    path, data = data_file
    try:
        hashing.set_hash_threads(1)
        assert hashing.hash_pool()._max_workers == 1
        fd = os.open(path, os.O_RDONLY)
        try:
            assert hashing.chunk_fd(fd, len(data), SMALL) == hashing.chunk_buffer(data, SMALL)
        finally:
            os.close(fd)
        with pytest.raises(UsageError):
            hashing.set_hash_threads(-1)
    finally:
        hashing.set_hash_threads(0)
    default = int(os.environ.get("TB5SYNC_HASH_THREADS", "0") or 0) or max(2, os.cpu_count() or 2)
    assert hashing.hash_pool()._max_workers == default


def test_chunk_threads_setting(tmp_path: Path) -> None:
    """Several cutting threads give the same chunks as one, through the windows of chunk_fd."""
    p = ChunkParams(version=0, min_size=1024, avg_size=16384, max_size=65536)
    data = os.urandom(3 << 20) + bytes(300_000) + os.urandom(1 << 20)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        hashing.set_chunk_threads(1)
        assert hashing.chunk_threads() == 1
        one = hashing.chunk_fd(fd, len(data), p)
        hashing.set_chunk_threads(3)
        assert hashing.chunk_threads() == 3
        windows = list(hashing.iter_chunk_fd(fd, len(data), p, window=1 << 20))
        assert [r for w in windows for r in w] == one
        assert hashing.chunk_buffer(data, p) == one
        with pytest.raises(UsageError):
            hashing.set_chunk_threads(-1)
    finally:
        os.close(fd)
        hashing.set_chunk_threads(0)
    cpus = os.cpu_count() or 1
    env = int(os.environ.get("TB5SYNC_CHUNK_THREADS", "0") or 0)
    assert hashing.chunk_threads() == (env or (1 if cpus < 8 else min(4, cpus // 4)))


@pytest.mark.parametrize("var", ["TB5SYNC_CHUNK_THREADS", "TB5SYNC_HASH_THREADS"])
def test_bad_thread_counts_in_the_environment_are_named(monkeypatch: pytest.MonkeyPatch, var: str) -> None:
    monkeypatch.setenv(var, "lots")
    try:
        hashing.set_chunk_threads(0)
        hashing.set_hash_threads(0)
        with pytest.raises(UsageError, match=var):
            hashing.chunk_threads() if var == "TB5SYNC_CHUNK_THREADS" else hashing.hash_pool()
    finally:
        monkeypatch.delenv(var)
        hashing.set_chunk_threads(0)
        hashing.set_hash_threads(0)
