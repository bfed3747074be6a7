"""Large tb5:// reads: pieces over the connections received straight into the returned bytes,
``get_file`` streamed into a new file or through the engine onto an existing one, and a file that
shrinks while it is sent (an error, never zeros). Expected values come from fsspec's
LocalFileSystem reading the same file."""

from __future__ import annotations

import os
import random
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
from fsspec.implementations.local import LocalFileSystem

from conftest import joined, start_server, tmp_files
from conftest import tb5fs as tb5
import tb5sync.fs.file as fsfile
import tb5sync.wire.protocol as P
from tb5sync.wire.parts import FileRange, SharedFd
from tb5sync.errors import SourceChangedError, Tb5syncError
from tb5sync.wire.rpc import Requester
from tb5sync.wire.transport import Channel

pytestmark = pytest.mark.timeout(120)

SIZE = 37 * 1024 * 1024 + 4321  # more than two 16 MiB replies, not a whole number of pieces


@pytest.fixture(scope="module")
def big_served(tmp_path_factory: Any) -> Any:
    root = tmp_path_factory.mktemp("reads")
    data = random.Random(7).randbytes(SIZE)
    (root / "big.bin").write_bytes(data)
    (root / "small.bin").write_bytes(data[:5000])
    live = start_server(str(root))
    try:
        yield live, str(root)
    finally:
        live.server.stop()


@pytest.fixture(params=["native", "bytearray"])
def buffers(request: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both kinds of receive buffer: the Cython core's bytes, and the pure-Python bytearray."""
    if request.param == "bytearray":
        monkeypatch.setattr(fsfile, "_empty_bytes", None)
    else:
        pytest.importorskip("tb5sync._bytes")
    return str(request.param)


@pytest.mark.parametrize("streams", [1, 3])
def test_large_reads_equal_local_ones(big_served: Any, buffers: str, streams: int) -> None:
    live, root = big_served
    local = LocalFileSystem()
    path = os.path.join(root, "big.bin")
    fs = tb5(live, streams=streams)
    try:
        whole = fs.cat_file("big.bin")
        assert type(whole) is bytes and whole == local.cat_file(path)
        for start, end in [(0, None), (123, SIZE - 5), (-20_000_000, None), (17 << 20, 40 << 20), (None, -1), (SIZE, None)]:
            assert fs.cat_file("big.bin", start, end) == local.cat_file(path, start, end), (start, end)
        info = fs.info("big.bin")
        pin = {"size": info["size"], "mtime": info["mtime"]}
        assert fs.cat_file("big.bin", 5, 30 << 20, expect=pin) == whole[5 : 30 << 20]  # the known-range path
        with fs.open("big.bin", "rb") as f:
            got = f.read()
        assert type(got) is bytes and got == whole
        with fs.open("big.bin", "rb") as f, local.open(path, "rb") as g:
            for n in (8 << 20, 1, 3 << 20, 40 << 20):
                assert f.read(n) == g.read(n)
            f.seek(1000)
            g.seek(1000)
            assert f.read(20 << 20) == g.read(20 << 20)
    finally:
        fs._holder.close()


def test_get_file_streams_into_a_new_file_and_uses_the_engine_onto_an_existing_one(big_served: Any, tmp_path: Path, buffers: str) -> None:
    live, root = big_served
    want = Path(root, "big.bin").read_bytes()
    fs = tb5(live, engine_threshold=1 << 20)
    try:
        dst = tmp_path / "new.bin"
        fs.get_file("big.bin", str(dst))
        assert dst.read_bytes() == want and tmp_files(str(tmp_path)) == []
        assert not (tmp_path / ".tb5sync").exists()
        old = bytearray(want)
        old[1000:2000] = bytes(1000)  # an older version: the engine reuses its other chunks
        dst.write_bytes(old)
        fs.get_file("big.bin", str(dst))
        assert dst.read_bytes() == want
        empty = tmp_path / "empty.bin"
        Path(root, "empty.bin").write_bytes(b"")
        fs.get_file("empty.bin", str(empty))
        assert empty.read_bytes() == b""
    finally:
        fs._holder.close()
        Path(root, "empty.bin").unlink(missing_ok=True)


def test_a_file_replaced_between_open_and_read_is_refused(big_served: Any, tmp_path: Path) -> None:
    live, root = big_served
    victim = Path(root, "victim.bin")
    victim.write_bytes(os.urandom(20 << 20))
    fs = tb5(live)
    try:
        f = fs.open("victim.bin", "rb")
        victim.write_bytes(os.urandom(21 << 20))
        with pytest.raises(SourceChangedError):
            f.read()
    finally:
        fs._holder.close()
        victim.unlink()


def test_a_file_part_without_padding_ends_the_connection_when_the_file_shrank(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"a" * 3_000_000)
    a, b = socket.socketpair()
    tx, rx = Channel(a), Channel(b)
    shared = SharedFd(os.open(path, os.O_RDONLY))
    part = FileRange(shared, 0, 3_000_000, pad=False, sendfile=False)
    os.truncate(path, 2_500_000)
    errors: list[BaseException] = []

    def send() -> None:
        try:
            tx.send_data(3, {}, [part])
        except OSError as exc:
            errors.append(exc)
        finally:
            tx.close()

    t = threading.Thread(target=send)
    t.start()
    try:
        header = rx.recv_header()
        assert header is not None and header.type is P.FrameType.DATA
        with pytest.raises(P.RemoteProtocolError, match="closed inside a frame"):
            rx.recv_payload(header)
        joined(t, 60)
        assert errors and "early" in str(errors[0])
    finally:
        part.close()
        rx.close()


@pytest.mark.parametrize("room", [10, 4, 0])
def test_recv_data_into_puts_the_body_in_the_buffer_or_one_of_its_own(room: int) -> None:
    a, b = socket.socketpair()
    tx, rx = Channel(a), Channel(b)
    try:
        tx.send_data(9, {"k": 1}, [b"hello", b"world"])
        header = rx.recv_header()
        assert header is not None
        into = memoryview(bytearray(room))
        meta, body = rx.recv_data_into(header, into)
        assert P.decode_control(meta) == {"k": 1} and bytes(body) == b"helloworld"
        if room >= 10:
            assert bytes(into[:10]) == b"helloworld"
        if room == 10:
            fsfile.check_piece("x", {"start": 0, "end": 10}, ({}, body), into)
        else:
            with pytest.raises(SourceChangedError):  # a body that is not exactly the piece asked for
                fsfile.check_piece("x", {"start": 0, "end": room}, ({}, body), into)
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("into", [False, True])
def test_a_reply_cut_inside_its_frame_fails_its_request(into: bool) -> None:
    """The request whose reply is being received when the connection breaks fails (it must not hang)."""
    a, b = socket.socketpair()
    server = Channel(a)
    req = Requester([Channel(b)])
    try:
        buf = bytearray(1000)
        fut = req.submit("cat", {}, into=memoryview(buf) if into else None, owner=buf)
        got = server.recv_frame()
        assert got is not None
        head = P.encode_data_prefix(got[0].rid, {}, 1000)
        server.sock.sendall(head + b"x" * 10)  # 10 of the 1000 announced bytes, then the connection ends
        server.close()
        with pytest.raises(Tb5syncError):
            fut.result(timeout=30)
    finally:
        req.close(bye=False)


ODD_RANGES = [(4, 2), (4, 3), (5, 5), (0, 0), (-3, None), (None, -3), (-3, -1), (-1, -3), (-1, -2), (2, 100),
              (100, 200), (12, None), (12, 11), (12, 5), (None, None), (None, 12), (-100, 3), (3, -100),
              (-100, None), (None, -100), (-100, -95), (-10, -10), (9, 8), (10, 9), (None, 0)]


def _outcome(fn: Any) -> Any:
    """``fn()``'s bytes, or its error as (kind, errno): ValueError / OSError(errno)."""
    try:
        return fn()
    except ValueError as exc:
        return ("ValueError", getattr(exc, "errno", None)) if not isinstance(exc, OSError) else ("OSError", exc.errno)
    except OSError as exc:
        return ("OSError", exc.errno)


@pytest.mark.parametrize("size", [10, 300_000])
def test_odd_ranges_as_local_filesystem(tmp_path: Any, size: int) -> None:
    """cat_file (sync and async), cat_ranges and open().seek/read on ranges fsspec's
    LocalFileSystem reads oddly (start after end, negative bounds, past the end, None) give its
    results and its errors: an end one byte before the start reads to the end, further before
    raises ValueError; a seek before the start is OSError EINVAL (and a ValueError too)."""
    from fsspec.asyn import sync

    from conftest import served_fs
    from tb5sync.errors import InvalidSeekError

    data = random.Random(3).randbytes(size)
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "f.bin").write_bytes(data)
    local, lp = LocalFileSystem(), str(tmp_path / "root" / "f.bin")
    ranges = ODD_RANGES + [(size - 1, size - 2), (size + 5, size + 4), (-size, -size - 1), (-size - 1, -size - 2)]
    with served_fs(str(tmp_path / "root")) as (_live, fs):
        for s, e in ranges:
            want = _outcome(lambda: local.cat_file(lp, s, e))
            assert _outcome(lambda: fs.cat_file("f.bin", s, e)) == want, (s, e, want)
            assert _outcome(lambda: sync(fs.loop, fs._cat_file, "f.bin", s, e)) == want, ("async", s, e)
        starts, ends = [r[0] for r in ranges], [r[1] for r in ranges]
        want_all = [o if isinstance(o, bytes) else (type(o).__name__, getattr(o, "errno", None))
                    for o in local.cat_ranges([lp] * len(ranges), starts, ends)]
        got_all = [o if isinstance(o, bytes) else ("ValueError" if isinstance(o, ValueError) else type(o).__name__,
                                                   getattr(o, "errno", None))
                   for o in fs.cat_ranges(["f.bin"] * len(ranges), starts, ends)]
        assert got_all == want_all
        with pytest.raises(ValueError):
            fs.cat_ranges(["f.bin", "f.bin"], [0, 4], [1, 2], on_error="raise")
        for whence, off in [(0, -1), (0, size + 20), (1, -5), (1, -1), (1, 3), (2, -3), (2, 5), (2, -size - 1), (0, 4)]:
            def go(f: Any) -> Any:
                f.read(2)
                return f.seek(off, whence), f.read(3), f.tell(), f.read(-1)[-5:], f.read(None), f.read(2), f.tell()

            with local.open(lp, "rb") as lf, fs.open("f.bin", "rb") as tf:
                want = _outcome(lambda: go(lf))
                assert _outcome(lambda: go(tf)) == want, (whence, off, want)
        with fs.open("f.bin", "rb") as tf:
            with pytest.raises(InvalidSeekError) as ei:
                tf.seek(-1)
            assert isinstance(ei.value, ValueError) and ei.value.errno == 22 and "f.bin" in str(ei.value)
            with pytest.raises(ValueError):
                tf.seek(0, 5)
            for n in (-2, -100):
                with pytest.raises(ValueError, match="read length must be non-negative or -1"):
                    tf.read(n)
            assert tf.tell() == 0 and tf.read(-1) == data and tf.read() == b""


def test_a_small_cat_of_a_file_that_shrank_after_its_stat_is_an_error_never_zeros(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small ``cat`` is read in one ``pread`` while answered: the file cut short between its
    ``fstat`` and the read gives SourceChangedError for that request, never the bytes it no
    longer holds nor zeros (LocalFileSystem would return what is left; tb5:// pins the size)."""
    from tb5sync.daemon.fsops import INLINE_READ, FsOps
    from tb5sync.tree.state import TreeState

    data = random.Random(11).randbytes(5000)
    (tmp_path / "f.bin").write_bytes(data)
    assert len(data) <= INLINE_READ
    state = TreeState(str(tmp_path), writable=False)
    ops = FsOps(str(tmp_path), state)
    real_fstat = os.fstat

    def fstat_then_cut(fd: int) -> os.stat_result:
        st = real_fstat(fd)
        os.truncate(tmp_path / "f.bin", 1000)
        return st

    try:
        meta, parts = ops.cat("f.bin", 100, 900)  # within what stays: served as it is
        assert bytes(parts[0]) == data[100:900] and meta["size"] == 5000
        monkeypatch.setattr(os, "fstat", fstat_then_cut)
        with pytest.raises(SourceChangedError):
            ops.cat("f.bin", 0, 5000)
        monkeypatch.setattr(os, "fstat", real_fstat)
        meta, parts = ops.cat("f.bin")
        assert meta["size"] == 1000 and bytes(parts[0]) == data[:1000]
    finally:
        ops.close()
        state.close()
