"""Sub-chunk refinement of a delta (tb5sync.engine.refine) and the sender's sub_chunks request."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import xxhash

import tb5sync
from conftest import LiveServer
import tb5sync.engine.refine as refine
from tb5sync.engine.chunking import ChunkParams
from tb5sync.errors import RemoteProtocolError, SourceChangedError, UsageError
from tb5sync.roles.sender import Sender

pytestmark = pytest.mark.timeout(60)




def test_sub_chunk_list_covers_the_view() -> None:
    data = random.Random(1).randbytes(300_000)
    subs = refine.sub_chunk_list(data)
    assert sum(n for _, n in subs) == len(data)
    assert len(subs) > 5
    off = 0
    for d, n in subs:
        assert d == xxhash.xxh3_128_digest(data[off : off + n])
        assert n <= refine.SUB_PARAMS.max_size
        off += n
    assert refine.sub_chunk_list(b"") == []


def test_wire_forms_round_trip_and_are_checked() -> None:
    subs = refine.sub_chunk_list(random.Random(2).randbytes(100_000))
    assert refine.decode_subs(refine.encode_subs(subs), 100_000) == subs
    blob, lengths = refine.encode_subs(subs)
    with pytest.raises(RemoteProtocolError, match="add up"):
        refine.decode_subs([blob, lengths], 99_999)
    with pytest.raises(RemoteProtocolError, match="malformed"):
        refine.decode_subs([blob[:-1], lengths], 100_000)
    with pytest.raises(RemoteProtocolError, match="malformed"):
        refine.decode_subs("x", 1)
    assert refine.params_from_wire(refine.params_to_wire(refine.SUB_PARAMS)) == refine.SUB_PARAMS
    for bad in ([1, 2, 3], [64, 128, 512, 2], [4096, 16384, 4 << 20, 2], "x", [4096, 5000, 65536, 2]):
        with pytest.raises(UsageError):
            refine.params_from_wire(bad)


@pytest.mark.parametrize("edit", ["overwrite", "insert", "delete", "none"])
def test_plan_fetches_little_more_than_the_edit(tmp_path: Path, edit: str) -> None:
    rnd = random.Random(3)
    old = rnd.randbytes(3 << 20)
    new = bytearray(old)
    at = (1 << 20) + 400_000
    if edit == "overwrite":
        new[at : at + 5000] = rnd.randbytes(5000)
    elif edit == "insert":
        new[at:at] = rnd.randbytes(4096)
    elif edit == "delete":
        del new[at : at + 3000]
    chunk_start, chunk_end = 1 << 20, (2 << 20) + 100_000  # the new file's chunk holding the edit
    chunk = bytes(new[chunk_start:chunk_end])
    basis = tmp_path / "basis"
    basis.write_bytes(old)
    fd = os.open(basis, os.O_RDONLY)
    try:
        index = refine.BasisIndex(fd, len(old))
        index.add_window(chunk_start, chunk_end + (1 << 20))
        index.add_window(chunk_start, chunk_end + (1 << 20))  # indexed once only
        assert index.indexed_bytes == min(len(old), chunk_end + (1 << 20)) - chunk_start
        copies, fetches = refine.plan(refine.sub_chunk_list(chunk), index)
        fetched = sum(n for _, n in fetches)
        edited = {"overwrite": 5000, "insert": 4096, "delete": 0, "none": 0}[edit]
        assert fetched <= edited + 2 * refine.SUB_PARAMS.max_size
        if edit == "none":
            assert fetches == [] and len(copies) == 1
        # Copies and fetches cover the chunk exactly once, and the copies hold the right bytes.
        spans = sorted([(a, n) for a, _, n in copies] + fetches)
        pos = 0
        for a, n in spans:
            assert a == pos
            pos += n
        assert pos == len(chunk)
        buf = bytearray(len(chunk))
        refine.fill_copies(memoryview(buf), fd, copies)
        for a, n in fetches:
            buf[a : a + n] = chunk[a : a + n]
        assert bytes(buf) == chunk
    finally:
        os.close(fd)


def test_fill_copies_refuses_a_shrunk_basis(tmp_path: Path) -> None:
    basis = tmp_path / "basis"
    basis.write_bytes(b"x" * 1000)
    fd = os.open(basis, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="basis ended"):
            refine.fill_copies(memoryview(bytearray(100)), fd, [(0, 950, 100)])
    finally:
        os.close(fd)


def test_sender_sub_chunks(tmp_path: Path) -> None:
    data = random.Random(4).randbytes(500_000)
    (tmp_path / "f.bin").write_bytes(data)
    st = os.stat(tmp_path / "f.bin")
    sender = Sender(str(tmp_path))
    try:
        wire = refine.params_to_wire(refine.SUB_PARAMS)
        got = sender.sub_chunks("f.bin", [[0, 200_000], [300_000, 200_000]], st.st_size, st.st_mtime_ns, wire)
        assert [refine.decode_subs(v, 200_000) for v in got["subs"]] == [
            refine.sub_chunk_list(data[:200_000]),
            refine.sub_chunk_list(data[300_000:]),
        ]
        small = ChunkParams(version=0, min_size=256, avg_size=1024, max_size=4096)
        got = sender.sub_chunks("f.bin", [[10, 50_000]], st.st_size, st.st_mtime_ns, refine.params_to_wire(small))
        assert refine.decode_subs(got["subs"][0], 50_000) == refine.sub_chunk_list(data[10:50_010], small)
        with pytest.raises(SourceChangedError):
            sender.sub_chunks("f.bin", [[0, 10]], st.st_size, st.st_mtime_ns + 1, wire)
        with pytest.raises(UsageError, match="beyond end"):
            sender.sub_chunks("f.bin", [[499_999, 10]], st.st_size, st.st_mtime_ns, wire)
        with pytest.raises(UsageError):
            sender.sub_chunks("f.bin", [[0, 10]], st.st_size, st.st_mtime_ns, [1, 2, 3, 4])
    finally:
        sender.close()


# --- end to end: delta syncs that send only the changed sub-chunks ---------------------------


def _edited_pair(tmp_path: Path) -> tuple[Path, bytes]:
    rnd = random.Random(5)
    src = tmp_path / "src"
    src.mkdir()
    data = bytearray(rnd.randbytes(12 << 20))
    (src / "big.bin").write_bytes(data)
    return src, bytes(data)


def _edit(src: Path, data: bytes) -> bytes:
    new = bytearray(data)
    new[3_000_000:3_000_100] = b"E" * 100  # overwrite inside one chunk
    new[8_000_000:8_000_000] = b"I" * 4096  # insertion: the chunks after it shift
    (src / "big.bin").write_bytes(new)
    return bytes(new)


@pytest.mark.parametrize("route", ["local", "push", "pull"])
def test_delta_sends_sub_chunks_only(tmp_path: Path, server: LiveServer, route: str) -> None:
    src, data = _edited_pair(tmp_path)
    if route == "local":
        dst, final = str(tmp_path / "out"), tmp_path / "out"
    elif route == "push":
        dst, final = server.url("d"), Path(server.root) / "d"
    else:
        staged = Path(server.root) / "staged"
        src_url = server.url("staged/")
        dst, final = str(tmp_path / "pulled"), tmp_path / "pulled"
    if route == "pull":
        tb5sync.sync(str(src) + "/", str(staged))
        tb5sync.sync(src_url, dst)
        new = _edit(src, data)
        tb5sync.sync(str(src) + "/", str(staged))
        stats = tb5sync.sync(src_url, dst)
    else:
        tb5sync.sync(str(src) + "/", dst)
        new = _edit(src, data)
        stats = tb5sync.sync(str(src) + "/", dst)
    assert (final / "big.bin").read_bytes() == new
    assert stats.files_transferred == 1
    assert stats.chunks_sent >= 2
    # Whole chunks would be >= 2 x 256 KiB (format v1's minimum); sub-chunks are ~16 KiB.
    assert stats.bytes_matched > 0
    if route != "local":
        assert stats.wire_bytes < 400_000, stats


def test_wrong_basis_match_falls_back_to_the_whole_chunk(
    tmp_path: Path, server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan that copies the wrong basis bytes is caught by the chunk digest: the chunk comes whole."""
    src, data = _edited_pair(tmp_path)
    tb5sync.sync(str(src) + "/", server.url("d"))
    new = _edit(src, data)
    real_plan = refine.plan

    def bad_plan(subs: list[tuple[bytes, int]], index: refine.BasisIndex) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
        copies, fetches = real_plan(subs, index)
        return [(a, at + 1, n) for a, at, n in copies], fetches  # off by one byte

    monkeypatch.setattr(refine, "plan", bad_plan)
    stats = tb5sync.sync(str(src) + "/", server.url("d"))
    assert (Path(server.root) / "d" / "big.bin").read_bytes() == new
    assert stats.chunks_sent >= 2
    assert stats.wire_bytes > 2 * 256 * 1024  # the chunks came whole


def test_refinement_gives_up_on_a_basis_that_shares_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A destination file unrelated to the new version: after a few groups without a match the
    rest is fetched whole (the result is the same either way)."""
    src, dst = tmp_path / "s", tmp_path / "d"
    src.mkdir()
    dst.mkdir()
    new = random.Random(11).randbytes(100 << 20)
    (src / "f.bin").write_bytes(new)
    (dst / "f.bin").write_bytes(random.Random(12).randbytes(100 << 20))
    calls = []
    real = Sender.sub_chunks

    def counting(self: Sender, *args: object, **kw: object) -> dict[str, object]:
        calls.append(1)
        return real(self, *args, **kw)

    monkeypatch.setattr(Sender, "sub_chunks", counting)
    stats = tb5sync.sync(str(src) + "/", str(dst))
    assert (dst / "f.bin").read_bytes() == new
    assert stats.bytes_matched == 0
    groups = (100 << 20) // (8 << 20)
    assert 3 <= len(calls) < groups, (len(calls), groups)


def test_basis_index_starts_over_past_its_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(refine, "MAX_ENTRIES", 10)
    data = random.Random(13).randbytes(2 << 20)
    (tmp_path / "b").write_bytes(data)
    fd = os.open(tmp_path / "b", os.O_RDONLY)
    try:
        index = refine.BasisIndex(fd, len(data))
        index.add_window(0, 1 << 20)
        first = refine.sub_chunk_list(data[:100_000])[0]
        assert index.find(*first) == 0
        index.add_window(1 << 20, 2 << 20)  # over the bound: the first window is dropped
        assert index.find(*first) is None
        later = refine.sub_chunk_list(data[1 << 20 :])[0]
        assert index.find(*later) == 1 << 20
    finally:
        os.close(fd)
