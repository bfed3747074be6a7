"""``tb5sync sync`` ended by SIGINT, SIGTERM or SIGHUP, against rsync ended the same way: exit 20 and
rsync's "received SIGINT, SIGTERM, or SIGHUP (code 20)", one line; no temporary file left and no
partial file at a final path, on the client (local, pull) and on the server (push)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from conftest import slurp, tmp_files, wait_for
from test_vs_rsync import write

pytestmark = pytest.mark.usefixtures("need_rsync")

MiB = 1 << 20


def _tree(src: str) -> None:
    write(os.path.join(src, "big"), os.urandom(6 * MiB))
    for i in range(120):
        write(os.path.join(src, f"d{i % 4}", f"f{i:03d}"), os.urandom(20_000))


def _as_background_job() -> None:
    """What a non-interactive shell does to a job started with ``&``: SIGINT (and SIGQUIT) ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)


def _interrupt(cmd: list[str], landed: str, signum: int, cwd: str | None = None,
               background: bool = False) -> tuple[int, str]:
    """Run ``cmd``, send ``signum`` once something has landed under ``landed`` (while it is still
    running: ``--bwlimit`` makes it last seconds); returns (exit code, stderr). ``background``
    starts it as a shell script's ``cmd &`` does (SIGINT ignored)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=cwd,
                            preexec_fn=_as_background_job if background else None)
    try:
        wait_for(lambda: os.path.isdir(landed) and len(os.listdir(landed)) > 1 or proc.poll() is not None, 30,
                 f"{cmd[0]} to start writing {landed}")
        time.sleep(0.3)
        assert proc.poll() is None, "the run finished before it could be interrupted"
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return proc.returncode, err


def _whole_or_absent(src: str, dst: str) -> int:
    """Every regular file under ``dst`` (but tb5sync's state directory) is its source's whole content;
    returns how many there are."""
    n = 0
    for d, dirs, names in os.walk(dst):
        dirs[:] = [x for x in dirs if x != ".tb5sync"]
        for name in names:
            rel = os.path.relpath(os.path.join(d, name), dst)
            assert slurp(os.path.join(dst, rel)) == slurp(os.path.join(src, rel)), rel
            n += 1
    return n


@pytest.mark.timeout(180)
def test_signals_end_a_sync_as_rsync(tmp_path: Any, server: Any) -> None:
    src = str(tmp_path / "src")
    _tree(src)
    os.makedirs(os.path.join(server.root, "pullsrc"))
    subprocess.run(["cp", "-a", src + "/.", os.path.join(server.root, "pullsrc")], check=True, timeout=60)
    ref_code, ref_err = _interrupt(["rsync", "-a", "--bwlimit=1M", src + "/", str(tmp_path / "ref")],
                                   str(tmp_path / "ref"), signal.SIGTERM)
    assert ref_code == 20
    words = "received SIGINT, SIGTERM, or SIGHUP (code 20)"
    assert words in ref_err
    tb5 = [sys.executable, "-m", "tb5sync.cli", "sync", "--bwlimit=1M"]
    runs = [("local", signal.SIGTERM, [src + "/", str(tmp_path / "l1")], str(tmp_path / "l1")),
            ("local", signal.SIGHUP, [src + "/", str(tmp_path / "l2")], str(tmp_path / "l2")),
            ("local", signal.SIGINT, [src + "/", str(tmp_path / "l3")], str(tmp_path / "l3")),
            ("pull", signal.SIGTERM, [server.url("pullsrc/"), str(tmp_path / "p1")], str(tmp_path / "p1")),
            ("push", signal.SIGTERM, [src + "/", server.url("pushed")], os.path.join(server.root, "pushed")),
            ("push", signal.SIGINT, [src + "/", server.url("pushed2")], os.path.join(server.root, "pushed2"))]
    for route, signum, args, landed in runs:
        code, err = _interrupt([*tb5, *args], landed, signum)
        assert code == ref_code, (route, signum, err)
        assert err.strip().splitlines() == [f"tb5sync: error: {words}"], (route, err)
        if route == "push":  # the server notices the client is gone and removes what it was writing
            wait_for(lambda: not tmp_files(landed), 20, "the server to remove its temporary files")
        assert tmp_files(landed) == [], route
        assert _whole_or_absent(src, landed) < 121, route  # interrupted: not everything arrived
    # the server is still serving: a whole push then completes
    done = subprocess.run([*tb5[:-1], src + "/", server.url("pushed")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert _whole_or_absent(src, os.path.join(server.root, "pushed")) == 121


@pytest.mark.timeout(180)
def test_sigint_ends_a_background_job_as_rsync(tmp_path: Any, server: Any) -> None:
    """``tb5sync sync ... &`` in a script starts with SIGINT ignored; rsync installs its handler
    regardless, and so must we: ``kill -INT`` ends it with 20 (local, pull, push)."""
    src = str(tmp_path / "src")
    _tree(src)
    os.makedirs(os.path.join(server.root, "pullsrc"))
    subprocess.run(["cp", "-a", src + "/.", os.path.join(server.root, "pullsrc")], check=True, timeout=60)
    ref_code, ref_err = _interrupt(["rsync", "-a", "--bwlimit=1M", src + "/", str(tmp_path / "ref")],
                                   str(tmp_path / "ref"), signal.SIGINT, background=True)
    assert ref_code == 20, ref_err
    tb5 = [sys.executable, "-m", "tb5sync.cli", "sync", "--bwlimit=1M"]
    runs = [("local", [src + "/", str(tmp_path / "l")], str(tmp_path / "l")),
            ("pull", [server.url("pullsrc/"), str(tmp_path / "p")], str(tmp_path / "p")),
            ("push", [src + "/", server.url("pushed")], os.path.join(server.root, "pushed"))]
    for route, args, landed in runs:
        code, err = _interrupt([*tb5, *args], landed, signal.SIGINT, background=True)
        assert code == ref_code, (route, err)
        assert err.strip().splitlines() == ["tb5sync: error: received SIGINT, SIGTERM, or SIGHUP (code 20)"], route
        assert _whole_or_absent(src, landed) < 121, route


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", [["serve", "{root}", "--bind", "127.0.0.1:0"],
                                     ["http-cache", "{root}/store", "--bind", "127.0.0.1:0"]])
def test_sigint_stops_a_background_daemon(tmp_path: Any, command: list[str]) -> None:
    """A daemon started with ``&`` from a script (SIGINT ignored) still stops on ``kill -INT``, status 0."""
    root = str(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "TB5SYNC_TOKEN"}
    argv = [sys.executable, "-m", "tb5sync.cli", *[c.format(root=root) for c in command]]
    if command[0] == "serve":
        argv.append("--no-auth")
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=_as_background_job)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert " on 127.0.0.1:" in line, line
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _dir_modes(base: str) -> dict[str, int]:
    """Each directory under ``base`` (itself ``.``, tb5sync's state directory left out) -> its mode bits."""
    out = {}
    for d, dirs, _ in os.walk(base):
        dirs[:] = [x for x in dirs if x != ".tb5sync"]
        out[os.path.relpath(d, base)] = os.stat(d).st_mode & 0o7777
    return out


@pytest.mark.timeout(240)
def test_interrupted_run_leaves_directories_at_their_modes(tmp_path: Any, server: Any) -> None:
    """An interrupted run (SIGINT, SIGTERM) leaves every directory it made at its source's mode, as
    rsync's interrupted run does (not at 0700): local, pull and push (the server's side)."""
    src = str(tmp_path / "src")
    _tree(src)
    for i, mode in enumerate((0o755, 0o750, 0o711, 0o775)):
        os.chmod(os.path.join(src, f"d{i}"), mode)
    os.chmod(src, 0o751)
    want = _dir_modes(src)
    os.makedirs(os.path.join(server.root, "pullsrc"))
    subprocess.run(["cp", "-a", src + "/.", os.path.join(server.root, "pullsrc")], check=True, timeout=60)
    ref = str(tmp_path / "ref")
    code, _ = _interrupt(["rsync", "-a", "--bwlimit=1M", src + "/", ref], ref, signal.SIGTERM)
    assert code == 20
    got = _dir_modes(ref)
    assert got and all(got[d] == want[d] for d in got), (got, want)  # rsync's reference
    tb5 = [sys.executable, "-m", "tb5sync.cli", "sync", "--bwlimit=1M"]
    runs = [("local", signal.SIGINT, [src + "/", str(tmp_path / "l")], str(tmp_path / "l")),
            ("pull", signal.SIGTERM, [server.url("pullsrc/"), str(tmp_path / "p")], str(tmp_path / "p")),
            ("push", signal.SIGTERM, [src + "/", server.url("pushed")], os.path.join(server.root, "pushed"))]
    for route, signum, args, landed in runs:
        code, err = _interrupt([*tb5, *args], landed, signum)
        assert code == 20, (route, err)
        if route == "push":  # the server's session ends once it notices the client is gone
            wait_for(lambda: all(m == want[d] for d, m in _dir_modes(landed).items()), 20,
                     "the server to give its directories their modes")
        got = _dir_modes(landed)
        assert len(got) == len(want) and {d: got[d] for d in got} == {d: want[d] for d in got}, (route, got)
        assert _whole_or_absent(src, landed) < 121, route


@pytest.mark.timeout(120)
def test_failed_push_leaves_directories_at_their_modes(tmp_path: Any) -> None:
    """A push stopped by the server's --max-session-bytes: the directories it made have their modes."""
    from conftest import start_server

    src = str(tmp_path / "src")
    _tree(src)
    for i, mode in enumerate((0o755, 0o750, 0o711, 0o775)):
        os.chmod(os.path.join(src, f"d{i}"), mode)
    want = _dir_modes(src)
    live = start_server(str(tmp_path / "root"), max_session_bytes=MiB)
    try:
        r = subprocess.run([sys.executable, "-m", "tb5sync.cli", "sync", src + "/", live.url("q")], capture_output=True,
                           text=True, timeout=60, env={k: v for k, v in os.environ.items() if k != "TB5SYNC_TOKEN"})
        assert r.returncode == 11 and "--max-session-bytes" in r.stderr, r.stderr
    finally:
        live.server.stop()
    got = _dir_modes(str(tmp_path / "root" / "q"))
    assert got == want
