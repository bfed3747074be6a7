"""``get_file`` into a new local file: pieces over every connection written at their offsets off
the event loop's thread, a temporary name renamed into place, and the destination treated as
fsspec's LocalFileSystem treats it (``shutil.copyfile``). Every expected value comes from
LocalFileSystem copying the same file on the same disk."""

from __future__ import annotations

import asyncio
import os
import random
import stat
import threading
from pathlib import Path
from typing import Any

import fsspec.asyn
import pytest
from fsspec.callbacks import Callback
from fsspec.implementations.local import LocalFileSystem

from conftest import start_server, tb5fs, tmp_files
import tb5sync._os.io as _io
import tb5sync.fs.filesystem as fsmod
from tb5sync.errors import SourceChangedError, Tb5syncError
from tb5sync.fs.file import MIN_PIECE

pytestmark = pytest.mark.timeout(120)

SIZE = 11 * MIN_PIECE + 777  # more pieces than are ever in flight at once (2 per connection)


@pytest.fixture(scope="module")
def remote(tmp_path_factory: Any) -> Any:
    root = tmp_path_factory.mktemp("getroot")
    (root / "big.bin").write_bytes(random.Random(3).randbytes(SIZE))
    (root / "empty.bin").write_bytes(b"")
    (root / "small.bin").write_bytes(b"0123456789" * 100)
    with open(root / "sparse.bin", "wb") as f:  # holes before, between and after data
        f.seek(3 * MIN_PIECE + 5)
        f.write(b"data in the middle")
        f.seek(7 * MIN_PIECE)
        f.write(os.urandom(5000))
        f.truncate(9 * MIN_PIECE + 12345)
    (root / "dir" / "sub").mkdir(parents=True)
    (root / "dir" / "sub" / "f.txt").write_bytes(b"below")
    live = start_server(str(root))
    fs = tb5fs(live, streams=3)
    try:
        yield root, fs, live
    finally:
        fs._holder.close()
        live.server.stop()


def _local_copy(src: Path, dst: Path) -> None:
    LocalFileSystem().get_file(str(src), str(dst))


@pytest.mark.parametrize("name", ["big.bin", "empty.bin", "small.bin", "sparse.bin"])
def test_a_new_file_equals_localfilesystems_copy(remote: Any, tmp_path: Path, name: str) -> None:
    root, fs, _ = remote
    (tmp_path / "want").mkdir()
    (tmp_path / "got").mkdir()
    _local_copy(root / name, tmp_path / "want" / name)
    fs.get_file(name, str(tmp_path / "got" / name))
    want, got = tmp_path / "want" / name, tmp_path / "got" / name
    assert got.read_bytes() == want.read_bytes()
    assert stat.S_IMODE(got.stat().st_mode) == stat.S_IMODE(want.stat().st_mode)
    assert tmp_files(str(tmp_path)) == []
    if os.path.exists("/proc/self/maps"):  # the mapping it was received into is gone
        with open("/proc/self/maps") as maps:
            assert str(tmp_path) not in maps.read()


@pytest.mark.parametrize("env", [_io.PORTABLE_ENV, "TB5SYNC_FALLOCATE_PORTABLE", fsmod.MMAP_PORTABLE_ENV])
def test_the_portable_path_without_preallocation_gives_the_same_file(remote: Any, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch, env: str) -> None:
    """What a system without posix_fallocate (macOS) does: the same bytes, nothing left over."""
    root, fs, _ = remote
    monkeypatch.setenv(env, "1")
    fd = os.open(tmp_path / "probe", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if env != fsmod.MMAP_PORTABLE_ENV:  # that one keeps the reservation, and writes with pwrite
            assert _io.preallocate(fd, 1 << 20) is False and os.fstat(fd).st_size == 0
    finally:
        os.close(fd)
    os.unlink(tmp_path / "probe")
    for name in ("big.bin", "sparse.bin"):
        fs.get_file(name, str(tmp_path / name))
        assert (tmp_path / name).read_bytes() == (root / name).read_bytes()
    assert tmp_files(str(tmp_path)) == []


def test_preallocate_reserves_on_linux(tmp_path: Path) -> None:
    if not hasattr(os, "posix_fallocate"):
        pytest.skip("no posix_fallocate here (the portable path is the one taken)")
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        done = _io.preallocate(fd, 3 << 20)
        assert os.fstat(fd).st_size == (3 << 20 if done else 0)
        assert _io.preallocate(fd, 0) is False
    finally:
        os.close(fd)


def test_an_existing_file_is_replaced_keeping_its_mode_as_localfilesystem_does(remote: Any, tmp_path: Path) -> None:
    root, fs, _ = remote
    for side in ("want", "got"):
        (tmp_path / side).mkdir()
        old = tmp_path / side / "small.bin"
        old.write_bytes(b"an older, longer version of the file" * 50)
        old.chmod(0o640)
    _local_copy(root / "small.bin", tmp_path / "want" / "small.bin")
    fs.get_file("small.bin", str(tmp_path / "got" / "small.bin"))
    want, got = tmp_path / "want" / "small.bin", tmp_path / "got" / "small.bin"
    assert got.read_bytes() == want.read_bytes()
    assert stat.S_IMODE(got.stat().st_mode) == stat.S_IMODE(want.stat().st_mode) == 0o640


@pytest.mark.parametrize("dangling", [False, True])
def test_a_symlink_destination_is_written_through_as_localfilesystem_does(remote: Any, tmp_path: Path, dangling: bool) -> None:
    root, fs, _ = remote
    for side in ("want", "got"):
        d = tmp_path / side
        d.mkdir()
        if not dangling:
            (d / "target").write_bytes(b"old")
        (d / "link").symlink_to("target")
    _local_copy(root / "big.bin", tmp_path / "want" / "link")
    fs.get_file("big.bin", str(tmp_path / "got" / "link"))
    for side in ("want", "got"):
        assert (tmp_path / side / "link").is_symlink() and os.readlink(tmp_path / side / "link") == "target"
    assert (tmp_path / "got" / "target").read_bytes() == (tmp_path / "want" / "target").read_bytes()
    assert tmp_files(str(tmp_path)) == []


def _error_of(call: Any) -> type[BaseException]:
    with pytest.raises(BaseException) as exc:
        call()
    return exc.type


def test_bad_destinations_fail_as_on_localfilesystem_and_leave_nothing(remote: Any, tmp_path: Path) -> None:
    root, fs, _ = remote
    (tmp_path / "adir").mkdir()
    # an existing directory, a missing parent, a parent that is a file
    (tmp_path / "afile").write_bytes(b"x")
    for dst in (tmp_path / "adir", tmp_path / "missing" / "f", tmp_path / "afile" / "f"):
        want = _error_of(lambda: LocalFileSystem().cp_file(str(root / "small.bin"), str(dst)))
        got = _error_of(lambda: fs.get_file("small.bin", str(dst)))
        assert issubclass(got, want) or issubclass(want, got), (dst, want, got)
    assert sorted(os.listdir(tmp_path)) == ["adir", "afile"] and os.listdir(tmp_path / "adir") == []
    # a missing remote file: the local error class, and no local file
    with pytest.raises(FileNotFoundError):
        fs.get_file("nope.bin", str(tmp_path / "nope.bin"))
    assert not (tmp_path / "nope.bin").exists() and tmp_files(str(tmp_path)) == []


def test_a_remote_directory_makes_the_local_directory(remote: Any, tmp_path: Path) -> None:
    root, fs, _ = remote
    fs.get_file("dir", str(tmp_path / "d1"))
    LocalFileSystem().get_file(str(root / "dir"), str(tmp_path / "d2"))
    assert (tmp_path / "d1").is_dir() and (tmp_path / "d2").is_dir()
    fs.get("dir", str(tmp_path / "tree"), recursive=True)
    LocalFileSystem().get(str(root / "dir"), str(tmp_path / "ltree"), recursive=True)
    assert (tmp_path / "tree" / "sub" / "f.txt").read_bytes() == (tmp_path / "ltree" / "sub" / "f.txt").read_bytes() == b"below"


class _ChangeAfterFirst(Callback):
    """Rewrites the remote file once the first piece has been written locally."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.changed = False

    def call(self, *args: Any, **kwargs: Any) -> None:
        if self.value and not self.changed:
            self.changed = True
            self.path.write_bytes(os.urandom(SIZE + 1))


@pytest.mark.parametrize("path", ["mapped", "pwrite"])
def test_a_file_that_changes_during_the_read_fails_and_leaves_no_file(remote: Any, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    root, fs, live = remote
    if path == "pwrite":
        monkeypatch.setenv(fsmod.MMAP_PORTABLE_ENV, "1")
    streamed = tb5fs(live, streams=2, engine_threshold=1 << 40)  # onto an existing file too
    victim = root / "victim.bin"
    victim.write_bytes(os.urandom(SIZE))
    old = tmp_path / "old.bin"
    old.write_bytes(b"the previous version")
    try:
        cb = _ChangeAfterFirst(victim)
        with pytest.raises(SourceChangedError):
            fs.get_file("victim.bin", str(tmp_path / "new.bin"), callback=cb)
        assert cb.changed
        assert not (tmp_path / "new.bin").exists()
        victim.write_bytes(os.urandom(SIZE))
        cb = _ChangeAfterFirst(victim)  # over an existing file: it stays as it was
        with pytest.raises(SourceChangedError):
            streamed.get_file("victim.bin", str(old), callback=cb)
        assert old.read_bytes() == b"the previous version"
        assert tmp_files(str(tmp_path)) == []
        assert isinstance(SourceChangedError("x"), Tb5syncError)
    finally:
        streamed._holder.close()
        victim.unlink()


@pytest.mark.parametrize("path", ["mapped", "pwrite"])
def test_writes_run_off_the_event_loop_thread(remote: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Both ways of writing (straight into a mapping of the file where blocks can be reserved,
    ``pwrite`` elsewhere) run on the calling thread or a worker, never fsspec's loop thread."""
    root, fs, _ = remote
    if path == "pwrite":
        monkeypatch.setenv(fsmod.MMAP_PORTABLE_ENV, "1")
    writers: set[threading.Thread] = set()
    kinds: list[bool] = []
    real = fsmod.TB5FileSystem._stream_sync

    def spy(self: Any, *args: Any, **kwargs: Any) -> None:
        writers.add(threading.current_thread())
        kinds.append(kwargs.get("into") is not None)
        real(self, *args, **kwargs)

    monkeypatch.setattr(fsmod.TB5FileSystem, "_stream_sync", spy)
    fs.get("big.bin", str(tmp_path / "a.bin"))  # fsspec's sync wrapper: the coroutine on fsspec's loop
    loop_thread = fsspec.asyn.iothread[0]  # the thread fsspec runs its event loop on
    assert loop_thread is not None and writers and loop_thread not in writers
    assert kinds == [path == "mapped" and hasattr(os, "posix_fallocate")]
    assert (tmp_path / "a.bin").read_bytes() == (root / "big.bin").read_bytes()

    async def both() -> None:
        await asyncio.gather(fs._get_file("big.bin", str(tmp_path / "b.bin")), fs._get_file("sparse.bin", str(tmp_path / "c.bin")))

    writers.clear()
    fsspec.asyn.sync(fs.loop, both)
    assert len(writers) == 2 and loop_thread not in writers
    assert (tmp_path / "b.bin").read_bytes() == (root / "big.bin").read_bytes()
    assert (tmp_path / "c.bin").read_bytes() == (root / "sparse.bin").read_bytes()
    assert tmp_files(str(tmp_path)) == []


def test_into_a_file_object(remote: Any, tmp_path: Path) -> None:
    root, fs, _ = remote
    with open(tmp_path / "obj.bin", "wb") as f:
        fs.get_file("big.bin", f)
    assert (tmp_path / "obj.bin").read_bytes() == (root / "big.bin").read_bytes()


# ---- a hostile server's names in ls/find replies (issue 21) ------------------------------------


def _hostile_root(tmp_path: Path) -> str:
    root = tmp_path / "served"
    (root / "dir" / "sub").mkdir(parents=True)
    (root / "dir" / "sub" / "f.txt").write_bytes(b"below")
    (root / "dir" / "top.txt").write_bytes(b"top")
    return str(root)


def _all_files(base: Path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), base) for d, ds, ns in os.walk(base) for n in ds + ns)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["dir/../../evil", "dir/sub/../../../evil", "/abs/evil", "other/evil", "dir/a\x00b",
                                  "dir//evil", "dir/./evil"])
@pytest.mark.parametrize("how", ["get", "get-slash", "find"])
def test_get_refuses_a_servers_name_leading_outside(tmp_path: Path, name: str, how: str) -> None:
    """A name in a hostile server's ls/find replies that is not a safe path below the one asked
    for: the get stops before anything is written (one line, exit 12), nothing outside the
    destination, not even the destination."""
    from hostile import LyingFs, fs_server

    from tb5sync.errors import RemoteProtocolError
    from tb5sync.fs.filesystem import TB5FileSystem

    root = _hostile_root(tmp_path)
    work = tmp_path / "work" / "a" / "b"
    work.mkdir(parents=True)
    with fs_server(LyingFs(root, [name], "dir/sub/f.txt")) as hs:
        fs = TB5FileSystem(host="127.0.0.1", port=hs.port, skip_instance_cache=True)
        try:
            with pytest.raises(RemoteProtocolError) as ei:
                if how == "find":
                    fs.find("dir", withdirs=True)
                else:
                    fs.get("dir/" if how == "get-slash" else "dir", str(work / "dst"), recursive=True)
        finally:
            fs._holder.close()
    assert ei.value.exit_code == 12
    msg = str(ei.value)
    assert "\n" not in msg and "\x00" not in msg and "127.0.0.1" in msg, msg
    assert _all_files(tmp_path / "work") == ["a", "a/b"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["dir/\x1b[31mred\x07", "dir/sub/nl\nname", "dir/\u009bcsi"])
def test_get_of_a_servers_control_character_names_stays_inside(tmp_path: Path, name: str) -> None:
    """Another input of the kind: names holding control characters are names like any other:
    written below the destination under that name, nothing outside it."""
    from hostile import LyingFs, fs_server

    from tb5sync.fs.filesystem import TB5FileSystem

    root = _hostile_root(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    with fs_server(LyingFs(root, [name], "dir/sub/f.txt")) as hs:
        fs = TB5FileSystem(host="127.0.0.1", port=hs.port, skip_instance_cache=True)
        try:
            fs.get("dir", str(work / "dst"), recursive=True)
        finally:
            fs._holder.close()
    got = _all_files(work)
    assert all(p == "dst" or p.startswith("dst/") for p in got), got
    assert (work / "dst" / name[len("dir/"):]).read_bytes() == b"below"
    assert (work / "dst" / "sub" / "f.txt").read_bytes() == b"below"
