"""Special files (FIFOs, sockets) are not synced and are named on every route, as ``rsync -a
--no-D`` names them ("skipping non-regular file"); recreating them (``-D``) is not done.

The reference is rsync without ``-D``: the same tree, the same names skipped, exit 0. The
tb5sync command prints one line per special file on local, push and pull alike (a pull used to
skip them on the server with no word to the client), and ``SyncStats.skipped`` lists them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from typing import Any

import pytest
from test_partial_vs_rsync import cli
from test_vs_rsync import T0, Harness, assert_same, cp_a, digest_snapshot, freeze_dirs, settle, write


pytestmark = pytest.mark.usefixtures("need_rsync")  # conftest: skipped without rsync


def _specials_tree(src: str) -> None:
    write(os.path.join(src, "a.txt"), b"regular", 0o644, T0)
    os.makedirs(os.path.join(src, "sub"))
    os.mkfifo(os.path.join(src, "sub", "pipe"))
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(os.path.join(src, "sock"))
    finally:
        s.close()
    write(os.path.join(src, "sub", "z.txt"), b"after", 0o600, T0)
    freeze_dirs(src, T0)


def test_special_files_named_on_every_route(tmp_path: Any, server: Any) -> None:
    h = Harness(tmp_path, server)
    _specials_tree(h.src)
    h.prepare()
    settle(h.sp)
    ref = subprocess.run(["rsync", "-a", "--no-D", h.src + "/", os.path.join(h.dp["rsync"], "dst")],
                         capture_output=True, text=True, timeout=60, check=False)
    assert ref.returncode == 0, ref.stderr
    named = {ln.split('"')[1] for ln in (ref.stdout + ref.stderr).splitlines() if ln.startswith("skipping non-regular file")}
    assert named == {"sock", "sub/pipe"}
    cp_a(h.sp, os.path.join(server.root, "pullsrc"))
    runs = {
        "local": cli(["sync", "--json", h.src + "/", os.path.join(h.dp["local"], "dst")]),
        "push": cli(["sync", "--json", h.src + "/", server.url("push/dst")]),
        "pull": cli(["sync", "--json", server.url("pullsrc/src/"), os.path.join(h.dp["pull"], "dst")]),
    }
    want = digest_snapshot(os.path.join(h.dp["rsync"], "dst"))
    for r, p in runs.items():
        assert p.returncode == 0, f"{r}: {p.stderr}"
        assert {x["path"] for x in json.loads(p.stdout)["skipped"]} == named, r
        lines = sorted(ln for ln in p.stderr.splitlines() if ln.startswith("tb5sync: skipping non-regular file"))
        assert lines == ["tb5sync: skipping non-regular file 'sock' (socket)",
                         "tb5sync: skipping non-regular file 'sub/pipe' (fifo)"], f"{r}: {p.stderr}"
        final = os.path.join(h.dp[r], "dst") if r != "push" else os.path.join(server.root, "push", "dst")
        assert_same(want, digest_snapshot(final), r)
