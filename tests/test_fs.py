"""tb5:// as an fsspec filesystem, against a live server and against fsspec's LocalFileSystem on the same tree.

The server serves a directory; LocalFileSystem looks at the very same directory, so
every listing, info dict, byte range and error can be compared one to one (local
names are made relative to the root first).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import struct
import threading
import time
from typing import Any

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem
from fsspec.tests.abstract import (
    AbstractCopyTests,
    AbstractFixtures,
    AbstractGetTests,
    AbstractOpenTests,
    AbstractPipeTests,
    AbstractPutTests,
)

from conftest import joined, make_tree, slurp, start_server, tmp_files
from conftest import tb5fs as tb5
from tb5sync import errors
from tb5sync.fs.filesystem import TB5File, TB5FileSystem

TOKEN = b"s3cret-token"


@pytest.fixture
def served(tmp_path: Any) -> Any:
    """A live server whose root holds :func:`make_tree`; yields ``(server, fs, local fs, root)``."""
    root = str(tmp_path / "root")
    make_tree(root)
    live = start_server(root)
    fs = tb5(live)
    try:
        yield live, fs, LocalFileSystem(), live.root
    finally:
        fs._holder.close()
        live.server.stop()


def _state(name: Any) -> bool:
    return isinstance(name, str) and (name == ".tb5sync" or name.startswith(".tb5sync/"))


def rel(root: str, value: Any) -> Any:
    """Local names made relative to ``root`` (recursively through lists, dicts and tuples).

    The server's own state directory (``ROOT/.tb5sync``), which tb5:// never shows, is dropped.
    """
    prefix = root.rstrip("/") + "/"
    if isinstance(value, str):
        if value == root:
            return ""
        return value[len(prefix) :] if value.startswith(prefix) else value
    if isinstance(value, dict):
        out = {rel(root, k): (rel(root, v) if k == "name" or isinstance(v, (dict, list)) else v) for k, v in value.items()}
        return {k: v for k, v in out.items() if not _state(k) and not (isinstance(v, dict) and _state(v.get("name")))}
    if isinstance(value, (list, tuple)):
        items = [rel(root, v) for v in value]
        return type(value)(v for v in items if not _state(v) and not (isinstance(v, dict) and _state(v.get("name"))))
    return value


def same_error(fn_local: Any, fn_remote: Any) -> type[BaseException]:
    """Both calls raise; the remote error is an instance of the local error's class. Returns that class."""
    with pytest.raises(Exception) as local_exc:
        fn_local()
    with pytest.raises(Exception) as remote_exc:
        fn_remote()
    assert isinstance(remote_exc.value, local_exc.type), (local_exc.value, remote_exc.value)
    assert isinstance(remote_exc.value, errors.Tb5syncError)
    return local_exc.type


OUTSIDE = "abs_link"  # a symlink to /etc/hostname: LocalFileSystem follows it, the server must not


# ---- registration, URLs, instances --------------------------------------------------------------


def test_registered_through_entry_point_and_url(served: Any) -> None:
    live, _, _, _ = served
    assert fsspec.get_filesystem_class("tb5") is TB5FileSystem
    fs, path = fsspec.core.url_to_fs(live.url("d1/sub1/f1.bin"))
    assert isinstance(fs, TB5FileSystem) and (fs.host, fs.port) == ("127.0.0.1", live.port)
    assert path == "d1/sub1/f1.bin"
    assert fs.unstrip_protocol(path) == live.url("d1/sub1/f1.bin")
    with fsspec.open(live.url("d1/sub1/f1.bin"), "rb") as f:
        assert f.read() == slurp(os.path.join(live.root, "d1/sub1/f1.bin"))


def test_instances_are_cached_and_reuse_connections(served: Any) -> None:
    live, _, _, _ = served
    a = fsspec.filesystem("tb5", host="127.0.0.1", port=live.port)
    b = fsspec.filesystem("tb5", host="127.0.0.1", port=live.port)
    assert a is b
    a.ls("")
    link = a._holder.link
    b.info("big.bin")
    assert a._holder.link is link  # same connections
    c = fsspec.filesystem("tb5", host="127.0.0.1", port=live.port, streams=2)
    assert c is not a
    a._holder.close()
    c._holder.close()


@pytest.mark.parametrize(
    "path, want",
    [("tb5://h:1/a/b/", "a/b"), ("tb5://h/a", "a"), ("/a/b", "a/b"), ("a/b", "a/b"), ("tb5://h:9", ""), ("", ""), ("/", "")],
)
def test_strip_protocol(path: str, want: str) -> None:
    assert TB5FileSystem._strip_protocol(path) == want


def test_url_kwargs() -> None:
    assert TB5FileSystem._get_kwargs_from_urls("tb5://node-b:9000/x") == {"host": "node-b", "port": 9000}
    assert TB5FileSystem._get_kwargs_from_urls("tb5://[::1]/x") == {"host": "::1", "port": 8873}
    with pytest.raises(ValueError):
        TB5FileSystem(port=0, skip_instance_cache=True)


def test_token_from_argument_and_environment(tmp_path: Any, monkeypatch: Any) -> None:
    live = start_server(str(tmp_path / "t"), token=TOKEN)
    try:
        with open(os.path.join(live.root, "x"), "wb") as f:
            f.write(b"secret data")
        fs = tb5(live)
        assert fs.cat_file("x") == b"secret data"
        fs._holder.close()
        monkeypatch.setenv("TB5SYNC_TOKEN", TOKEN.decode())
        env_fs = TB5FileSystem(host="127.0.0.1", port=live.port, skip_instance_cache=True)
        assert env_fs.cat_file("x") == b"secret data"
        env_fs._holder.close()
        monkeypatch.delenv("TB5SYNC_TOKEN")
        bad = TB5FileSystem(host="127.0.0.1", port=live.port, token="wrong", skip_instance_cache=True)
        with pytest.raises(PermissionError):
            bad.ls("")
        assert live.server._thread is not None and live.server._thread.is_alive()
    finally:
        live.server.stop()


def test_reconnects_after_server_restart(tmp_path: Any) -> None:
    root = str(tmp_path / "r")
    live = start_server(root)
    with open(os.path.join(root, "x"), "wb") as f:
        f.write(b"one")
    fs = tb5(live)
    assert fs.cat_file("x") == b"one"
    live.server.stop()
    with pytest.raises(ConnectionError):
        fs.cat_file("x")  # the server is gone
    live2 = start_server(root)  # port reuse is not guaranteed: point the instance at the new port
    try:
        fs.port = live2.port
        assert fs.cat_file("x") == b"one"
    finally:
        fs._holder.close()
        live2.server.stop()


# ---- listings compared with LocalFileSystem -----------------------------------------------------


LIST_PATHS = ["", "d0", "d1/sub1", "empty_dir", "big.bin", "rel_link", "d0/sub0/f0.bin"]


@pytest.mark.parametrize("path", LIST_PATHS)
def test_ls_and_info_match_local(served: Any, path: str) -> None:
    _, fs, local, root = served
    lpath = os.path.join(root, path) if path else root
    want = sorted(rel(root, local.ls(lpath, detail=True)), key=lambda i: i["name"])
    got = fs.ls(path, detail=True)
    for w, g in zip(want, got):
        if w["name"] == OUTSIDE:  # not followed out of the root: listed with size 0
            assert g["size"] == 0 and g["islink"] and g["type"] == "other"
            w = {**w, "size": 0}
        assert g == w
    assert len(got) == len(want)
    assert sorted(fs.ls(path, detail=False)) == sorted(rel(root, local.ls(lpath, detail=False)))
    assert fs.info(path) == rel(root, local.info(lpath))
    for probe in ("exists", "isdir", "isfile", "size"):
        assert getattr(fs, probe)(path) == getattr(local, probe)(lpath), probe
    assert fs.modified(path) == local.modified(lpath)
    assert fs.created(path) == local.created(lpath)


def test_ls_hides_state_dir_and_refuses_it(served: Any) -> None:
    live, fs, _, root = served
    os.makedirs(os.path.join(root, ".tb5sync"), exist_ok=True)
    assert ".tb5sync" not in fs.ls("", detail=False)
    assert ".tb5sync" not in fs.find("", withdirs=True)
    with pytest.raises(PermissionError):
        fs.ls(".tb5sync")
    with pytest.raises(PermissionError):
        fs.pipe_file(".tb5sync/x", b"no")


@pytest.mark.parametrize("maxdepth", [None, 1, 2])
@pytest.mark.parametrize("withdirs", [False, True])
@pytest.mark.parametrize("path", ["", "d1", "big.bin", "missing"])
def test_find_matches_local(served: Any, path: str, maxdepth: int | None, withdirs: bool) -> None:
    _, fs, local, root = served
    lpath = os.path.join(root, path) if path else root
    want = rel(root, local.find(lpath, maxdepth=maxdepth, withdirs=withdirs, detail=True))
    want.pop("", None)  # the root's own name is "" here, which fsspec's find never lists
    got = fs.find(path, maxdepth=maxdepth, withdirs=withdirs, detail=True)
    assert sorted(got) == sorted(want)
    for name in got:
        if name != OUTSIDE:
            assert got[name]["type"] == want[name]["type"] and got[name]["size"] == want[name]["size"], name
    assert fs.find(path, maxdepth=maxdepth, withdirs=withdirs) == sorted(want)


@pytest.mark.parametrize("topdown", [True, False])
@pytest.mark.parametrize("maxdepth", [None, 1, 2])
def test_walk_matches_local(served: Any, topdown: bool, maxdepth: int | None) -> None:
    _, fs, local, root = served
    want = [(rel(root, p), sorted(rel(root, d)), sorted(f)) for p, d, f in local.walk(root, maxdepth=maxdepth, topdown=topdown) if not _state(rel(root, p))]
    got = [(p, sorted(d), sorted(f)) for p, d, f in fs.walk("", maxdepth=maxdepth, topdown=topdown)]
    assert sorted(got) == sorted(want)  # LocalFileSystem's order is the directory's (scandir) order
    order = [p for p, _, _ in got]
    for i, p in enumerate(order):  # a parent before its children top-down, after them bottom-up
        parent = p.rpartition("/")[0] if p else None
        if parent is not None:
            assert (order.index(parent) < i) == topdown, (p, order)
    detail = list(fs.walk("d0", detail=True))
    assert all(isinstance(d, dict) and isinstance(f, dict) for _, d, f in detail)
    assert detail[0][2] == {} and set(detail[0][1]) == {"sub0", "sub1", "sub2"}


def test_walk_prunes_in_place(served: Any) -> None:
    _, fs, _, _ = served
    seen = []
    for path, dirs, _ in fs.walk(""):
        seen.append(path)
        dirs[:] = [d for d in dirs if d != "d1"]
    assert "d1" not in seen and "d1/sub1" not in seen and "d2/sub1" in seen


@pytest.mark.parametrize("pattern", ["*", "**", "**/*.bin", "d1/*", "d?/sub[01]/*", "d0/**", "*/sub2/f*.bin", "missing/*", "big.bin", "d0/"])
def test_glob_matches_local(served: Any, pattern: str) -> None:
    _, fs, local, root = served
    want = [w for w in rel(root, local.glob(os.path.join(root, pattern))) if w != ""]  # the root is "" here
    assert fs.glob(pattern) == want


def test_du_matches_local(served: Any) -> None:
    _, fs, local, root = served
    assert fs.du("", total=False)["dangling_link"] == 0  # LocalFileSystem.du raises FileNotFoundError here
    os.unlink(os.path.join(root, "dangling_link"))
    want = rel(root, local.du(root, total=False))
    got = fs.du("", total=False)
    assert set(got) == set(want)
    assert all(got[k] == want[k] for k in got if k != OUTSIDE)
    assert fs.du("d1") == local.du(os.path.join(root, "d1"))
    assert fs.du("d1", withdirs=True, total=False).keys() == rel(root, local.du(os.path.join(root, "d1"), withdirs=True, total=False)).keys()


# ---- reading --------------------------------------------------------------------------------------


RANGES = [(None, None), (0, 10), (5, -5), (-100, None), (-100, -50), (10**9, None), (0, 10**9), (3, 3), (100, 50), (-(10**9), 10)]


@pytest.mark.parametrize("start, end", RANGES)
def test_cat_file_ranges_match_local(served: Any, start: int | None, end: int | None) -> None:
    """Every range reads as LocalFileSystem reads it, its ValueError included (a range that ends
    before it starts; test_fs_reads.py::test_odd_ranges_as_local_filesystem has the whole table)."""
    _, fs, local, root = served
    for path in ("big.bin", "d1/sub1/f1.bin", "rel_link"):
        try:
            want = local.cat_file(os.path.join(root, path), start, end)
        except ValueError:
            with pytest.raises(ValueError, match="read length must be non-negative or -1"):
                fs.cat_file(path, start, end)
            continue
        assert fs.cat_file(path, start, end) == want, (path, start, end)


def test_cat_many_in_one_round_trip(served: Any) -> None:
    live, fs, local, root = served
    names = fs.find("d0")
    calls = []
    orig = fs._call

    async def counting(method: str, args: dict[str, Any], **kw: Any) -> Any:
        calls.append(method)
        return await orig(method, args, **kw)

    fs._call = counting  # type: ignore[method-assign]
    got = fs.cat(names)
    fs._call = orig  # type: ignore[method-assign]
    assert calls == ["cat_many"]
    assert got == rel(root, local.cat([os.path.join(root, n) for n in names]))
    assert fs.cat("d0/sub1/*.bin") == rel(root, local.cat(os.path.join(root, "d0/sub1/*.bin")))
    assert fs.cat("d1/sub1/f1.bin") == local.cat(os.path.join(root, "d1/sub1/f1.bin"))


def test_cat_errors_raise_omit_return(served: Any) -> None:
    _, fs, local, root = served
    paths = ["big.bin", "nope", "d0"]
    same_error(lambda: local.cat([os.path.join(root, p) for p in paths]), lambda: fs.cat(paths))
    same_error(lambda: local.cat([os.path.join(root, p) for p in paths[:2]]), lambda: fs.cat(paths[:2]))
    assert set(fs.cat(paths, on_error="omit")) == {"big.bin"}
    got = fs.cat(paths, on_error="return")
    want = local.cat([os.path.join(root, p) for p in paths], on_error="return")
    assert got["big.bin"] == want[os.path.join(root, "big.bin")]
    assert isinstance(got["nope"], FileNotFoundError) and isinstance(want[os.path.join(root, "nope")], FileNotFoundError)
    assert isinstance(got["d0"], IsADirectoryError) and isinstance(want[os.path.join(root, "d0")], IsADirectoryError)


def test_cat_many_larger_than_one_reply(served: Any) -> None:
    live, fs, _, root = served
    blob = os.urandom(20 * 1024 * 1024)
    for i in range(3):  # 60 MiB: more than the 32 MiB reply budget, each file more than one 16 MiB request
        with open(os.path.join(root, f"large{i}.bin"), "wb") as f:
            f.write(blob[i:] + blob[:i])
    got = fs.cat([f"large{i}.bin" for i in range(3)] + ["d1/sub1/f1.bin"])
    for i in range(3):
        assert got[f"large{i}.bin"] == blob[i:] + blob[:i]


def test_cat_ranges_match_local(served: Any) -> None:
    _, fs, local, root = served
    paths = ["big.bin", "big.bin", "d1/sub1/f1.bin", "nope"]
    starts = [0, 9 * 1024 * 1024, -10, 0]
    ends = [100, None, None, 5]
    got = fs.cat_ranges(paths, starts, ends)
    want = local.cat_ranges([os.path.join(root, p) for p in paths], starts, ends)
    assert got[:3] == want[:3]
    assert isinstance(got[3], FileNotFoundError) and isinstance(want[3], FileNotFoundError)
    with pytest.raises(FileNotFoundError):
        fs.cat_ranges(paths, starts, ends, on_error="raise")


def test_open_read_random_access_and_sequential(served: Any) -> None:
    _, fs, _, root = served
    data = slurp(os.path.join(root, "big.bin"))
    with fs.open("big.bin", "rb", block_size=1 << 20) as f:
        assert isinstance(f, TB5File) and f.size == len(data)
        for off in (0, 5_000_000, len(data) - 10, 123):
            f.seek(off)
            assert f.read(1000) == data[off : off + 1000]
        f.seek(-20, 2)
        assert f.read() == data[-20:]
        f.seek(0)
        pieces = []
        while True:
            piece = f.read(300_001)
            if not piece:
                break
            pieces.append(piece)
        assert b"".join(pieces) == data
    with fs.open("big.bin", "rb") as f:
        assert f.read() == data
    with pytest.raises(IsADirectoryError):
        fs.open("d0", "rb")
    with pytest.raises(FileNotFoundError):
        fs.open("nope", "rb")


def test_open_read_refuses_a_file_replaced_meanwhile(served: Any) -> None:
    _, fs, _, root = served
    path = os.path.join(root, "big.bin")
    f = fs.open("big.bin", "rb", block_size=1 << 20, cache_type="none")
    assert f.read(10) == slurp(path)[:10]
    with open(path + ".new", "wb") as g:
        g.write(os.urandom(9 * 1024 * 1024 + 123))
    os.replace(path + ".new", path)
    os.utime(path, (1, 1))
    f.seek(5_000_000)  # not read ahead: the next request goes to the server, which sees the new file
    with pytest.raises(errors.SourceChangedError):
        f.read(10)
    f.close()


def test_large_read_is_split_over_streams(served: Any) -> None:
    _, fs, _, root = served
    blob = os.urandom(40 * 1024 * 1024 + 7)
    with open(os.path.join(root, "forty.bin"), "wb") as f:
        f.write(blob)
    assert fs.cat_file("forty.bin") == blob
    assert fs.cat_file("forty.bin", 1, -1) == blob[1:-1]
    link = fs._holder.link
    chans = [*link.requester.channels, link.direct]
    before = [c.bytes_received for c in chans]
    assert fs.cat_file("forty.bin", 17 * 1024 * 1024) == blob[17 * 1024 * 1024 :]
    after = [c.bytes_received for c in chans]
    assert sum(1 for a, b in zip(after, before) if a > b) >= 2


def test_safetensors_header_by_ranged_read(served: Any) -> None:
    """A safetensors file's header (u64 little-endian length + JSON) read without fetching the tensors."""
    _, fs, _, root = served
    header = {"__metadata__": {"format": "pt"}, "w": {"dtype": "F32", "shape": [2048, 2048], "data_offsets": [0, 2048 * 2048 * 4]}}
    hbytes = json.dumps(header).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    with open(os.path.join(root, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)) + hbytes + os.urandom(2048 * 2048 * 4))
    fs.info("model.safetensors")  # connect first, so the handshake is not counted
    before = wire_bytes(fs)
    got = read_safetensors_header(fs, "model.safetensors")
    assert got == header
    assert wire_bytes(fs) - before < 64 * 1024  # the file is 16 MiB


def wire_bytes(fs: TB5FileSystem) -> int:
    """Bytes sent and received on all of the instance's connections."""
    link = fs._holder.link
    return link.requester.wire_bytes + link.direct.bytes_sent + link.direct.bytes_received


def read_safetensors_header(fs: Any, path: str) -> dict[str, Any]:
    """What huggingface_hub's metadata helpers do over HTTP ranges, through fsspec."""
    with fs.open(path, "rb", cache_type="none") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def test_pyarrow_reads_parquet_through_tb5(served: Any) -> None:
    import pyarrow as pa  # a test dependency (pyproject's [test] extra)
    import pyarrow.parquet as pq
    live, fs, _, root = served
    table = pa.table({"id": list(range(50_000)), "name": [f"row-{i}" for i in range(50_000)], "x": [i * 0.5 for i in range(50_000)]})
    pq.write_table(table, os.path.join(root, "t.parquet"), row_group_size=10_000)
    assert pq.read_table("t.parquet", filesystem=fs).equals(table)
    assert pq.read_table(live.url("t.parquet")[len("tb5://") :].split("/", 1)[1], filesystem=fs, columns=["x"]).column("x").equals(table.column("x"))
    with fsspec.open(live.url("t.parquet"), "rb") as f:
        assert pq.ParquetFile(f).metadata.num_rows == 50_000
    # and writing through tb5:// (atomic write on close)
    pq.write_table(table.slice(0, 100), "out.parquet", filesystem=fs)
    assert pq.read_table(os.path.join(root, "out.parquet")).equals(table.slice(0, 100))


def test_checksum_and_ukey_from_content(served: Any) -> None:
    _, fs, _, root = served
    fs.cp_file("big.bin", "copy.bin")
    assert fs.ukey("copy.bin") == fs.ukey("big.bin") and len(fs.ukey("big.bin")) == 64
    assert fs.checksum("copy.bin") == fs.checksum("big.bin")
    assert fs.checksum("d0/sub0/f0.bin") != fs.checksum("big.bin") or os.path.getsize(os.path.join(root, "d0/sub0/f0.bin")) == 0
    fs.pipe_file("copy.bin", b"changed")
    assert fs.ukey("copy.bin") != fs.ukey("big.bin")
    with pytest.raises(IsADirectoryError):
        fs.ukey("d0")


# ---- writing --------------------------------------------------------------------------------------


def test_pipe_and_modes(served: Any) -> None:
    _, fs, local, root = served
    fs.pipe_file("p.txt", b"hello")
    assert slurp(os.path.join(root, "p.txt")) == b"hello"
    fs.pipe({"p.txt": b"again", "q.txt": b"q"})
    assert fs.cat(["p.txt", "q.txt"]) == {"p.txt": b"again", "q.txt": b"q"}
    with pytest.raises(FileExistsError):
        fs.pipe_file("p.txt", b"x", mode="create")
    fs.pipe_file("new.txt", b"x", mode="create")
    big = os.urandom(40 * 1024 * 1024 + 1)  # past one request: a pipelined server-side write
    fs.pipe_file("bigpipe.bin", big)
    assert slurp(os.path.join(root, "bigpipe.bin")) == big
    same_error(lambda: local.pipe_file(os.path.join(root, "nodir/x"), b"1"), lambda: fs.pipe_file("nodir/x", b"1"))
    same_error(lambda: local.pipe_file(os.path.join(root, "d0"), b"1"), lambda: fs.pipe_file("d0", b"1"))
    same_error(lambda: local.pipe_file(os.path.join(root, "big.bin/x"), b"1"), lambda: fs.pipe_file("big.bin/x", b"1"))
    auto = tb5(served[0], auto_mkdir=True)
    auto.pipe_file("made/by/pipe.txt", b"1")
    assert slurp(os.path.join(root, "made/by/pipe.txt")) == b"1"
    auto._holder.close()
    assert tmp_files(root) == []


def test_open_write_is_atomic(served: Any) -> None:
    _, fs, _, root = served
    final = os.path.join(root, "w.bin")
    blob = os.urandom(30 * 1024 * 1024)
    with fs.open("w.bin", "wb", block_size=4 << 20) as f:
        f.write(blob[: 20 << 20])
        f.flush()
        assert not os.path.exists(final)  # 20 MiB sent, nothing at the final path yet
        assert len(tmp_files(root)) == 1
        f.write(blob[20 << 20 :])
    assert slurp(final) == blob
    assert tmp_files(root) == []
    # overwrite keeps the old file visible until close
    with fs.open("w.bin", "wb", block_size=1 << 20) as f:
        f.write(b"x" * (3 << 20))
        f.flush()
        assert slurp(final) == blob
    assert slurp(final) == b"x" * (3 << 20)


def test_abandoned_write_leaves_nothing(served: Any) -> None:
    live, fs, _, root = served
    f = fs.open("gone.bin", "wb", block_size=1 << 20)
    f.write(os.urandom(3 << 20))
    f.flush()
    assert len(tmp_files(root)) == 1
    f.discard()
    assert tmp_files(root) == [] and not os.path.exists(os.path.join(root, "gone.bin"))
    g = fs.open("lost.bin", "wb", block_size=1 << 20)
    g.write(os.urandom(3 << 20))
    g.flush()
    fs._holder.close()  # the connection drops mid-write
    deadline = time.monotonic() + 10
    while tmp_files(root) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tmp_files(root) == [] and not os.path.exists(os.path.join(root, "lost.bin"))
    g.closed = True  # nothing left to commit on this side
    assert fs.ls("d0", detail=False)  # reconnects


def test_open_exclusive_and_append(served: Any) -> None:
    _, fs, _, root = served
    with pytest.raises(FileExistsError):
        fs.open("big.bin", "xb")
    with fs.open("x.bin", "xb") as f:
        f.write(b"first")
    with fs.open("x.bin", "ab") as f:
        f.write(b"-second")
    assert fs.cat_file("x.bin") == b"first-second"
    with fs.open("fresh.bin", "ab") as f:
        f.write(b"only")
    assert fs.cat_file("fresh.bin") == b"only"


def test_transaction_commits_at_the_end(served: Any) -> None:
    _, fs, _, root = served
    with fs.transaction:
        with fs.open("tx.bin", "wb") as f:
            f.write(b"in a transaction")
        assert not os.path.exists(os.path.join(root, "tx.bin"))
    assert fs.cat_file("tx.bin") == b"in a transaction"
    with pytest.raises(RuntimeError):
        with fs.transaction:
            with fs.open("tx2.bin", "wb") as f:
                f.write(b"never")
            raise RuntimeError("abort")
    assert not fs.exists("tx2.bin") and tmp_files(root) == []


@pytest.mark.parametrize("threshold", [1 << 40, 1 << 20])  # single requests / the sync engine
def test_put_and_get_files(served: Any, tmp_path: Any, threshold: int) -> None:
    live, _, _, root = served
    fs = tb5(live, engine_threshold=threshold)
    try:
        src = os.path.join(root, "big.bin")
        blob = slurp(src)
        local = tmp_path / "local"
        local.mkdir()
        sizes: list[int] = []

        class Record(fsspec.callbacks.Callback):
            def call(self, *a: Any, **kw: Any) -> None:
                sizes.append(self.value)

        fs.get_file("big.bin", str(local / "big.bin"), callback=Record())
        assert (local / "big.bin").read_bytes() == blob and sizes and sizes[-1] == len(blob)
        assert not (local / ".tb5sync").exists()
        fs.put_file(str(local / "big.bin"), "uploaded.bin")
        assert slurp(os.path.join(root, "uploaded.bin")) == blob
        (local / "big.bin").write_bytes(blob[::-1])
        fs.put_file(str(local / "big.bin"), "uploaded.bin")  # overwrite (a delta for the engine)
        assert slurp(os.path.join(root, "uploaded.bin")) == blob[::-1]
        with pytest.raises(FileNotFoundError):
            fs.put_file(str(local / "big.bin"), "nodir/uploaded.bin")
        with pytest.raises(IsADirectoryError):
            fs.put_file(str(local / "big.bin"), "d0")
        with pytest.raises(IsADirectoryError):
            fs.get_file("big.bin", str(local))
        with pytest.raises(FileNotFoundError):
            fs.get_file("nope", str(local / "nope"))
        buf = io.BytesIO()
        fs.get_file("d1/sub1/f1.bin", buf)
        assert buf.getvalue() == slurp(os.path.join(root, "d1/sub1/f1.bin"))
        assert tmp_files(root) == [] and tmp_files(str(local)) == []
    finally:
        fs._holder.close()


def test_recursive_put_get_copy_match_local(served: Any, tmp_path: Any) -> None:
    _, fs, local, root = served
    dst_local = str(tmp_path / "via_local")
    dst_remote = str(tmp_path / "via_tb5")
    local.get(os.path.join(root, "d0"), dst_local, recursive=True)
    fs.get("d0", dst_remote, recursive=True)
    assert sorted(rel(dst_local, local.find(dst_local))) == sorted(rel(dst_remote, local.find(dst_remote)))
    for name in rel(dst_local, local.find(dst_local)):
        assert slurp(os.path.join(dst_local, name)) == slurp(os.path.join(dst_remote, name))
    fs.put(dst_remote + "/", "put_back", recursive=True)
    assert sorted(fs.find("put_back")) == sorted("put_back/" + n for n in rel(dst_remote, local.find(dst_remote)))
    local.copy(os.path.join(root, "d1"), os.path.join(root, "copied_local"), recursive=True)
    fs.copy("d1", "copied_tb5", recursive=True)
    assert [n[len("copied_tb5") :] for n in fs.find("copied_tb5", withdirs=True)] == [n[len("copied_local") :] for n in fs.find("copied_local", withdirs=True)]
    assert fs.cat("copied_tb5/sub1/f1.bin") == fs.cat("d1/sub1/f1.bin")


def test_server_side_copy_moves_no_bytes_through_client(served: Any) -> None:
    _, fs, _, root = served
    fs.ls("")
    before = wire_bytes(fs)
    fs.cp_file("big.bin", "big2.bin")
    assert wire_bytes(fs) - before < 4096
    assert slurp(os.path.join(root, "big2.bin")) == slurp(os.path.join(root, "big.bin"))


def test_rm_matches_local(served: Any) -> None:
    _, fs, local, root = served
    fs.rm("d0/sub0/f0.bin")
    assert not os.path.exists(os.path.join(root, "d0/sub0/f0.bin"))
    same_error(lambda: local.rm(os.path.join(root, "d1")), lambda: fs.rm("d1"))  # ValueError: needs recursive
    same_error(lambda: local.rm(os.path.join(root, "nope")), lambda: fs.rm("nope"))
    fs.rm("d1", recursive=True)
    assert not os.path.exists(os.path.join(root, "d1"))
    fs.rm(["d2/sub0", "d2/sub1"], recursive=True)
    assert sorted(os.listdir(os.path.join(root, "d2"))) == ["sub2"]
    fs.rm("d3/sub*", recursive=True)
    assert os.listdir(os.path.join(root, "d3")) == []
    fs.rm("rel_link")  # the link, not its target
    assert not os.path.lexists(os.path.join(root, "rel_link"))
    fs.rm("abs_link")
    assert not os.path.lexists(os.path.join(root, "abs_link"))
    fs.rm_file("big.bin")
    same_error(lambda: local.rm_file(os.path.join(root, "big.bin")), lambda: fs.rm_file("big.bin"))
    with pytest.raises(PermissionError):
        fs.rm("", recursive=True)
    assert os.path.isdir(root)


def test_mkdir_makedirs_rmdir_match_local(served: Any) -> None:
    _, fs, local, root = served
    fs.mkdir("m/n/o")
    assert os.path.isdir(os.path.join(root, "m/n/o"))
    same_error(lambda: local.mkdir(os.path.join(root, "m")), lambda: fs.mkdir("m"))
    same_error(lambda: local.mkdir(os.path.join(root, "p/q"), create_parents=False), lambda: fs.mkdir("p/q", create_parents=False))
    same_error(lambda: local.makedirs(os.path.join(root, "m")), lambda: fs.makedirs("m"))
    fs.makedirs("m", exist_ok=True)
    same_error(lambda: local.makedirs(os.path.join(root, "big.bin"), exist_ok=True), lambda: fs.makedirs("big.bin", exist_ok=True))
    same_error(lambda: local.rmdir(os.path.join(root, "m")), lambda: fs.rmdir("m"))  # not empty
    fs.rmdir("m/n/o")
    assert not os.path.exists(os.path.join(root, "m/n/o"))
    same_error(lambda: local.rmdir(os.path.join(root, "big.bin")), lambda: fs.rmdir("big.bin"))


def test_mv_matches_local(served: Any) -> None:
    _, fs, local, root = served
    fs.mv("big.bin", "moved.bin")
    assert os.path.exists(os.path.join(root, "moved.bin")) and not os.path.exists(os.path.join(root, "big.bin"))
    fs.mv("moved.bin", "d0")  # into an existing directory
    assert os.path.exists(os.path.join(root, "d0/moved.bin"))
    fs.mv("d1", "renamed")
    assert os.path.isdir(os.path.join(root, "renamed/sub1"))
    fs.pipe_file("d0/sub0/f1.bin", b"clash")
    fs.pipe_file("f1.bin", b"top")
    local_fs = LocalFileSystem()
    same_error(lambda: local_fs.mv(os.path.join(root, "nope"), os.path.join(root, "x")), lambda: fs.mv("nope", "x"))
    fs.mv("renamed", "renamed")  # to itself: nothing happens
    with pytest.raises(ValueError):
        fs.mv("d2", "d2/sub0/inside")
    assert os.path.isdir(os.path.join(root, "d2"))


def test_touch_matches_local(served: Any) -> None:
    _, fs, local, root = served
    fs.touch("t.txt")
    assert os.path.getsize(os.path.join(root, "t.txt")) == 0
    fs.pipe_file("t.txt", b"data")
    old = time.time() - 1000
    os.utime(os.path.join(root, "t.txt"), (old, old))
    fs.touch("t.txt", truncate=False)
    st = os.stat(os.path.join(root, "t.txt"))
    assert st.st_size == 4 and st.st_mtime > old + 500
    fs.touch("t.txt")
    assert os.path.getsize(os.path.join(root, "t.txt")) == 0
    same_error(lambda: local.touch(os.path.join(root, "d0")), lambda: fs.touch("d0"))
    same_error(lambda: local.touch(os.path.join(root, "nodir/t")), lambda: fs.touch("nodir/t"))


# ---- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "op",
    [
        lambda fs, p: fs.info(p("nope")),
        lambda fs, p: fs.ls(p("nope")),
        lambda fs, p: fs.ls(p("big.bin/x")),
        lambda fs, p: fs.cat_file(p("nope")),
        lambda fs, p: fs.cat_file(p("d0")),
        lambda fs, p: fs.cat_file(p("big.bin/x")),
        lambda fs, p: fs.cat_file(p("dangling_link")),
        lambda fs, p: fs.open(p("nope"), "rb"),
        lambda fs, p: fs.rm(p("nope")),
        lambda fs, p: fs.rmdir(p("nope")),
        lambda fs, p: fs.mkdir(p("d0")),
        lambda fs, p: fs.cp_file(p("nope"), p("x")),
        lambda fs, p: fs.cp_file(p("big.bin"), p("d0")),
        lambda fs, p: fs.cp_file(p("big.bin"), p("nodir/x")),
    ],
    ids=["info-missing", "ls-missing", "ls-through-file", "cat-missing", "cat-dir", "cat-through-file", "cat-dangling", "open-missing", "rm-missing", "rmdir-missing", "mkdir-exists", "cp-missing", "cp-onto-dir", "cp-nodir"],
)
def test_errors_match_local(served: Any, op: Any) -> None:
    _, fs, local, root = served
    same_error(lambda: op(local, lambda p: os.path.join(root, p)), lambda: op(fs, lambda p: p))


@pytest.mark.parametrize("path", ["../x", "d0/../../x", OUTSIDE, "/../x"])
def test_paths_outside_root_are_permission_errors(served: Any, path: str) -> None:
    _, fs, _, root = served
    calls = [lambda: fs.cat_file(path), lambda: fs.pipe_file(path + "/y", b"1"), lambda: fs.open(path, "rb")]
    if path == OUTSIDE:  # the link itself is in the root: described, never followed
        info = fs.info(path)
        assert (info["type"], info["size"], info["islink"], info["destination"]) == ("other", 0, True, "/etc/hostname")
        calls.append(lambda: fs.pipe_file(path, b"1"))  # nor written through
    else:
        calls.append(lambda: fs.info(path))
    for call in calls:
        with pytest.raises(PermissionError):
            call()
    assert fs.ls("d0", detail=False)


def test_symlinked_dir_leading_out_is_refused(served: Any, tmp_path: Any) -> None:
    _, fs, _, root = served
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    os.symlink(str(outside), os.path.join(root, "escape"))
    for call in (lambda: fs.ls("escape"), lambda: fs.cat_file("escape/secret"), lambda: fs.pipe_file("escape/new", b"x"), lambda: fs.rm("escape/secret"), lambda: fs.mv("escape/secret", "got")):
        with pytest.raises(PermissionError):
            call()
    assert (outside / "secret").read_bytes() == b"secret" and not (outside / "new").exists()


def test_read_only_server_refuses_every_write(tmp_path: Any) -> None:
    root = str(tmp_path / "ro")
    make_tree(root)
    before = {p: os.lstat(os.path.join(d, p)).st_mtime_ns for d, _, fs_ in os.walk(root) for p in fs_}
    live = start_server(root, read_only=True)
    fs = tb5(live, engine_threshold=1 << 20)
    try:
        writes = [
            lambda: fs.pipe_file("x", b"1"),
            lambda: fs.open("x", "wb").close(),
            lambda: fs.rm("big.bin"),
            lambda: fs.rm("d0", recursive=True),
            lambda: fs.mkdir("newdir"),
            lambda: fs.makedirs("a/b", exist_ok=True),
            lambda: fs.rmdir("empty_dir"),
            lambda: fs.mv("big.bin", "moved"),
            lambda: fs.cp_file("big.bin", "copy"),
            lambda: fs.touch("big.bin"),
            lambda: fs.put_file(os.path.join(root, "big.bin"), "up.bin"),
        ]
        for w in writes:
            with pytest.raises(PermissionError):
                w()
            assert fs.cat_file("d1/sub1/f1.bin", 0, 4) == slurp(os.path.join(root, "d1/sub1/f1.bin"))[:4]
        after = {p: os.lstat(os.path.join(d, p)).st_mtime_ns for d, _, fs_ in os.walk(root) for p in fs_}
        assert after == before
        assert os.path.isdir(os.path.join(root, "empty_dir"))
        assert not os.path.exists(os.path.join(root, ".tb5sync"))  # not even a scan cache
        assert fs.ukey("big.bin")  # digests still work (kept in memory)
    finally:
        fs._holder.close()
        live.server.stop()


def test_many_concurrent_small_ops_share_connections(served: Any) -> None:
    _, fs, _, root = served
    names = fs.find("")
    errors_seen: list[BaseException] = []

    def worker() -> None:
        try:
            for n in names[:20]:
                if n == OUTSIDE:
                    continue
                fs.info(n)
                if fs.isfile(n) and not fs.info(n)["islink"]:
                    assert fs.cat_file(n, 0, 16) == slurp(os.path.join(root, n))[:16]
        except BaseException as exc:  # surfaced below
            errors_seen.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        joined(t, 60)
    assert errors_seen == []
    assert len(fs._holder.link.requester.channels) == fs.streams


# ---- fsspec's own abstract suites (copy/get/put trailing-slash rules, open, pipe) ------------------


class TestFsspecAbstract(AbstractFixtures, AbstractCopyTests, AbstractGetTests, AbstractPutTests, AbstractOpenTests, AbstractPipeTests):  # type: ignore[misc]
    @pytest.fixture
    def fs(self, tmp_path: Any) -> Any:
        live = start_server(str(tmp_path / "abstract-root"))
        fs = tb5(live, auto_mkdir=True)  # as fsspec's own suite runs LocalFileSystem(auto_mkdir=True)
        try:
            yield fs
        finally:
            fs._holder.close()
            live.server.stop()

    @pytest.fixture
    def fs_path(self) -> str:
        return "work"



def test_asynchronous_use(served: Any) -> None:
    """The coroutines work on the caller's own event loop (``asynchronous=True``), concurrently."""
    live, _, _, root = served

    async def main() -> None:
        fs = TB5FileSystem(host="127.0.0.1", port=live.port, asynchronous=True, skip_instance_cache=True)
        try:
            names = await fs._find("d0")
            datas = await asyncio.gather(*[fs._cat_file(n) for n in names])
            assert datas == [slurp(os.path.join(root, n)) for n in names]
            await fs._pipe_file("async.bin", b"from a coroutine")
            assert (await fs._info("async.bin"))["size"] == 16
            assert [i["name"] for i in await fs._ls("d0")] == ["d0/sub0", "d0/sub1", "d0/sub2"]
        finally:
            fs._holder.close()

    asyncio.run(main())


def test_pickled_instance_works_in_a_fresh_state(served: Any) -> None:
    """fsspec ships filesystems to workers (dask) by pickling: the copy reconnects by itself."""
    import pickle

    live, fs, _, root = served
    fs.ls("")
    clone = pickle.loads(pickle.dumps(fs))
    try:
        assert (clone.host, clone.port, clone.streams) == (fs.host, fs.port, fs.streams)
        assert clone.cat_file("d1/sub1/f1.bin") == slurp(os.path.join(root, "d1/sub1/f1.bin"))
    finally:
        clone._holder.close()


def test_long_listings_come_in_pages(served: Any, monkeypatch: Any) -> None:
    """ls/find larger than one page arrive in several (any connection may fetch the next page)."""
    import tb5sync.daemon.fsops as fsops

    _, fs, _, _ = served
    want_find = fs.find("", withdirs=True, detail=True)
    want_ls = fs.ls("d0/sub0", detail=True)
    calls: list[str] = []
    orig = fs._call

    async def counting(method: str, args: dict[str, Any], **kw: Any) -> Any:
        calls.append(method)
        return await orig(method, args, **kw)

    monkeypatch.setattr(fsops, "PAGE_BYTES", 2000)  # a handful of entries per page
    monkeypatch.setattr(fs, "_call", counting)
    assert fs.find("", withdirs=True, detail=True) == want_find
    assert calls.count("more") >= 5
    assert fs.ls("d0/sub0", detail=True) == want_ls  # the sync path pages too
    assert sorted(p for p, _, _ in fs.walk("")) == sorted(["", *(n for n, i in want_find.items() if i["type"] == "directory")])
