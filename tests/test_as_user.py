"""Permission paths tested for real: the unprivileged part runs as another user.

CI runs as root, which ignores permission bits; these tests run the ``tb5sync`` command (and a
server) as ``nobody`` through ``setpriv --reuid --regid --clear-groups`` instead of skipping.
When the tests themselves do not run as root they already are unprivileged and run the
command as they are; they skip only when root cannot switch (no ``setpriv``, no ``nobody``).
Expected outcomes are rsync's (3.x, run as the same user on the same tree): a destination
directory that cannot be written (another user's) is named, with the reason, for each entry
that could not be synced, everything else is synced, and the exit status is 23 (tb5sync's
``PartialTransferError``); nothing half-written is left behind; and another user cannot read
tb5sync's state of a tree (its state directory 0700, ``state.sqlite`` 0600). A directory of
the user's own with mode 0555 is no obstacle: rsync (and tb5sync) give it ``u+w`` while
writing into it (``tests/test_readonly_dirs_vs_rsync.py``).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest
from conftest import tmp_files

import tb5sync

TB5SYNC = os.path.join(os.path.dirname(sys.executable), "tb5sync")


def _nobody() -> tuple[int, int] | None:
    try:
        pw = pwd.getpwnam("nobody")
    except KeyError:
        return None
    return pw.pw_uid, pw.pw_gid


def as_user(cmd: list[str]) -> list[str]:
    """``cmd`` run as an unprivileged user: through setpriv as ``nobody`` when we are root, else as we are."""
    if os.geteuid() != 0:
        return cmd
    ids = _nobody()
    setpriv = shutil.which("setpriv")
    if ids is None or setpriv is None:
        pytest.skip("running as root without setpriv or a 'nobody' user: cannot drop privileges")
    return [setpriv, f"--reuid={ids[0]}", f"--regid={ids[1]}", "--clear-groups", *cmd]


def run_as_user(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(as_user(cmd), capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def world() -> Iterator[str]:
    """A directory every user can traverse (pytest's own tmp dirs are 0700 under root)."""
    d = tempfile.mkdtemp(prefix="tb5-as-user-")
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _source(world: str) -> str:
    src = os.path.join(world, "src")
    os.makedirs(os.path.join(src, "a"))
    for name in ("f", "g"):
        with open(os.path.join(src, "a", name), "wb") as f:
            f.write(name.encode() * 1000)
    with open(os.path.join(src, "big"), "wb") as f:
        f.write(os.urandom(5 * 1024 * 1024))
    for dirpath, dirnames, filenames in os.walk(src):
        os.chmod(dirpath, 0o755)
        for n in filenames:
            os.chmod(os.path.join(dirpath, n), 0o644)
    return src


def _give_to_user(path: str) -> None:
    if os.geteuid() == 0:
        ids = _nobody()
        assert ids is not None
        for dirpath, dirnames, filenames in os.walk(path):
            os.chown(dirpath, *ids)
            for n in filenames:
                os.chown(os.path.join(dirpath, n), *ids)


def _not_users(path: str) -> None:
    """Make ``path`` a directory the unprivileged user may neither write nor chmod (root's, 0755)."""
    if os.geteuid() != 0:
        pytest.skip("a directory of another user is needed: the tests do not run as root")
    os.chown(path, 0, 0)
    os.chmod(path, 0o755)


def test_read_only_destination_is_destination_error(world: str) -> None:
    """Nothing can be written into the destination: each entry is named with the reason, exit 23 (rsync's)."""
    src = _source(world)
    dst = os.path.join(world, "dst")
    os.makedirs(dst)
    _not_users(dst)
    proc = run_as_user([TB5SYNC, "sync", src + "/", dst + "/"])
    assert proc.returncode == 23, proc.stderr
    assert "destination 'big': Permission denied" in proc.stderr, proc.stderr  # named relative to DST
    assert os.listdir(dst) == []
    assert tmp_files(dst) == []


def test_read_only_subdirectory_names_it(world: str) -> None:
    src = _source(world)
    dst = os.path.join(world, "dst")
    os.makedirs(os.path.join(dst, "a"))
    _give_to_user(dst)
    _not_users(os.path.join(dst, "a"))
    proc = run_as_user([TB5SYNC, "sync", src + "/", dst + "/"])
    assert proc.returncode == 23, proc.stderr
    assert "destination 'a/f': Permission denied" in proc.stderr, proc.stderr  # named relative to DST
    assert sorted(os.listdir(os.path.join(dst, "a"))) == []
    assert sorted(os.listdir(dst)) == ["a", "big"]  # everything else is synced, as rsync does
    assert tmp_files(dst) == []


def test_state_is_not_readable_by_another_user(world: str) -> None:
    """Synced as the owner under umask 022: another user reads the files it may, never the state's names."""
    src = _source(world)
    dst = os.path.join(world, "dst")
    state = os.path.join(world, "state")  # a local destination's state: in a directory others can reach
    old = os.umask(0o022)
    try:
        tb5sync.sync(src + "/", dst, state_dir=state)
    finally:
        os.umask(old)
    if os.geteuid() != 0:
        pytest.skip("the other user must be someone else than the owner")
    assert run_as_user(["cat", os.path.join(dst, "a", "f")]).returncode == 0
    proc = run_as_user(["cat", os.path.join(state, "state.sqlite")])
    assert proc.returncode != 0 and "Permission denied" in proc.stderr
    proc = run_as_user(["ls", os.path.join(state)])
    assert proc.returncode != 0 and "Permission denied" in proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_push_to_read_only_directory_of_an_unprivileged_server(world: str) -> None:
    """The server runs as the unprivileged user; a push into a directory it cannot write names each entry (exit 23), and it keeps serving."""
    src = _source(world)
    root = os.path.join(world, "root")
    os.makedirs(os.path.join(root, "locked"))
    os.makedirs(os.path.join(root, "open"))
    _give_to_user(root)
    _not_users(os.path.join(root, "locked"))
    port = _free_port()
    server = subprocess.Popen(as_user([TB5SYNC, "serve", root, "--bind", f"127.0.0.1:{port}"]), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None, server.stderr.read().decode() if server.stderr else ""
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.05)
        url = f"tb5://127.0.0.1:{port}"
        with pytest.raises(tb5sync.PartialTransferError) as info:  # rsync: exit 23, each entry named
            tb5sync.sync(src + "/", f"{url}/locked/")
        assert info.value.exit_code == 23
        assert {f.path for f in info.value.stats.failures} >= {"a", "big"}, info.value.stats.failures
        assert os.listdir(os.path.join(root, "locked")) == []
        tb5sync.sync(src + "/", f"{url}/open/")  # still serving, and writing where it may
        assert sorted(os.listdir(os.path.join(root, "open"))) == ["a", "big"]
        st = os.stat(os.path.join(root, "open", "a", "f"))
        assert stat.S_ISREG(st.st_mode) and st.st_uid == (os.geteuid() if os.geteuid() != 0 else (_nobody() or (0, 0))[0])
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
        assert server.poll() is not None
        if server.stdout:
            server.stdout.close()
        if server.stderr:
            server.stderr.close()
    assert tmp_files(root) == []


def test_helper_drops_privileges() -> None:
    """The helper really runs as someone else than root (else the tests above would prove nothing)."""
    proc = run_as_user(["id", "-u"])
    assert proc.returncode == 0
    assert int(proc.stdout.strip()) != 0
