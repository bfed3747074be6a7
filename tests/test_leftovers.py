"""Nothing left behind, concurrent writers never mix, the first error is the one reported, state is private.

Expectations from the issue: an interrupted run leaves no ``.tb5tmp`` (or the next run removes
it, only when no live run owns it); two runs writing the same path with the same size and mtime
each write their own work file and the result is exactly one version; a cleanup's error never
replaces the error that caused it; ``.tb5sync`` is 0700 and ``state.sqlite`` 0600 under umask 022.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import snapshot, start_server, tb5fs, tmp_files

import tb5sync
import tb5sync.roles.destination as destination_mod
import tb5sync.daemon.fsops as fsops_mod
from tb5sync.remote.client import default_state_dir
from tb5sync._os.paths import claim_temp, release_temp
from tb5sync.roles.largefile import LargeFileJob
from tb5sync.roles.receiver import Receiver
from tb5sync.tree.scan import scan, scan_tree
from tb5sync.roles.sender import Sender
from tb5sync.tree.state import TreeState

T0 = 1_600_000_000_000_000_000
MiB = 1024 * 1024


def _state(dst: str) -> str:
    """The state directory of the local destination ``dst``: in the user's cache directory, not ``dst/.tb5sync``."""
    where = default_state_dir(dst)
    assert where is not None, dst
    return where


def write(path: str, data: bytes, mtime_ns: int = T0) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def slurp(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class LocalLink:
    """An in-process link to ``sender`` (futures settled at once)."""

    streams = 1
    wire_bytes = 0

    def __init__(self, sender: Sender) -> None:
        self.sender = sender

    def submit(self, method: str, **args: Any) -> Any:
        from concurrent.futures import Future

        fut: Future[Any] = Future()
        try:
            fut.set_result(getattr(self.sender, method)(**args))
        except BaseException as exc:
            fut.set_exception(exc)
        return fut

    def recycle(self, parts: Any) -> None:
        pass


# ---- temporary files are never listed ------------------------------------------------------


def test_temporary_files_are_not_listed_nor_synced(tmp_path: Path) -> None:
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write(os.path.join(src, "d", "f"), b"f")
    write(os.path.join(src, "d", ".f.0123abcd.tb5tmp"), b"in flight")
    write(os.path.join(src, ".x.tb5tmp"), b"not our pattern: a user's file")
    assert [e.path for e in scan(src)] == ["", ".x.tb5tmp", "d", "d/f"]
    assert scan_tree(src).temps == ["d/.f.0123abcd.tb5tmp"]
    tb5sync.sync(src + "/", dst)
    assert not os.path.exists(os.path.join(dst, "d", ".f.0123abcd.tb5tmp"))
    assert slurp(os.path.join(dst, ".x.tb5tmp")) == b"not our pattern: a user's file"


def test_pull_does_not_serve_a_push_in_flight(tmp_path: Path) -> None:
    live = start_server(str(tmp_path / "root"))
    try:
        write(os.path.join(live.root, "a", "f"), b"f")
        write(os.path.join(live.root, "a", ".g.89abcdef.tb5tmp"), b"half written")
        out = str(tmp_path / "out")
        tb5sync.sync(live.url("a/"), out)
        assert sorted(os.listdir(out)) == ["f"]  # a pulled destination's state is in the user's cache directory
    finally:
        live.server.stop()


def test_sender_never_serves_state_partial_or_temporary_files(tmp_path: Path) -> None:
    """Asked by name (a crafted receiver), the sender refuses what no listing of it names."""
    root = str(tmp_path / "root")
    write(os.path.join(root, "f"), b"f")
    write(os.path.join(root, "d", ".f.0123abcd.tb5tmp"), b"in flight")
    state = TreeState(root)
    write(os.path.join(root, ".tb5sync", "partial", "ab" * 32), b"partial data")
    sender = Sender(root, state=state)
    try:
        for path in (".tb5sync/state.sqlite", ".tb5sync/partial/" + "ab" * 32, "d/.f.0123abcd.tb5tmp"):
            with pytest.raises(tb5sync.RemoteNotFoundError):
                sender.chunk_list(path)
            meta, _parts = sender.read_files([path])
            assert meta["files"] == [None], path
        assert sender.chunk_list("f")["size"] == 1
    finally:
        sender.close()
        state.close()


# ---- interrupted runs ------------------------------------------------------------------------


def test_interrupt_while_writing_a_small_file_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Python writer interrupted mid-write (the Cython batch writer cannot be interrupted inside
    a file; its failures mid-write are tests/test_small_writes.py's)."""
    monkeypatch.setattr(destination_mod, "_cy_write_files", None)
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write(os.path.join(src, "f"), b"x" * 1000)

    def interrupted(fd: int, data: Any) -> None:
        os.write(fd, b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(destination_mod, "write_all", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tb5sync.sync(src + "/", dst)
    assert tmp_files(dst) == []
    assert not os.path.exists(os.path.join(dst, "f"))


def test_interrupt_during_a_large_file_without_state_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write(os.path.join(src, "big"), os.urandom(6 * MiB))
    fetch = LargeFileJob._fetch_ranges

    def interrupted(self: LargeFileJob, *args: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(LargeFileJob, "_fetch_ranges", interrupted)
    sender = Sender(src)
    try:
        with pytest.raises(KeyboardInterrupt):
            Receiver(dst, LocalLink(sender)).run()  # no state: the work file is a temporary file
    finally:
        sender.close()
    assert tmp_files(str(tmp_path)) == []
    monkeypatch.setattr(LargeFileJob, "_fetch_ranges", fetch)


def test_stale_temporary_files_are_removed_by_the_next_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write(os.path.join(src, "d", "f"), b"f")
    stale = os.path.join(dst, "d", ".f.00000001.tb5tmp")
    live = os.path.join(dst, "d", ".f.00000002.tb5tmp")
    claimed = os.path.join(dst, "d", ".g.00000003.tb5tmp")
    link = os.path.join(dst, "d", ".l.00000004.tb5tmp")
    user = os.path.join(dst, "d", "user.tb5tmp")
    for p in (stale, live, claimed, user):
        write(p, b"left")
    os.symlink("f", link)
    holder = os.open(live, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)  # a live writer (another process would hold it the same way)
    claim_temp(os.path.basename(claimed))  # a streamed fs write of this process
    try:
        tb5sync.sync(src + "/", dst)  # young files (STALE_GRACE): nothing removed
        assert sorted(os.listdir(os.path.join(dst, "d"))) == sorted(
            ["f", "user.tb5tmp", *(os.path.basename(p) for p in (stale, live, claimed, link))]
        )
        monkeypatch.setattr(destination_mod, "STALE_GRACE", 0.0)
        tb5sync.sync(src + "/", dst)
        assert sorted(os.listdir(os.path.join(dst, "d"))) == sorted(["f", "user.tb5tmp", os.path.basename(live), os.path.basename(claimed)])
    finally:
        os.close(holder)
        release_temp(os.path.basename(claimed))


def test_sigkill_leftovers_are_removed_by_the_next_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local sync killed with SIGKILL while writing; the next run finishes it and leaves no temporary file."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    for i in range(400):
        write(os.path.join(src, f"d{i % 4}", f"f{i:03d}"), os.urandom(20_000))
    write(os.path.join(src, "big"), os.urandom(30 * MiB))
    code = "import sys, tb5sync; tb5sync.sync(sys.argv[1] + '/', sys.argv[2])"
    proc = subprocess.Popen([sys.executable, "-c", code, src, dst])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            if os.path.isdir(os.path.join(dst, "d0")) and os.listdir(os.path.join(dst, "d0")):
                break
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
    monkeypatch.setattr(destination_mod, "STALE_GRACE", 0.0)
    tb5sync.sync(src + "/", dst)
    assert tmp_files(dst) == []
    assert snapshot(dst) == snapshot(src)


# ---- large files: work files ---------------------------------------------------------------


def test_partial_in_use_by_a_live_run_is_not_shared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs of the same path, same size and mtime, different content: each its own work file; the last commit wins whole."""
    a, b, dst = str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "dst")
    va, vb = os.urandom(9 * MiB), os.urandom(9 * MiB)
    write(os.path.join(a, "big"), va)
    write(os.path.join(b, "big"), vb)
    fetch = LargeFileJob._fetch_ranges
    inner: list[Any] = []
    started: list[bool] = []

    def b_runs_in_between(self: LargeFileJob, *args: Any) -> None:
        if not started:
            started.append(True)
            inner.append(tb5sync.sync(b + "/", dst))  # B, start to end, while A holds its partial file
        fetch(self, *args)

    monkeypatch.setattr(LargeFileJob, "_fetch_ranges", b_runs_in_between)
    stats_a = tb5sync.sync(a + "/", dst)
    assert inner and inner[0].files_transferred == 1 and stats_a.files_transferred == 1
    assert slurp(os.path.join(dst, "big")) == va  # A committed last: exactly A, not a mix
    assert tmp_files(dst) == []
    assert os.listdir(os.path.join(_state(dst), "partial")) == []


def test_interrupted_partial_is_kept_and_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    data = os.urandom(12 * MiB)
    write(os.path.join(src, "big"), data)
    fetch = LargeFileJob._fetch_ranges

    def fail(self: LargeFileJob, *args: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(LargeFileJob, "_fetch_ranges", fail)
    with pytest.raises(tb5sync.DestinationError, match="No space"):
        tb5sync.sync(src + "/", dst)
    assert len(os.listdir(os.path.join(_state(dst), "partial"))) == 1  # kept for resume, no temp file
    assert tmp_files(dst) == []
    monkeypatch.setattr(LargeFileJob, "_fetch_ranges", fetch)
    tb5sync.sync(src + "/", dst)
    assert slurp(os.path.join(dst, "big")) == data
    assert os.listdir(os.path.join(_state(dst), "partial")) == []


@pytest.mark.parametrize("fail_copy", [False, True], ids=["copied", "disk-full"])
def test_commit_across_file_systems(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_copy: bool) -> None:
    """A rename the kernel refuses with EXDEV (a mount below the root) is a copy beside the final path; a full disk leaves nothing."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    data = os.urandom(6 * MiB)
    write(os.path.join(src, "big"), data)
    real_rename = os.rename

    def rename(a: Any, b: Any, *args: Any, **kw: Any) -> None:
        if isinstance(a, str) and len(a) == 64 and kw.get("src_dir_fd") is not None:  # the partial file's key
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        real_rename(a, b, *args, **kw)

    monkeypatch.setattr(destination_mod.os, "rename", rename)
    if fail_copy:

        def full(src_fd: int, dst_fd: int, n: int) -> None:
            os.pwrite(dst_fd, b"some", 0)
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(destination_mod, "_copy_fd", full)
        with pytest.raises(tb5sync.DestinationError, match="No space"):
            tb5sync.sync(src + "/", dst)
        assert tmp_files(dst) == []
        assert not os.path.exists(os.path.join(dst, "big"))
    else:
        tb5sync.sync(src + "/", dst)
        assert slurp(os.path.join(dst, "big")) == data
        assert tmp_files(dst) == []
        assert os.listdir(os.path.join(_state(dst), "partial")) == []


# ---- the first error is the one reported ------------------------------------------------------


@pytest.mark.parametrize("how", ["pieces", "streamed"])
def test_fs_disk_full_during_a_streamed_write_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """ENOSPC on the server during a large write (``put_piece``; ``wwrite`` on a server without
    pieces) reaches the fsspec caller as ENOSPC, not as the cleanup's 'no open write'/'no open put'."""
    import tb5sync.daemon.services as services_mod

    if how == "streamed":
        monkeypatch.setattr(services_mod, "FS_CAPABILITIES", {})
    live = start_server(str(tmp_path / "root"))
    calls = [0]
    name = "write_all" if how == "streamed" else "pwrite_all"
    real = getattr(fsops_mod, name)

    def full(fd: int, data: Any, *offset: int) -> None:
        calls[0] += 1
        raise OSError(errno.ENOSPC, "No space left on device")

    try:
        fs = tb5fs(live)
        monkeypatch.setattr(fsops_mod, name, full)
        with pytest.raises(OSError) as info:
            fs.pipe("big.bin", os.urandom(17 * MiB))  # more than one request: a streamed write
        assert info.value.errno == errno.ENOSPC, repr(info.value)
        assert "no open write" not in str(info.value) and "no open put" not in str(info.value)
        assert calls[0] >= 1
        assert tmp_files(live.root) == []
        assert not os.path.exists(os.path.join(live.root, "big.bin"))
        monkeypatch.setattr(fsops_mod, name, real)
    finally:
        live.server.stop()


# ---- state -------------------------------------------------------------------------------------


def test_state_is_private_under_umask_022(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
        write(os.path.join(src, "private", "names"), b"x")
        tb5sync.sync(src + "/", dst)
    finally:
        os.umask(old)
    sd = os.path.join(_state(dst))
    assert stat.S_IMODE(os.stat(sd).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(sd, "partial")).st_mode) == 0o700
    for name in os.listdir(sd):
        if name.startswith("state.sqlite"):
            assert stat.S_IMODE(os.stat(os.path.join(sd, name)).st_mode) == 0o600, name


def test_state_made_by_an_older_version_is_made_private(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    os.makedirs(os.path.join(root, ".tb5sync", "partial"), mode=0o755)
    os.chmod(os.path.join(root, ".tb5sync"), 0o755)
    db = os.path.join(root, ".tb5sync", "state.sqlite")
    sqlite3.connect(db).close()
    os.chmod(db, 0o644)
    TreeState(root).close()
    assert stat.S_IMODE(os.stat(os.path.join(root, ".tb5sync")).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(db).st_mode) == 0o600


def test_corrupt_state_is_rebuilt(tmp_path: Path) -> None:
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write(os.path.join(src, "f"), b"f")
    tb5sync.sync(src + "/", dst)
    db = os.path.join(_state(dst), "state.sqlite")
    with open(db, "r+b") as f:
        f.write(b"this is not an SQLite database at all" * 10)
    for suffix in ("-wal", "-shm"):
        if os.path.exists(db + suffix):
            os.unlink(db + suffix)
    write(os.path.join(src, "g"), b"g")
    tb5sync.sync(src + "/", dst)
    state = TreeState(dst, state_dir=_state(dst))
    try:
        assert state.persistent
        assert state.lookup("g", 1, T0, os.stat(os.path.join(dst, "g")).st_ino) is not None
    finally:
        state.close()
    assert os.path.exists(db + ".corrupt")


def test_partials_are_capped_and_live_ones_kept(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    state = TreeState(root)
    pdir = os.path.join(root, ".tb5sync", "partial")
    now = time.time()
    for i, age in enumerate([3000, 2000, 1000]):
        p = os.path.join(pdir, f"{i:064x}")
        write(p, os.urandom(MiB))
        os.utime(p, (now - age, now - age))
    old = os.path.join(pdir, "f" * 64)
    write(old, b"abandoned")
    os.utime(old, (now - 8 * 86400, now - 8 * 86400))
    holder = os.open(os.path.join(pdir, f"{0:064x}"), os.O_RDONLY)  # the oldest is in use by a live run
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        state.partial_cap = 2 * MiB + 100_000
        kept = state.prune_partials()
    finally:
        os.close(holder)
        state.close()
    assert sorted(os.listdir(pdir)) == [f"{0:064x}", f"{2:064x}"]  # live kept; then newest within the cap
    assert kept <= 2 * MiB + 100_000


# ---- durability ---------------------------------------------------------------------------------


def _record_durability(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    events: list[tuple[str, Any]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        events.append(("fsync-dir" if stat.S_ISDIR(st.st_mode) else "fsync-file", st.st_ino))
        real_fsync(fd)

    def rename(a: Any, b: Any, *args: Any, **kw: Any) -> None:
        real_rename(a, b, *args, **kw)
        events.append(("rename", b))

    monkeypatch.setattr(destination_mod.os, "fsync", fsync)
    monkeypatch.setattr(destination_mod.os, "rename", rename)
    return events


@pytest.mark.parametrize("size", [100, 6 * MiB], ids=["small", "large"])
def test_fsync_orders_data_rename_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int, write_impl: str) -> None:
    """With fsync: the file's data is flushed, then it is renamed into place, then its directory is flushed.

    The Cython batch writer's calls are not Python's: it is seen asked to fsync (it flushes each
    file before its ``renameat``, ext/_write.pyx) and its files' directory is flushed after it."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write(os.path.join(src, "d", "f"), os.urandom(size))
    events = _record_durability(monkeypatch)
    if write_impl != "python" and destination_mod._cy_write_files is not None:
        cy_write = destination_mod._cy_write_files

        def recorded(files: list[Any], fsync: bool = False, tmpfile: bool = False) -> list[Any]:
            out = cy_write(files, fsync, tmpfile)
            for f, res in zip(files, out):
                if fsync and not isinstance(res, int):
                    events.extend([("fsync-file", res[2]), ("rename", os.fsdecode(f[2]))])
            return out

        monkeypatch.setattr(destination_mod, "_cy_write_files", recorded)
    tb5sync.sync(src + "/", dst, fsync=True)
    ino_f = os.stat(os.path.join(dst, "d", "f")).st_ino
    ino_d = os.stat(os.path.join(dst, "d")).st_ino
    i_data = events.index(("fsync-file", ino_f))
    i_rename = events.index(("rename", "f"))
    i_dir = events.index(("fsync-dir", ino_d))
    assert i_data < i_rename < i_dir, events


@pytest.mark.parametrize("refused", [False, True], ids=["fullfsync", "refused-then-fsync"])
def test_fsync_is_full_fsync_where_the_system_has_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused: bool) -> None:
    """macOS: ``fsync`` leaves data in the drive's cache; ``--fsync`` flushes every file and
    directory with ``fcntl(F_FULLFSYNC)`` (forced here: the call is stood in for, as on a Mac),
    and with ``fsync`` where the file system refuses it (ENOTSUP). Stores and their packs too."""
    import tb5sync._os.io as _io

    calls: list[tuple[str, int]] = []
    real_fsync = os.fsync

    class FakeFcntl:
        @staticmethod
        def fcntl(fd: int, cmd: int) -> int:
            assert cmd == 12345
            calls.append(("full", os.fstat(fd).st_ino))
            if refused:
                raise OSError(errno.ENOTSUP, "not supported")
            return 0

    def fsync(fd: int) -> None:
        calls.append(("fsync", os.fstat(fd).st_ino))
        real_fsync(fd)

    monkeypatch.setattr(_io, "_F_FULLFSYNC", 12345)
    monkeypatch.setattr(_io, "_fcntl", FakeFcntl)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(destination_mod, "_cy_write_files", None)  # the C writer takes the same choice at compile time
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write(os.path.join(src, "d", "f"), b"small")
    write(os.path.join(src, "big"), os.urandom(6 * MiB))
    tb5sync.sync(src + "/", dst, fsync=True)
    for p in ("d/f", "big", "d", ""):
        ino = os.stat(os.path.join(dst, p)).st_ino
        assert ("full", ino) in calls, p
        assert (("fsync", ino) in calls) == refused, p
    calls.clear()
    from tb5sync.store import Store

    st = Store(str(tmp_path / "store"))
    try:
        st.put("r", src)
    finally:
        st.close()
    assert [c for c in calls if c[0] == "full"], calls  # the pack's flush
    assert all(c[0] == "full" or refused for c in calls), calls


def test_no_fsync_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write(os.path.join(src, "f"), b"f")
    events = _record_durability(monkeypatch)
    tb5sync.sync(src + "/", dst)
    assert [e for e in events if e[0].startswith("fsync")] == []
    from tb5sync.tree.options import SyncOptions

    assert SyncOptions.from_wire({"fsync": True}).fsync is True
    with pytest.raises(tb5sync.UsageError):
        SyncOptions.from_wire({"fsync": "yes"})


def test_ctrl_c_leaves_no_temporary_file(tmp_path: Path) -> None:
    """The issue's Ctrl-C: SIGINT at spread-out moments of local syncs; not one ``.tb5tmp`` is left, without a re-run."""
    src = str(tmp_path / "src")
    for i in range(600):
        write(os.path.join(src, f"d{i % 6}", f"f{i:03d}"), os.urandom(3000))
    code = "import sys, tb5sync; tb5sync.sync(sys.argv[1] + '/', sys.argv[2])"
    interrupted = 0
    for k in range(8):
        dst = str(tmp_path / f"dst{k}")
        proc = subprocess.Popen([sys.executable, "-c", code, src, dst], stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and proc.poll() is None:  # wait until files are being written
                if os.path.isdir(os.path.join(dst, "d0")):
                    break
                time.sleep(0.001)
            time.sleep(0.003 * k)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        interrupted += proc.returncode != 0
        assert tmp_files(dst) == [], f"round {k}: {err.decode()[-500:]}"
    assert interrupted > 0  # at least some rounds were really interrupted


_STATE_WRITER = """
import os, sys
from tb5sync.tree.state import TreeState
state = TreeState(sys.argv[1])
print("ready", flush=True)
i = 0
while True:
    state.record_many([(f"d{i % 50}/f{j}", j, i, j, [(os.urandom(32), 1000)] * 20) for j in range(200)])
    state.forget([f"d{(i + 25) % 50}"])
    i += 1
"""


def test_state_survives_sigkill_while_writing(tmp_path: Path) -> None:
    """SIGKILL during state transactions: the database opens, passes SQLite's integrity check, and is used."""
    root = str(tmp_path / "root")
    os.makedirs(root)
    for delay in (0.05, 0.2, 0.5):
        proc = subprocess.Popen([sys.executable, "-c", _STATE_WRITER, root], stdout=subprocess.PIPE)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.wait(30)
            if proc.stdout:
                proc.stdout.close()
        state = TreeState(root)
        try:
            assert state.persistent
            with state._lock:
                assert state._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            state.record("x", 1, 2, 3, [(bytes(32), 1)])
            assert state.lookup("x", 1, 2, 3) is not None
        finally:
            state.close()
        assert not os.path.exists(os.path.join(root, ".tb5sync", "state.sqlite.corrupt"))
