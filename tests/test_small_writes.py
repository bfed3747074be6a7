"""The small-file writer: the Cython batch writer (ext/_write.pyx) and the per-file Python path
give the same trees as ``rsync -a``, the same failures, and keep the same invariants (no temporary
name left, nothing written through a symlink, a failed file's old version kept)."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import resource
import signal
import stat
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import local_agrees_with_rsync, tmp_files

import tb5sync
import tb5sync.roles.destination as destination_mod
from tb5sync.roles.destination import Destination

MiB = 1024 * 1024
T0 = 1_700_000_000_123_456_789


def write(path: str, data: bytes, mtime_ns: int = T0, mode: int = 0o644) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def test_tree_matches_rsync(tmp_path: Path, write_impl: str, need_rsync: None) -> None:
    """Files in more directories than the destination keeps descriptors of (64), every kind of
    mode, nanosecond and pre-1970 mtimes, empty files, names that are not UTF-8 and names of
    255 bytes: the same tree as rsync -a, and a second run transfers nothing."""
    rng = random.Random(7)
    src = str(tmp_path / "src")
    modes = [0o644, 0o600, 0o755, 0o444, 0o640, 0o700]
    for i in range(400):
        d = f"d{i % 97:02d}/e{i % 3}"
        mt = T0 + rng.randrange(10**12) if i % 11 else -86_400 * 10**9 * 365 - rng.randrange(10**9)
        write(os.path.join(src, d, f"f{i}"), rng.randbytes(rng.choice([0, 1, 100, 4096, 70_000])), mt, modes[i % len(modes)])
    write(os.path.join(src, "n" * 255), b"long name")
    write(os.fsdecode(os.path.join(os.fsencode(src), b"latin-\xe9")), b"not utf-8")
    for k, (d, _dirs, _files) in enumerate(sorted(os.walk(src), reverse=True)):
        os.utime(d, ns=(T0 - k * 10**9, T0 - k * 10**9))  # seconds apart (rsync leaves a directory's time of the same second)
    local_agrees_with_rsync(src, str(tmp_path), f"sync ({write_impl} writer)")
    assert tmp_files(str(tmp_path / "mine")) == []


def test_symlink_at_the_final_name_is_replaced_not_followed(tmp_path: Path, write_impl: str) -> None:
    src, dst, outside = str(tmp_path / "src"), str(tmp_path / "dst"), str(tmp_path / "outside")
    write(os.path.join(src, "f"), b"new")
    write(os.path.join(outside, "target"), b"outside")
    os.makedirs(dst)
    os.symlink(os.path.join(outside, "target"), os.path.join(dst, "f"))
    tb5sync.sync(src + "/", dst)
    assert not os.path.islink(os.path.join(dst, "f"))
    with open(os.path.join(dst, "f"), "rb") as f:
        assert f.read() == b"new"
    with open(os.path.join(outside, "target"), "rb") as f:
        assert f.read() == b"outside"


def test_empty_directory_in_the_way_is_replaced(tmp_path: Path, write_impl: str, need_rsync: None) -> None:
    """An empty directory where the source has a file: replaced (rsync does the same); the
    Cython writer's rename fails and the Python path removes the directory once the file exists."""
    src = str(tmp_path / "src")
    write(os.path.join(src, "a", "x"), b"x")
    write(os.path.join(src, "a", "y"), b"y")
    os.utime(os.path.join(src, "a"), ns=(T0, T0))
    for side in ("ref", "mine"):
        os.makedirs(str(tmp_path / side / "a" / "x"))
    from conftest import assert_same, digest_snapshot, rsync

    rsync(src + "/", str(tmp_path / "ref"))
    tb5sync.sync(src + "/", str(tmp_path / "mine"))
    assert_same(digest_snapshot(str(tmp_path / "ref")), digest_snapshot(str(tmp_path / "mine")), write_impl)


@contextlib.contextmanager
def file_size_limit(limit: int = MiB) -> Iterator[int]:
    """RLIMIT_FSIZE of ``limit`` bytes for this process (SIGXFSZ ignored: a write past it fails with EFBIG)."""
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limit[1]))
    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def test_a_file_failing_mid_write_keeps_its_old_version(tmp_path: Path, write_impl: str) -> None:
    """A write that fails half-way (EFBIG): that file's error is returned naming its path, its old
    version stays, no temporary name is left, and the files around it in the batch are committed."""
    dst = str(tmp_path / "dst")
    write(os.path.join(dst, "big"), b"old version")
    d = Destination(dst, fsync=False)
    try:
        with file_size_limit() as limit:
            res = d.write_files([("a", b"a" * 10, 0o600, T0), ("big", b"b" * (2 * limit), 0o644, T0), ("c", b"", 0o640, T0)])
    finally:
        d.close()
    assert isinstance(res[1], OSError) and res[1].errno == errno.EFBIG
    assert res[1].filename == os.path.join(dst, "big")
    for i, name, size, mode in ((0, "a", 10, 0o600), (2, "c", 0, 0o640)):
        st = os.stat(os.path.join(dst, name))
        assert res[i] == (st.st_size, st.st_mtime_ns, st.st_ino) == (size, T0, st.st_ino)
        assert stat.S_IMODE(st.st_mode) == mode
    with open(os.path.join(dst, "big"), "rb") as f:
        assert f.read() == b"old version"
    assert tmp_files(dst) == []


def test_a_failed_file_is_a_destination_failure_and_the_rest_syncs(tmp_path: Path, write_impl: str) -> None:
    """Through a whole sync: the file that cannot be written is named in the failures (rsync's
    exit 23), everything else is synced."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write(os.path.join(src, "a"), b"a")
    write(os.path.join(src, "big"), os.urandom(2 * MiB))
    write(os.path.join(src, "c"), b"c")
    with pytest.raises(tb5sync.PartialTransferError) as ei, file_size_limit():
        tb5sync.sync(src + "/", dst, state_dir=str(tmp_path / "state"))
    failures = ei.value.stats.failures
    assert [(f.path, f.side) for f in failures] == [("big", "destination")]
    assert "File too large" in failures[0].reason
    assert sorted(os.listdir(dst)) == ["a", "c"]
    assert tmp_files(dst) == []


@pytest.mark.parametrize("tmpfile", [False, True], ids=["named", "unnamed"])
def test_batch_writer_leaves_a_name_it_did_not_create(tmp_path: Path, tmpfile: bool) -> None:
    """The raw Cython writer: a temporary name already taken (here by a symlink) is EEXIST when
    the file is to replace an existing name, and the thing there is left alone (nothing opened
    through it); the final name is untouched. On either path."""
    if destination_mod._cy_write_files is None:
        pytest.skip("tb5sync._write is not built")
    from tb5sync._write import write_files

    d = tmp_path / "d"
    d.mkdir()
    (tmp_path / "outside").write_bytes(b"outside")
    os.symlink(tmp_path / "outside", d / ".f.00000000.tb5tmp")
    (d / "f").write_bytes(b"old")
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        out = write_files([(fd, b".f.00000000.tb5tmp", b"f", b"new", 0o644, T0), (fd, b".g.00000000.tb5tmp", b"g", memoryview(b"xgx")[1:2], 0o600, -1)], False, tmpfile)
    finally:
        os.close(fd)
    assert out[0] == errno.EEXIST
    assert os.path.islink(d / ".f.00000000.tb5tmp") and (tmp_path / "outside").read_bytes() == b"outside"
    assert (d / "f").read_bytes() == b"old"
    st = os.stat(d / "g")
    assert out[1] == (1, -1, st.st_ino) and st.st_mtime_ns == -1 and (d / "g").read_bytes() == b"g"


def _raw_writer() -> Any:
    if destination_mod._cy_write_files is None:
        pytest.skip("tb5sync._write is not built")
    from tb5sync import _write

    return _write


def test_unnamed_path_needs_no_temporary_name_for_a_new_file(tmp_path: Path) -> None:
    """Where Linux has ``O_TMPFILE``, a new file is written unnamed and linked once whole: a taken
    temporary name does not stop it (the named path, forced with ``tmpfile=False`` as on macOS,
    meets EEXIST there); the thing at the temporary name is left alone either way."""
    _write = _raw_writer()
    d = tmp_path / "d"
    d.mkdir()
    (tmp_path / "outside").write_bytes(b"outside")
    os.symlink(tmp_path / "outside", d / ".n.00000000.tb5tmp")
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        named = _write.write_files([(fd, b".n.00000000.tb5tmp", b"n", b"data", 0o640, T0)], False, False)
        unnamed = _write.write_files([(fd, b".n.00000000.tb5tmp", b"n", b"data", 0o640, T0)], False, True)
    finally:
        os.close(fd)
    assert named == [errno.EEXIST]
    assert os.path.islink(d / ".n.00000000.tb5tmp") and (tmp_path / "outside").read_bytes() == b"outside"
    if _write.tmpfile_state() < 0 or not hasattr(os, "O_TMPFILE"):
        assert unnamed == [errno.EEXIST]  # the portable path served it: same answer
        return
    st = os.stat(d / "n")
    assert unnamed == [(4, T0, st.st_ino)]
    assert (d / "n").read_bytes() == b"data" and stat.S_IMODE(st.st_mode) == 0o640 and st.st_mtime_ns == T0
    assert sorted(os.listdir(d)) == [".n.00000000.tb5tmp", "n"]


@pytest.mark.parametrize("tmpfile", [False, True], ids=["named", "unnamed"])
def test_batch_writer_replaces_files_and_refuses_directories(tmp_path: Path, tmpfile: bool) -> None:
    """Either path: an existing file is replaced whole (new inode, new bytes, mode and mtime), a
    directory at the final name is an errno with the directory and its contents untouched, a
    read-only directory is EACCES (when not root); no temporary name is left behind."""
    _write = _raw_writer()
    d = tmp_path / "d"
    d.mkdir()
    (d / "old").write_bytes(b"old bytes")
    (d / "dir").mkdir()
    (d / "dir" / "keep").write_bytes(b"k")
    old_ino = os.stat(d / "old").st_ino
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        out = _write.write_files(
            [(fd, b".old.00000001.tb5tmp", b"old", b"new", 0o600, T0), (fd, b".dir.00000001.tb5tmp", b"dir", b"x", 0o644, T0),
             (fd, b".new.00000001.tb5tmp", b"new", b"", 0o755, T0)], False, tmpfile)
    finally:
        os.close(fd)
    st = os.stat(d / "old")
    assert out[0] == (3, T0, st.st_ino) and st.st_ino != old_ino and (d / "old").read_bytes() == b"new"
    assert isinstance(out[1], int) and out[1] in (errno.EISDIR, errno.EEXIST, errno.ENOTEMPTY)
    assert (d / "dir" / "keep").read_bytes() == b"k"
    st = os.stat(d / "new")
    assert out[2] == (0, T0, st.st_ino) and stat.S_IMODE(st.st_mode) == 0o755
    assert sorted(os.listdir(d)) == ["dir", "new", "old"]
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        os.chmod(ro, 0o555)
        fd = os.open(ro, os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert _write.write_files([(fd, b".f.00000001.tb5tmp", b"f", b"x", 0o644, T0)], False, tmpfile) == [errno.EACCES]
        finally:
            os.close(fd)
            os.chmod(ro, 0o755)
        assert os.listdir(ro) == []


def test_no_tmpfile_env_forces_the_named_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """``$TB5SYNC_NO_TMPFILE`` (but ``0``) keeps the destination's writer on the portable path."""
    monkeypatch.delenv(destination_mod.NO_TMPFILE_ENV, raising=False)
    assert destination_mod.use_tmpfile()
    monkeypatch.setenv(destination_mod.NO_TMPFILE_ENV, "0")
    assert destination_mod.use_tmpfile()
    monkeypatch.setenv(destination_mod.NO_TMPFILE_ENV, "1")
    assert not destination_mod.use_tmpfile()
