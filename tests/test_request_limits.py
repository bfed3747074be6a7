"""What one request of an authenticated peer may make the server do is bounded.

A pull session's ``read_files`` naming a file far larger than a reply may hold is refused before
anything is read (the Python reader used to allocate the whole file first); a request naming more
paths than any client sends (``entries``, ``file_digests``, ``read_files``) is refused at once; and
``--link-dest`` or a push never look into, nor write, a directory named ``.tb5sync``. Each refusal
ends in one error for that request, and the server keeps serving.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import start_server

import tb5sync
from tb5sync.client import ls as remote_ls
from tb5sync.client import parse_url
from tb5sync.errors import PathError, UsageError
from tb5sync.messages import MAX_REQUEST_PATHS, SENDER_MAX_READ
from tb5sync.rpc import call_direct, open_session
from tb5sync.transport import connect


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return float("nan")


@pytest.mark.timeout(60)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_read_files_of_a_huge_file_is_refused_before_it_is_read(tmp_path: Path, read_impl: str) -> None:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    with open(root / "sub" / "big.bin", "wb") as f:
        f.truncate(4 << 30)  # 4 GiB, sparse: what reading it whole would allocate
    (root / "sub" / "small").write_bytes(b"small")
    live = start_server(str(root))
    peak = [0.0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mib())
            time.sleep(0.01)

    before = _rss_mib()
    w = threading.Thread(target=watch, daemon=True)
    w.start()
    try:
        ch = connect("127.0.0.1", live.port, None)
        try:
            open_session(ch, {"op": "pull", "path": "sub", "options": {}, "streams": 1})
            with pytest.raises(UsageError, match="read_files of more than"):
                call_direct(ch, "read_files", {"paths": ["small", "big.bin"]})
        finally:
            ch.close()
        done.set()
        w.join()
        assert peak[0] - before < 2 * SENDER_MAX_READ / 2**20 + 64, (before, peak[0])  # never the file's 4 GiB
        assert [e.path for e in remote_ls(parse_url(live.url("sub")), token=None)] == ["", "big.bin", "small"]
    finally:
        done.set()
        live.server.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method,key", [("read_files", "paths"), ("file_digests", "paths"), ("entries", "dirs")])
def test_a_request_naming_too_many_paths_is_refused_at_once(tmp_path: Path, method: str, key: str) -> None:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "f").write_bytes(b"tiny")
    live = start_server(str(root))
    try:
        ch = connect("127.0.0.1", live.port, None)
        try:
            open_session(ch, {"op": "pull", "path": "sub", "options": {}, "streams": 1})
            args: dict[str, Any] = {key: [("" if key == "dirs" else "f")] * (MAX_REQUEST_PATHS + 1)}
            t = time.monotonic()
            with pytest.raises(UsageError, match=f"{MAX_REQUEST_PATHS + 1} paths in one request, at most {MAX_REQUEST_PATHS}"):
                call_direct(ch, method, args)
            assert time.monotonic() - t < 5
            # as many as a client sends are still served
            ok = call_direct(ch, method, {key: [("" if key == "dirs" else "f")] * 64})
            assert ok
        finally:
            ch.close()
    finally:
        live.server.stop()


@pytest.mark.timeout(60)
def test_link_dest_never_looks_into_the_servers_state(tmp_path: Path) -> None:
    """A source named ``.tb5sync`` pushed into ``ROOT/sub`` with ``--link-dest ..`` would have the
    server look its files up under ``ROOT/.tb5sync``: the push is refused, nothing is created, and
    the link-dest lookup itself skips any path naming the state directory."""
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    live = start_server(str(root))
    src = tmp_path / "src" / ".tb5sync"
    src.mkdir(parents=True)
    (src / "state.sqlite").write_bytes(b"x" * 100)
    try:
        for opts in ({"link_dest": [".."], "itemize_changes": True, "dry_run": True}, {"link_dest": [".."]}, {}):
            with pytest.raises(PathError, match="state directory"):
                tb5sync.sync(str(src), live.url("sub"), **opts)
            with pytest.raises(PathError, match="state directory"):
                tb5sync.sync(str(tmp_path / "src") + "/", live.url("sub/.tb5sync/x"), **opts)
        assert sorted(os.listdir(root / "sub")) == []
    finally:
        live.server.stop()
    from tb5sync.inodes import LinkDest
    from tb5sync.destination import Destination
    from tb5sync.entry import FILE, Entry
    from tb5sync.options import SyncOptions

    (tmp_path / "ld" / ".tb5sync").mkdir(parents=True)
    (tmp_path / "ld" / ".tb5sync" / "f").write_bytes(b"abc")
    st = os.stat(tmp_path / "ld" / ".tb5sync" / "f")
    dest = Destination(str(tmp_path / "out" / ".tb5sync"))
    ld = LinkDest(dest, SyncOptions(link_dest=("../ld",), exclude_root=".tb5sync"))
    try:
        e = Entry("f", FILE, st.st_mode & 0o7777, st.st_size, st.st_mtime_ns, "")
        assert ld.link(e) is False and ld._alt(e) is None
    finally:
        ld.close()
