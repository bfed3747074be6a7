"""What one session may write: ``Server(max_session_bytes=, min_free_space=)``
(``tb5sync serve --max-session-bytes --min-free-space``).

Each write is charged with its file's size (or its chunks' bytes) before any byte of it is
written, so a refused write leaves nothing at its final path and no temporary or work file, and
the session gets a ``QuotaError`` naming the option; the server keeps serving, and a new session
starts with a fresh count.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from conftest import served_fs, start_server, tmp_files

import tb5sync
from tb5sync.errors import QuotaError, UsageError
from tb5sync.tree.quota import WriteQuota

pytestmark = pytest.mark.timeout(60)

MiB = 1024 * 1024


def _files(base: Path, sizes: dict[str, int]) -> dict[str, bytes]:
    base.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, n in sizes.items():
        out[name] = os.urandom(n)
        (base / name).write_bytes(out[name])
    return out


def _only_whole_files(dst: Path, want: dict[str, bytes]) -> list[str]:
    """Names under ``dst`` (no temporary or work file among them), each the whole source file."""
    names = []
    for dirpath, _dirs, files in os.walk(dst):
        for n in files:
            rel = os.path.relpath(os.path.join(dirpath, n), dst)
            assert rel in want, f"unexpected file {rel} at the destination"
            assert (dst / rel).read_bytes() == want[rel], f"{rel} is not the whole source file"
            names.append(rel)
    return sorted(names)


def _written(root: Path) -> list[str]:
    """Files under a server's ``root`` but its state database: what its sessions wrote."""
    return [os.path.relpath(os.path.join(d, n), root) for d, _, names in os.walk(root) for n in names
            if not os.path.relpath(os.path.join(d, n), root).startswith(".tb5sync/state.sqlite")]


def test_push_past_the_session_limit_stops_with_nothing_partial(tmp_path: Path) -> None:
    """Small files (batched) and a large one (a work file): the session's first write past
    --max-session-bytes stops the push with QuotaError; every file at the destination is whole,
    no temporary or partial file is left, and a push within the limit then succeeds."""
    want = _files(tmp_path / "src", {f"s{i}": 300 * 1024 for i in range(8)} | {"large": 6 * MiB})
    live = start_server(str(tmp_path / "root"), max_session_bytes=2 * MiB)
    try:
        with pytest.raises(QuotaError, match="--max-session-bytes"):
            tb5sync.sync(str(tmp_path / "src") + "/", live.url("dst/"), timeout=30)
        got = _only_whole_files(tmp_path / "root" / "dst", want)
        assert sum(len(want[n]) for n in got) <= 2 * MiB and "large" not in got
        assert not tmp_files(str(tmp_path / "root"))
        partial = tmp_path / "root" / ".tb5sync" / "partial"
        assert not partial.exists() or not os.listdir(partial)
        small = _files(tmp_path / "small", {"a": 1000, "b": MiB})
        tb5sync.sync(str(tmp_path / "small") + "/", live.url("ok/"), timeout=30)  # a new session, a new count
        assert _only_whole_files(tmp_path / "root" / "ok", small) == ["a", "b"]
    finally:
        live.server.stop()


def test_a_large_file_past_the_limit_is_refused_before_its_work_file(tmp_path: Path) -> None:
    _files(tmp_path / "src", {"large": 8 * MiB})
    live = start_server(str(tmp_path / "root"), max_session_bytes=4 * MiB)
    try:
        with pytest.raises(QuotaError, match="large: writing 8388608 bytes would pass"):
            tb5sync.sync(str(tmp_path / "src") + "/", live.url("dst/"), timeout=30)
    finally:
        live.server.stop()
    assert _written(tmp_path / "root") == []


def test_min_free_space_refuses_writes_that_would_leave_less(tmp_path: Path) -> None:
    """A server asked to keep more free space than its disk has refuses every write; one asked to
    keep little refuses nothing."""
    _files(tmp_path / "src", {"f": 1000})
    free = shutil.disk_usage(tmp_path).free
    live = start_server(str(tmp_path / "root"), min_free_space=free + 1024 * MiB)
    try:
        with pytest.raises(QuotaError, match="--min-free-space"):
            tb5sync.sync(str(tmp_path / "src") + "/", live.url("dst/"), timeout=30)
    finally:
        live.server.stop()
    assert _written(tmp_path / "root") == []
    live = start_server(str(tmp_path / "root2"), min_free_space=1)
    try:
        tb5sync.sync(str(tmp_path / "src") + "/", live.url("dst/"), timeout=30)
    finally:
        live.server.stop()
    assert (tmp_path / "root2" / "dst" / "f").read_bytes() == (tmp_path / "src" / "f").read_bytes()


def test_fs_writes_past_the_session_limit_are_refused_and_leave_nothing(tmp_path: Path) -> None:
    """On one fs connection, put, a streamed write (wopen/wwrite/wclose), an appending wopen and a
    server-side copy each charge their bytes: past the limit the request fails with QuotaError
    (errno ENOSPC), no file appears at its path, the streamed write's temporary file is removed,
    and the connection goes on answering."""
    from tb5sync.wire.rpc import call_direct, open_session
    from tb5sync.wire.transport import connect

    live = start_server(str(tmp_path / "root"), max_session_bytes=3 * MiB)
    root = tmp_path / "root"
    try:
        ch = connect("127.0.0.1", live.port, None)
        open_session(ch, {"op": "fs"})
        call_direct(ch, "put", {"path": "a", "data": b"x" * (2 * MiB)})
        with pytest.raises(QuotaError, match="b: writing 2097152 bytes would pass .*--max-session-bytes") as info:
            call_direct(ch, "put", {"path": "b", "data": b"y" * (2 * MiB)})
        assert info.value.errno == 28
        call_direct(ch, "wopen", {"handle": 1, "path": "c"})
        call_direct(ch, "wwrite", {"handle": 1, "data": b"z" * (512 * 1024)})
        with pytest.raises(QuotaError):
            call_direct(ch, "wwrite", {"handle": 1, "data": b"z" * (1024 * 1024)})
        with pytest.raises(QuotaError):
            call_direct(ch, "copy", {"src": "a", "dst": "d"})
        with pytest.raises(QuotaError):
            call_direct(ch, "wopen", {"handle": 2, "path": "a", "append": True})
        assert not tmp_files(str(root))
        assert sorted(_written(root)) == ["a"]
        assert call_direct(ch, "info", {"path": "a"})["info"]["size"] == 2 * MiB
        call_direct(ch, "put", {"path": "small", "data": b"s" * 1000})  # under what is left
        ch.close()
    finally:
        live.server.stop()
    assert (root / "small").read_bytes() == b"s" * 1000


def test_fsspec_face_reports_the_quota(tmp_path: Path) -> None:
    """Through tb5:// (fsspec), a file larger than the limit is refused whole: QuotaError, no file."""
    with served_fs(str(tmp_path / "root"), max_session_bytes=MiB) as (_live, fs):
        with pytest.raises(QuotaError, match="--max-session-bytes"):
            fs.pipe_file("/big", b"x" * (2 * MiB))
        assert not fs.exists("/big")
    assert _written(tmp_path / "root") == [] and not tmp_files(str(tmp_path / "root"))


def test_store_push_past_the_session_limit_is_refused(tmp_path: Path) -> None:
    from conftest import make_tree
    from tb5sync.remote.client import parse_url
    from tb5sync.store import Store
    from tb5sync.remote.storeclient import push_ref

    root = tmp_path / "root"
    root.mkdir()
    tree = tmp_path / "t"
    _files(tree, {"big": 3 * MiB})
    live = start_server(str(root), store=str(root / ".tb5sync" / "store"), max_session_bytes=MiB)
    try:
        with Store(tmp_path / "mine") as mine:
            mine.put("r", str(tree))
            with pytest.raises(QuotaError, match="--max-session-bytes"):
                push_ref(mine, "r", parse_url(live.url("")))  # type: ignore[arg-type]
            mine.put("s", make_tree(str(tmp_path / "t2"), files=3))
    finally:
        live.server.stop()
    with Store(root / ".tb5sync" / "store") as st:
        assert [r.name for r in st.refs()] == []


def test_quota_counts_and_checks_its_arguments(tmp_path: Path) -> None:
    q = WriteQuota(str(tmp_path), max_bytes=10)
    q.charge(6, "a")
    with pytest.raises(QuotaError, match="^a: writing 5 bytes would pass this session's limit of 10 bytes \\(6 written"):
        q.charge(5, "a")
    q.charge(4, "b")
    assert q.used == 10
    assert not WriteQuota(str(tmp_path)).active
    for bad in ({"max_bytes": -1}, {"min_free": -1}, {"max_bytes": True}):
        with pytest.raises(UsageError):
            WriteQuota(str(tmp_path), **bad)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="max_session_bytes"):
        start_server(str(tmp_path / "r"), max_session_bytes=-5)


def test_serve_options_reach_the_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve --max-session-bytes 50G --min-free-space 10M`` gives Server those sizes in bytes."""
    import tb5sync.daemon.server as server_mod
    from tb5sync.cli.command import main

    seen: dict[str, object] = {}

    class Stop(Exception):
        pass

    def fake(*args: object, **kw: object) -> None:
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(server_mod, "Server", fake)
    with pytest.raises(Stop):
        main(["serve", str(tmp_path), "--max-session-bytes", "50G", "--min-free-space", "10M"])
    assert (seen["max_session_bytes"], seen["min_free_space"]) == (50 << 30, 10 << 20)
    with pytest.raises(Stop):
        main(["serve", str(tmp_path)])
    assert (seen["max_session_bytes"], seen["min_free_space"]) == (None, 0)


def test_single_file_push_past_the_limit_names_the_file(tmp_path: Path) -> None:
    """A single-file push (CLI, ``sync()``) and fsspec ``put_file`` past --max-session-bytes: the
    error names the file by its path under ROOT as the client gave it (not ``remote: : writing``),
    one line; nothing at the final path."""
    import subprocess
    import sys

    from conftest import tb5fs

    src = tmp_path / "data"
    src.mkdir()
    (src / "big.bin").write_bytes(os.urandom(3 * MiB))
    root = tmp_path / "root"
    live = start_server(str(root), max_session_bytes=2 * MiB)
    try:
        (root / "in").mkdir()
        r = subprocess.run([sys.executable, "-m", "tb5sync.cli", "sync", str(src / "big.bin"), live.url("in/")],
                           capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in os.environ.items() if k != "TB5SYNC_TOKEN"})
        assert r.returncode == 11, r.stderr
        assert r.stderr.strip().splitlines() == [
            f"tb5sync: error: remote: in/big.bin: writing {3 * MiB} bytes would pass this session's limit of "
            f"{2 * MiB} bytes (0 written; the server's --max-session-bytes)"], r.stderr
        with pytest.raises(QuotaError, match=r"^remote: in/renamed\.bin: writing \d+ bytes would pass"):
            tb5sync.sync(str(src / "big.bin"), live.url("in/renamed.bin"))
        fs = tb5fs(live, engine_threshold=MiB)
        try:
            with pytest.raises(QuotaError, match=r"^remote: in/put\.bin: writing \d+ bytes would pass"):
                fs.put_file(str(src / "big.bin"), "/in/put.bin")
        finally:
            fs._holder.close()
    finally:
        live.server.stop()
    assert _written(root) == [] and not tmp_files(str(root))
