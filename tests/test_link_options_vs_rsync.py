"""rsync's -H, -S, -X, -L, --copy-unsafe-links, --safe-links and --link-dest on every route.

The reference is ``rsync -a <option>`` run in the test on the same trees: the result trees must
agree in content, type, mode, mtime and link targets (``digest_snapshot``), and beyond that in
hard-link identity (which paths share an inode), allocated blocks of sparse files (``st_blocks``)
and extended attributes (``user.*``). Routes: local, push to a live server, pull from it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Sequence
from typing import Any

import pytest
from conftest import have_rsync, start_server
from test_partial_vs_rsync import cli
from test_vs_rsync import T0, Harness, assert_same, cp_a, digest_snapshot, freeze_dirs, settle, write

import tb5sync
from tb5sync.errors import PartialTransferError, PathError, UsageError
from tb5sync.tree.options import BASE_OPTIONS, SyncOptions


@pytest.fixture(autouse=True)
def _need_rsync() -> None:
    if not have_rsync():
        pytest.skip("rsync is not installed")


# ---- helpers -------------------------------------------------------------------------------


def inode_groups(base: str) -> list[tuple[str, ...]]:
    """The paths under ``base`` (files only) that share an inode, as sorted groups of two or more."""
    by_ino: dict[tuple[int, int], list[str]] = {}
    for d, _, names in os.walk(base):
        for n in names:
            p = os.path.join(d, n)
            st = os.lstat(p)
            if not os.path.islink(p):
                by_ino.setdefault((st.st_dev, st.st_ino), []).append(os.path.relpath(p, base))
    return sorted(tuple(sorted(g)) for g in by_ino.values() if len(g) > 1)


def xattr_snapshot(base: str) -> dict[str, list[tuple[str, bytes]]]:
    """Each file or directory under ``base`` (``.`` the base) -> its ``user.*`` attributes, sorted."""
    out: dict[str, list[tuple[str, bytes]]] = {}
    for d, dirs, names in os.walk(base):
        for n in [".", *dirs, *names] if d == base else [*dirs, *names]:
            p = os.path.normpath(os.path.join(d, n))
            if os.path.islink(p):
                continue
            attrs = sorted((a, os.getxattr(p, a)) for a in os.listxattr(p) if a.startswith("user."))
            if attrs:
                out[os.path.relpath(p, base)] = attrs
    return out


def blocks(base: str) -> dict[str, int]:
    """Each regular file under ``base`` -> its allocated 512-byte blocks (``st_blocks``)."""
    return {os.path.relpath(os.path.join(d, n), base): os.lstat(os.path.join(d, n)).st_blocks
            for d, _, names in os.walk(base) for n in names if not os.path.islink(os.path.join(d, n))}


class OptHarness(Harness):
    """:class:`Harness` with rsync options: ``rsync -a ARGS`` against ``tb5sync.sync(**kw)``, both
    expected to end with ``rc`` (0, or 23 with the failures of each route in :attr:`failed`)."""

    def run_opts(self, src_spec: str, dst_spec: str, rsync_args: Sequence[str], rc: int = 0, **kw: Any) -> None:
        if not self._prepared:
            self.prepare()
        settle(self.sp)
        self.failed: dict[str, set[str]] = {}
        for r in self.routes:
            local_src = os.path.join(self.sp, src_spec)
            local_dst = os.path.join(self.dp[r], dst_spec)
            if r == "rsync":
                p = subprocess.run(["rsync", "-a", *rsync_args, local_src, local_dst], capture_output=True, text=True,
                                   timeout=100, check=False)
                assert p.returncode == rc, f"rsync {rsync_args}: {p.returncode} {p.stderr}"
                self.rsync_stderr = p.stderr
                continue
            if r == "push":
                src, dst = local_src, self.server.url("push/" + dst_spec)
            elif r == "pull":
                self.stage_pull()
                src, dst = self.server.url("pullsrc/" + src_spec), local_dst
            else:
                src, dst = local_src, local_dst
            try:
                self.stats[r] = tb5sync.sync(src, dst, **kw)
                got = 0
            except PartialTransferError as exc:
                self.stats[r], got = exc.stats, exc.exit_code
            assert got == rc, f"{r}: exit {got}, failures {self.stats[r].failures}"
            self.failed[r] = {f.path for f in self.stats[r].failures}

    def check_all(self, *, groups: bool = False, xattrs: bool = False, sparse: bool = False, ignore: Sequence[str] = ()) -> None:
        """Trees equal rsync's (mtimes of ``ignore`` aside: directories the run made); with ``groups`` the
        inode groups, ``xattrs`` the attributes, ``sparse`` the blocks."""
        self.check(ignore)
        ref = self.dp["rsync"]
        for r in self.routes:
            if r == "rsync":
                continue
            if groups:
                assert inode_groups(self.dp[r]) == inode_groups(ref), r
            if xattrs:
                assert xattr_snapshot(self.dp[r]) == xattr_snapshot(ref), r
            if sparse:
                assert blocks(self.dp[r]) == blocks(ref), r


@pytest.fixture
def oh(tmp_path: Any, server: Any) -> OptHarness:
    return OptHarness(tmp_path, server)


# ---- -H / --hard-links ----------------------------------------------------------------------


def _hardlink_tree(src: str) -> None:
    write(os.path.join(src, "a"), b"group one", 0o644, T0)
    os.makedirs(os.path.join(src, "d", "e"))
    os.link(os.path.join(src, "a"), os.path.join(src, "d", "b"))
    os.link(os.path.join(src, "a"), os.path.join(src, "d", "e", "c"))
    write(os.path.join(src, "x"), b"group two" * 1000, 0o600, T0)
    os.link(os.path.join(src, "x"), os.path.join(src, "y"))
    write(os.path.join(src, "keep1"), b"partly excluded", 0o644, T0)
    os.link(os.path.join(src, "keep1"), os.path.join(src, "excl1"))
    os.link(os.path.join(src, "keep1"), os.path.join(src, "d", "keep2"))
    write(os.path.join(src, "big"), os.urandom(5 << 20), 0o644, T0)  # a large file's path (>= 4 MiB)
    os.link(os.path.join(src, "big"), os.path.join(src, "d", "big2"))
    write(os.path.join(src, "single"), b"alone", 0o644, T0)
    freeze_dirs(src, T0)


def test_hard_links_vs_rsync_across_excludes_and_reruns(oh: OptHarness) -> None:
    _hardlink_tree(oh.src)
    oh.run_opts("src/", "dst", ["-H", "--exclude=excl1"], hard_links=True, exclude=["excl1"])
    oh.check_all(groups=True)
    assert ("a", "d/b", "d/e/c") in inode_groups(os.path.join(oh.dp["local"], "dst"))
    # second run: a group's content changed in place (every member changes), a link broken at the
    # source (y rewritten as a file of its own), a new link added, one member of a group removed
    with open(os.path.join(oh.src, "a"), "r+b") as f:
        f.write(b"GROUP ONE")
    os.utime(os.path.join(oh.src, "a"), ns=(T0 + 10**9, T0 + 10**9))
    os.unlink(os.path.join(oh.src, "y"))
    write(os.path.join(oh.src, "y"), b"now alone" * 1000, 0o600, T0 + 2 * 10**9)
    os.link(os.path.join(oh.src, "single"), os.path.join(oh.src, "d", "single-link"))
    os.unlink(os.path.join(oh.src, "d", "big2"))
    freeze_dirs(oh.src, T0)
    oh.run_opts("src/", "dst", ["-H", "--delete", "--exclude=excl1"], hard_links=True, delete=True, exclude=["excl1"])
    oh.check_all(groups=True)
    groups = inode_groups(os.path.join(oh.dp["push"], "dst"))
    assert ("d/single-link", "single") in groups and not any("y" in g for g in groups)


def test_hard_links_off_copies_each_path(oh: OptHarness) -> None:
    """Without -H each path is a file of its own, as rsync -a makes it (the groups are not kept)."""
    _hardlink_tree(oh.src)
    oh.run_opts("src/", "dst", [])
    oh.check_all(groups=True)
    assert inode_groups(os.path.join(oh.dp["local"], "dst")) == []


# ---- -S / --sparse ------------------------------------------------------------------------


def _sparse_tree(src: str) -> None:
    os.makedirs(src)
    for name, size, pieces in (
        ("small.img", 3 << 20, [(0, b"head" * 1000), (2 << 20, b"\x01" * 10)]),  # a small file's path
        ("large.img", 24 << 20, [(4096, os.urandom(1 << 20)), (12 << 20, b"mid"), (20 << 20, b"z" * 4097)]),
        ("zeros.bin", 6 << 20, []),  # written as zeros (no hole at the source at all)
    ):
        with open(os.path.join(src, name), "wb") as f:
            if name == "zeros.bin":
                f.write(bytes(size))
            else:
                f.truncate(size)
                for off, data in pieces:
                    f.seek(off)
                    f.write(data)
        os.utime(os.path.join(src, name), ns=(T0, T0))
    write(os.path.join(src, "dense.bin"), os.urandom(70_000), 0o644, T0)
    freeze_dirs(src, T0)


@pytest.mark.parametrize("portable", [False, True], ids=["seek-hole", "zero-scan"])
def test_sparse_vs_rsync_blocks(oh: OptHarness, monkeypatch: pytest.MonkeyPatch, portable: bool) -> None:
    if portable:  # no SEEK_DATA/SEEK_HOLE: every byte is read and scanned
        monkeypatch.setenv("TB5SYNC_NO_SEEK_HOLE", "1")
    _sparse_tree(oh.src)
    oh.run_opts("src/", "dst", ["-S"], sparse=True)
    oh.check_all(sparse=True)
    got = blocks(os.path.join(oh.dp["pull"], "dst"))
    assert got["zeros.bin"] == 0 and got["large.img"] * 512 < (2 << 20), got


def test_sparse_unit_paths_agree(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """copy_sparse gives the same bytes and blocks with SEEK_DATA and with the zero-block scan."""
    import tb5sync._os.sparse as _sparse

    src = str(tmp_path / "s")
    with open(src, "wb") as f:
        f.truncate(9 << 20)
        f.seek(5000)
        f.write(b"x" * 9000)
        f.seek(8 << 20)
        f.write(bytes(8192) + b"y")
    fd = os.open(src, os.O_RDONLY)
    try:
        if _sparse.seek_hole_supported():
            assert sum(n for _, n in _sparse.data_extents(fd, 9 << 20)) < (1 << 20)
        outs = []
        for env in ("0", "1"):
            monkeypatch.setenv("TB5SYNC_NO_SEEK_HOLE", env)
            dst = str(tmp_path / f"d{env}")
            out = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                _sparse.copy_sparse(fd, out, 9 << 20)
            finally:
                os.close(out)
            outs.append(dst)
        monkeypatch.setenv("TB5SYNC_NO_SEEK_HOLE", "1")
        assert _sparse.data_extents(fd, 9 << 20) == [(0, 9 << 20)]
    finally:
        os.close(fd)
    with open(src, "rb") as a, open(outs[0], "rb") as b, open(outs[1], "rb") as c:
        assert a.read() == b.read() == c.read()
    assert os.stat(outs[0]).st_blocks == os.stat(outs[1]).st_blocks <= 48  # 3 data blocks of 4 KiB (+ the 'y' block)


# ---- -X / --xattrs ------------------------------------------------------------------------


def _xattr_tree(src: str) -> None:
    os.makedirs(os.path.join(src, "d"))
    write(os.path.join(src, "f"), b"file", 0o644, T0)
    write(os.path.join(src, "d", "g"), b"other", 0o600, T0)
    write(os.path.join(src, "plain"), b"none", 0o644, T0)
    os.setxattr(os.path.join(src, "f"), "user.colour", b"blue")
    os.setxattr(os.path.join(src, "f"), "user.bin", bytes(range(256)))
    os.setxattr(os.path.join(src, "d"), "user.dir", b"1")
    os.setxattr(os.path.join(src, "d", "g"), "user.empty", b"")
    os.setxattr(src, "user.root", b"top")
    os.symlink("f", os.path.join(src, "lnk"))
    freeze_dirs(src, T0)


@pytest.mark.parametrize("backend", ["os", "libc"])
def test_xattrs_vs_rsync_and_rerun(oh: OptHarness, monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    if backend == "libc":  # the path macOS takes (ctypes on the C library), forced here
        monkeypatch.setenv("TB5SYNC_XATTR_LIBC", "1")
    from tb5sync._os.fsmeta import xattr_backend

    assert xattr_backend() == backend
    _xattr_tree(oh.src)
    try:
        os.setxattr(oh.sp, "user.probe", b"1")
    except OSError:
        pytest.skip("no user extended attributes on this file system")
    oh.run_opts("src/", "dst", ["-X"], xattrs=True)
    oh.check_all(xattrs=True)
    assert xattr_snapshot(os.path.join(oh.dp["push"], "dst"))["f"] == [("user.bin", bytes(range(256))), ("user.colour", b"blue")]
    # second run: a value changed, one removed, one added on an unchanged file
    os.setxattr(os.path.join(oh.src, "f"), "user.colour", b"red")
    os.removexattr(os.path.join(oh.src, "d"), "user.dir")
    os.setxattr(os.path.join(oh.src, "plain"), "user.new", b"n")
    oh.run_opts("src/", "dst", ["-X"], xattrs=True)
    oh.check_all(xattrs=True)


def test_xattrs_from_a_peer_only_in_copied_namespaces(tmp_path: Any) -> None:
    """The receiving side sets only names it would copy itself (user.* on Linux): a peer's
    trusted.* or security.* names are not set, whatever it sends."""
    from tb5sync.roles.destination import Destination

    base = str(tmp_path / "dst")
    os.makedirs(base)
    write(os.path.join(base, "f"), b"x", 0o644, T0)
    try:
        os.setxattr(os.path.join(base, "f"), "user.probe", b"1")
    except OSError:
        pytest.skip("no user extended attributes on this file system")
    d = Destination(base)
    try:
        d.set_xattrs("f", False, [(b"trusted.evil", b"1"), (b"user.ok", b"2")])
    finally:
        d.close()
    names = os.listxattr(os.path.join(base, "f"))
    assert "user.ok" in names and "trusted.evil" not in names and "user.probe" not in names


# ---- -L, --copy-unsafe-links, --safe-links ---------------------------------------------------


def _links_tree(sp: str, src: str) -> None:
    os.makedirs(os.path.join(src, "d", "sub"))
    write(os.path.join(src, "f"), b"target file", 0o640, T0)
    write(os.path.join(src, "d", "sub", "deep"), b"deep", 0o644, T0)
    write(os.path.join(sp, "outside.txt"), b"outside the tree", 0o644, T0)
    os.symlink("f", os.path.join(src, "to_file"))
    os.symlink("d", os.path.join(src, "to_dir"))
    os.symlink("../f", os.path.join(src, "d", "safe_up"))
    os.symlink("../../outside.txt", os.path.join(src, "d", "unsafe_out"))
    os.symlink("../outside.txt", os.path.join(src, "top_up"))  # unsafe from src/, safe from src (rsync's depth rule)
    freeze_dirs(src, T0)


@pytest.mark.parametrize("spec", ["src/", "src"])
@pytest.mark.parametrize("flag", ["-L", "--copy-unsafe-links", "--safe-links"])
def test_symlink_options_vs_rsync(oh: OptHarness, flag: str, spec: str) -> None:
    _links_tree(oh.sp, oh.src)
    kw = {"-L": {"copy_links": True}, "--copy-unsafe-links": {"copy_unsafe_links": True}, "--safe-links": {"safe_links": True}}[flag]
    oh.run_opts(spec, "dst/", [flag], **kw)
    oh.check_all(ignore=("dst",))


@pytest.mark.parametrize("spec", ["lnk_dir", "lnk_dir/", "lnk_file"])
def test_copy_links_source_itself_a_symlink(oh: OptHarness, spec: str) -> None:
    """-L with the source itself a symlink: rsync copies what it points to, under the link's name."""
    _links_tree(oh.sp, oh.src)
    os.symlink("src/d", os.path.join(oh.sp, "lnk_dir"))
    os.symlink("src/f", os.path.join(oh.sp, "lnk_file"))
    oh.run_opts(spec, "dst/", ["-L"], copy_links=True)
    oh.check_all(ignore=("dst",))


def test_safe_links_leaves_absolute_links_out(oh: OptHarness) -> None:
    os.makedirs(oh.src)
    write(os.path.join(oh.src, "f"), b"x", 0o644, T0)
    os.symlink("/etc/hostname", os.path.join(oh.src, "abs"))
    os.symlink("f", os.path.join(oh.src, "rel"))
    freeze_dirs(oh.src, T0)
    oh.run_opts("src/", "dst", ["--safe-links"], safe_links=True)
    oh.check_all()
    assert not os.path.lexists(os.path.join(oh.dp["local"], "dst", "abs"))


def test_copy_links_loop_fails_one_line_rest_synced(oh: OptHarness) -> None:
    """A loop of links (ELOOP) and a dangling link under -L: rsync's exit 23, each named, the rest synced."""
    _links_tree(oh.sp, oh.src)
    os.symlink("loop2", os.path.join(oh.src, "loop1"))
    os.symlink("loop1", os.path.join(oh.src, "loop2"))
    os.symlink("nowhere", os.path.join(oh.src, "d", "dangling"))
    freeze_dirs(oh.src, T0)
    oh.run_opts("src/", "dst", ["-L"], rc=23, copy_links=True)
    oh.check_all()
    # rsync names each: 'symlink has no referent: "SRC/d/dangling"', 'readlink_stat("SRC/loop1") failed: ...'
    named = {os.path.relpath(m, oh.src) for m in re.findall(r'"([^"]+)"', oh.rsync_stderr)}
    assert named == {"loop1", "loop2", "d/dangling", "to_dir/dangling"}, oh.rsync_stderr
    for r in ("local", "push", "pull"):
        assert oh.failed[r] == named, r


def test_copy_links_directory_loop_cli(tmp_path: Any) -> None:
    """A link to a directory holding it (rsync recurses until paths are too long): one failure line
    naming it, exit 23, everything else as rsync -L makes it from the tree without that link."""
    src = str(tmp_path / "src")
    os.makedirs(os.path.join(src, "e"))
    write(os.path.join(src, "e", "x"), b"x", 0o644, T0)
    write(os.path.join(src, "y"), b"y", 0o644, T0)
    freeze_dirs(src, T0)
    settle(src)
    ref = str(tmp_path / "ref")
    subprocess.run(["rsync", "-a", "-L", src + "/", ref], check=True, timeout=60)
    os.symlink("..", os.path.join(src, "e", "up"))
    os.utime(os.path.join(src, "e"), ns=(T0, T0))
    p = cli(["sync", "-L", "--json", src + "/", str(tmp_path / "dst")])
    assert p.returncode == 23, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if "e/up" in ln]
    assert lines == ["tb5sync: source 'e/up': symlink loop: the directory it points to holds it"], p.stderr
    assert [f["path"] for f in json.loads(p.stdout)["failures"]] == ["e/up"]
    assert_same(digest_snapshot(ref), digest_snapshot(str(tmp_path / "dst")), "local")


def test_pull_copy_links_stays_inside_root(tmp_path: Any, server: Any) -> None:
    """On a server, -L never follows a link out of ROOT: the link is a source failure (exit 23)."""
    outside = str(tmp_path / "secret.txt")
    write(outside, b"not served", 0o644, T0)
    src = os.path.join(server.root, "tree")
    os.makedirs(src)
    write(os.path.join(src, "ok"), b"ok", 0o644, T0)
    os.symlink(outside, os.path.join(src, "leak"))
    os.symlink(str(tmp_path), os.path.join(src, "leakdir"))
    os.makedirs(os.path.join(server.root, ".tb5sync"), exist_ok=True)
    os.symlink("../.tb5sync", os.path.join(src, "state"))  # inside ROOT, but the server's own state
    dst = str(tmp_path / "dst")
    with pytest.raises(PartialTransferError) as ei:
        tb5sync.sync(server.url("tree/"), dst, copy_links=True)
    assert {(f.path, f.side, f.server) for f in ei.value.failures} == {
        ("leak", "source", True), ("leakdir", "source", True), ("state", "source", True)}
    assert sorted(os.listdir(dst)) == ["ok"]


# ---- --link-dest ----------------------------------------------------------------------------


def _snap_src(src: str) -> None:
    os.makedirs(os.path.join(src, "d"))
    for i in range(6):
        write(os.path.join(src, "d", f"f{i}"), f"file {i}".encode() * 100, 0o644, T0)
    write(os.path.join(src, "big"), os.urandom(5 << 20), 0o644, T0)
    write(os.path.join(src, "mode"), b"mode changes", 0o644, T0)
    freeze_dirs(src, T0)


@pytest.mark.parametrize("spec", ["src/", "src"])
def test_link_dest_snapshot_rotation_vs_rsync(oh: OptHarness, spec: str) -> None:
    _snap_src(oh.src)
    oh.run_opts(spec, "snap1", [])
    write(os.path.join(oh.src, "d", "f1"), b"changed", 0o644, T0 + 10**9)
    os.chmod(os.path.join(oh.src, "mode"), 0o600)  # same content, other mode: rsync copies it
    write(os.path.join(oh.src, "d", "new"), b"new", 0o644, T0)
    freeze_dirs(oh.src, T0)
    oh.run_opts(spec, "snap2", ["--link-dest=../snap1"], link_dest=["../snap1"])
    oh.check_all(ignore=("snap1", "snap2"))
    sub = "" if spec.endswith("/") else "src"

    def shared(dp: str) -> dict[str, bool]:
        s1, s2 = os.path.join(dp, "snap1", sub), os.path.join(dp, "snap2", sub)
        return {os.path.relpath(os.path.join(d, n), s2): os.path.exists(os.path.join(s1, os.path.relpath(os.path.join(d, n), s2)))
                and os.path.samefile(os.path.join(d, n), os.path.join(s1, os.path.relpath(os.path.join(d, n), s2)))
                for d, _, names in os.walk(s2) for n in names}

    want = shared(oh.dp["rsync"])
    assert want["d/f0"] and want["big"] and not want["d/f1"] and not want["mode"] and not want["d/new"]
    for r in ("local", "push", "pull"):
        assert shared(oh.dp[r]) == want, r


def test_link_dest_outside_server_root_refused(tmp_path: Any, server: Any) -> None:
    src = str(tmp_path / "src")
    os.makedirs(src)
    write(os.path.join(src, "a"), b"a", 0o644, T0)
    with pytest.raises(PathError, match="outside"):
        tb5sync.sync(src + "/", server.url("snap"), link_dest=["../../.."])
    assert not os.path.exists(os.path.join(server.root, "snap"))  # refused before any change


def test_link_dest_missing_dir_copies(tmp_path: Any) -> None:
    src = str(tmp_path / "src")
    os.makedirs(src)
    write(os.path.join(src, "a"), b"a", 0o644, T0)
    tb5sync.sync(src + "/", str(tmp_path / "snap"), link_dest=["../nope"])
    assert os.stat(str(tmp_path / "snap" / "a")).st_nlink == 1


@pytest.mark.parametrize("route", ["local", "push", "pull"])
def test_link_dest_missing_dir_warned_on_every_route(tmp_path: Any, server: Any, route: str) -> None:
    """rsync's "--link-dest arg does not exist: ../nope" reaches the user on every route: a push's
    comes from the server, in its statistics (``SyncStats.warnings``), printed by the client."""
    src = str(tmp_path / "src")
    write(os.path.join(src, "a"), b"a", 0o644, T0)
    ref = subprocess.run(["rsync", "-a", "--link-dest=../nope", src + "/", str(tmp_path / "r")], capture_output=True,
                         text=True, timeout=100, check=True)
    assert re.search(r"^--link-dest arg does not exist: .*\.\./nope$", ref.stderr, re.M), ref.stderr
    want = "--link-dest arg does not exist: ../nope"  # as given (rsync: from /, which a server's would reveal)
    if route == "pull":
        os.makedirs(os.path.join(server.root, "pullsrc"))
        write(os.path.join(server.root, "pullsrc", "a"), b"a", 0o644, T0)
    a = {"local": src + "/", "push": src + "/", "pull": server.url("pullsrc/")}[route]
    b = {"local": str(tmp_path / "t"), "push": server.url("snap"), "pull": str(tmp_path / "t")}[route]
    p = cli(["sync", "--link-dest=../nope", a, b])
    assert p.returncode == 0, p.stderr
    assert p.stderr.count(want) == 1, p.stderr
    assert tb5sync.sync(a, b, link_dest=["../nope"]).warnings == (want,)


# ---- API, CLI and wire -----------------------------------------------------------------------


@pytest.mark.parametrize("kw, exc", [
    ({"hard_links": 1}, TypeError), ({"sparse": "yes"}, TypeError), ({"xattrs": None}, TypeError),
    ({"copy_links": 1}, TypeError), ({"safe_links": "x"}, TypeError), ({"copy_unsafe_links": []}, TypeError),
    ({"link_dest": "../snap1"}, TypeError), ({"link_dest": [1]}, TypeError), ({"link_dest": [""]}, ValueError),
    ({"link_dest": ["d"] * 21}, ValueError),
])
def test_api_checks_link_options(tmp_path: Any, kw: dict[str, Any], exc: type[Exception]) -> None:
    with pytest.raises(exc) as ei:
        tb5sync.sync(str(tmp_path), str(tmp_path / "d"), **kw)
    assert isinstance(ei.value, UsageError) and next(iter(kw)) in str(ei.value)


def test_options_round_trip_the_wire() -> None:
    o = SyncOptions(hard_links=True, sparse=True, xattrs=True, copy_links=True, safe_links=True, link_dest=("../a", "b\udce9"))
    assert SyncOptions.from_wire(o.to_wire()) == o
    with pytest.raises(UsageError):
        SyncOptions.from_wire({**o.to_wire(), "sparse": 1})
    assert o.unsupported(None) == ["hard_links", "sparse", "xattrs", "copy_links", "safe_links", "link_dest"]
    assert o.unsupported(list(BASE_OPTIONS) + ["sparse"]) == ["hard_links", "xattrs", "copy_links", "safe_links", "link_dest"]


@pytest.mark.parametrize("route", ["push", "pull"])
def test_old_server_refused_not_ignored(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, route: str) -> None:
    """A server that does not list an option in its OPEN reply (one older than it) makes the client fail, naming it."""
    import tb5sync.daemon.sessions as sessions_mod

    monkeypatch.setattr(sessions_mod, "known_options", lambda: list(BASE_OPTIONS))
    live = start_server(str(tmp_path / "old"))
    try:
        src = str(tmp_path / "src")
        os.makedirs(src)
        write(os.path.join(src, "a"), b"a", 0o644, T0)
        cp_a(src, os.path.join(live.root, "src"))
        with pytest.raises(UsageError, match=r"does not support -H/--hard-links, --link-dest: upgrade"):
            if route == "push":
                tb5sync.sync(src + "/", live.url("dst"), hard_links=True, link_dest=["x"])
            else:
                tb5sync.sync(live.url("src/"), str(tmp_path / "dst"), hard_links=True, link_dest=["x"])
        assert not os.path.exists(os.path.join(live.root, "dst", "a")) and not os.path.exists(str(tmp_path / "dst" / "a"))
        tb5sync.sync(src + "/", live.url("dst"))  # without them the old server serves as before
    finally:
        live.server.stop()


def test_cli_flags(tmp_path: Any) -> None:
    src = str(tmp_path / "src")
    os.makedirs(src)
    write(os.path.join(src, "a"), b"a" * 10, 0o644, T0)
    os.link(os.path.join(src, "a"), os.path.join(src, "b"))
    p = cli(["sync", "-H", "-S", "--safe-links", "--link-dest", "../none", src + "/", str(tmp_path / "dst")])
    assert p.returncode == 0, p.stderr
    assert os.path.samefile(str(tmp_path / "dst" / "a"), str(tmp_path / "dst" / "b"))


def test_safe_links_judges_dotdot_after_a_name_as_rsync_3_4(oh: OptHarness) -> None:
    """rsync 3.4+ (CVE-2024-12088): a target with ``..`` after a name is unsafe, since that name
    may be a link of the same transfer: ``d/via -> sub/parent/../..`` with ``d/sub/parent -> ..``
    resolves above the top, though its lexical depth never goes below 0 (rsync 3.2.7 keeps it).
    Also ``d/back -> sub/..`` (same place, ending in ``..``); ``d/ok -> ../f`` stays."""
    os.makedirs(os.path.join(oh.src, "d", "sub"))
    write(os.path.join(oh.src, "f"), b"f", 0o644, T0)
    os.symlink("..", os.path.join(oh.src, "d", "sub", "parent"))
    os.symlink("sub/parent/../..", os.path.join(oh.src, "d", "via"))
    os.symlink("sub/..", os.path.join(oh.src, "d", "back"))
    os.symlink("../f", os.path.join(oh.src, "d", "ok"))
    freeze_dirs(oh.src, T0)
    oh.run_opts("src/", "dst", ["--safe-links"], safe_links=True)
    for r in ("local", "push", "pull"):
        d = os.path.join(oh.dp[r], "dst", "d")
        assert not os.path.lexists(os.path.join(d, "via")), r
        assert not os.path.lexists(os.path.join(d, "back")), r
        assert os.readlink(os.path.join(d, "ok")) == "../f", r
        assert os.readlink(os.path.join(d, "sub", "parent")) == "..", r


# ---- --copy-unsafe-links judged by where a link resolves (rsync's open bug #470) -------------


def _nested_unsafe_tree(sp: str, src: str) -> None:
    """``src/b_dir -> ../b`` (outside the transfer: copied as a directory); inside ``b``,
    ``c_dir -> ../c`` (lexically safe from ``b_dir/``, but it resolves to ``sp/c``, outside),
    ``back -> ../src/f`` (resolves inside the transfer, but not where its text leads from
    ``b_dir/``), ``in_b -> file`` (resolves inside the copied directory, where its text leads)."""
    write(os.path.join(src, "f"), b"top file", 0o644, T0)
    write(os.path.join(sp, "b", "file"), b"in b", 0o644, T0)
    write(os.path.join(sp, "c", "cf"), b"in c", 0o644, T0)
    os.symlink("../c", os.path.join(sp, "b", "c_dir"))
    os.symlink("../src/f", os.path.join(sp, "b", "back"))
    os.symlink("file", os.path.join(sp, "b", "in_b"))
    os.symlink("../b", os.path.join(src, "b_dir"))
    os.symlink("b_dir/c_dir", os.path.join(src, "via"))  # safe text; resolves through b_dir, which is copied
    freeze_dirs(src, T0)


def _dangling_or_outside(base: str) -> list[str]:
    """The symlinks under ``base`` that dangle or resolve outside it."""
    out = []
    real = os.path.realpath(base)
    for d, dirs, names in os.walk(base):
        for n in dirs + names:
            p = os.path.join(d, n)
            if os.path.islink(p):
                r = os.path.realpath(p)
                if not os.path.exists(p) or not (r == real or r.startswith(real + os.sep)):
                    out.append(os.path.relpath(p, base))
    return sorted(out)


@pytest.mark.timeout(120)
def test_copy_unsafe_links_judges_nested_links_by_where_they_resolve(tmp_path: Any, server: Any) -> None:
    """Better than rsync (bug #470, rsync 3.5.0 leaves ``b_dir/c_dir`` dangling): a link below a
    copied unsafe link is copied when it resolves elsewhere than its text leads in the copy, and
    kept when it leads to the same place; on every route nothing dangles or leads outside."""
    oh = OptHarness(tmp_path, server, routes=("local", "push", "pull"))
    _nested_unsafe_tree(oh.sp, oh.src)
    oh.run_opts("src/", "dst", ["--copy-unsafe-links"], copy_unsafe_links=True)
    for r in oh.routes:
        d = os.path.join(oh.dp[r], "dst")
        assert _dangling_or_outside(d) == [], r
        assert not os.path.islink(os.path.join(d, "b_dir")), r
        assert not os.path.islink(os.path.join(d, "b_dir", "c_dir")), r
        with open(os.path.join(d, "b_dir", "c_dir", "cf"), "rb") as fh:
            assert fh.read() == b"in c", r
        assert not os.path.islink(os.path.join(d, "b_dir", "back")), r
        with open(os.path.join(d, "b_dir", "back"), "rb") as fh:
            assert fh.read() == b"top file", r
        assert os.readlink(os.path.join(d, "b_dir", "in_b")) == "file", r
        assert os.readlink(os.path.join(d, "via")) == "b_dir/c_dir", r


@pytest.mark.timeout(120)
def test_copy_unsafe_links_link_through_a_copied_link_at_depth(tmp_path: Any, server: Any) -> None:
    """Another input of the kind: two levels below the copied link (``b_dir/e/up -> ../../c/cf``,
    lexically inside the copy, resolves to ``sp/c/cf``): copied as a file, and a link two levels
    down that stays in the copied directory (``b_dir/e/ok -> ../file``) kept."""
    oh = OptHarness(tmp_path, server, routes=("local", "push", "pull"))
    write(os.path.join(oh.src, "f"), b"top file", 0o644, T0)
    write(os.path.join(oh.sp, "b", "file"), b"in b", 0o644, T0)
    write(os.path.join(oh.sp, "c", "cf"), b"in c", 0o644, T0)
    os.makedirs(os.path.join(oh.sp, "b", "e"))
    os.symlink("../../c/cf", os.path.join(oh.sp, "b", "e", "up"))
    os.symlink("../file", os.path.join(oh.sp, "b", "e", "ok"))
    os.symlink("../b", os.path.join(oh.src, "b_dir"))
    freeze_dirs(oh.src, T0)
    oh.run_opts("src/", "dst", ["--copy-unsafe-links"], copy_unsafe_links=True)
    for r in oh.routes:
        d = os.path.join(oh.dp[r], "dst")
        assert _dangling_or_outside(d) == [], r
        up = os.path.join(d, "b_dir", "e", "up")
        assert not os.path.islink(up), r
        with open(up, "rb") as fh:
            assert fh.read() == b"in c", r
        assert os.readlink(os.path.join(d, "b_dir", "e", "ok")) == "../file", r


@pytest.mark.timeout(120)
def test_safe_links_drops_a_link_that_resolves_outside_through_another(tmp_path: Any, server: Any) -> None:
    """``--safe-links`` judged by where a link resolves too: ``x -> l/f`` and ``y -> l`` have safe
    text but resolve outside the transfer through ``l -> ../outside`` (itself left out): left out on
    every route (rsync 3.5.0 keeps them, dangling). ``ok -> to_d/g`` through the safe
    ``to_d -> d`` resolves inside and stays."""
    oh = OptHarness(tmp_path, server, routes=("local", "push", "pull"))
    write(os.path.join(oh.src, "d", "g"), b"g", 0o644, T0)
    write(os.path.join(oh.sp, "outside", "f"), b"outside", 0o644, T0)
    os.symlink("../outside", os.path.join(oh.src, "l"))
    os.symlink("l/f", os.path.join(oh.src, "x"))
    os.symlink("l", os.path.join(oh.src, "y"))
    os.symlink("d", os.path.join(oh.src, "to_d"))
    os.symlink("to_d/g", os.path.join(oh.src, "ok"))
    freeze_dirs(oh.src, T0)
    oh.run_opts("src/", "dst", ["--safe-links"], safe_links=True)
    for r in oh.routes:
        d = os.path.join(oh.dp[r], "dst")
        assert _dangling_or_outside(d) == [], r
        assert links_of(d) == {"to_d": "d", "ok": "to_d/g"}, r


def links_of(base: str) -> dict[str, str]:
    return {os.path.relpath(os.path.join(dp, n), base): os.readlink(os.path.join(dp, n))
            for dp, ds, ns in os.walk(base) for n in ds + ns if os.path.islink(os.path.join(dp, n))}
