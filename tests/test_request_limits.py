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
from tb5sync.remote.client import ls as remote_ls
from tb5sync.remote.client import parse_url
from tb5sync.errors import PathError, UsageError
from tb5sync.wire.messages import MAX_REQUEST_PATHS, SENDER_MAX_READ
from tb5sync.wire.rpc import call_direct, open_session
from tb5sync.wire.transport import connect


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
    from tb5sync.roles.inodes import LinkDest
    from tb5sync.roles.destination import Destination
    from tb5sync.tree.entry import FILE, Entry
    from tb5sync.tree.options import SyncOptions

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


# ---- what a peer's reply claims is checked before it is allocated ------------------------------


def _lz4_bomb(total: int) -> bytes:
    """An lz4 block of ~total/255 bytes that decompresses to ``total`` zero bytes (one literal, one
    long match at offset 1, five closing literals: the block format's own rules)."""
    ext = total - 1 - 5 - 4 - 15
    return bytes([0x1F, 0x00, 0x01, 0x00]) + b"\xff" * (ext // 255) + bytes([ext % 255, 0x50]) + b"\0" * 5


def test_chunk_longer_than_any_read_is_refused() -> None:
    """A chunk is fetched by one read (at most SENDER_MAX_READ): a peer's chunk list naming a
    longer one is refused as it is checked (the receiver used to allocate a buffer of its length
    to rebuild it from a basis)."""
    from tb5sync.errors import RemoteProtocolError
    from tb5sync.wire.messages import ChunkListPiece, check_chunks

    assert check_chunks([[b"d" * 32, SENDER_MAX_READ]], SENDER_MAX_READ, "f") == [(b"d" * 32, SENDER_MAX_READ)]
    with pytest.raises(RemoteProtocolError, match="chunk of f longer than"):
        check_chunks([[b"d" * 32, SENDER_MAX_READ + 1]], SENDER_MAX_READ + 1, "f")
    wire = {"size": 1 << 40, "mtime_ns": 1, "start": 0, "end": 1 << 40, "chunks": [[b"d" * 32, 1 << 40]]}
    with pytest.raises(RemoteProtocolError, match="longer than"):
        ChunkListPiece.from_wire(wire, "f")


def test_read_files_reply_past_its_limit_is_refused_before_it_is_decompressed() -> None:
    from tb5sync.errors import RemoteProtocolError
    from tb5sync.wire.messages import READ_FILES_MAX, FilesMeta

    n = READ_FILES_MAX // 2 + 1
    chunks = [[b"d" * 32, n // 2], [b"e" * 32, n - n // 2]]
    meta = {"files": [[n, 1, 0o644, chunks, 10, 1], [n, 1, 0o644, chunks, 10, 1]], "wire": [10, 10]}
    with pytest.raises(RemoteProtocolError, match="read_files reply of .* bytes exceeds"):
        FilesMeta.from_wire(meta, ["a", "b"])
    meta = {"files": [[n, 1, 0o644, chunks, 10, 1]], "wire": [10]}
    assert FilesMeta.from_wire(meta, ["a"]).files[0].size == n  # type: ignore[union-attr]


@pytest.mark.timeout(60)
def test_pushing_peer_cannot_make_the_server_inflate_a_bomb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A push client whose read_files answers a small file with a 1 MiB lz4 part claiming 256 MiB
    (one chunk of that length) used to make the server allocate and fill 256 MiB before the digest
    check failed; the reply is now refused as it is checked, before anything is decompressed."""
    import tb5sync.roles.sender as sender_mod
    from tb5sync.errors import RemoteProtocolError

    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"x" * 100)
    claim = 256 * 1024 * 1024
    part = _lz4_bomb(claim)

    def read_files(self: Any, paths: list[str]) -> tuple[dict[str, Any], list[bytes]]:
        files = [[claim, 1, 0o100644, [[b"\1" * 32, claim]], len(part), 1] for _ in paths]
        return {"files": files, "wire": [len(part)] * len(paths)}, [part] * len(paths)

    monkeypatch.setattr(sender_mod.Sender, "read_files", read_files)
    live = start_server(str(tmp_path / "root"))
    try:
        with pytest.raises(RemoteProtocolError, match="longer than|exceeds"):
            tb5sync.sync(str(src) + "/", live.url("dst/"), timeout=30)
        assert not os.path.exists(tmp_path / "root" / "dst" / "f")
    finally:
        live.server.stop()


@pytest.mark.timeout(60)
def test_unfetched_listing_pages_are_bounded_in_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long ``find``/``ls`` reply waits server-side for its ``more`` requests. The server kept the
    last 64 such listings whatever their size (each up to 2,000,000 entries, ~1 KB each held), so
    64 unfetched finds of a big tree could pin ~100 GB; now what waits is bounded in entries
    (``fsops.PAGES_MAX_ENTRIES``), the oldest dropped first (its cursor then says "list again")."""
    import tb5sync.daemon.fsops as fsops_mod
    from tb5sync.errors import UsageError as Usage

    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    for i in range(200):
        (root / "d" / f"f{i:03d}").write_bytes(b"")
    monkeypatch.setattr(fsops_mod, "PAGE_BYTES", 2000)  # ~12 entries a page
    monkeypatch.setattr(fsops_mod, "PAGES_MAX_ENTRIES", 1000)
    live = start_server(str(root))
    try:
        ch = connect("127.0.0.1", live.port, None)
        open_session(ch, {"op": "fs"})
        cursors = [call_direct(ch, "find", {"path": "d"})["more"] for _ in range(20)]
        waiting = live.server._pages.waiting_entries()
        assert 0 < waiting <= 1000 + 200, waiting
        with pytest.raises(Usage, match="list again"):
            call_direct(ch, "more", {"cursor": cursors[0]})
        got = call_direct(ch, "more", {"cursor": cursors[-1]})  # the newest still waits
        assert got["entries"]
        ch.close()
    finally:
        live.server.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("excludes", [[f"p{i}*x[ab]" for i in range(100_000)], ["*a" * 50_000 + "b"]], ids=["many", "long"])
def test_a_peers_exclude_rules_are_bounded(tmp_path: Path, excludes: list[str]) -> None:
    """OPEN's options name the exclude rules the server compiles and then matches against every
    entry (each costs time per entry and pattern token). 100,000 patterns in a 1.3 MiB OPEN took
    the server over a minute of CPU (and ~100 MiB) before answering, and slowed every entry's
    match; one pattern of 100,000 tokens, the same per entry. Both are refused at once."""
    from tb5sync.tree.options import MAX_PATTERN, MAX_WIRE_EXCLUDES

    live = start_server(str(tmp_path / "root"))
    try:
        ch = connect("127.0.0.1", live.port, None)
        t0 = time.monotonic()
        with pytest.raises(UsageError, match=f"at most {MAX_WIRE_EXCLUDES} exclude patterns|longer than {MAX_PATTERN}"):
            open_session(ch, {"op": "push", "path": "", "name": "x", "src_kind": "d", "dst_slash": True,
                              "options": {"excludes": excludes}, "streams": 1})
        assert time.monotonic() - t0 < 5
        ch.close()
        assert remote_ls(parse_url(live.url("")))  # type: ignore[arg-type]
    finally:
        live.server.stop()
