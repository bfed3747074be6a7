"""``put_file`` of a new remote file in pieces (``put_open``/``put_piece``/``put_close``): DATA
frames over every connection written at their offsets into a preallocated temporary file, renamed
into place once every byte arrived. Expected destinations come from fsspec's LocalFileSystem
doing the same ``put_file`` on the same disk."""

from __future__ import annotations

import os
import random
import stat
from pathlib import Path
from typing import Any

import pytest
from fsspec.callbacks import Callback
from fsspec.implementations.local import LocalFileSystem

from conftest import start_server, tb5fs, tmp_files, wait_for
import tb5sync._os.io as _io
import tb5sync.daemon.services as services_mod
import tb5sync.wire.messages as messages
from tb5sync.errors import ConnectError, QuotaError, SourceChangedError, Tb5syncError, UsageError
from tb5sync.fs.file import MIN_PIECE
from tb5sync.daemon.fsops import MIN_PUT_PIECE, _Put

pytestmark = pytest.mark.timeout(120)

SIZE = 11 * MIN_PIECE + 777  # more pieces than are ever in flight at once (2 per connection)


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(random.Random(3).randbytes(SIZE))
    (src / "one_over.bin").write_bytes(random.Random(4).randbytes(MIN_PIECE + 1))
    (src / "small.bin").write_bytes(b"0123456789" * 100)
    (src / "empty.bin").write_bytes(b"")
    with open(src / "sparse.bin", "wb") as f:  # holes before, between and after data
        f.seek(3 * MIN_PIECE + 5)
        f.write(b"data in the middle")
        f.truncate(6 * MIN_PIECE + 12345)
    return src


@pytest.fixture
def remote(tmp_path: Path) -> Any:
    root = tmp_path / "root"
    live = start_server(str(root))
    fs = tb5fs(live, streams=3, engine_threshold=1 << 40)  # onto existing files too: pieces, not the engine
    try:
        yield root, fs, live
    finally:
        fs._holder.close()
        live.server.stop()


def _outcome(fn: Any) -> Any:
    """``None`` or the exception class's OS-level kind (what LocalFileSystem and tb5 must agree on)."""
    try:
        fn()
    except (IsADirectoryError, FileNotFoundError, FileExistsError, NotADirectoryError) as exc:
        return next(k for k in (IsADirectoryError, FileNotFoundError, FileExistsError, NotADirectoryError) if isinstance(exc, k))
    return None


@pytest.mark.parametrize("name", ["big.bin", "one_over.bin", "small.bin", "empty.bin", "sparse.bin"])
def test_a_new_file_equals_localfilesystems_put(remote: Any, sources: Path, tmp_path: Path, name: str) -> None:
    root, fs, _ = remote
    want = tmp_path / "want"
    want.mkdir()
    LocalFileSystem().put_file(str(sources / name), str(want / name))
    fs.put_file(str(sources / name), name)
    assert (root / name).read_bytes() == (want / name).read_bytes()
    assert stat.S_IMODE((root / name).stat().st_mode) == stat.S_IMODE((want / name).stat().st_mode)
    assert tmp_files(str(root)) == []


def test_pieces_travel_as_data_frames_on_every_connection(remote: Any, sources: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, fs, _ = remote
    import tb5sync.wire.rpc as rpc

    seen: list[tuple[str, int]] = []
    orig = rpc.Requester.submit_data

    def spy(self: Any, method: str, args: dict[str, Any], parts: list[Any], *, channel: int) -> Any:
        seen.append((method, channel))
        return orig(self, method, args, parts, channel=channel)

    monkeypatch.setattr(rpc.Requester, "submit_data", spy)
    fs.put_file(str(sources / "big.bin"), "big.bin")
    assert len(seen) == -(-SIZE // MIN_PIECE)
    assert {m for m, _ in seen} == {"put_piece"} and {c for _, c in seen} == {0, 1, 2}
    assert (root / "big.bin").read_bytes() == (sources / "big.bin").read_bytes()


@pytest.mark.parametrize("sendfile", [True, False])
def test_sendfile_and_the_forced_portable_read_and_send_give_the_same_file(
        tmp_path: Path, sources: Path, monkeypatch: pytest.MonkeyPatch, sendfile: bool) -> None:
    """The portable path (no ``sendfile``: macOS sockets in some setups, TLS) is forced with ``$TB5SYNC_PORTABLE``."""
    if sendfile and not hasattr(os, "sendfile"):
        pytest.skip("no os.sendfile here")
    if not sendfile:
        monkeypatch.setenv(_io.PORTABLE_ENV, "1")
    calls = []
    real = getattr(os, "sendfile", None)
    if real is not None:
        def counting(*a: Any) -> Any:
            calls.append(a[2:])
            return real(*a)

        monkeypatch.setattr(os, "sendfile", counting)
    live = start_server(str(tmp_path / "root"))
    fs = tb5fs(live, streams=2)
    try:
        fs.put_file(str(sources / "big.bin"), "big.bin")
    finally:
        fs._holder.close()
        live.server.stop()
    assert (tmp_path / "root" / "big.bin").read_bytes() == (sources / "big.bin").read_bytes()
    assert (len(calls) > 0) is sendfile


def _both(tmp_path: Path, remote: Any, prepare: Any, put: Any) -> tuple[Path, Path]:
    """Run ``prepare(base)`` in a local and the remote root, then ``put`` with each filesystem."""
    root, fs, _ = remote
    local = tmp_path / "local"
    local.mkdir(parents=True)
    prepare(local)
    prepare(root)
    want = _outcome(lambda: put(LocalFileSystem(), str(local) + "/"))
    got = _outcome(lambda: put(fs, ""))
    assert got is want
    return local, root


def test_an_existing_file_is_replaced_keeping_its_permission_bits(remote: Any, sources: Path, tmp_path: Path) -> None:
    def prepare(base: Path) -> None:
        (base / "f.bin").write_bytes(b"old contents")
        os.chmod(base / "f.bin", 0o640)

    local, root = _both(tmp_path, remote, prepare, lambda fs, b: fs.put_file(str(sources / "one_over.bin"), b + "f.bin"))
    assert (root / "f.bin").read_bytes() == (local / "f.bin").read_bytes() == (sources / "one_over.bin").read_bytes()
    assert stat.S_IMODE((root / "f.bin").stat().st_mode) == stat.S_IMODE((local / "f.bin").stat().st_mode) == 0o640


def test_a_directory_as_destination_and_a_missing_parent_fail_as_localfilesystem(remote: Any, sources: Path, tmp_path: Path) -> None:
    def prepare(base: Path) -> None:
        (base / "d").mkdir()

    local, root = _both(tmp_path, remote, prepare, lambda fs, b: fs.put_file(str(sources / "big.bin"), b + "d"))
    assert sorted(os.listdir(root / "d")) == sorted(os.listdir(local / "d")) == []
    _both(tmp_path / "m", remote, lambda b: os.makedirs(b, exist_ok=True),
          lambda fs, b: fs.put_file(str(sources / "big.bin"), b + "missing/f.bin"))
    root = remote[0]
    assert not (root / "missing").exists() and tmp_files(str(root)) == []


def test_auto_mkdir_makes_the_parents_as_localfilesystem(remote: Any, sources: Path, tmp_path: Path) -> None:
    root, _, live = remote
    fs = tb5fs(live, streams=2, auto_mkdir=True)
    try:
        fs.put_file(str(sources / "big.bin"), "a/b/f.bin")
    finally:
        fs._holder.close()
    LocalFileSystem(auto_mkdir=True).put_file(str(sources / "big.bin"), str(tmp_path / "want" / "a" / "b" / "f.bin"))
    assert (root / "a" / "b" / "f.bin").read_bytes() == (tmp_path / "want" / "a" / "b" / "f.bin").read_bytes()


def test_a_symlink_at_the_destination_is_written_through(remote: Any, sources: Path, tmp_path: Path) -> None:
    def prepare(base: Path) -> None:
        (base / "target.bin").write_bytes(b"old")
        os.symlink("target.bin", base / "link.bin")

    local, root = _both(tmp_path, remote, prepare, lambda fs, b: fs.put_file(str(sources / "big.bin"), b + "link.bin"))
    for base in (local, root):
        assert os.path.islink(base / "link.bin")
        assert (base / "target.bin").read_bytes() == (sources / "big.bin").read_bytes()


def test_onto_an_existing_plain_file_the_engine_reuses_its_chunks(remote: Any, sources: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tb5sync.remote.client as client

    root, _, live = remote
    pushed: list[str] = []
    real = client.push
    monkeypatch.setattr(client, "push", lambda src, *a, **kw: pushed.append(src) or real(src, *a, **kw))
    (root / "big.bin").write_bytes((sources / "big.bin").read_bytes()[: SIZE // 2])
    fs = tb5fs(live, streams=2, engine_threshold=2 * MIN_PIECE)
    try:
        fs.put_file(str(sources / "one_over.bin"), "one_over.bin")  # new: pieces
        fs.put_file(str(sources / "big.bin"), "big.bin")  # existing, over the threshold: the engine
    finally:
        fs._holder.close()
    assert pushed == [os.path.realpath(sources / "big.bin")]
    assert (root / "big.bin").read_bytes() == (sources / "big.bin").read_bytes()
    assert (root / "one_over.bin").read_bytes() == (sources / "one_over.bin").read_bytes()


def test_create_mode_refuses_an_existing_file(remote: Any, sources: Path) -> None:
    root, fs, _ = remote
    (root / "f.bin").write_bytes(b"keep")
    with pytest.raises(FileExistsError):
        fs.put_file(str(sources / "big.bin"), "f.bin", mode="create")
    assert (root / "f.bin").read_bytes() == b"keep" and tmp_files(str(root)) == []


def test_the_quota_is_charged_before_anything_is_written(tmp_path: Path, sources: Path) -> None:
    live = start_server(str(tmp_path / "root"), max_session_bytes=SIZE - 1)
    fs = tb5fs(live, streams=2)
    try:
        with pytest.raises(QuotaError):
            fs.put_file(str(sources / "big.bin"), "big.bin")
        assert os.listdir(tmp_path / "root") == [] or tmp_files(str(tmp_path / "root")) == []
        assert not (tmp_path / "root" / "big.bin").exists()
        fs.put_file(str(sources / "one_over.bin"), "ok.bin")  # the connection goes on
        assert (tmp_path / "root" / "ok.bin").read_bytes() == (sources / "one_over.bin").read_bytes()
    finally:
        fs._holder.close()
        live.server.stop()


class _OnFirst(Callback):
    def __init__(self, act: Any) -> None:
        super().__init__()
        self.act = act

    def relative_update(self, inc: int = 1) -> None:
        if self.act is not None:
            act, self.act = self.act, None
            act()
        super().relative_update(inc)


def test_a_source_that_changes_meanwhile_leaves_nothing(remote: Any, sources: Path) -> None:
    root, fs, _ = remote
    (root / "big.bin").write_bytes(b"before")
    src = sources / "big.bin"

    def grow() -> None:
        with open(src, "ab") as f:
            f.write(b"more")

    with pytest.raises(SourceChangedError):
        fs.put_file(str(src), "big.bin", callback=_OnFirst(grow))
    assert (root / "big.bin").read_bytes() == b"before" and tmp_files(str(root)) == []


def test_a_connection_lost_midway_leaves_no_temporary_file(remote: Any, sources: Path) -> None:
    root, fs, _ = remote
    with pytest.raises(Tb5syncError):
        fs.put_file(str(sources / "big.bin"), "big.bin", callback=_OnFirst(fs._holder.close))
    assert not (root / "big.bin").exists()
    wait_for(lambda: tmp_files(str(root)) == [], 10, "the server to remove the temporary file")
    fs.put_file(str(sources / "big.bin"), "big.bin")  # a new link
    assert (root / "big.bin").read_bytes() == (sources / "big.bin").read_bytes()


def test_the_server_refuses_bad_pieces_and_an_incomplete_commit(remote: Any) -> None:
    root, fs, _ = remote
    size = 3 * MIN_PUT_PIECE
    pid = fs._call_sync("put_open", {"path": "f.bin", "size": size})["id"]
    link = fs._holder.link
    with pytest.raises(UsageError, match="reach past"):
        link.requester.submit_data("put_piece", {"id": pid, "offset": size - 5}, [b"123456"], channel=0).result(10)
    with pytest.raises(UsageError, match="DATA frame"):
        link.requester.submit("put_piece", {"id": pid, "offset": 0, "data": b"12345"}, channel=1).result(10)
    with pytest.raises(UsageError, match="no open put"):
        link.requester.submit_data("put_piece", {"id": "0" * 32, "offset": 0}, [b"1"], channel=1).result(10)
    with pytest.raises(UsageError, match="must not"):  # its body is discarded: the connection goes on
        link.requester.submit_data("info", {"path": ""}, [b"x" * 100_000], channel=2).result(10)
    # a piece but the last must hold MIN_PUT_PIECE bytes: a stream of empty or tiny pieces kept a
    # range each on the server, without end
    for piece in (b"", b"1", b"x" * (MIN_PUT_PIECE - 1)):
        with pytest.raises(UsageError, match="at least"):
            link.requester.submit_data("put_piece", {"id": pid, "offset": 0}, [piece], channel=2).result(10)
    link.requester.submit_data("put_piece", {"id": pid, "offset": size - 5}, [b"12345"], channel=2).result(10)  # the last
    link.requester.submit_data("put_piece", {"id": pid, "offset": size}, [b""], channel=2).result(10)  # empty, at the end
    link.requester.submit_data("put_piece", {"id": pid, "offset": 0}, [b"a" * MIN_PUT_PIECE], channel=2).result(10)
    with pytest.raises(UsageError, match="missing"):
        fs._call_sync("put_close", {"id": pid, "commit": True})
    assert not (root / "f.bin").exists() and tmp_files(str(root)) == []
    with pytest.raises(UsageError, match="no open put"):  # removed with its temporary file
        link.requester.submit_data("put_piece", {"id": pid, "offset": 5}, [b"67890"], channel=0).result(10)


def test_the_ranges_a_put_keeps_are_merged() -> None:
    """Pieces in any order, overlapping or adjacent, leave one range per gap between them."""
    put = _Put([], "t", "f", False, "f", 100, None)
    for off, n in ((50, 10), (0, 10), (60, 5), (10, 5), (70, 30), (0, 0), (5, 20)):
        put.add(off, n)
    assert put.got == [(0, 25), (50, 65), (70, 100)] and not put.complete()
    put.add(20, 55)
    assert put.got == [(0, 100)] and put.complete()


def test_an_older_server_without_pieces_gets_todays_requests(tmp_path: Path, sources: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that predates pieces neither announces them nor takes DATA requests."""
    monkeypatch.setattr(services_mod, "FS_CAPABILITIES", {})
    monkeypatch.setattr(services_mod, "FS_DATA_METHODS", frozenset())
    monkeypatch.setattr(services_mod, "FS_METHODS", messages.FS_METHODS - {"put_open", "put_piece", "put_close"})
    live = start_server(str(tmp_path / "root"))
    fs = tb5fs(live, streams=2, engine_threshold=2 * MIN_PIECE)
    try:
        for name in ("one_over.bin", "big.bin"):  # wopen/wwrite below the threshold, the engine above
            fs.put_file(str(sources / name), name)
            assert (tmp_path / "root" / name).read_bytes() == (sources / name).read_bytes()
        assert not fs._holder.link.pieces
        with pytest.raises(UsageError, match="unknown request"):
            fs.put_pieces(str(sources / "one_over.bin"), "x.bin")
    finally:
        fs._holder.close()
        live.server.stop()
    assert tmp_files(str(tmp_path / "root")) == []


def test_pipe_file_of_a_large_value_goes_in_pieces(remote: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tb5sync.wire.rpc as rpc

    root, fs, _ = remote
    value = random.Random(5).randbytes(3 * MIN_PIECE + 99)
    sent: list[str] = []
    orig = rpc.Requester.submit_data
    monkeypatch.setattr(rpc.Requester, "submit_data", lambda self, m, *a, **kw: sent.append(m) or orig(self, m, *a, **kw))
    LocalFileSystem().pipe_file(str(tmp_path / "want.bin"), value)
    fs.pipe_file("got.bin", value)
    assert (root / "got.bin").read_bytes() == (tmp_path / "want.bin").read_bytes()
    assert sent == ["put_piece"] * 4
    with pytest.raises(FileExistsError):
        fs.pipe_file("got.bin", value, mode="create")
    assert tmp_files(str(root)) == []


def test_a_recursive_put_of_many_large_files_matches_localfilesystem(remote: Any, tmp_path: Path) -> None:
    """fsspec's ``put`` runs many ``put_file`` at once: each its own put, none holding a descriptor."""
    root, fs, _ = remote
    src = tmp_path / "tree"
    (src / "sub").mkdir(parents=True)
    rnd = random.Random(9)
    for i in range(6):
        (src / ("sub" if i % 2 else "") / f"f{i}.bin").write_bytes(rnd.randbytes(MIN_PIECE + 1000 * i + 1))
    LocalFileSystem().put(str(src), str(tmp_path / "want"), recursive=True)
    fs.put(str(src), "want", recursive=True)

    def tree(base: Path) -> dict[str, bytes]:
        return {str(p.relative_to(base)): p.read_bytes() for p in sorted(base.rglob("*")) if p.is_file()}

    assert tree(root / "want") == tree(tmp_path / "want") and len(tree(root / "want")) == 6
    assert tmp_files(str(root)) == []
