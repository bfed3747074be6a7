"""File hashing reads with pread into pooled buffers: digests checked independently, truncation is an error, not a signal.

Expected digests come from the ``blake3`` package called here over the same byte ranges
(not from tb5sync's own helpers); the truncation tests come from the issue: a file truncated
while it is hashed used to raise SIGBUS through ``mmap`` and kill the process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import blake3
import pytest

import tb5sync.engine.hashing as hashing
import tb5sync.engine.chunking as chunking
from tb5sync.errors import SourceChangedError
from tb5sync.roles.sender import Sender
from tb5sync.tree.state import TreeState

MiB = 1024 * 1024


def _data(n: int, seed: int = 7) -> bytes:
    import random

    return random.Random(seed).randbytes(n)


def _expected(data: bytes, params: chunking.ChunkParams) -> list[tuple[bytes, int]]:
    """Chunk digests computed here: the blake3 package over each range between cut points of the whole buffer."""
    out = []
    prev = 0
    for cut in chunking.py_cut_points(data, params, True):
        out.append((blake3.blake3(data[prev:cut]).digest(), cut - prev))
        prev = cut
    return out


@pytest.fixture(params=["preadv", "pread-copy"])
def reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each way of reading into a buffer: preadv where the system has it, and the portable pread + copy."""
    if request.param == "pread-copy":
        monkeypatch.setenv("TB5SYNC_PORTABLE", "1")  # tb5sync._os.io.read_into: pread and a copy
    elif not hasattr(os, "preadv"):
        pytest.skip("no preadv here (the portable path is tested)")
    return str(request.param)


@pytest.mark.parametrize("size", [0, 1, 1000, 3 * MiB + 17, 9 * MiB + 5])
def test_chunk_fd_matches_blake3_over_the_same_ranges(tmp_path: Path, reader: str, size: int) -> None:
    data = _data(size)
    p = tmp_path / "f"
    p.write_bytes(data)
    params = chunking.DEFAULT_PARAMS
    fd = os.open(p, os.O_RDONLY)
    try:
        got = hashing.chunk_fd(fd, size, params)
        windows = list(hashing.iter_chunk_fd(fd, size, params, window=params.max_size))
    finally:
        os.close(fd)
    want = _expected(data, params)
    assert got == want
    assert [r for w in windows for r in w] == want  # small windows: the same cuts and digests
    # a file's digest: BLAKE3 over the concatenated chunk digests
    assert hashing.file_digest(d for d, _ in got) == blake3.blake3(b"".join(d for d, _ in want)).digest()


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_windows_fit_the_chunk_threads_and_give_the_same_chunks(tmp_path: Path, threads: int) -> None:
    """Windows are 16 MiB, or 2 x 4 MiB (the largest chunk) per chunk thread when more threads cut
    each window (so 4 threads still get 4 segments); the chunks are the blake3 package's over the
    whole buffer's cut points whatever the window."""
    data = _data(40 * MiB + 123, seed=11)
    p = tmp_path / "f"
    p.write_bytes(data)
    params = chunking.DEFAULT_PARAMS
    if "40M" not in _EXPECTED:  # the pure-Python cut of 40 MiB takes seconds: once for the three cases
        _EXPECTED["40M"] = _expected(data, params)
    hashing.set_chunk_threads(threads)
    try:
        assert hashing.default_window(params) == max(16 * MiB, 8 * MiB * threads if threads > 1 else 0)
        fd = os.open(p, os.O_RDONLY)
        try:
            got = [r for w in hashing.iter_chunk_fd(fd, len(data), params) for r in w]
        finally:
            os.close(fd)
    finally:
        hashing.set_chunk_threads(0)
    assert got == _EXPECTED["40M"]


_EXPECTED: dict[str, list[tuple[bytes, int]]] = {}


def test_chunk_fd_of_a_range_from_a_cut(tmp_path: Path, small_chunk_params: chunking.ChunkParams) -> None:
    data = _data(200_000, seed=3)
    p = tmp_path / "f"
    p.write_bytes(data)
    want = _expected(data, small_chunk_params)
    start = sum(n for _, n in want[:40])
    fd = os.open(p, os.O_RDONLY)
    try:
        got = [r for w in hashing.iter_chunk_fd(fd, len(data), small_chunk_params, start, window=4096) for r in w]
    finally:
        os.close(fd)
    assert got == want[40:]


def test_file_shorter_than_asked_is_source_changed(tmp_path: Path, reader: str) -> None:
    p = tmp_path / "f"
    p.write_bytes(_data(5 * MiB))
    fd = os.open(p, os.O_RDONLY)
    try:
        with pytest.raises(SourceChangedError, match="big.bin"):
            hashing.chunk_fd(fd, 40 * MiB, where="big.bin")
        with pytest.raises(SourceChangedError):
            hashing.chunk_fd(fd, 6 * MiB)
    finally:
        os.close(fd)


def test_truncated_between_windows(tmp_path: Path, small_chunk_params: chunking.ChunkParams) -> None:
    """Truncated after the first window was read: an error at the next read, deterministically."""
    data = _data(100_000, seed=5)
    p = tmp_path / "f"
    p.write_bytes(data)
    fd = os.open(p, os.O_RDONLY)
    try:
        it = hashing.iter_chunk_fd(fd, len(data), small_chunk_params, window=8192)
        next(it)  # first window read (and the second), the first one's chunks returned
        os.truncate(p, 10_000)
        with pytest.raises(SourceChangedError):
            for _ in it:
                pass
    finally:
        os.close(fd)


def test_abandoned_iteration_gives_its_buffers_back(tmp_path: Path) -> None:
    data = _data(70 * MiB, seed=9)
    p = tmp_path / "f"
    p.write_bytes(data)
    fd = os.open(p, os.O_RDONLY)
    try:
        it = hashing.iter_chunk_fd(fd, len(data))
        first = next(it)
        it.close()
        assert sum(n for _, n in first) > 0
        again = hashing.chunk_fd(fd, len(data))  # the pooled buffers are reusable
    finally:
        os.close(fd)
    assert again == _expected(data, chunking.DEFAULT_PARAMS)


_TRUNCATE_RACE = textwrap.dedent(
    """
    import os, sys, threading, time
    import tb5sync.engine.hashing as hashing
    from tb5sync.errors import SourceChangedError
    path = sys.argv[1]
    size = 48 * 1024 * 1024
    block = os.urandom(1024 * 1024)
    stop = threading.Event()
    def truncator():
        while not stop.is_set():
            with open(path, "r+b") as f:
                f.truncate(0)
                for _ in range(48):
                    f.write(block)
    with open(path, "wb") as f:
        for _ in range(48):
            f.write(block)
    t = threading.Thread(target=truncator)
    t.start()
    outcomes = {"ok": 0, "changed": 0}
    deadline = time.monotonic() + 3
    try:
        while time.monotonic() < deadline:
            fd = os.open(path, os.O_RDONLY)
            try:
                hashing.chunk_fd(fd, size, where=path)
                outcomes["ok"] += 1
            except SourceChangedError:
                outcomes["changed"] += 1
            finally:
                os.close(fd)
    finally:
        stop.set()
        t.join(30)
    assert not t.is_alive()
    print(outcomes)
    """
)


def test_truncation_while_hashing_never_kills_the_process(tmp_path: Path) -> None:
    """The issue's fault, in a child process: hashing while another thread truncates and rewrites the file."""
    proc = subprocess.run(
        [sys.executable, "-c", _TRUNCATE_RACE, str(tmp_path / "racy.bin")], capture_output=True, text=True, timeout=90
    )
    assert proc.returncode == 0, f"exit {proc.returncode} (a negative one is a signal): {proc.stderr[-2000:]}"
    assert "changed" in proc.stdout


def test_chunk_list_piece_of_a_replaced_file_is_source_changed(tmp_path: Path) -> None:
    """A piece asked from an offset that is no cut of the file now there: the file was replaced (exit 24, not 2)."""
    src = tmp_path / "src"
    src.mkdir()
    f = src / "big.bin"
    f.write_bytes(_data(12 * MiB, seed=1))
    state = TreeState(str(src))
    sender = Sender(str(src), state=state)
    try:
        first = sender.chunk_list("big.bin", start=0, limit=4 * MiB)
        end = first["end"]
        f.write_bytes(_data(12 * MiB, seed=2))  # replaced: same size, new mtime
        sender.chunk_list("big.bin")  # cached for the new version
        with pytest.raises(SourceChangedError):
            sender.chunk_list("big.bin", start=end + 1, limit=4 * MiB)
        f.write_bytes(_data(1000, seed=3))
        with pytest.raises(SourceChangedError):
            sender.chunk_list("big.bin", start=end, limit=4 * MiB)
        assert SourceChangedError("x").exit_code == 24
    finally:
        sender.close()
        state.close()


_CHECKSUM_TOUCH_RACE = textwrap.dedent(
    """
    import os, sys, threading, time
    from tb5sync.daemon.server import Server
    from tb5sync.fs.filesystem import TB5FileSystem
    from tb5sync.errors import Tb5syncError
    root = sys.argv[1]
    os.makedirs(root, exist_ok=True)
    srv = Server(root, host="127.0.0.1", port=0).start()
    try:
        fs = TB5FileSystem(host="127.0.0.1", port=srv.port, skip_instance_cache=True)
        block = os.urandom(1024 * 1024)
        path = os.path.join(root, "f.bin")
        stop = threading.Event()
        def refill():
            while not stop.is_set():
                with open(path, "ab") as f:
                    for _ in range(40):
                        f.write(block)
                fs.touch("f.bin")  # truncates in place, on the server
        with open(path, "wb") as f:
            for _ in range(40):
                f.write(block)
        t = threading.Thread(target=refill)
        t.start()
        outcomes = {"ok": 0, "error": 0}
        deadline = time.monotonic() + 3
        try:
            while time.monotonic() < deadline:
                try:
                    fs.checksum("f.bin")
                    outcomes["ok"] += 1
                except (Tb5syncError, OSError):
                    outcomes["error"] += 1
        finally:
            stop.set()
            t.join(30)
        assert not t.is_alive()
        assert fs.info("f.bin")["type"] == "file"  # the server still answers
        print(outcomes)
    finally:
        srv.stop()
    """
)


def test_fs_checksum_racing_touch_never_kills_the_server(tmp_path: Path) -> None:
    """The issue's fs.checksum vs fs.touch race, in a child process running the server and the client."""
    proc = subprocess.run(
        [sys.executable, "-c", _CHECKSUM_TOUCH_RACE, str(tmp_path / "root")], capture_output=True, text=True, timeout=90
    )
    assert proc.returncode == 0, f"exit {proc.returncode} (a negative one is a signal): {proc.stderr[-2000:]}"
    assert "'ok'" in proc.stdout


def test_sender_replies_carry_blake3_digests_of_the_bytes(tmp_path: Path) -> None:
    """What the sender says about a file (read_files chunks, chunk_list, file_digests) matches blake3 over the file's bytes."""
    src = tmp_path / "src"
    src.mkdir()
    small, big = _data(300_000, seed=11), _data(6 * MiB + 3, seed=12)
    (src / "small").write_bytes(small)
    (src / "big").write_bytes(big)
    sender = Sender(str(src))
    try:
        meta, _parts = sender.read_files(["small"])
        size, _mtime, _mode, chunks, _wirelen, _codec = meta["files"][0]
        assert size == len(small)
        assert [(bytes(d), n) for d, n in chunks] == _expected(small, chunking.DEFAULT_PARAMS)
        listed = sender.chunk_list("big")
        refs = [(bytes(d), n) for d, n in listed["chunks"]]
        assert refs == _expected(big, chunking.DEFAULT_PARAMS)
        want_file = blake3.blake3(b"".join(d for d, _ in refs)).digest()
        assert bytes(listed["digest"]) == want_file
        assert [bytes(d) for d in sender.file_digests(["big"])["digests"]] == [want_file]
    finally:
        sender.close()


def test_pull_of_a_file_being_truncated_is_source_changed_or_whole(tmp_path: Path) -> None:
    """Pulls while the server's file is truncated and rewritten in place: each ends with a state the file had, or SourceChangedError (exit 24)."""
    import threading
    import time

    import tb5sync
    from conftest import start_server

    live = start_server(str(tmp_path / "root"))
    path = os.path.join(live.root, "big.bin")
    versions = [_data(8 * MiB, seed=s) for s in (21, 22)]
    with open(path, "wb") as f:
        f.write(versions[0])
    stop = threading.Event()

    def rewrite() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            with open(path, "r+b") as f:
                f.truncate(0)
                f.write(versions[i % 2])
            time.sleep(0.01)

    t = threading.Thread(target=rewrite, daemon=True)
    t.start()
    outcomes = {"whole": 0, "changed": 0}
    try:
        deadline = time.monotonic() + 3
        k = 0
        while time.monotonic() < deadline:
            k += 1
            out = str(tmp_path / f"out{k}")
            try:
                tb5sync.sync(live.url("big.bin"), out, streams=2)
            except SourceChangedError as exc:
                assert exc.exit_code == 24
                outcomes["changed"] += 1
                continue
            with open(out, "rb") as f:
                got = f.read()
            # a state the file really had (empty after the truncation, a version being written,
            # a whole version), never a mix of the two versions
            assert any(v.startswith(got) for v in versions), f"a pull reported success with a mix ({len(got)} bytes)"
            outcomes["whole"] += 1
    finally:
        stop.set()
        t.join(30)
        assert not t.is_alive()
        try:
            assert tb5sync.sync(live.url("big.bin"), str(tmp_path / "after")).files_transferred == 1  # still serving
        finally:
            live.server.stop()
    assert sum(outcomes.values()) > 0


def test_known_chunks_answers_as_find_chunk_does_in_one_query_per_batch(tmp_path: Path) -> None:
    """``TreeState.known_chunks`` (asked once per chunk-list piece by a large-file job) is the set of
    digests ``find_chunk`` finds a place for, across its 500-digest batches and with duplicates."""
    from tb5sync.tree.state import TreeState

    state = TreeState(str(tmp_path))
    try:
        have = [bytes([i % 256, i // 256]) * 16 for i in range(700)]
        state.record("a", 700, 1, 1, [(d, 1) for d in have[:400]])
        state.record("b", 300, 1, 2, [(d, 1) for d in have[400:]])
        asked = have[::3] + [b"\xff" * 32, b"\xfe" * 32] + have[:5]
        got = state.known_chunks(asked)
        assert got == {d for d in asked if state.find_chunk(d)}
        assert got == set(have[::3]) | set(have[:5])
        assert state.known_chunks([]) == set()
    finally:
        state.close()
