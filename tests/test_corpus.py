"""Real inputs: the corpus built by ``scripts/make_corpus.sh`` (``make corpus``), through a live server.

Set ``TB5SYNC_CORPUS`` to the corpus directory (``make corpus`` builds ``.corpus``; ``TB5SYNC_CORPUS=$PWD/.corpus``); without
it every test here is skipped. For each part present (``models``, ``site-packages``,
``build``, ``ccache``):

1. push it to a server, pull the server copy back to a local directory;
2. the server copy and the pulled copy equal the source (content, modes, mtimes, symlinks),
   compared with :func:`tree_digest` (streaming BLAKE3, never a whole tree in memory);
3. a second push sends nothing (no chunk, no file);

and for ``models``: overwrite 4 KiB in the middle of the largest model file (in the pulled
copy, so the corpus itself is never written) and push that copy onto the server copy: only a
few chunks and a small fraction of the file cross the wire.

The push and pull of each part happen once per module (:func:`round_trip`) and are
shared by the tests of that part.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import blake3
import pytest
from conftest import LiveServer, start_server

import tb5sync
from tb5sync.fs.filesystem import TB5FileSystem

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CORPUS_ENV = "TB5SYNC_CORPUS"
PARTS = ("models", "site-packages", "build", "ccache")
#: Files at least this big are hashed by blake3 itself from a memory map, multi-threaded.
_MMAP_FROM = 8 * 1024 * 1024
_READ = 1024 * 1024

Digest = dict[str, tuple[Any, ...]]


# ---- helpers -----------------------------------------------------------------------------------


def _file_hash(path: str, size: int) -> str:
    """BLAKE3 hex digest of a regular file, streamed (never the whole file in one bytes object)."""
    if size >= _MMAP_FROM:
        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
        h.update_mmap(path)
        return h.hexdigest()
    h = blake3.blake3()
    buf = bytearray(min(size, _READ) or 1)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def tree_digest(base: str) -> Digest:
    """Relative path -> ``(kind, mode, size, mtime_ns, blake3 hexdigest or link target)``.

    Symlinks are not followed; ``.tb5sync`` state directories are left out; the base
    itself is ``"."``. Directory sizes are reported as 0 (they depend on the filesystem's
    history, not on what was synced). File contents are hashed on a small thread pool.
    """
    out: Digest = {}
    files: list[tuple[str, str, os.stat_result]] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d != ".tb5sync")
        names = [*dirnames, *filenames]
        if dirpath == base:
            names.insert(0, ".")
        for name in names:
            full = os.path.normpath(os.path.join(dirpath, name))
            rel = os.path.relpath(full, base)
            st = os.lstat(full)
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("l", mode, st.st_size, st.st_mtime_ns, os.readlink(full))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("d", mode, 0, st.st_mtime_ns, "")
            elif stat.S_ISREG(st.st_mode):
                files.append((rel, full, st))
            else:
                out[rel] = ("?", mode, 0, st.st_mtime_ns, "")
    with ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
        hashes = pool.map(lambda t: _file_hash(t[1], t[2].st_size), files)
        for (rel, _full, st), hx in zip(files, hashes):
            out[rel] = ("f", stat.S_IMODE(st.st_mode), st.st_size, st.st_mtime_ns, hx)
    return out


def assert_same_tree(expected: Digest, got: Digest, what: str) -> None:
    """Equal digests, or a short report of the first differing paths."""
    if expected == got:
        return
    diff = [p for p in sorted(set(expected) | set(got)) if expected.get(p) != got.get(p)]
    lines = [f"  {p!r}: expected={expected.get(p)} got={got.get(p)}" for p in diff[:20]]
    raise AssertionError(f"{what}: {len(diff)} paths differ from the source:\n" + "\n".join(lines))


@dataclass
class RoundTrip:
    """One part pushed to the server and pulled back."""

    part: str
    src: str
    server_copy: str
    pulled: str
    src_digest: Digest
    server_digest: Digest
    pulled_digest: Digest
    push: tb5sync.SyncStats
    pull: tb5sync.SyncStats


# ---- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus_dir() -> str:
    path = os.environ.get(CORPUS_ENV)
    if not path:
        pytest.skip(f"{CORPUS_ENV} is not set (run `make corpus`: `make test` then uses .corpus; or set {CORPUS_ENV}=DIR)")
    if not os.path.isdir(path):
        pytest.fail(f"{CORPUS_ENV}={path} is not a directory")
    return path


@pytest.fixture(scope="module")
def corpus_server(corpus_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    live = start_server(str(tmp_path_factory.mktemp("corpus") / "server"))
    try:
        yield live
    finally:
        live.server.stop()


@pytest.fixture(scope="module")
def round_trip(corpus_dir: str, corpus_server: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``round_trip(part) -> RoundTrip``: push the part, pull it back, digest all three (once per part)."""
    done: dict[str, RoundTrip] = {}

    def get(part: str) -> RoundTrip:
        if part in done:
            return done[part]
        src = os.path.join(corpus_dir, part)
        if not os.path.isdir(src):
            pytest.skip(f"corpus part {part!r} is not in {corpus_dir}")
        t = time.perf_counter()
        src_digest = tree_digest(src)
        t_digest = time.perf_counter() - t
        push = tb5sync.sync(src + "/", corpus_server.url(part))
        server_copy = os.path.join(corpus_server.root, part)
        pulled = str(tmp_path_factory.mktemp("pulled") / part)
        pull = tb5sync.sync(corpus_server.url(part + "/"), pulled)
        rt = RoundTrip(part, src, server_copy, pulled, src_digest, tree_digest(server_copy), tree_digest(pulled), push, pull)
        print(f"\n[{part}] {push.files_total} files, {push.bytes_total / 2**20:.0f} MiB; digest {t_digest:.1f} s, "
              f"push {push.seconds:.1f} s ({push.bytes_total / max(push.seconds, 1e-9) / 1e6:.0f} MB/s), "
              f"pull {pull.seconds:.1f} s ({pull.bytes_total / max(pull.seconds, 1e-9) / 1e6:.0f} MB/s)")
        done[part] = rt
        return rt

    return get


# ---- tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("part", PARTS)
def test_push_and_pull_back_identical(round_trip: Any, part: str) -> None:
    rt = round_trip(part)
    assert len(rt.src_digest) > 1, f"corpus part {part} is empty"
    assert rt.push.files_transferred == rt.push.files_total == sum(1 for v in rt.src_digest.values() if v[0] == "f")
    assert rt.push.bytes_transferred == rt.push.bytes_total
    assert rt.pull.files_transferred == rt.pull.files_total == rt.push.files_total
    assert rt.push.wire_bytes > 0 and rt.pull.wire_bytes > 0
    assert_same_tree(rt.src_digest, rt.server_digest, f"{part} on the server")
    assert_same_tree(rt.src_digest, rt.pulled_digest, f"{part} pulled back")


@pytest.mark.parametrize("part", PARTS)
def test_second_push_sends_nothing(round_trip: Any, corpus_server: LiveServer, part: str) -> None:
    rt = round_trip(part)
    again = tb5sync.sync(rt.src + "/", corpus_server.url(part))
    assert again.files_total == rt.push.files_total
    assert again.files_transferred == 0, again
    assert again.chunks_sent == 0, again
    assert again.bytes_transferred == 0, again
    # only the manifest and a few control frames: far below one byte per source byte
    assert again.wire_bytes < max(1 << 20, rt.push.bytes_total // 100), again
    assert_same_tree(rt.src_digest, tree_digest(rt.server_copy), f"{part} on the server after a no-op push")


def test_model_delta_push(round_trip: Any, corpus_server: LiveServer) -> None:
    """Overwrite 4 KiB in the middle of the largest model file and re-push: a delta, not the file."""
    rt = round_trip("models")
    files = [(v[2], p) for p, v in rt.pulled_digest.items() if v[0] == "f"]
    size, rel = max(files)
    assert size > 16 * 1024 * 1024, f"largest model file {rel} is only {size} bytes"
    victim = os.path.join(rt.pulled, rel)  # a copy of the corpus file, never the corpus itself
    mid = size // 2
    with open(victim, "r+b") as f:
        f.seek(mid)
        old = f.read(4096)
        f.seek(mid)
        f.write(bytes(b ^ 0xA5 for b in old))
    st = os.stat(victim)
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    expected = tree_digest(rt.pulled)
    assert expected[rel] != rt.src_digest[rel]
    stats = tb5sync.sync(rt.pulled + "/", corpus_server.url("models"))
    print(f"\n[models delta] {rel}: {size / 2**20:.0f} MiB, chunks_sent={stats.chunks_sent}, "
          f"chunks_reused={stats.chunks_reused}, wire_bytes={stats.wire_bytes}, {stats.seconds:.2f} s")
    assert stats.files_transferred == 1, stats
    assert 1 <= stats.chunks_sent <= 3, stats
    assert stats.chunks_reused > 10, stats
    assert stats.wire_bytes < size // 16, stats
    assert_same_tree(expected, tree_digest(rt.server_copy), "models on the server after the delta push")


def test_fsspec_reads_real_model_files(round_trip: Any, corpus_server: LiveServer) -> None:
    """Through tb5://: each safetensors header by a ranged read (not the tensors), the GGUF whole and byte-exact."""
    round_trip("models")  # the server holds the models now
    fs = TB5FileSystem(host="127.0.0.1", port=corpus_server.port, skip_instance_cache=True)
    try:
        names = fs.glob("models/**/*.safetensors")
        assert names, "the models corpus has a safetensors file"
        for name in names:  # compared with the server's own copy (other tests here edit it)
            with open(os.path.join(corpus_server.root, name), "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                want = json.loads(f.read(n))
            fs.info(name)
            link = fs._holder.link
            before = link.requester.wire_bytes + link.direct.bytes_received
            with fs.open(name, "rb", cache_type="none") as f:
                (got_n,) = struct.unpack("<Q", f.read(8))
                got = json.loads(f.read(got_n))
            assert got == want
            wire = link.requester.wire_bytes + link.direct.bytes_received - before
            assert wire < n + 64 * 1024 < fs.size(name) // 10, (wire, n, fs.size(name))
        for name in fs.glob("models/**/*.gguf"):
            assert fs.cat_file(name, 0, 4) == b"GGUF"
            h = blake3.blake3()
            with fs.open(name, "rb") as f:
                while block := f.read(8 * 1024 * 1024):
                    h.update(block)
            on_server = os.path.join(corpus_server.root, name)
            assert h.hexdigest() == _file_hash(on_server, os.path.getsize(on_server))
    finally:
        fs._holder.close()
