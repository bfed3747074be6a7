"""fs sessions answered by worker processes (``serve --fs-workers N``, tb5sync.daemon.fsworkers):
the same answers as fsspec's LocalFileSystem over the same tree, with every rule of the server
kept (tokens, --allow, --max-sessions, read-only, the path jail), one client's connections
sharing one worker (a file put in pieces over all of them, listing pages), the workers stopped
with the server (SIGTERM included), and the portable path ($TB5SYNC_FS_WORKERS_PORTABLE=1,
every session in the server's process)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from fsspec.implementations.local import LocalFileSystem

from conftest import start_server, wait_for
from conftest import tb5fs as tb5
from tb5sync.daemon import fsworkers
from tb5sync.errors import AuthError, BusyError, PathError, ReadOnlyError, RefusedError, Tb5syncError

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(fsworkers.available() is not None, reason=f"no fs workers here: {fsworkers.available()}")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _children(pid: int) -> list[int]:
    """Live child processes of ``pid`` (from /proc: the workers run only on Linux)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rpartition(")")[2].split()[1]) == pid:
                        out.append(int(name))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _tree(root: Path) -> bytes:
    (root / "d").mkdir(parents=True)
    data = random.Random(1).randbytes(9 * 1024 * 1024 + 17)  # more than two 4 MiB pieces
    (root / "big.bin").write_bytes(data)
    (root / "small.txt").write_bytes(b"hello world\n")
    for i in range(30):
        (root / "d" / f"f{i:02d}").write_bytes(bytes([i]) * (i + 1))
    return data


def test_answers_equal_local_ones_and_a_clients_connections_share_a_worker(tmp_path: Path) -> None:
    root = tmp_path / "root"
    data = _tree(root)
    live = start_server(str(root), fs_workers=2)
    fs = tb5(live, streams=3)
    local = LocalFileSystem()
    try:
        pids = live.server.fs_worker_pids
        assert len(pids) == 2
        assert fs.cat_file("small.txt") == local.cat_file(str(root / "small.txt"))
        assert fs.cat_file("big.bin") == data
        assert fs.cat_file("big.bin", 100, 5000) == data[100:5000]
        assert sorted(fs.ls("d", detail=False)) == sorted(f"d/{n}" for n in os.listdir(root / "d"))
        assert fs.info("d/f03")["size"] == local.info(str(root / "d" / "f03"))["size"]
        got = fs.cat_ranges(["d/f05", "big.bin"], [0, 10], [3, 20])
        assert got == [b"\x05" * 3, data[10:20]]
        # a file in pieces over every connection: one worker holds the put for all of them
        (tmp_path / "up.bin").write_bytes(data[::-1])
        fs.put_file(str(tmp_path / "up.bin"), "up.bin")
        assert (root / "up.bin").read_bytes() == data[::-1]
        fs.rm("up.bin")
        assert not (root / "up.bin").exists()
        with pytest.raises(FileNotFoundError):
            fs.info("missing")
        # the jail: nothing outside the root, nor the state directory
        (tmp_path / "outside.txt").write_text("secret")
        with pytest.raises((PathError, PermissionError, FileNotFoundError)):
            fs.cat_file("../outside.txt")
        with pytest.raises((PathError, PermissionError)):
            fs.ls(".tb5sync")
        pool = live.server._fs_pool
        assert pool is not None and pool.handed == 4  # every connection of the client, none in process
    finally:
        fs._holder.close()
        live.server.stop()
    for pid in pids:
        wait_for(lambda pid=pid: not _alive(pid), 10, f"fs worker {pid} to exit")


def test_read_only_token_allow_and_session_cap_still_hold(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _tree(root)
    live = start_server(str(root), fs_workers=1, read_only=True, token=b"tok-123", max_sessions=4)
    try:
        fs = tb5(live, streams=3)  # 4 sessions: the cap
        try:
            assert fs.cat_file("small.txt") == b"hello world\n"
            with pytest.raises(ReadOnlyError):
                fs.pipe_file("new.txt", b"x")
            assert not (root / "new.txt").exists()
            with pytest.raises(BusyError):  # the handed sessions still count against --max-sessions
                tb5(live, streams=1).info("small.txt")
        finally:
            fs._holder.close()
        wait_for(lambda: live.server.connections == 0, 10, "the sessions to end")
        from tb5sync.fs.filesystem import TB5FileSystem

        with pytest.raises(AuthError):
            TB5FileSystem(host="127.0.0.1", port=live.port, token=b"wrong", skip_instance_cache=True).info("small.txt")
    finally:
        live.server.stop()
    live = start_server(str(root), fs_workers=1, allow=["10.9.8.7"])
    try:
        with pytest.raises((RefusedError, Tb5syncError)):
            tb5(live).info("small.txt")
    finally:
        live.server.stop()


def test_stop_ends_the_sessions_a_worker_serves_and_leaves_no_partial_file(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _tree(root)
    live = start_server(str(root), fs_workers=2)
    fs = tb5(live, streams=2)
    pids = live.server.fs_worker_pids
    f = fs.open("half.bin", "wb")
    try:
        f.write(b"x" * (12 << 20))
        f.flush()  # the write is open on the server: its temporary file exists
        wait_for(lambda: any(n.endswith(".tb5tmp") for n in os.listdir(root)), 10, "the write to start")
        t = time.monotonic()
        live.server.stop()
        assert time.monotonic() - t < 10
        with pytest.raises((Tb5syncError, OSError)):
            f.write(b"y" * (12 << 20))
            f.close()
    finally:
        fs._holder.close()
        live.server.stop()
    assert not (root / "half.bin").exists()
    assert not [n for n in os.listdir(root) if n.endswith(".tb5tmp")]
    for pid in pids:
        assert not _alive(pid)


def test_portable_path_serves_every_session_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fsworkers.PORTABLE_ENV, "1")
    root = tmp_path / "root"
    data = _tree(root)
    live = start_server(str(root), fs_workers=2)
    fs = tb5(live, streams=2)
    try:
        assert fs.cat_file("big.bin") == data
        assert live.server.fs_worker_pids == [] and live.server._fs_pool is None
    finally:
        fs._holder.close()
        live.server.stop()


def test_cli_serve_with_workers_stops_them_on_sigterm(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _tree(root)
    p = subprocess.Popen([sys.executable, "-m", "tb5sync.cli", "serve", str(root), "--bind", "127.0.0.1:0",
                          "--fs-workers", "2"], stderr=subprocess.PIPE, text=True)
    try:
        assert p.stderr is not None
        line = p.stderr.readline()
        port = int(line.rsplit(":", 1)[1].split()[0])
        from tb5sync.fs.filesystem import TB5FileSystem

        fs = TB5FileSystem(host="127.0.0.1", port=port, skip_instance_cache=True)
        assert fs.cat_file("small.txt") == b"hello world\n"
        kids = _children(p.pid)
        assert len(kids) == 2
        fs._holder.close()
    finally:
        p.send_signal(signal.SIGTERM)
        err = p.communicate(timeout=30)[1]
    assert p.returncode == 0, err
    for pid in kids:
        wait_for(lambda pid=pid: not _alive(pid), 10, f"fs worker {pid} to exit")


def test_a_worker_stopped_by_sigterm_closes_its_sessions_and_the_server_serves_on(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _tree(root)
    live = start_server(str(root), fs_workers=1)
    fs = tb5(live, streams=1)
    try:
        (pid,) = live.server.fs_worker_pids
        f = fs.open("half.bin", "wb")
        f.write(b"x" * (12 << 20))
        f.flush()
        wait_for(lambda: any(n.endswith(".tb5tmp") for n in os.listdir(root)), 10, "the write to start")
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not _alive(pid) or live.server._fs_pool.workers[0].proc.poll() is not None, 10, "the worker to exit")
        assert live.server._fs_pool.workers[0].proc.wait(10) == 0  # it stopped, not killed
        assert not [n for n in os.listdir(root) if n.endswith(".tb5tmp")]
        with pytest.raises((Tb5syncError, OSError)):
            f.write(b"y" * (12 << 20))
            f.close()
        assert not (root / "half.bin").exists()
        fs2 = tb5(live, streams=1)  # a new client: served in the server's process now
        try:
            assert fs2.cat_file("small.txt") == b"hello world\n"
        finally:
            fs2._holder.close()
    finally:
        fs._holder.close()
        live.server.stop()


@pytest.mark.parametrize("bad", [-1, 65, True, "2"])
def test_a_bad_worker_count_is_refused(tmp_path: Path, bad: Any) -> None:
    from tb5sync.daemon.server import Server
    from tb5sync.errors import UsageError

    with pytest.raises(UsageError, match="fs_workers"):
        Server(str(tmp_path), host="127.0.0.1", port=0, fs_workers=bad)


def test_hands_on_a_stream_pair_keep_their_descriptors_apart() -> None:
    """The pair is a Unix *stream* socket pair (macOS has no SOCK_SEQPACKET Unix sockets): hands
    sent back to back are read one at a time, each with its own descriptor, and an end of stream
    is None."""
    import socket

    a, b = fsworkers._pair()
    assert a.type == socket.SOCK_STREAM
    files = [os.open(os.devnull, os.O_RDONLY) for _ in range(3)]
    try:
        for sid, fd in zip((7, 8, 1 << 40), files):
            socket.send_fds(a, [fsworkers._MSG.pack(sid)], [fd])
        got = [fsworkers._recv_hand(b) for _ in range(3)]
        assert [g[0] for g in got if g] == [7, 8, 1 << 40]
        for g in got:
            assert g is not None and len(g[1]) == 1
            assert os.path.samestat(os.fstat(g[1][0]), os.fstat(files[0]))
            os.close(g[1][0])
        a.close()
        assert fsworkers._recv_hand(b) is None
    finally:
        for fd in files:
            os.close(fd)
        b.close()


def test_a_worker_killed_by_sigkill_leaves_no_temporary_file(tmp_path: Path) -> None:
    # the module docstring: "A worker that dies ends its sessions as a broken connection", and a
    # broken connection's open write leaves neither its final path nor its temporary file
    root = tmp_path / "root"
    _tree(root)
    live = start_server(str(root), fs_workers=1)
    fs = tb5(live, streams=1)
    try:
        (pid,) = live.server.fs_worker_pids
        f = fs.open("half.bin", "wb")
        f.write(b"x" * (12 << 20))
        f.flush()
        wait_for(lambda: any(n.endswith(".tb5tmp") for n in os.listdir(root)), 10, "the write to start")
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: live.server._fs_pool.workers[0].dead, 10, "the server to see the worker gone")
        with pytest.raises((Tb5syncError, OSError)):
            f.write(b"y" * (12 << 20))
            f.close()
        fs2 = tb5(live, streams=1)  # later sessions are served in the server's process
        try:
            assert fs2.cat_file("small.txt") == b"hello world\n"
        finally:
            fs2._holder.close()
        assert not (root / "half.bin").exists()
        wait_for(lambda: not [n for n in os.listdir(root) if n.endswith(".tb5tmp")], 5, "the temporary file to go")
    finally:
        fs._holder.close()
        live.server.stop()


@pytest.mark.xfail(strict=False, reason="known intermittent hang: the first hand to a just-started worker is "
                   "sometimes not answered for minutes on a loaded machine (seen 2 of ~12 runs; a 30 s wait seen "
                   "once, as long as the state database's busy timeout); under investigation")
def test_a_sync_into_the_root_leaves_a_workers_idle_put_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a file put in pieces by a worker holds no descriptor between pieces; a sync's stale sweep in
    # the server's process must still know the write is live (as it does without workers)
    import tb5sync
    from tb5sync.roles import destination
    from tb5sync.wire.rpc import Requester, open_session
    from tb5sync.wire.transport import connect

    monkeypatch.setattr(destination, "STALE_GRACE", 0.0)  # the sweep takes a temp file idle this long
    root = tmp_path / "root"
    root.mkdir()
    src = tmp_path / "src"
    src.mkdir()
    (src / "s.txt").write_bytes(b"s")
    live = start_server(str(root), fs_workers=1)
    ch = connect("127.0.0.1", live.port, None)
    r = Requester([ch])
    try:
        open_session(ch, {"op": "fs", "group": "g"})
        pid = r.call("put_open", {"path": "up.bin", "size": 2 * 65536})["id"]
        r.submit_data("put_piece", {"id": pid, "offset": 0}, [b"a" * 65536], channel=0).result(30)
        tb5sync.sync(str(src) + "/", f"tb5://127.0.0.1:{live.port}/")
        r.submit_data("put_piece", {"id": pid, "offset": 65536}, [b"b" * 65536], channel=0).result(30)
        r.call("put_close", {"id": pid})
        assert (root / "up.bin").read_bytes() == b"a" * 65536 + b"b" * 65536
    finally:
        r.close()
        live.server.stop()
