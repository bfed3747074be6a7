"""Regression tests from a review of tb5:// (tb5sync.fs.filesystem / tb5sync.daemon.fsops) that attacked a live server.

Each test pins one problem that was found and fixed; its docstring describes the problem as it
was (severity and a one-line reproduction), the test asserts the fixed behaviour.
"""

from __future__ import annotations

import os
import resource
import threading
from typing import Any

import pytest
from fsspec.implementations.local import LocalFileSystem

from conftest import LiveServer, served_fs, slurp, start_server, tmp_files
from conftest import tb5fs as tb5
from tb5sync import errors
from tb5sync.wire.rpc import Requester, open_session
from tb5sync.wire.transport import connect

TOKEN = b"s3cret-token"


@pytest.fixture
def srv(tmp_path: Any) -> Any:
    """``(live, fs, root)``: a server on 127.0.0.1:0 over ``tmp_path/root`` holding ``f`` and ``sub/g``."""
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "f").write_bytes(b"hello world")
    (root / "sub" / "g").write_bytes(b"gee")
    with served_fs(str(root)) as (live, fs):
        yield live, fs, live.root


def _raw(live: LiveServer) -> Requester:
    ch = connect("127.0.0.1", live.port, live.token, 5)
    open_session(ch, {"op": "fs"})
    return Requester([ch])


# ---- security ---------------------------------------------------------------------------------------


def test_state_dir_not_listed_through_symlink_to_root(srv: Any) -> None:
    """security: `ls("rootlink")` / `find("sub/up")` list ROOT/.tb5sync (names and sizes of the state db)
    when a symlink inside the root points at the root itself (`_listdir` hides the state dir only when
    the *request* path is "", not when the *resolved* directory is the root)."""
    _, fs, root = srv
    fs.pipe_file("warm", b"x")
    fs.checksum("f")  # make sure the scan cache exists
    assert os.path.isdir(os.path.join(root, ".tb5sync"))
    os.symlink(".", os.path.join(root, "rootlink"))
    os.symlink("..", os.path.join(root, "sub", "up"))
    for listing in (fs.ls("rootlink", detail=False), fs.ls("sub/up", detail=False), fs.find("rootlink", withdirs=True), list(fs.du("sub/up", total=False))):
        assert not any(".tb5sync" in name for name in listing), listing


def test_makedirs_exist_ok_does_not_probe_outside_root(srv: Any, tmp_path: Any) -> None:
    """security (low, oracle): `makedirs("outlink", exist_ok=True)` succeeds when the symlink's target
    outside the root is a directory and fails otherwise (`mkdir` stats the name *following* the link)."""
    _, fs, root = srv
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(str(outside), os.path.join(root, "outlink"))
    assert fs.info("outlink")["type"] == "other"  # the link is described, never followed...
    with pytest.raises(PermissionError):
        fs.ls("outlink")
    with pytest.raises((PermissionError, FileExistsError)):
        fs.makedirs("outlink", exist_ok=True)  # ...but this one answers "is a directory out there"


def test_cp_into_refused_path_is_a_permission_error(srv: Any) -> None:
    """wrong exception: `cp_file("f", ".tb5sync/x")` (or into a symlink leading out) raises a bare
    RemoteOSError, not PermissionError: `copy` re-wraps the PathError from `_parent(dst)` with
    `remote_os_error` (errno None -> base class)."""
    _, fs, root = srv
    os.symlink("/tmp", os.path.join(root, "out"))
    for dst in (".tb5sync/x", "out/x"):
        with pytest.raises(PermissionError):
            fs.cp_file("f", dst)
    with pytest.raises(PermissionError):
        fs.pipe_file(".tb5sync/x", b"1")  # the same refusal through put is a PermissionError


# ---- atomicity / data loss ------------------------------------------------------------------------


def test_exception_inside_with_open_wb_keeps_the_old_file(srv: Any) -> None:
    """data-loss: an exception inside `with fs.open("f", "wb")` commits the partial bytes over the old
    file (fsspec's __exit__ closes = commits). TB5File promises that an unfinished write leaves nothing."""
    _, fs, root = srv
    with pytest.raises(RuntimeError):
        with fs.open("f", "wb") as f:
            f.write(b"half of the new ")
            raise RuntimeError("writer crashed")
    assert slurp(os.path.join(root, "f")) == b"hello world"
    assert tmp_files(root) == []


def test_unclosed_writer_collected_leaves_nothing(srv: Any) -> None:
    """data-loss: a `fs.open(.., "wb")` that is never closed is committed when garbage-collected
    (AbstractBufferedFile.__del__ -> close), contrary to TB5File's docstring."""
    _, fs, root = srv
    f = fs.open("never-closed.bin", "wb")
    f.write(b"partial")
    del f
    import gc

    gc.collect()
    assert not os.path.exists(os.path.join(root, "never-closed.bin"))


def test_pending_temp_files_are_not_listed(srv: Any) -> None:
    """minor: while a write is open, `ls`/`find` show its `.NAME.XXXX.tb5tmp` (a half-written file),
    and so would a concurrent pull; LocalFileSystem transactions keep temp files out of the tree."""
    _, fs, root = srv
    f = fs.open("big.bin", "wb", block_size=1024)
    try:
        f.write(b"x" * 4096)
        f.flush()
        assert len(tmp_files(root)) == 1
        names = fs.find("", withdirs=True)
        assert not [n for n in names if n.endswith(".tb5tmp")], names
    finally:
        f.discard()
        f.closed = True


# ---- fsspec fidelity ------------------------------------------------------------------------------


def test_get_file_of_symlink_gives_its_contents_through_engine(srv: Any, tmp_path: Any) -> None:
    """wrong-result: `get_file("link", lpath)` of a symlink at least `engine_threshold` bytes big makes
    a local *symlink* (copied as a link by the sync engine, here dangling) instead of the file's bytes;
    below the threshold it copies the bytes."""
    live, _, root = srv
    with open(os.path.join(root, "sub", "big"), "wb") as f:
        f.write(os.urandom(5000))
    os.symlink("sub/big", os.path.join(root, "link"))
    fs = tb5(live, engine_threshold=1000)
    try:
        out = str(tmp_path / "got")
        fs.get_file("link", out)
        assert not os.path.islink(out)
        assert slurp(out) == slurp(os.path.join(root, "sub", "big"))
    finally:
        fs._holder.close()


def test_put_file_of_local_symlink_uploads_contents_through_engine(srv: Any, tmp_path: Any) -> None:
    """wrong-result: `put_file(local_symlink, "r")` over `engine_threshold` creates a remote symlink
    (target: the client's absolute local path) instead of uploading the bytes (LocalFileSystem copies them)."""
    live, _, root = srv
    real = tmp_path / "real.bin"
    real.write_bytes(os.urandom(5000))
    os.symlink(str(real), str(tmp_path / "lnk"))
    fs = tb5(live, engine_threshold=1000)
    try:
        fs.put_file(str(tmp_path / "lnk"), "up.bin")
        assert not os.path.islink(os.path.join(root, "up.bin"))
        assert slurp(os.path.join(root, "up.bin")) == real.read_bytes()
    finally:
        fs._holder.close()


def test_rm_recursive_with_maxdepth_matches_local(srv: Any) -> None:
    """wrong-result: `rm("sub", recursive=True, maxdepth=1)` deletes some files, then fails with
    UsageError (it sends the expanded list with recursive=False); LocalFileSystem removes the tree."""
    _, fs, root = srv
    os.makedirs(os.path.join(root, "sub", "deeper"))
    open(os.path.join(root, "sub", "deeper", "h"), "wb").close()
    fs.rm("sub", recursive=True, maxdepth=1)
    assert not os.path.exists(os.path.join(root, "sub"))


def test_exists_matches_local_for_links(srv: Any) -> None:
    """minor: `exists()` raises PermissionError for a symlink leading outside the root and is False for a
    dangling symlink; LocalFileSystem (lexists) says True for both, and fsspec's exists never raises."""
    _, fs, root = srv
    os.symlink("/etc/hostname", os.path.join(root, "abs_link"))
    os.symlink("does/not/exist", os.path.join(root, "dangling"))
    local = LocalFileSystem()
    for name in ("abs_link", "dangling"):  # local: True (followed) and False (broken link)
        assert fs.exists(name) == local.exists(os.path.join(root, name))


def test_touch_and_append_through_symlink_inside_root(srv: Any) -> None:
    """minor: `touch("flink")` and `open("flink", "ab")` on a symlink to a file inside the root fail
    with a bare RemoteOSError(ELOOP); LocalFileSystem touches/appends the target."""
    _, fs, root = srv
    os.symlink("f", os.path.join(root, "flink"))
    fs.touch("flink", truncate=False)
    with fs.open("flink", "ab") as f:
        f.write(b"!")
    assert slurp(os.path.join(root, "f")) == b"hello world!"


def test_token_from_url(tmp_path: Any) -> None:
    """gap (issue 3: "Host, port and token come from the URL or from keyword arguments"):
    `tb5://TOKEN@host:port/` drops the token silently (AuthError), and the URL maps to the same
    cached instance as the token-less one."""
    import fsspec

    live = start_server(str(tmp_path / "t"), token=TOKEN)
    try:
        fs, path = fsspec.core.url_to_fs(f"tb5://{TOKEN.decode()}@127.0.0.1:{live.port}/")
        try:
            assert fs.ls(path, detail=False) == []
        finally:
            fs._holder.close()
    finally:
        live.server.stop()


def test_cat_ranges_of_many_items(srv: Any) -> None:
    """wrong-result: `cat_ranges` (and `cat` of many paths) with more than 100,000 items fails with
    UsageError: the client sends them all in one cat_many request that the server caps at 100,000."""
    _, fs, _ = srv
    out = fs.cat_ranges(["f"] * 100_001, 0, 2)
    assert len(out) == 100_001 and out[-1] == b"he"


def test_find_on_a_tree_whose_listing_exceeds_one_control_message(srv: Any) -> None:
    """wrong-result at scale: `find`/`ls`/`walk`/`du` answer in one control message (<= 32 MiB), so a tree of
    ~250k ordinary files (here: ~2.5k files under very long names, same byte count) fails with
    RemoteError "control message ... exceeds 33554432" although _MAX_FIND promises 2,000,000 entries."""
    _, fs, root = srv
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(60):  # a ~15 KB deep path, built with dir fds (past PATH_MAX)
            name = f"d{i:02d}" + "x" * 250
            os.mkdir(name, dir_fd=fd)
            nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        for i in range(2500):
            os.close(os.open(f"f{i:05d}", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd))
    finally:
        os.close(fd)
    assert len(fs.find("")) == 2502


# ---- robustness -----------------------------------------------------------------------------------


def test_fifo_in_tree_does_not_hang_the_connection(srv: Any) -> None:
    """robustness: `ls("x")` where x/l is a symlink to a FIFO (or `cat("fifo")`) blocks the server's
    connection thread forever in open(O_RDONLY) (no O_NONBLOCK), and every later request on it."""
    _, fs, root = srv
    fifo = os.path.join(root, "fifo")
    os.mkfifo(fifo)
    os.mkdir(os.path.join(root, "x"))
    os.symlink("../fifo", os.path.join(root, "x", "l"))
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(fs.ls("x", detail=False)), daemon=True)
    t.start()
    t.join(3)
    hung = t.is_alive()
    if hung:  # release the server thread blocked in open()
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(3)
        assert not t.is_alive(), "the ls thread is still blocked after the FIFO was opened"
    assert not hung, "ls of a directory holding a symlink to a FIFO hung"
    assert result == [["x/l"]]


def test_bad_expect_argument_does_not_end_the_session(srv: Any) -> None:
    """robustness: a raw `cat` with `expect=[1]` raises AttributeError in FsOps._read, which `serve`
    does not catch: the whole connection ends (every pipelined request on it fails)."""
    live, _, _ = srv
    r = _raw(live)
    try:
        with pytest.raises(errors.Tb5syncError):
            r.call("cat", {"path": "f", "expect": [1]}, timeout=5)
        meta, data = r.call("cat", {"path": "f"}, timeout=5)
        assert bytes(data) == b"hello world"
    finally:
        r.close(bye=True)


def test_first_write_after_reconnect_is_not_lost(srv: Any, tmp_path: Any) -> None:
    """robustness: after the server restarts, the first *write* on a cached instance fails with
    ConnectError although it was never sent (the dead stream is detected before sending); only reads
    are retried. `fs.pipe_file` right after a restart raises."""
    live, fs, root = srv
    assert fs.cat_file("f") == b"hello world"
    live.server.stop()
    live2 = start_server(root)
    try:
        fs.port = live2.port  # same as test_reconnects_after_server_restart
        fs.pipe_file("after-restart", b"1")
        assert slurp(os.path.join(root, "after-restart")) == b"1"
    finally:
        fs._holder.close()
        live2.server.stop()


def test_transaction_of_many_files_does_not_exhaust_server_fds(srv: Any) -> None:
    """robustness/DoS: every pending write keeps two fds open on the server (temp file + directory), up to
    1024 writes per connection. Under the common default `ulimit -n 1024`, a transaction of 600 small
    files fails with EMFILE, and meanwhile every other client of the server gets EMFILE too."""
    live, _, root = srv
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    fs = tb5(live, streams=1)
    try:
        with fs.transaction:
            for i in range(600):
                with fs.open(f"t{i}", "wb") as f:
                    f.write(b"x")
        assert len([n for n in os.listdir(root) if n.startswith("t")]) == 600
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        fs._holder.close()


# ---- outside the fs op, same server: the sync sessions ---------------------------------------------


def test_sync_sessions_cannot_reach_the_state_dir(srv: Any, tmp_path: Any) -> None:
    """security: the fs op refuses ROOT/.tb5sync, but the server's other sessions do not:
    `client.push(src, Remote(host, port, ".tb5sync/"), name="state.sqlite")` replaces the server's
    state database, `client.pull(Remote(.., ".tb5sync/state.sqlite"), out)` reads it, and
    `client.ls(Remote(.., ".tb5sync"))` lists it (server._push/_pull/_ls use resolve_in_root only)."""
    import tb5sync.remote.client as client
    from tb5sync.tree.options import SyncOptions

    live, fs, root = srv
    fs.checksum("f")  # the state db exists now
    state = os.path.join(root, ".tb5sync")
    before = sorted(os.listdir(state))
    src = tmp_path / "evil"
    src.write_bytes(b"not a database")
    pushed = pulled = listed = None
    try:
        client.push(str(src), client.Remote("127.0.0.1", live.port, ".tb5sync/"), SyncOptions(streams=1), token=None, name="evil")
        pushed = True
    except PermissionError:
        pass
    try:
        client.pull(client.Remote("127.0.0.1", live.port, ".tb5sync/state.sqlite"), str(tmp_path / "stolen"), SyncOptions(streams=1), token=None)
        pulled = True
    except PermissionError:
        pass
    try:
        listed = [e.path for e in client.ls(client.Remote("127.0.0.1", live.port, ".tb5sync"))]
    except PermissionError:
        pass
    assert sorted(os.listdir(state)) == before
    assert (pushed, pulled, listed) == (None, None, None)


def test_write_into_a_missing_directory_fails_at_open(tmp_path: Any) -> None:
    """As with LocalFileSystem, open(..., "wb") raises at once when the parent is missing or a file."""
    live = start_server(str(tmp_path / "root"))
    try:
        fs = tb5(live)
        local = LocalFileSystem()
        (tmp_path / "root" / "afile").write_bytes(b"x")
        for mode in ("wb", "xb", "ab"):
            with pytest.raises(FileNotFoundError):
                local.open(str(tmp_path / "root" / "nodir" / "f"), mode)
            with pytest.raises(FileNotFoundError):
                fs.open("nodir/f", mode)
            with pytest.raises(NotADirectoryError):
                fs.open("afile/f", mode)
        with fs.open("top.txt", "wb") as f:  # ROOT itself is always there
            f.write(b"ok")
        assert fs.cat_file("top.txt") == b"ok"
        fs2 = tb5(live, auto_mkdir=True)
        with fs2.open("new/dir/f", "wb") as f:
            f.write(b"made")
        assert fs.cat_file("new/dir/f") == b"made"
    finally:
        live.server.stop()


def test_touch_of_a_fifo_answers_at_once(srv: Any) -> None:
    """`touch` of a FIFO without a reader is refused within a second (its open() is O_NONBLOCK),
    and the connection keeps serving."""
    live, fs, root = srv
    fifo = os.path.join(root, "fifo")
    os.mkfifo(fifo)
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fs.touch("fifo", truncate=False))
        except Exception as exc:
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(1.0)
    hung = t.is_alive()
    if hung:  # release the server thread blocked in open()
        os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))
        t.join(3)
    assert not hung, "touch of a FIFO blocked the server"
    assert isinstance(out[0], Exception) and "not a regular file" in str(out[0]), out
    assert fs.cat("f") == b"hello world"
