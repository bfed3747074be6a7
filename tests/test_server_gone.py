"""The server stopped or killed in the middle of a sync: the client exits as rsync does when its
remote side goes away mid-transfer (12, "connection unexpectedly closed": an error in the protocol
data stream), with one line saying the server closed the connection; 10 stays for a server that
cannot be reached or refuses the client at admission."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from conftest import wait_for
from test_interrupt_vs_rsync import _tree
from test_serve_process import serve

pytestmark = pytest.mark.usefixtures("need_rsync")


def _rsync_remote_killed(tmp_path: Any, src: str) -> int:
    """rsync's exit code when its remote side (``rsync --server`` behind a remote shell that runs it
    here) is killed mid-transfer."""
    rsh = tmp_path / "rsh"
    rsh.write_text('#!/bin/sh\nshift\nexec "$@"\n')
    rsh.chmod(0o755)
    dst = str(tmp_path / "ref")
    proc = subprocess.Popen(["rsync", "-a", "--bwlimit=1M", "-e", str(rsh), src + "/", f"localhost:{dst}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: os.path.isdir(dst) and len(os.listdir(dst)) > 1, 30, "rsync to start writing")
        remote = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True, timeout=10)
        os.kill(int(remote.stdout.split()[0]), signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert "connection unexpectedly closed" in err, err
    return proc.returncode


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_server_gone_mid_transfer_exits_12(tmp_path: Any, how: int) -> None:
    src = str(tmp_path / "src")
    _tree(src)
    ref = _rsync_remote_killed(tmp_path, src)
    assert ref == 12
    root = tmp_path / "root"
    root.mkdir()
    subprocess.run(["cp", "-a", src, str(root / "pullsrc")], check=True, timeout=60)
    env = {k: v for k, v in os.environ.items() if k != "TB5SYNC_TOKEN"}
    for route in ("push", "pull"):
        srv, port = serve(root)
        try:
            url = f"tb5://127.0.0.1:{port}/"
            args, landed = (([src + "/", url + "pushed"], str(root / "pushed")) if route == "push"
                            else ([url + "pullsrc/", str(tmp_path / "pulled")], str(tmp_path / "pulled")))
            proc = subprocess.Popen([sys.executable, "-m", "tb5sync.cli", "sync", "--bwlimit=1M", *args],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
            try:
                wait_for(lambda: os.path.isdir(landed) and len(os.listdir(landed)) > 1 or proc.poll() is not None,
                         30, "the sync to start writing")
                time.sleep(0.3)
                assert proc.poll() is None, "the sync finished before the server could be stopped"
                srv.send_signal(how)
                srv.wait(30)
                _, err = proc.communicate(timeout=60)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
            assert proc.returncode == ref, (route, how, err)
            lines = err.strip().splitlines()
            assert len(lines) == 1, (route, err)
            assert lines[0].startswith("tb5sync: error: server closed the connection mid-transfer"), (route, err)
        finally:
            if srv.poll() is None:
                srv.kill()
            srv.wait(10)
            if srv.stderr is not None:
                srv.stderr.close()


@pytest.mark.timeout(60)
def test_no_server_is_still_10(tmp_path: Any) -> None:
    """Nothing listening: "cannot connect", exit 10 (rsync's 10, "error in socket IO")."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "tb5sync.cli", "sync", str(tmp_path) + "/", f"tb5://127.0.0.1:{port}/x"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 10, r.stderr
    assert "cannot connect" in r.stderr
