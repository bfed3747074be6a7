"""End-to-end sync through the same sender/receiver code: local -> local, push and pull over loopback."""

from __future__ import annotations

import os

import pytest

import tb5sync
from conftest import snapshot


@pytest.fixture(params=["local", "push", "pull"])
def route(request, server, tmp_path):
    """A function (src_tree, name) -> (sync_src, sync_dst, final_path) for each route."""

    def make(src: str, name: str):
        if request.param == "local":
            dst = str(tmp_path / "out" / name)
            return src + "/", dst, dst
        if request.param == "push":
            return src + "/", server.url(name), os.path.join(server.root, name)
        # pull: first put the tree on the server by a local copy, then pull it
        staged = os.path.join(server.root, "staged-" + name)
        tb5sync.sync(src + "/", staged)
        dst = str(tmp_path / "pulled" / name)
        return server.url("staged-" + name + "/"), dst, dst

    return make


def test_round_trip_identical(route, tree):
    s, d, final = route(tree, "copy")
    stats = tb5sync.sync(s, d)
    assert snapshot(final) == snapshot(tree)
    assert stats.files_total == stats.files_transferred > 0
    assert stats.bytes_transferred == stats.bytes_total
    again = tb5sync.sync(s, d)
    assert again.files_transferred == 0
    assert again.chunks_sent == 0
    assert snapshot(final) == snapshot(tree)


@pytest.mark.parametrize("remote", [False, True], ids=["local", "push"])
def test_delta_sends_small_fraction(remote, server, tree, tmp_path):
    d = server.url("delta") if remote else str(tmp_path / "delta")
    final = os.path.join(server.root, "delta") if remote else d
    tb5sync.sync(tree + "/", d)
    with open(os.path.join(tree, "big.bin"), "r+b") as f:
        f.seek(5 * 1024 * 1024)
        f.write(b"changed!" * 16)
    stats = tb5sync.sync(tree + "/", d)
    assert stats.files_transferred == 1
    assert stats.chunks_reused >= 3
    assert stats.chunks_sent <= 3
    assert snapshot(final) == snapshot(tree)


def test_pull_delta(server, tree, tmp_path):
    remote = os.path.join(server.root, "m")
    tb5sync.sync(tree + "/", remote)
    dst = str(tmp_path / "p")
    tb5sync.sync(server.url("m/"), dst)
    with open(os.path.join(remote, "big.bin"), "r+b") as f:
        f.seek(1000)
        f.write(b"x" * 50)
    stats = tb5sync.sync(server.url("m/"), dst)
    assert stats.files_transferred == 1
    assert stats.chunks_sent <= 2 and stats.chunks_reused >= 3
    assert snapshot(dst) == snapshot(remote)


def test_trailing_slash_semantics(tree, tmp_path):
    out = tmp_path / "o"
    tb5sync.sync(tree, str(out))
    assert (out / "src" / "big.bin").is_file()
    tb5sync.sync(tree + "/", str(out / "contents"))
    assert (out / "contents" / "big.bin").is_file()
    single = os.path.join(tree, "big.bin")
    tb5sync.sync(single, str(out / "renamed.bin"))
    with open(single, "rb") as f:
        assert (out / "renamed.bin").read_bytes() == f.read()
    os.makedirs(out / "into")
    tb5sync.sync(single, str(out / "into"))
    assert (out / "into" / "big.bin").is_file()


def test_delete_respects_excludes(tree, tmp_path):
    dst = str(tmp_path / "d")
    tb5sync.sync(tree + "/", dst)
    for name in ("extra.txt", "keep.log"):
        with open(os.path.join(dst, name), "w") as f:
            f.write("x")
    os.makedirs(os.path.join(dst, "extradir", "deep"))
    stats = tb5sync.sync(tree + "/", dst, delete=True, exclude=["*.log"])
    assert not os.path.exists(os.path.join(dst, "extra.txt"))
    assert not os.path.exists(os.path.join(dst, "extradir"))
    assert os.path.exists(os.path.join(dst, "keep.log"))
    assert stats.files_deleted == 3  # extra.txt, extradir/deep, extradir (rsync counts each)


def test_exclude_skips_source(tree, tmp_path):
    dst = str(tmp_path / "d")
    tb5sync.sync(tree + "/", dst, exclude=["d1/", "*.bin"])
    assert not os.path.exists(os.path.join(dst, "d1"))
    assert not any(n.endswith(".bin") for _, _, fs in os.walk(dst) for n in fs)
    assert os.path.islink(os.path.join(dst, "rel_link"))


def test_checksum_detects_same_size_same_mtime_change(tree, tmp_path):
    dst = str(tmp_path / "d")
    tb5sync.sync(tree + "/", dst)
    victim = os.path.join(dst, "d0", "sub0", "f0.bin")
    st = os.stat(victim)
    if st.st_size == 0:
        victim = os.path.join(dst, "big.bin")
        st = os.stat(victim)
    with open(victim, "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert tb5sync.sync(tree + "/", dst).files_transferred == 0  # quick check misses it, like rsync
    stats = tb5sync.sync(tree + "/", dst, checksum=True)
    assert stats.files_transferred == 1
    assert snapshot(dst) == snapshot(tree)


def test_dry_run_changes_nothing(tree, tmp_path):
    dst = tmp_path / "d"
    stats = tb5sync.sync(tree + "/", str(dst), dry_run=True)
    assert stats.files_transferred == stats.files_total > 0
    assert not dst.exists() or not any(p.name != ".tb5sync" for p in dst.iterdir())


def test_type_change_file_to_dir_and_link(tree, tmp_path):
    dst = str(tmp_path / "d")
    tb5sync.sync(tree + "/", dst)
    os.unlink(os.path.join(tree, "rel_link"))
    os.makedirs(os.path.join(tree, "rel_link"))
    os.rename(os.path.join(tree, "empty_dir"), os.path.join(tree, "tmpx"))
    with open(os.path.join(tree, "empty_dir"), "w") as f:
        f.write("now a file")
    os.rmdir(os.path.join(tree, "tmpx"))
    tb5sync.sync(tree + "/", dst)
    assert snapshot(dst) == snapshot(tree)


def test_missing_source_is_clear(tmp_path):
    with pytest.raises(tb5sync.RemoteNotFoundError, match="does not exist"):
        tb5sync.sync(str(tmp_path / "nope"), str(tmp_path / "x"))


def test_both_remote_refused():
    with pytest.raises(tb5sync.UsageError, match="both"):
        tb5sync.sync("tb5://a/x", "tb5://b/y")


def test_bad_options_refused(tmp_path):
    with pytest.raises(tb5sync.UsageError, match="compress"):
        tb5sync.sync(str(tmp_path), str(tmp_path / "x"), compress="zip")
    with pytest.raises(tb5sync.UsageError, match="streams"):
        tb5sync.sync(str(tmp_path), str(tmp_path / "x"), streams=0)


@pytest.mark.parametrize("compress", ["lz4", "none", "auto"])
def test_compression_modes_round_trip(server, tmp_path, compress):
    src = tmp_path / "c"
    src.mkdir()
    (src / "text.txt").write_bytes(b"hello tb5sync " * 500_000)  # 7 MB, compressible: the chunked path
    (src / "small.txt").write_bytes(b"abc" * 10_000)
    (src / "random.bin").write_bytes(os.urandom(300_000))
    stats = tb5sync.sync(str(src) + "/", server.url("c"), compress=compress)
    assert snapshot(os.path.join(server.root, "c")) == snapshot(str(src))
    if compress == "lz4":
        assert stats.wire_bytes < 3_000_000


def test_stats_fields_are_ints(tree, tmp_path):
    stats = tb5sync.sync(tree + "/", str(tmp_path / "d"))
    d = stats.as_dict()
    for k in ("files_total", "bytes_total", "files_transferred", "bytes_transferred", "wire_bytes",
              "chunks_sent", "chunks_reused", "files_deleted"):
        assert isinstance(d[k], int), k
    assert isinstance(d["seconds"], float)


def test_many_streams_and_one_stream(server, tree):
    for n in (1, 7):
        tb5sync.sync(tree + "/", server.url(f"s{n}"), streams=n)
        assert snapshot(os.path.join(server.root, f"s{n}")) == snapshot(tree)


def test_dedup_across_files_uses_index(server, tmp_path):
    src = tmp_path / "dd"
    src.mkdir()
    data = os.urandom(12 * 1024 * 1024)
    (src / "a.bin").write_bytes(data)
    tb5sync.sync(str(src) + "/", server.url("dd"))
    (src / "b.bin").write_bytes(data)  # same content under a new name
    stats = tb5sync.sync(str(src) + "/", server.url("dd"))
    assert stats.files_transferred == 1
    assert stats.chunks_sent == 0 and stats.chunks_reused > 0
    with open(os.path.join(server.root, "dd", "b.bin"), "rb") as f:
        assert f.read() == data


def test_import_loads_no_engine() -> None:
    """`import tb5sync` (and `tb5sync --help`) load no sockets, sqlite or chunker: the engine comes on first use."""
    import subprocess
    import sys

    code = (
        "import sys, tb5sync\n"
        "heavy = [m for m in ('tb5sync.remote.client', 'tb5sync.roles.receiver', 'tb5sync.roles.sender', 'tb5sync.wire.transport',"
        " 'tb5sync.tree.state', 'tb5sync.engine.chunking', 'sqlite3', 'socket') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
        "assert callable(tb5sync.sync) and tb5sync.SyncOptions is not None\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == ""


def test_plain_push_loads_no_tls(server, tmp_path) -> None:
    """A push without TLS or a token never imports ssl, hmac, importlib.abc or platform (~10 ms
    of a client's start-up, a twentieth of a no-change re-run of 20,000 files), and still lands."""
    import subprocess
    import sys

    src = tmp_path / "tsrc"
    src.mkdir()
    (src / "a.txt").write_bytes(b"plain")
    code = (
        "import sys, tb5sync\n"
        f"tb5sync.sync({str(src) + '/'!r}, {server.url('t')!r})\n"
        "print(','.join(m for m in ('ssl', 'hmac', 'importlib.abc', 'platform') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == ""
    assert (tmp_path / "server" / "t" / "a.txt").read_bytes() == b"plain"


@pytest.mark.parametrize("route_kind", ["push", "pull", "local"])
def test_progress_ends_complete(server, tmp_path, route_kind):
    """The progress callback's last call says done == total, also when most chunks are reused."""
    import random

    src = tmp_path / "psrc"
    src.mkdir()
    data = bytearray(random.Random(7).randbytes(6 << 20))
    (src / "big.bin").write_bytes(data)
    (src / "small.txt").write_bytes(b"x" * 1000)
    if route_kind == "push":
        s, d = str(src) + "/", server.url("p")
    elif route_kind == "pull":
        tb5sync.sync(str(src) + "/", os.path.join(server.root, "staged"))
        s, d = server.url("staged/"), str(tmp_path / "pulled")
    else:
        s, d = str(src) + "/", str(tmp_path / "copy")
    for run in range(2):
        calls = []
        stats = tb5sync.sync(s, d, progress=lambda done, total: calls.append((done, total)))
        assert calls, run
        done, total = calls[-1]
        assert done == total == stats.bytes_transferred, (run, calls[-3:], stats)
        assert all(0 <= a <= b or b == 0 for a, b in calls)
        data[3_000_000:3_000_100] = b"E" * 100  # the second run: a delta, chunks mostly reused
        (src / "big.bin").write_bytes(data)
        if route_kind == "pull":
            tb5sync.sync(str(src) + "/", os.path.join(server.root, "staged"))


@pytest.mark.parametrize("route_kind", ["local", "push", "pull"])
def test_dry_run_lists_what_would_change(server, tmp_path, route_kind):
    """-n lists the paths that would be created, updated and deleted, and changes nothing."""
    src = tmp_path / "dsrc"
    (src / "sub").mkdir(parents=True)
    (src / "same.txt").write_text("same")
    (src / "edit.txt").write_text("v1")
    (src / "sub" / "gone.txt").write_text("x")
    if route_kind == "push":
        s, d, final = str(src) + "/", server.url("dd"), os.path.join(server.root, "dd")
    elif route_kind == "pull":
        staged = os.path.join(server.root, "staged")
        s, d, final = server.url("staged/"), str(tmp_path / "pulled"), str(tmp_path / "pulled")
    else:
        s, d, final = str(src) + "/", str(tmp_path / "copy"), str(tmp_path / "copy")

    def publish():
        if route_kind == "pull":
            tb5sync.sync(str(src) + "/", staged, delete=True)

    publish()
    tb5sync.sync(s, d)
    (src / "edit.txt").write_text("version 2")
    (src / "new").mkdir()
    (src / "new" / "added.bin").write_bytes(b"\0" * 10)
    os.symlink("same.txt", src / "alink")
    (src / "sub" / "gone.txt").unlink()
    publish()
    before = snapshot(final)
    stats = tb5sync.sync(s, d, dry_run=True, delete=True)
    changes = stats.extra["changes"]
    assert changes["transfer"].index("new") < changes["transfer"].index("new/added.bin")  # parents first
    assert set(changes["transfer"]) == {"edit.txt", "new", "new/added.bin", "alink"}
    assert changes["delete"] == ["sub/gone.txt"]
    assert snapshot(final) == before


def test_cli_dry_run_prints_the_paths(tmp_path):
    import subprocess
    import sys

    src = tmp_path / "s"
    src.mkdir()
    (src / "a.txt").write_text("a")
    dst = tmp_path / "d"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    env = {k: v for k, v in os.environ.items() if k != "TB5SYNC_TOKEN"}
    r = subprocess.run([sys.executable, "-m", "tb5sync.cli", "sync", "-n", "--delete", f"{src}/", str(dst)],
                       capture_output=True, text=True, timeout=60, env=env, check=False)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "deleting old.txt" in lines and "a.txt" in lines
    assert not any(ln.startswith("files:") for ln in lines)  # as rsync -n: the list, no statistics
    r = subprocess.run([sys.executable, "-m", "tb5sync.cli", "sync", "-n", "--stats", "--delete", f"{src}/", str(dst)],
                       capture_output=True, text=True, timeout=60, env=env, check=False)
    assert any(ln.startswith("files:") and "1 would delete" in ln for ln in r.stdout.splitlines())
    assert sorted(os.listdir(dst)) == ["old.txt"]
