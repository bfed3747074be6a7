"""The sender's small-file reader: the Cython batch reader (ext/_read.pyx) and the per-file Python
path answer ``read_files`` alike (same files, sizes, mtimes, modes, chunk lists, bytes and
failures), read nothing through a symlink, keep ``read_files``' size limit and reuse their buffers;
and the small-file writer's threads (``TB5SYNC_WRITE_THREADS``) give the same trees as rsync -a."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any

import blake3
import pytest
from conftest import local_agrees_with_rsync, tmp_files

import tb5sync.roles.destination as destination_mod
import tb5sync.roles.sender as sender_mod
from tb5sync.roles.destination import Destination
from tb5sync.errors import UsageError
from tb5sync.tree.options import SyncOptions
from tb5sync.roles.sender import Sender

MiB = 1024 * 1024
T0 = 1_700_000_000_123_456_789


def write(path: Path, data: bytes, mtime_ns: int = T0, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.chmod(path, mode)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def _tree(src: Path, outside: Path) -> list[str]:
    """Regular files of many sizes and modes in several directories, and every kind of path the
    reader must not read as a regular file; returns the paths to ask for, in a sender's order."""
    sizes = [0, 1, 100, 4095, 4096, 65_536, 300_000, 3 * MiB + 5]
    modes = [0o644, 0o600, 0o755, 0o444, 0o4755]
    paths = []
    for i, n in enumerate(sizes * 3):
        rel = f"d{i % 4}/f{i}"
        write(src / rel, os.urandom(n) if i % 2 else (b"text %d\n" % i) * (n // 7 + 1), T0 + i * 1_000_003, modes[i % len(modes)])
        paths.append(rel)
    write(src / ".hidden", b"dot file")
    write(Path(os.fsdecode(os.path.join(os.fsencode(src), b"latin-\xe9"))), b"not utf-8")
    write(outside / "secret", b"outside the source")
    os.symlink(outside / "secret", src / "link")  # a symlink: not followed
    os.symlink(outside, src / "dirlink")  # a directory on the way that is a symlink
    os.mkfifo(src / "fifo")
    (src / "subdir").mkdir()
    (src / ".tb5sync").mkdir()
    write(src / ".tb5sync" / "state", b"never served")
    return paths + [".hidden", os.fsdecode(b"latin-\xe9"), "link", "dirlink/secret", "fifo", "subdir", "missing",
                    "d0/missing", ".tb5sync/state", ".f.0123abcd.tb5tmp", "d1/../d0/f0", "/etc/hostname"]


def _answer(sender: Sender, paths: list[str]) -> tuple[dict[str, Any], list[bytes]]:
    meta, parts = sender.read_files(paths)
    return meta, [bytes(p) for p in parts]


def test_reader_answers_as_the_python_path_and_as_the_files_are(tmp_path: Path, read_impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    src, outside = tmp_path / "src", tmp_path / "outside"
    paths = _tree(src, outside)
    sender = Sender(str(src), SyncOptions(compress="none"))
    slow: list[str] = []
    read_one = sender._read_one
    monkeypatch.setattr(sender, "_read_one", lambda path, **kw: slow.append(path) or read_one(path, **kw))
    try:
        meta, parts = _answer(sender, paths)
    finally:
        sender.close()
    plain = [p for p in paths if p.startswith("d") and "/f" in p and ".." not in p]
    # the Cython reader reads every plain file itself; the Python path is asked only for the rest
    assert set(plain) & set(slow) == (set() if read_impl == "cython" else set(plain))
    # what each path must give, from the files themselves (lstat, not followed)
    files, pi = meta["files"], 0
    assert len(files) == len(paths)
    for path, info in zip(paths, files):
        full = os.path.join(src, path)
        regular = not path.startswith((".tb5sync", "/")) and ".." not in path and "dirlink" not in path \
            and os.path.lexists(full) and stat.S_ISREG(os.lstat(full).st_mode)
        if not regular:
            assert info is None, path
            continue
        st = os.lstat(full)
        data = Path(full).read_bytes()
        size, mtime_ns, mode, chunks, wirelen, codec = info
        assert (size, mtime_ns, mode, wirelen, codec) == (st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode), len(data), 0), path
        assert parts[pi] == data, path
        off = 0
        for d, n in chunks:
            assert bytes(d) == blake3.blake3(data[off : off + n]).digest()
            off += n
        assert off == len(data)
        pi += 1
    assert pi == len(parts)
    # a directory on the way that is a symlink is named as a failure, whichever reader ran
    failed = dict(meta.get("failed", []))
    assert paths.index("dirlink/secret") in failed


def test_both_readers_give_the_same_reply(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Cython reader (when built) and the Python path, on the same tree with lz4 on: byte for byte."""
    if sender_mod._cy_read_files is None:
        pytest.skip("tb5sync._read is not built (or TB5SYNC_PUREPYTHON=1)")
    src, outside = tmp_path / "src", tmp_path / "outside"
    paths = _tree(src, outside)
    sender = Sender(str(src), SyncOptions(compress="lz4"))
    try:
        fast = _answer(sender, paths)
        monkeypatch.setattr(sender_mod, "_cy_read_files", None)
        slow = _answer(sender, paths)
    finally:
        sender.close()
    assert fast == slow


def test_batches_larger_than_a_buffer_and_files_larger_than_one(tmp_path: Path, read_impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With 64 KiB buffers: a batch goes on in further buffers, a file larger than a buffer is read
    by the Python path, and every file comes back whole and in order."""
    monkeypatch.setattr(sender_mod, "READ_BUFFER", 64 * 1024)
    src = tmp_path / "src"
    sizes = [10_000, 50_000, 30_000, 200_000, 0, 65_535, 65_536, 1, 40_000]
    for i, n in enumerate(sizes):
        write(src / f"f{i}", os.urandom(n))
    sender = Sender(str(src), SyncOptions(compress="none"))
    try:
        meta, parts = _answer(sender, [f"f{i}" for i in range(len(sizes))])
    finally:
        sender.close()
    assert [f[0] for f in meta["files"]] == sizes
    assert parts == [(src / f"f{i}").read_bytes() for i in range(len(sizes))]


def test_many_directories_in_one_batch(tmp_path: Path, read_impl: str) -> None:
    """More directories than one call holds descriptors of (and than the jail caches): all read."""
    src = tmp_path / "src"
    n = sender_mod._READ_DIRS + 70
    for i in range(n):
        write(src / f"d{i}" / "f", b"%d" % i)
    sender = Sender(str(src))
    try:
        meta, parts = _answer(sender, [f"d{i}/f" for i in range(n)])
    finally:
        sender.close()
    assert parts == [b"%d" % i for i in range(n)]
    assert all(f is not None for f in meta["files"])


def test_a_file_that_changes_while_read_is_read_again(tmp_path: Path, read_impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file the batch reader found changed (or could not open) is read again by the Python path."""
    src = tmp_path / "src"
    for i in range(4):
        write(src / f"f{i}", b"x" * (i + 1))
    real = sender_mod._cy_read_files
    if real is not None:
        from tb5sync import _read

        def flaky(files: list[tuple[int, bytes]], buf: Any, start: int = 0) -> tuple[list[Any], int]:
            results, used = real(files, buf, start)
            return [_read.CHANGED if i == 1 else errno.EIO if i == 2 else r for i, r in enumerate(results)], used

        monkeypatch.setattr(sender_mod, "_cy_read_files", flaky)
    sender = Sender(str(src))
    try:
        meta, parts = _answer(sender, [f"f{i}" for i in range(4)])
    finally:
        sender.close()
    assert parts == [b"x" * (i + 1) for i in range(4)]
    assert [f[0] for f in meta["files"]] == [1, 2, 3, 4]


def test_read_files_keeps_its_size_limit(tmp_path: Path, read_impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """More than the limit in one request is refused (UsageError), whichever reader runs."""
    monkeypatch.setattr(sender_mod, "MAX_READ", 1 * MiB)
    monkeypatch.setattr(sender_mod, "READ_BUFFER", 1 * MiB)
    src = tmp_path / "src"
    for i in range(8):
        write(src / f"f{i}", os.urandom(MiB - 10))
    sender = Sender(str(src))
    try:
        with pytest.raises(UsageError, match="read_files of more than"):
            sender.read_files([f"f{i}" for i in range(8)])
    finally:
        sender.close()


def test_reader_buffers_are_reused(tmp_path: Path, read_impl: str) -> None:
    """Once a reply's parts are gone, the next batch reads into the same buffer (no new memory per batch)."""
    src = tmp_path / "src"
    for i in range(50):
        write(src / f"f{i}", os.urandom(20_000))
    sender = Sender(str(src))
    try:
        for _ in range(5):
            meta, parts = sender.read_files([f"f{i}" for i in range(50)])
            assert len(parts) == 50
            del meta, parts
        assert len(sender._read_bufs._bufs) <= (1 if read_impl == "cython" else 0)
    finally:
        sender.close()


# --- the small-file writer's threads ----------------------------------------------------------


@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_write_threads_give_rsyncs_tree(tmp_path: Path, threads: str, write_impl: str, monkeypatch: pytest.MonkeyPatch,
                                        need_rsync: None) -> None:
    """Batches over many directories (and one large directory) written by 1, 2 or 3 threads: the
    same tree as rsync -a, no temporary name left, and a second run sends nothing."""
    monkeypatch.setenv("TB5SYNC_WRITE_THREADS", threads)
    src = tmp_path / "src"
    for i in range(600):
        d = "big" if i % 3 == 0 else f"d{i % 23}"
        write(src / d / f"f{i}", os.urandom(i * 37 % 5000), T0 + i * 999_999_937, [0o644, 0o600, 0o755][i % 3])
    for k, d in enumerate(sorted(p for p in src.iterdir() if p.is_dir())):
        os.utime(d, ns=(T0 - k * 10**9, T0 - k * 10**9))
    local_agrees_with_rsync(str(src), str(tmp_path), f"sync ({write_impl} writer, {threads} threads)")
    assert tmp_files(str(tmp_path / "mine")) == []


def test_write_split_keeps_the_order_of_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The results of a split batch come back in the batch's order, errors included."""
    if destination_mod._cy_write_files is None:
        pytest.skip("tb5sync._write is not built (or TB5SYNC_PUREPYTHON=1)")
    monkeypatch.setenv("TB5SYNC_WRITE_THREADS", "3")
    os.makedirs(tmp_path / "dst")
    dest = Destination(str(tmp_path / "dst"))
    try:
        for d in range(7):
            dest.mkdir(f"d{d}", 0o755)
        files = [(f"d{i % 7}/f{i}", b"%d" % i * (i + 1), 0o644, T0 + i) for i in range(300)]
        out = dest.write_files(files)
    finally:
        dest.close()
    assert [o[0] for o in out] == [len(f[1]) for f in files]
    assert [o[1] for o in out] == [f[3] for f in files]
    for rel, data, _mode, _mt in files:
        assert (tmp_path / "dst" / rel).read_bytes() == data


def test_write_split_hands_out_whole_directories_to_whichever_thread_is_free(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A split batch goes out in units of whole directories: no directory is in two calls of the
    writer, and a thread held up on its first unit does not keep the rest of the batch waiting
    for it (the other thread takes the remaining units)."""
    if destination_mod._cy_write_files is None:
        pytest.skip("tb5sync._write is not built (or TB5SYNC_PUREPYTHON=1)")
    import threading
    import time

    monkeypatch.setenv("TB5SYNC_WRITE_THREADS", "2")
    cy_write = destination_mod._cy_write_files
    calls: list[tuple[str, set[int]]] = []
    first = threading.Event()

    def recorded(files: list[Any], fsync: bool = False, tmpfile: bool = False) -> list[Any]:
        calls.append((threading.current_thread().name, {f[0] for f in files}))
        if not first.is_set():
            first.set()
            time.sleep(0.5)  # this thread's directories are slow
        return cy_write(files, fsync, tmpfile)

    monkeypatch.setattr(destination_mod, "_cy_write_files", recorded)
    os.makedirs(tmp_path / "dst")
    dest = Destination(str(tmp_path / "dst"))
    try:
        for d in range(40):
            dest.mkdir(f"d{d}", 0o755)
        files = [(f"d{i % 40}/f{i}", b"%d" % i, 0o644, T0 + i) for i in range(400)]
        out = dest.write_files(files)
    finally:
        dest.close()
    assert [o[0] for o in out] == [len(f[1]) for f in files]
    for rel, data, _mode, _mt in files:
        assert (tmp_path / "dst" / rel).read_bytes() == data
    fds = [fd for _, got in calls for fd in got]
    assert len(fds) == len(set(fds)) == 40  # each directory's files in one call only
    slow = calls[0][0]
    assert len(calls) > 3 and sum(name == slow for name, _ in calls) == 1, calls


def test_write_threads_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ("0", "17", "two", "-1"):
        monkeypatch.setenv("TB5SYNC_WRITE_THREADS", bad)
        with pytest.raises(UsageError, match="TB5SYNC_WRITE_THREADS"):
            destination_mod.write_threads()
    monkeypatch.setenv("TB5SYNC_WRITE_THREADS", "4")
    assert destination_mod.write_threads() == 4
    monkeypatch.delenv("TB5SYNC_WRITE_THREADS")
    assert destination_mod.write_threads() == destination_mod.WRITE_THREADS



def test_temp_names_of_a_batch() -> None:
    """A batch's temporary names (tags from one random draw) are temporary names, distinct, and
    within NAME_MAX bytes for a name of 255 bytes."""
    from tb5sync._os.paths import NAME_MAX, is_temp_name, temp_name, temp_tags

    tags = temp_tags(1000)
    assert len(set(tags)) > 990 and all(len(t) == 8 and int(t, 16) >= 0 for t in tags)
    for name in ("f", "é" * 127 + "x", "n" * 255):
        t = temp_name(name, tags[0])
        assert is_temp_name(t) and tags[0] in t and len(t.encode()) <= NAME_MAX


def test_a_corrupted_small_file_stops_the_batch_and_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver checks a whole ``read_files`` batch's chunks in one call: a file whose bytes do
    not match its digest (changed in transit, here after the sender hashed them) is named in the
    IntegrityError, and no file of that batch is written."""
    import tb5sync
    from tb5sync.errors import IntegrityError

    src, dst = tmp_path / "src", tmp_path / "dst"
    for name in ("a", "b", "c"):
        write(src / name, name.encode() * 1000)
    real = Sender.read_files

    def corrupting(self: Sender, **kw: Any) -> tuple[dict[str, Any], list[Any]]:
        meta, parts = real(self, **kw)
        paths = kw["paths"]
        if "b" in paths:
            k = paths.index("b")  # every file is present, so parts line up with paths
            parts = list(parts)
            bad = bytearray(parts[k])
            bad[10] ^= 1
            parts[k] = bytes(bad)
        return meta, parts

    monkeypatch.setattr(Sender, "read_files", corrupting)
    with pytest.raises(IntegrityError, match=r"mismatch in b\b"):
        tb5sync.sync(str(src) + "/", str(dst))
    assert not (dst / "a").exists() and not (dst / "b").exists() and not (dst / "c").exists()
    assert tmp_files(str(dst)) == []


@pytest.mark.parametrize("size", [0, 1, 4095, 262143, 262144, 262145, 300_000])
def test_chunk_buffer_of_a_file_below_min_size_is_one_chunk_as_the_chunker_says(size: int) -> None:
    """``chunk_buffer`` skips the chunker for a buffer no larger than ``min_size`` (FastCDC cuts no
    chunk shorter): the same chunk list as the chunker's cut points give."""
    import tb5sync.engine.chunking as chunking
    import tb5sync.engine.hashing as hashing

    data = blake3.blake3(b"seed").digest(length=size)
    params = chunking.DEFAULT_PARAMS
    assert params.min_size == 262144
    cuts = chunking.cut_points(data, params, True)
    expected = []
    start = 0
    for end in cuts:
        expected.append((hashing.chunk_digest(data[start:end]), end - start))
        start = end
    assert hashing.chunk_buffer(data, params) == expected
