"""Delta of a large file against its previous version (the basis): hints from the scan cache and
from re-alignment, every reused byte verified; local, push and pull."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

import tb5sync
import tb5sync.engine.basis as _basis
import tb5sync.engine.chunking as chunking
from tb5sync.engine.basis import BasisFinder, check_copy
from tb5sync.engine.hashing import chunk_buffer, chunk_digest

pytestmark = pytest.mark.timeout(60)

MiB = 1024 * 1024


# ---- BasisFinder and check_copy on their own -------------------------------------------------


def _find_all(basis: bytes, new: bytes, params: chunking.ChunkParams, tmp_path: Any) -> tuple[list[bool], BasisFinder]:
    """Run the receiver's order of questions over ``new``'s chunks; True per chunk found (and verified) in ``basis``."""
    p = tmp_path / "basis.bin"
    p.write_bytes(basis)
    fd = os.open(p, os.O_RDONLY)
    try:
        bf = BasisFinder(fd, len(basis), params)
        buf = bytearray(params.max_size)
        found = []
        off = 0
        for d, n in chunk_buffer(new, params):
            place = bf.first_place(off, n, d)
            ok = place is not None and check_copy(fd, place, n, d, -1, 0, buf)
            if ok:
                assert place is not None
                bf.found(off, n, place)
            else:
                for q in bf.more_places(off, n, d, {place} if place is not None else set()):
                    if check_copy(fd, q, n, d, -1, 0, buf):
                        bf.found(off, n, q)
                        ok = True
                        break
            found.append(ok)
            off += n
        return found, bf
    finally:
        os.close(fd)


@pytest.mark.parametrize("edit", ["overwrite", "insert", "delete", "insert_at_start"])
def test_finder_realigns(edit: str, small_chunk_params: chunking.ChunkParams, tmp_path: Any) -> None:
    """After an edit, every chunk of the new version that exists in the basis is found; cutting stays local."""
    rnd = random.Random(7)
    basis = rnd.randbytes(200_000)
    at = 100_000
    new = {
        "overwrite": basis[:at] + rnd.randbytes(300) + basis[at + 300 :],
        "insert": basis[:at] + rnd.randbytes(777) + basis[at:],
        "delete": basis[:at] + basis[at + 999 :],
        "insert_at_start": rnd.randbytes(333) + basis,
    }[edit]
    found, bf = _find_all(basis, new, small_chunk_params, tmp_path)
    have = {d for d, _ in chunk_buffer(basis, small_chunk_params)}
    expected = [d in have for d, _ in chunk_buffer(new, small_chunk_params)]
    assert found == expected
    assert sum(found) >= len(found) - 6
    assert bf.cut_bytes <= 40 * small_chunk_params.max_size


def test_finder_unrelated_file_cuts_at_most_once(small_chunk_params: chunking.ChunkParams, tmp_path: Any) -> None:
    """Nothing in common: nothing found, and the basis is cut about once over (each cut re-reads the tail
    of the previous one, at most ``max_size`` bytes)."""
    rnd = random.Random(8)
    basis, new = rnd.randbytes(100_000), rnd.randbytes(100_000)
    found, bf = _find_all(basis, new, small_chunk_params, tmp_path)
    assert not any(found)
    assert bf.cut_bytes <= 2 * len(basis)


def test_check_copy_writes_only_verified_bytes(tmp_path: Any) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(b"a" * 1000 + b"b" * 1000)
    dst.write_bytes(b"\0" * 2000)
    sfd, dfd = os.open(src, os.O_RDONLY), os.open(dst, os.O_RDWR)
    try:
        buf = bytearray(4096)
        assert not check_copy(sfd, 0, 1000, chunk_digest(b"b" * 1000), dfd, 0, buf)  # wrong bytes there
        assert not check_copy(sfd, 1500, 1000, chunk_digest(b"b" * 1000), dfd, 0, buf)  # short read
        assert dst.read_bytes() == b"\0" * 2000
        assert check_copy(sfd, 1000, 1000, chunk_digest(b"b" * 1000), dfd, 500, buf)
        assert dst.read_bytes() == b"\0" * 500 + b"b" * 1000 + b"\0" * 500
    finally:
        os.close(sfd)
        os.close(dfd)


def test_stale_cached_list_is_only_a_hint(small_chunk_params: chunking.ChunkParams, tmp_path: Any) -> None:
    """A cached chunk list whose bytes changed since gives places that fail verification, never wrong bytes."""
    rnd = random.Random(9)
    old = rnd.randbytes(50_000)
    cached = chunk_buffer(old, small_chunk_params)
    now = bytearray(old)
    now[20_000:20_100] = rnd.randbytes(100)  # changed behind the cache's back
    (tmp_path / "b").write_bytes(now)
    fd = os.open(tmp_path / "b", os.O_RDONLY)
    try:
        bf = BasisFinder(fd, len(now), small_chunk_params, cached)
        buf = bytearray(small_chunk_params.max_size)
        off = 0
        for d, n in cached:  # ask for the old version's chunks: the changed one must not verify
            place = bf.first_place(off, n, d)
            assert place == off
            assert check_copy(fd, place, n, d, -1, 0, buf) == (bytes(now[off : off + n]) == old[off : off + n])
            off += n
    finally:
        os.close(fd)


# ---- end to end: local, push, pull ---------------------------------------------------------------


@pytest.fixture(params=["local", "push", "pull"])
def place(request: Any, server: Any, tmp_path: Any) -> Any:
    """``(src_dir, sync_src, dst_dir, sync_dst)``: where to edit the source and the destination copy, per route."""
    if request.param == "local":
        src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
        return src, src + "/", dst, dst
    if request.param == "push":
        src, dst = str(tmp_path / "src"), os.path.join(server.root, "dst")
        return src, src + "/", dst, server.url("dst")
    src, dst = os.path.join(server.root, "src"), str(tmp_path / "dst")
    return src, server.url("src/"), dst, dst


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write(path: str, data: bytes, mtime_ns: int | None = None) -> None:
    with open(path, "wb") as f:
        f.write(data)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))


def _edit_source(path: str, rnd: random.Random) -> bytes:
    """Scattered overwrites plus a 4 KiB insertion in the middle; a new mtime."""
    data = bytearray(_read(path))
    for k in range(1, 6):
        at = k * len(data) // 7
        data[at : at + 5000] = rnd.randbytes(5000)
    mid = len(data) // 2
    data[mid:mid] = rnd.randbytes(4096)
    _write(path, bytes(data), 1_700_000_123_000_000_000)
    return bytes(data)


def test_delta_against_cached_basis(place: Any, monkeypatch: Any) -> None:
    """Second sync after a first one: the destination's cached chunk list guides reuse; identical bytes."""
    src, s, dst, d = place
    os.makedirs(src)
    rnd = random.Random(11)
    _write(os.path.join(src, "big.bin"), rnd.randbytes(12 * MiB + 77), 1_600_000_000_000_000_000)
    tb5sync.sync(s, d)
    finders: list[BasisFinder] = []
    real = _basis.BasisFinder.__init__

    def spy(self: BasisFinder, *a: Any, **k: Any) -> None:
        real(self, *a, **k)
        finders.append(self)

    monkeypatch.setattr(_basis.BasisFinder, "__init__", spy)
    want = _edit_source(os.path.join(src, "big.bin"), rnd)
    stats = tb5sync.sync(s, d)
    assert _read(os.path.join(dst, "big.bin")) == want
    assert os.stat(os.path.join(dst, "big.bin")).st_mtime_ns == 1_700_000_123_000_000_000
    assert stats.files_transferred == 1 and stats.chunks_reused >= 4
    assert stats.chunks_sent <= 8
    assert finders and finders[0].by_digest  # the cache was there and used
    assert finders[0].cut_bytes == 0  # ... so no cutting was needed


def test_delta_against_uncached_basis(place: Any) -> None:
    """The previous version placed by hand (no state): found by continuation and re-alignment."""
    src, s, dst, d = place
    os.makedirs(src)
    os.makedirs(dst)
    rnd = random.Random(12)
    old = rnd.randbytes(12 * MiB + 5)
    _write(os.path.join(src, "big.bin"), old)
    _write(os.path.join(dst, "big.bin"), old)
    want = _edit_source(os.path.join(src, "big.bin"), rnd)
    stats = tb5sync.sync(s, d)
    assert _read(os.path.join(dst, "big.bin")) == want
    assert stats.chunks_reused >= 4 and stats.chunks_sent <= 8


@pytest.mark.parametrize("restore_mtime", [False, True], ids=["mtime_changed", "mtime_restored"])
def test_basis_changed_after_caching_is_not_trusted(place: Any, restore_mtime: bool) -> None:
    """The destination copy is overwritten in place after it was cached (same size and inode, and with
    ``restore_mtime`` the cached mtime put back with os.utime): its cached chunk list now lies about
    some chunks; the result must still be the source's bytes."""
    src, s, dst, d = place
    os.makedirs(src)
    rnd = random.Random(13)
    _write(os.path.join(src, "big.bin"), rnd.randbytes(12 * MiB + 3), 1_600_000_000_000_000_000)
    tb5sync.sync(s, d)
    target = os.path.join(dst, "big.bin")
    before = os.stat(target)
    with open(target, "r+b") as f:  # in place: same inode, same size
        for at in (1 * MiB, 6 * MiB, 10 * MiB):
            f.seek(at)
            f.write(b"\xee" * 3000)
    if restore_mtime:
        os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(target)
    assert (after.st_size, after.st_ino) == (before.st_size, before.st_ino)
    assert (after.st_mtime_ns == before.st_mtime_ns) == restore_mtime
    # a small change at the source's end, so that the file is sent again (as a delta)
    data = bytearray(_read(os.path.join(src, "big.bin")))
    data[-10:] = b"0123456789"
    _write(os.path.join(src, "big.bin"), bytes(data), 1_600_000_000_000_000_777)
    stats = tb5sync.sync(s, d)
    assert _read(target) == bytes(data)
    assert stats.chunks_sent >= 4  # the three damaged chunks and the edited last one came from the source
    assert stats.chunks_reused >= 4


def test_start_writeback_changes_nothing(tmp_path: Any) -> None:
    p = tmp_path / "f"
    p.write_bytes(b"x" * 100_000)
    fd = os.open(p, os.O_RDWR)
    try:
        os.pwrite(fd, b"y" * 10, 50_000)
        _basis.start_writeback(fd, 0, 100_000)
        _basis.start_writeback(fd, 99_000, 10_000)  # past the end: no error
    finally:
        os.close(fd)
    assert _read(str(p)) == b"x" * 50_000 + b"y" * 10 + b"x" * (50_000 - 10)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_replaced_basis_is_released(tmp_path: Any) -> None:
    """The basis of a committed delta is closed in the background: no descriptor is left open."""
    import time

    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    os.makedirs(src)
    rnd = random.Random(14)
    _write(os.path.join(src, "big.bin"), rnd.randbytes(6 * MiB))
    tb5sync.sync(src + "/", dst)
    before = set(os.listdir("/proc/self/fd"))
    for _ in range(3):
        _edit_source(os.path.join(src, "big.bin"), rnd)
        want = _read(os.path.join(src, "big.bin"))
        tb5sync.sync(src + "/", dst)
        assert _read(os.path.join(dst, "big.bin")) == want
    deadline = time.monotonic() + 10
    while set(os.listdir("/proc/self/fd")) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    left = set(os.listdir("/proc/self/fd")) - before
    assert not left, [os.readlink(f"/proc/self/fd/{fd}") for fd in left if os.path.exists(f"/proc/self/fd/{fd}")]


def test_many_pieces_and_a_change_between_them(place: Any, monkeypatch: Any) -> None:
    """Small chunk-list pieces (many of them, read ahead by the receiver's helper thread); the source
    changes after the second piece was cut: the file is fetched again and ends up as the new source."""
    import functools

    import tb5sync.roles.largefile as largefile
    import tb5sync.roles.sender as sender
    from tb5sync.engine.hashing import iter_chunk_fd
    from tb5sync.roles.sender import Sender

    # pieces end at the sender's window: 4 MiB windows and 1-byte limits give one window a piece
    monkeypatch.setattr(sender, "iter_chunk_fd", functools.partial(iter_chunk_fd, window=4 * MiB))
    monkeypatch.setattr(largefile, "PIECE_BYTES", 1)
    monkeypatch.setattr(largefile, "BATCH_BYTES", 1)
    src, s, dst, d = place
    os.makedirs(src)
    rnd = random.Random(15)
    path = os.path.join(src, "big.bin")
    _write(path, rnd.randbytes(24 * MiB + 1), 1_600_000_000_000_000_000)
    tb5sync.sync(s, d)
    want = _edit_source(path, rnd)
    later = bytearray(want)
    later[-100:] = b"z" * 100
    calls: list[int] = []
    orig = Sender.chunk_list

    def changing(self: Sender, *a: Any, **k: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            _write(path, bytes(later), 1_700_000_999_000_000_000)
        return orig(self, *a, **k)

    monkeypatch.setattr(Sender, "chunk_list", changing)
    stats = tb5sync.sync(s, d)
    assert _read(os.path.join(dst, "big.bin")) == bytes(later)
    assert os.stat(os.path.join(dst, "big.bin")).st_mtime_ns == 1_700_000_999_000_000_000
    assert len(calls) >= 8 and stats.chunks_reused >= 4


def test_unverified_bytes_are_never_committed(tmp_path: Any, monkeypatch: Any) -> None:
    """If chunks went missing between the plan and the commit (here: the fetch of missing chunks does
    nothing), the file is not renamed into place: the previous version stays whole."""
    import tb5sync.roles.largefile as largefile
    from tb5sync.errors import IntegrityError

    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    os.makedirs(src)
    rnd = random.Random(16)
    _write(os.path.join(src, "big.bin"), rnd.randbytes(12 * MiB))
    tb5sync.sync(src + "/", dst)
    old = _read(os.path.join(dst, "big.bin"))
    _edit_source(os.path.join(src, "big.bin"), rnd)

    def lose(self: Any, fd: int, rel: str, groups: Any, size: int, mtime_ns: int) -> None:
        for _ in groups:
            pass

    monkeypatch.setattr(largefile.LargeFileJob, "_fetch_ranges", lose)
    with pytest.raises(IntegrityError, match="verified before commit"):
        tb5sync.sync(src + "/", dst)
    assert _read(os.path.join(dst, "big.bin")) == old
    assert sorted(os.listdir(dst)) == [".tb5sync", "big.bin"] or sorted(os.listdir(dst)) == ["big.bin"]


def test_chunk_index_recovers_from_copies_deleted_behind_its_back(tmp_path, server) -> None:
    """Copies of a file deleted outside tb5sync leave stale index rows; they must not hide the
    copies that still hold the chunks (the index is asked a few places at a time)."""
    import random
    import shutil

    import tb5sync

    src = tmp_path / "k"
    src.mkdir()
    (src / "u").write_bytes(random.Random(9).randbytes(4 << 20))
    for i in range(6):
        tb5sync.sync(str(src) + "/", server.url(f"kk_{i}"))
    for i in range(5):  # all but the last copy go, behind the server's back
        shutil.rmtree(os.path.join(server.root, f"kk_{i}"))
    first = tb5sync.sync(str(src) + "/", server.url("kk_a"))
    assert first.chunks_sent == 0 and first.chunks_reused >= 1, first
    second = tb5sync.sync(str(src) + "/", server.url("kk_b"))
    assert second.chunks_sent == 0 and second.chunks_reused >= 1, second
    for name in ("kk_a", "kk_b"):
        with open(os.path.join(server.root, name, "u"), "rb") as f:
            assert f.read() == (src / "u").read_bytes()


# ---- small changed files travel as deltas (receiver.DELTA_FILE) --------------------------------


def _rsync_bytes_sent(src: str, dst: str) -> int:
    """rsync's "Total bytes sent" for ``rsync -a --no-whole-file --stats SRC/ DST/`` (local rsync
    copies whole files unless told not to; the delta algorithm is what a remote rsync runs)."""
    import re
    import subprocess

    out = subprocess.run(["rsync", "-a", "--no-whole-file", "--stats", src + "/", dst + "/"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    m = re.search(r"Total bytes sent: ([\d,.]+)", out)
    assert m, out
    return int(m.group(1).replace(",", "").replace(".", ""))


@pytest.mark.parametrize("edit", ["touch", "change100"])
def test_changed_2mb_file_travels_as_a_delta(tmp_path: Any, need_rsync: None, edit: str) -> None:
    """A 2 MB file that exists at the destination, touched or with 100 bytes changed, pushed
    to a server: the client's wire bytes stay within 10x of what rsync sends for the same
    edit, far below the file's 2 MB; the result is the source's file."""
    from conftest import start_server

    from tb5sync.roles.receiver import DELTA_FILE, SMALL_FILE

    size = 2_000_000
    assert DELTA_FILE <= size < SMALL_FILE
    rng = random.Random(5)
    data = bytearray(rng.randbytes(size))
    src, ref = str(tmp_path / "src"), str(tmp_path / "ref")
    os.makedirs(src)
    with open(os.path.join(src, "f"), "wb") as f:
        f.write(data)
    live = start_server(str(tmp_path / "root"))
    try:
        first = tb5sync.sync(src + "/", live.url("d/"))
        assert first.wire_bytes > size  # the first copy travels whole
        _rsync_bytes_sent(src, ref)
        if edit == "touch":
            os.utime(os.path.join(src, "f"), ns=(2_000_000_000 * 10**9, 2_000_000_000 * 10**9))
        else:
            data[1_000_000:1_000_100] = rng.randbytes(100)
            with open(os.path.join(src, "f"), "wb") as f:
                f.write(data)
            os.utime(os.path.join(src, "f"), ns=(1_900_000_000 * 10**9, 1_900_000_000 * 10**9))  # another second: rsync's quick check
        stats = tb5sync.sync(src + "/", live.url("d/"))
        rsync_sent = _rsync_bytes_sent(src, ref)
        with open(os.path.join(live.root, "d", "f"), "rb") as f:
            assert f.read() == bytes(data)
        assert os.stat(os.path.join(live.root, "d", "f")).st_mtime_ns == os.stat(os.path.join(src, "f")).st_mtime_ns
    finally:
        live.server.stop()
    assert stats.files_transferred == 1 and stats.chunks_reused >= 1, stats
    assert stats.wire_bytes <= 10 * rsync_sent, (stats.wire_bytes, rsync_sent)
    assert stats.wire_bytes < size // 50, stats.wire_bytes


def test_changed_file_below_the_delta_size_travels_whole(tmp_path: Any) -> None:
    """Below DELTA_FILE a changed file is sent whole in a batch (no chunk-list round trip)."""
    from tb5sync.roles.receiver import DELTA_FILE

    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    os.makedirs(src)
    data = os.urandom(DELTA_FILE // 2)
    with open(os.path.join(src, "f"), "wb") as f:
        f.write(data)
    tb5sync.sync(src + "/", dst)
    os.utime(os.path.join(src, "f"), ns=(2_000_000_000 * 10**9, 2_000_000_000 * 10**9))
    stats = tb5sync.sync(src + "/", dst)
    assert stats.files_transferred == 1 and stats.chunks_reused == 0 and stats.bytes_transferred == len(data)


def test_copy_buffers_only_when_something_is_copied(tmp_path: Any, monkeypatch: Any) -> None:
    """A cold large file (no basis, nothing indexed) makes no copy buffer; a delta makes a few, reused.

    Each used to allocate and zero COPY_INFLIGHT max-size buffers (24 MiB) per large file up front.
    """
    import tb5sync.roles.largefile as largefile

    made: list[int] = []
    real = largefile._CopyBuffers.get

    def counting(self: Any) -> bytearray:
        before = len(self._free)
        buf = real(self)
        if before == 0:
            made.append(len(buf))
        return buf

    monkeypatch.setattr(largefile._CopyBuffers, "get", counting)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    rnd = random.Random(21)
    for i in range(3):
        _write(str(src / f"f{i}.bin"), rnd.randbytes(6 * MiB + i), 1_600_000_000_000_000_000)
    stats = tb5sync.sync(str(src) + "/", str(dst))
    assert stats.files_transferred == 3 and stats.chunks_reused == 0
    for i in range(3):
        assert _read(str(dst / f"f{i}.bin")) == _read(str(src / f"f{i}.bin"))
    assert made == []
    want = _edit_source(str(src / "f1.bin"), rnd)
    stats = tb5sync.sync(str(src) + "/", str(dst))
    assert _read(str(dst / "f1.bin")) == want
    assert stats.chunks_reused >= 2
    assert 1 <= len(made) <= largefile.COPY_INFLIGHT + 1
    assert all(n == chunking.DEFAULT_PARAMS.max_size for n in made)
