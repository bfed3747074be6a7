"""Raw ranges sent with sendfile(2): FileRange parts, their file descriptors, and a source that
changes after the sender's check (caught by the receiver's digest check and a re-request)."""

from __future__ import annotations

import errno
import os
import random
import socket
import threading
from pathlib import Path

import pytest

import tb5sync
from conftest import LiveServer, joined
import tb5sync.wire.protocol as P
from tb5sync.tree.options import SyncOptions
from tb5sync.wire.messages import CODEC_LZ4, CODEC_RAW
from tb5sync.roles.sender import Sender
from tb5sync.wire.parts import FileRange, SharedFd, close_parts
from tb5sync.wire.transport import Channel

pytestmark = pytest.mark.timeout(60)


def _fd_is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _send_and_receive(parts: list[object], meta: dict[str, object]) -> tuple[dict[str, object], bytes]:
    a, b = socket.socketpair()
    tx, rx = Channel(a), Channel(b)
    try:
        t = threading.Thread(target=tx.send_data, args=(7, meta, parts))
        t.start()
        got = rx.recv_frame()
        joined(t, 60)
        assert got is not None
        header, payload = got
        assert header.type is P.FrameType.DATA and header.rid == 7
        m, body = P.decode_data(payload)
        return m, bytes(body)
    finally:
        tx.close()
        rx.close()


def test_file_ranges_go_out_between_memory_parts(tmp_path: Path) -> None:
    data = random.Random(1).randbytes(3 << 20)
    path = tmp_path / "f"
    path.write_bytes(data)
    shared = SharedFd(os.open(path, os.O_RDONLY))
    fd = shared.fd
    parts = [b"head", FileRange(shared, 1000, 2 << 20), memoryview(b"mid"), FileRange(shared, 5, 10), b""]
    _, body = _send_and_receive(parts, {"x": 1})
    assert body == b"head" + data[1000 : 1000 + (2 << 20)] + b"mid" + data[5:15]
    assert _fd_is_open(fd)
    close_parts(parts)
    close_parts(parts)  # idempotent
    assert not _fd_is_open(fd)


def test_a_file_that_shrank_is_padded_so_the_frame_stays_whole(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"a" * 100_000)
    shared = SharedFd(os.open(path, os.O_RDONLY))
    part = FileRange(shared, 0, 100_000)
    os.truncate(path, 40_000)
    _, body = _send_and_receive([part, b"tail"], {})
    assert body == b"a" * 40_000 + bytes(60_000) + b"tail"
    part.close()


def test_zero_copy_sender_returns_file_ranges_and_closes_nothing_early(tmp_path: Path) -> None:
    rnd = random.Random(2)
    (tmp_path / "f.bin").write_bytes(rnd.randbytes(300_000) + b"z" * 200_000)
    st = os.stat(tmp_path / "f.bin")
    sender = Sender(str(tmp_path), SyncOptions(compress="auto"))
    sender.zero_copy = True
    try:
        meta, parts = sender.read_ranges("f.bin", [[0, 300_000], [300_000, 200_000]], st.st_size, st.st_mtime_ns)
        assert isinstance(parts[0], FileRange) and meta["parts"][0] == [300_000, 300_000, CODEC_RAW]
        assert not isinstance(parts[1], FileRange) and meta["parts"][1][2] == CODEC_LZ4  # zeros-like: compressed
        fd = parts[0].fd.fd
        assert _fd_is_open(fd)
        close_parts(parts)
        assert not _fd_is_open(fd)
        # Nothing taken by a FileRange: the descriptor is closed at once.
        meta, parts = sender.read_ranges("f.bin", [[300_000, 200_000]], st.st_size, st.st_mtime_ns)
        assert not any(isinstance(p, FileRange) for p in parts)
        sender.zero_copy = False
        meta, parts = sender.read_ranges("f.bin", [[0, 1000]], st.st_size, st.st_mtime_ns)
        assert not isinstance(parts[0], FileRange)
    finally:
        sender.close()


@pytest.mark.parametrize("route", ["push", "pull"])
def test_source_changed_after_the_check_is_fetched_again(
    tmp_path: Path, server: LiveServer, monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    """The sender checks size and mtime, then the file changes before sendfile reads it: the
    receiver's digest check fails, its re-request sees the change, and the file is fetched anew."""
    src = tmp_path / "src"
    src.mkdir()
    old = random.Random(3).randbytes(6 << 20)
    new = random.Random(4).randbytes(6 << 20)
    if route == "push":
        target = src / "big.bin"
        sync = (str(src) + "/", server.url("d"))
        final = Path(server.root) / "d" / "big.bin"
    else:
        (Path(server.root) / "s").mkdir()
        target = Path(server.root) / "s" / "big.bin"
        sync = (server.url("s/"), str(tmp_path / "out"))
        final = tmp_path / "out" / "big.bin"
    target.write_bytes(old)
    real = Sender._read_ranges_sendfile
    calls = []

    def changing(self: Sender, *args: object, **kw: object) -> tuple[dict[str, object], list[object]]:
        reply = real(self, *args, **kw)
        if not calls:
            target.write_bytes(new)  # same size, new content and mtime: after the check
            os.utime(target, ns=(1, 10**18))
        calls.append(1)
        return reply

    monkeypatch.setattr(Sender, "_read_ranges_sendfile", changing)
    tb5sync.sync(*sync)
    assert final.read_bytes() == new
    assert len(calls) >= 2


def test_a_failing_range_closes_the_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One range became a FileRange, a later one fails: the error is the sender's, the fd is closed once."""
    rnd = random.Random(5)
    (tmp_path / "f.bin").write_bytes(rnd.randbytes(8192) + bytes(8192))
    st = os.stat(tmp_path / "f.bin")
    sender = Sender(str(tmp_path), SyncOptions(compress="auto"))
    sender.zero_copy = True
    closes: list[int] = []
    real_close, real_pread = os.close, os.pread

    def spy_close(fd: int) -> None:
        closes.append(fd)
        real_close(fd)

    def short_pread(fd: int, n: int, off: int) -> bytes:
        data = real_pread(fd, n, off)
        return data[: n // 2] if off == 8192 and n == 8192 else data  # the file "shrank" under us

    monkeypatch.setattr(os, "close", spy_close)
    monkeypatch.setattr(os, "pread", short_pread)
    try:
        from tb5sync.errors import SourceChangedError

        with pytest.raises(SourceChangedError):
            sender.read_ranges("f.bin", [[0, 8192], [8192, 8192]], st.st_size, st.st_mtime_ns)
        assert len(closes) == len(set(closes)) == 1
    finally:
        monkeypatch.undo()
        sender.close()


def _big_file_route(route: str, tmp_path: Path, server: object, data: bytes) -> tuple[tuple[str, str], Path]:
    """``src/big.bin`` holding ``data``; the sync's ``(SRC, DST)`` for ``route`` (local or a push to
    ``server``) and where the file lands."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(data)
    if route == "push":
        return (str(src) + "/", server.url("d")), Path(server.root) / "d" / "big.bin"  # type: ignore[attr-defined]
    return (str(src) + "/", str(tmp_path / "d")), tmp_path / "d" / "big.bin"


def _sync_fails_on_the_big_file(sync: tuple[str, str], error: type[Exception], says: str) -> None:
    """``sync`` either raises ``error`` saying ``says`` (a local run) or reports ``big.bin`` failed."""
    try:
        stats = tb5sync.sync(*sync)
    except error as exc:
        assert says in str(exc)
    else:
        assert stats.failures and "big.bin" in stats.failures[0].path


@pytest.mark.parametrize("route", ["local", "push"])
def test_a_chunk_corrupted_every_time_is_never_written(route: str, tmp_path: Path, server: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """One chunk arrives damaged on every request: the others are written (each verified first), that
    one never is, the file is not committed, and the failure names it. (A push receives into
    buffers here, the portable twin: with splice the bytes land in the work file before they are
    hashed, see the test below.)"""
    import tb5sync.roles.largefile as largefile
    from tb5sync.errors import IntegrityError

    monkeypatch.setenv("TB5SYNC_SPLICE_PORTABLE", "1")

    data = random.Random(6).randbytes(9 << 20)
    sync, final = _big_file_route(route, tmp_path, server, data)
    real_decode = largefile.decode_ranges

    def damaging(meta: dict[str, object], parts: list[object], lengths: list[int]) -> list[object]:
        pieces = [bytearray(p) for p in real_decode(meta, parts, lengths)]  # type: ignore[arg-type]
        pieces[-1][len(pieces[-1]) // 2] ^= 0xFF  # the last chunk of every reply
        return pieces

    writes: list[tuple[int, bytes]] = []
    real_pwrite = largefile.pwrite_all

    def spy(fd: int, buf: object, off: int) -> None:
        writes.append((off, bytes(buf)))  # type: ignore[call-overload]
        real_pwrite(fd, buf, off)  # type: ignore[arg-type]

    monkeypatch.setattr(largefile, "decode_ranges", damaging)
    monkeypatch.setattr(largefile, "pwrite_all", spy)
    _sync_fails_on_the_big_file(sync, IntegrityError, "big.bin")
    assert not final.exists()
    assert writes  # the good chunks were written ...
    for off, buf in writes:  # ... and nothing else
        assert buf == data[off : off + len(buf)]


@pytest.mark.parametrize("route", ["local", "push"])
def test_replies_verified_side_by_side_are_all_done_before_the_work_file_closes(
    route: str, tmp_path: Path, server: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several replies are verified and written at once (each by the thread that received it): when a later reply
    fails, the fetch waits for every task still running before it returns (the caller then closes the
    work file and reuses the buffers), and nothing is committed; with no failure every byte lands."""
    import tb5sync.engine.hashing as hashing
    import tb5sync.roles.largefile as largefile
    from tb5sync.errors import RemoteProtocolError

    hashing.set_hash_threads(4)  # several replies at once even on a 2-core machine
    monkeypatch.setenv("TB5SYNC_SPLICE_PORTABLE", "1")  # replies in buffers: decode_ranges sees each
    monkeypatch.setattr(largefile, "RANGE_BYTES", 8 << 20)
    data = random.Random(8).randbytes(40 << 20)  # 5 replies of 8 MiB
    sync, final = _big_file_route(route, tmp_path, server, data)
    real_task, real_decode = largefile._verify_write_reply, largefile.decode_ranges
    running = [0]
    most = [0]
    lock = threading.Lock()

    def slow_task(*args: object) -> list[bool]:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            threading.Event().wait(0.3)
            return real_task(*args)  # type: ignore[arg-type]
        finally:
            with lock:
                running[0] -= 1

    replies = [0]

    def failing_decode(meta: dict[str, object], parts: list[object], lengths: list[int]) -> list[object]:
        replies[0] += 1
        if replies[0] == 4:
            raise RemoteProtocolError("the fourth reply is malformed")
        return real_decode(meta, parts, lengths)  # type: ignore[arg-type]

    real_fetch = largefile.LargeFileJob._fetch_ranges
    left_running: list[int] = []

    def fetch(self: largefile.LargeFileJob, *args: object) -> None:
        try:
            real_fetch(self, *args)  # type: ignore[arg-type]
        finally:
            left_running.append(running[0])

    monkeypatch.setattr(largefile, "_verify_write_reply", slow_task)
    monkeypatch.setattr(largefile, "decode_ranges", failing_decode)
    monkeypatch.setattr(largefile.LargeFileJob, "_fetch_ranges", fetch)
    try:
        _sync_fails_on_the_big_file(sync, RemoteProtocolError, "fourth reply")
        assert not final.exists()
        # none still ran when the fetch returned (tasks not started yet may have been cancelled:
        # in a push the sender shares the hash pool, so how many ran before the failure varies)
        assert left_running and set(left_running) == {0}
        monkeypatch.setattr(largefile, "decode_ranges", real_decode)
        left_running.clear()
        tb5sync.sync(*sync)
        assert final.read_bytes() == data
        assert set(left_running) == {0}
        assert most[0] >= 2  # replies were verified side by side
    finally:
        hashing.set_hash_threads(0)


def _splices() -> bool:
    """Whether a plain-TCP channel splices here (Linux, and ``TB5SYNC_PORTABLE`` not set)."""
    import tb5sync.wire.transport as transport
    from tb5sync._os.io import portable

    return transport.HAVE_SPLICE and not portable()


def test_a_chunk_damaged_in_the_work_file_is_caught_asked_again_and_mended(
    tmp_path: Path, server: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Received straight into the work file (splice): one chunk per reply damaged there fails its
    BLAKE3 check in the page cache, is asked for once more (into a buffer, checked, written) and
    the committed file is the source's; with the re-asked bytes damaged too, nothing is committed."""
    import tb5sync.roles.largefile as largefile
    import tb5sync.wire.transport as transport
    from tb5sync.errors import IntegrityError

    if not _splices():
        pytest.skip("no splice here (or TB5SYNC_PORTABLE=1)")
    data = random.Random(9).randbytes(9 << 20)
    sync, final = _big_file_route("push", tmp_path, server, data)
    real_verify, real_decode = largefile._verify_in_file, largefile.decode_ranges
    checked: list[int] = []

    def damaged(fd: int, group: list[tuple[int, int, bytes]]) -> list[bool]:
        off, n, _d = group[-1]
        byte = os.pread(fd, 1, off + n // 2)
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), off + n // 2)
        checked.append(len(group))
        return real_verify(fd, group)

    monkeypatch.setattr(largefile, "_verify_in_file", damaged)
    stats = tb5sync.sync(*sync)
    assert checked and final.read_bytes() == data
    assert stats.wire_bytes > len(data) + min(checked) * (256 << 10)  # the damaged chunks travelled twice

    def damaging(meta: dict[str, object], parts: list[object], lengths: list[int]) -> list[object]:
        pieces = [bytearray(p) for p in real_decode(meta, parts, lengths)]  # type: ignore[arg-type]
        pieces[-1][len(pieces[-1]) // 2] ^= 0xFF
        return pieces

    monkeypatch.setattr(largefile, "decode_ranges", damaging)
    final.unlink()
    _sync_fails_on_the_big_file(sync, IntegrityError, "big.bin")
    assert not final.exists()


@pytest.mark.parametrize("portable", ["0", "1"])
def test_a_push_receives_into_the_work_file_with_splice_or_its_portable_twin(
    portable: str, tmp_path: Path, server: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A push's ranges go socket -> pipe -> the work file (``splice``), then are hashed there; with
    ``TB5SYNC_SPLICE_PORTABLE=1`` (the portable twin) into a buffer, hashed, then written: the
    same bytes land either way."""
    import tb5sync.wire.transport as transport

    monkeypatch.setenv("TB5SYNC_SPLICE_PORTABLE", portable)
    calls = {"splice": 0, "to_file": 0}
    real_splice, real_to_file = transport.splice_to_file, transport.Channel.recv_body_to_file

    def spy_splice(*args: int) -> tuple[int, int, int, int]:
        calls["splice"] += 1
        return real_splice(*args)

    def spy_to_file(self: transport.Channel, fd: int, spans: list[tuple[int, int]]) -> object:
        calls["to_file"] += 1
        return real_to_file(self, fd, spans)

    monkeypatch.setattr(transport, "splice_to_file", spy_splice)
    monkeypatch.setattr(transport.Channel, "recv_body_to_file", spy_to_file)
    data = random.Random(10).randbytes(21 << 20) + bytes(3 << 20)  # the zeros travel lz4: into a buffer
    sync, final = _big_file_route("push", tmp_path, server, data)
    tb5sync.sync(*sync)
    assert final.read_bytes() == data
    if portable == "1" or not _splices():  # verified in a buffer, then written
        assert calls == {"splice": 0, "to_file": 0}
    else:
        assert calls["to_file"] >= 1 and calls["splice"] >= 1  # 21 MiB: one or two replies (32 MiB reads when spliced)


@pytest.mark.parametrize(("portable", "compress"), [("0", "auto"), ("1", "auto"), ("0", "lz4")])
def test_a_cold_file_on_a_splicing_link_is_asked_for_in_the_senders_largest_reads(
    portable: str, compress: str, tmp_path: Path, server: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spliced replies take no receive buffer, so a cold file's ranges are asked for in reads of
    the sender's most (``SENDER_MAX_READ``, 32 MiB) and never more; with the portable twin (replies
    in buffers), or ``compress="lz4"`` (every reply compressed into a buffer), in ``RANGE_BYTES``.
    The same bytes land either way, the lz4 part too (a compressed reply is received into a
    buffer in all three)."""
    import tb5sync.roles.largefile as largefile
    from tb5sync.wire.messages import SENDER_MAX_READ

    monkeypatch.setenv("TB5SYNC_SPLICE_PORTABLE", portable)
    asked: list[int] = []
    real = largefile.submit_then

    def spy(link: object, method: str, then: object, **kw: object) -> object:
        if method == "read_ranges":
            asked.append(sum(n for _o, n in kw["ranges"]))  # type: ignore[attr-defined]
        return real(link, method, then, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(largefile, "submit_then", spy)
    data = random.Random(11).randbytes(72 << 20) + bytes(6 << 20)
    sync, final = _big_file_route("push", tmp_path, server, data)
    tb5sync.sync(*sync, compress=compress)
    assert final.read_bytes() == data
    assert asked and sum(asked) == len(data) and max(asked) <= SENDER_MAX_READ
    if portable == "1" or compress == "lz4" or not _splices():
        assert max(asked) <= largefile.RANGE_BYTES
    else:
        assert max(asked) > largefile.RANGE_BYTES


@pytest.mark.parametrize("pure", ["0", "1"])
def test_read_mapping_twins_agree_and_verify_the_same(pure: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``map_read`` (the Cython mapping, or ``mmap.mmap`` with ``TB5SYNC_PUREPYTHON=1``) gives the
    file's bytes at an aligned offset, refuses to close while a view is held, and the reply check
    built on it passes the chunks whose BLAKE3 digest matches and fails the one that does not."""
    import mmap

    import tb5sync._os.io as io
    import tb5sync.roles.largefile as largefile
    from tb5sync.engine.hashing import chunk_digest

    monkeypatch.setenv("TB5SYNC_PUREPYTHON", pure)
    data = random.Random(12).randbytes(3 << 20)
    path = tmp_path / "work"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        g = mmap.ALLOCATIONGRANULARITY
        m = io.map_read(fd, 1 << 20, g)
        view = memoryview(m)
        assert bytes(view) == data[g : g + (1 << 20)]
        with pytest.raises(BufferError):
            m.close()
        view.release()
        m.close()
        group = [(5, 1000, chunk_digest(data[5:1005])), (70_000, 2 << 20, chunk_digest(data[70_000 : 70_000 + (2 << 20)])),
                 (1005, 10, chunk_digest(b"not these bytes"))]
        assert largefile._verify_in_file(fd, group) == [True, True, False]
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "splice"), reason="no splice on this system")
def test_splice_to_file_twins_agree(tmp_path: Path) -> None:
    """``tb5sync._bytes.splice_to_file`` and its pure-Python twin give the same results: a whole
    range, the socket's end part-way, and a file that refuses the write."""
    import socket

    import tb5sync._os.io as io

    try:
        from tb5sync._bytes import splice_to_file as cy
    except ImportError:
        pytest.skip("tb5sync._bytes not built")
    payload = random.Random(11).randbytes(3 << 20)
    for fn in (cy, io.splice_to_file_py):
        outs = []
        for case in ("whole", "eof", "refused"):
            a, b = socket.socketpair()
            r, w = os.pipe()
            path = tmp_path / f"{case}-{getattr(fn, '__name__', 'x')}.bin"
            path.write_bytes(b"")
            fd = os.open(path, os.O_RDONLY if case == "refused" else os.O_RDWR)
            try:
                sent = payload if case != "eof" else payload[: 1 << 20]
                def send(data: bytes = sent, a: socket.socket = a) -> None:
                    try:
                        a.sendall(data)
                        a.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass  # the refused case stops reading part-way

                t = threading.Thread(target=send)
                t.start()
                got = fn(b.fileno(), r, w, fd, 4096, len(payload), 256 * 1024)
                b.shutdown(socket.SHUT_RDWR)
                t.join()
                outs.append(got)
                if case == "whole":
                    assert got == (len(payload), len(payload), 0, -1)
                    assert os.pread(fd, len(payload) + 10, 4096) == payload
                elif case == "eof":
                    assert got == (1 << 20, 1 << 20, 0, 2)
                else:
                    assert got[3] == 1 and got[2] == errno.EBADF and got[1] == 0
            finally:
                for x in (r, w, fd):
                    os.close(x)
                a.close()
                b.close()
        if fn is cy:
            cy_outs = outs
        else:
            assert outs[:2] == cy_outs[:2] and outs[2][1:] == cy_outs[2][1:]


def test_consecutive_file_ranges_go_out_as_one_span_with_the_same_bytes(tmp_path: Path) -> None:
    """A reply's FileRanges that continue one another in one file are sent by one sendfile loop
    (``transport._joined_ranges``); the bytes on the wire are those of the parts one by one, a
    file that shrank meanwhile padded with zeros to the announced end in both cases."""
    import tb5sync.wire.transport as transport

    data = random.Random(12).randbytes(3 << 20)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    shared = SharedFd(fd)
    spans = [(0, 1 << 20), (1 << 20, 1 << 20), (2 << 20, 100), (3 << 20, 0), (5, 40000)]
    parts: list[object] = [b"head", *(FileRange(shared, o, n) for o, n in spans[:3]), b"mid", FileRange(shared, *spans[4])]
    joined = transport._joined_ranges(parts)
    assert [type(p).__name__ for p in joined] == ["bytes", "_Span", "bytes", "FileRange"]
    assert len(joined[1]) == (2 << 20) + 100
    want = b"head" + data[: (2 << 20) + 100] + b"mid" + data[5:40005]
    for shrink in (False, True):
        a, b = socket.socketpair()
        got = bytearray()
        t = threading.Thread(target=lambda: got.extend(joined_recv(b, len(want))))
        t.start()
        if shrink:
            os.truncate(path, (1 << 20) + 10)
        Channel(a).send_encoded(list(parts))
        t.join()
        a.close()
        b.close()
        if shrink:
            assert bytes(got[: 4 + (1 << 20) + 10]) == want[: 4 + (1 << 20) + 10]
            assert bytes(got[4 + (1 << 20) + 10 : 4 + (2 << 20) + 100]) == bytes((1 << 20) + 90)
        else:
            assert bytes(got) == want
    close_parts(parts)


def joined_recv(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        k = sock.recv(n - len(out))
        if not k:
            break
        out += k
    return bytes(out)


def test_a_pull_splices_into_the_work_file_too(tmp_path: Path, server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same data plane on the client's side: a pull's ranges are spliced into the client's work file."""
    import tb5sync.wire.transport as transport

    if not _splices():
        pytest.skip("no splice here (or TB5SYNC_PORTABLE=1)")
    calls = [0]
    real = transport.splice_to_file

    def spy(*args: int) -> tuple[int, int, int, int]:
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(transport, "splice_to_file", spy)
    data = random.Random(13).randbytes(40 << 20)
    src = Path(server.root) / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(data)
    tb5sync.sync(server.url("src/"), str(tmp_path / "out"))
    assert (tmp_path / "out" / "big.bin").read_bytes() == data
    assert calls[0] >= 2
