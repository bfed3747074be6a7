"""tb5sync against the reference: ``rsync -a`` on identical copies of the same trees.

Each scenario runs four routes side by side, each in its own destination parent
directory prepared identically:

* ``rsync``: ``rsync -a [--delete] [--exclude P] [-c] SRC DST`` (local to local), the reference;
* ``local``: ``tb5sync.sync(SRC, DST)`` local to local;
* ``push``: ``tb5sync.sync(SRC, tb5://127.0.0.1:PORT/push/DST)`` through a live server;
* ``pull``: the source parent staged on the server with ``cp -a``, then
  ``tb5sync.sync(tb5://.../pullsrc/SRC, DST)`` back to a local directory.

The resulting destination parents are compared with ``snapshot()`` (content, modes,
mtimes including directory mtimes, symlink targets and mtimes). The mtime of a
directory that is not part of the transfer (the destination parent itself, or an
existing directory a source is copied *into*) is whatever creating entries in it
made it, for rsync as for us, so those few mtimes are left out of the comparison.

rsync 3.x leaves a directory's mtime alone when it falls in the same second as the
directory it just created (it compares whole seconds there), so every source mtime
is first moved out of the current second (:func:`settle`) to keep the reference exact.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest
from conftest import assert_same, digest_snapshot, have_rsync, make_tree, rsync, snapshot  # noqa: F401 (re-exported)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tb5sync

ROUTES = ("rsync", "local", "push", "pull")
S = 1_000_000_000  # one second in ns
T0 = 1_650_000_000_123_456_789  # a fixed mtime base (ns) with a sub-second part


pytestmark = pytest.mark.usefixtures("need_rsync")  # conftest: skipped without rsync


# ---- helpers -----------------------------------------------------------------------------


def cp_a(src: str, dst: str) -> None:
    """``cp -a`` (independent of rsync) to stage identical copies; ``dst`` must not exist."""
    subprocess.run(["cp", "-a", "--", src, dst], check=True, capture_output=True, timeout=100)


def settle(base: str, age_s: int = 5) -> None:
    """Move every mtime under ``base`` that is within the last ``age_s`` seconds back by
    ``age_s`` seconds (keeping the sub-second part), deepest entries first (relative to
    directory descriptors: trees deeper than PATH_MAX too)."""
    limit = time.time_ns() - age_s * 1_000_000_000

    def back(name: str, dfd: int | None) -> None:
        st0 = os.lstat(name, dir_fd=dfd)
        if st0.st_mtime_ns > limit:
            m = st0.st_mtime_ns - age_s * 1_000_000_000
            os.utime(name, ns=(m, m), dir_fd=dfd, follow_symlinks=False)

    for _dirpath, dirnames, filenames, dfd in os.fwalk(base, topdown=False):
        for name in filenames + dirnames:
            back(name, dfd)
    back(base, None)


class Harness:
    """Runs one scenario on all routes, each with its own identically prepared destination parent.

    The source tree lives at ``self.src`` (``SP/src``); source specs are relative to
    ``SP`` (``"src/"``, ``"src"``, ``"src/big.bin"``), destination specs relative to each
    route's destination parent (``"dst"``, ``"new.bin"``, ``"into/"``).
    """

    def __init__(self, tmp_path: Any, server: Any, routes: Sequence[str] = ROUTES) -> None:
        self.tmp = str(tmp_path)
        self.server = server
        self.routes = tuple(routes)
        self.sp = os.path.join(self.tmp, "sp")
        self.src = os.path.join(self.sp, "src")
        os.makedirs(self.sp)
        self.dp = {
            "rsync": os.path.join(self.tmp, "dp-rsync"),
            "local": os.path.join(self.tmp, "dp-local"),
            "push": os.path.join(server.root, "push"),
            "pull": os.path.join(self.tmp, "dp-pull"),
        }
        self.stats: dict[str, tb5sync.SyncStats] = {}
        self._prepared = False

    def prepare(self, template: str | None = None) -> None:
        """Create each route's destination parent, as a ``cp -a`` copy of ``template`` if given."""
        for r in self.routes:
            if template is None:
                os.makedirs(self.dp[r])
            else:
                cp_a(template, self.dp[r])
        self._prepared = True

    def stage_pull(self) -> None:
        staged = os.path.join(self.server.root, "pullsrc")
        if os.path.lexists(staged):
            shutil.rmtree(staged)
        cp_a(self.sp, staged)

    def run(self, src_spec: str, dst_spec: str, *, delete: bool = False, exclude: Sequence[str] = (),
            checksum: bool = False) -> None:
        """Sync ``SP/src_spec`` to ``DP/dst_spec`` on every route."""
        if not self._prepared:
            self.prepare()
        opts = {"delete": delete, "exclude": list(exclude), "checksum": checksum}
        settle(self.sp)
        for r in self.routes:
            local_src = os.path.join(self.sp, src_spec)
            local_dst = os.path.join(self.dp[r], dst_spec)
            if r == "rsync":
                rsync(local_src, local_dst, **opts)  # type: ignore[arg-type]
            elif r == "local":
                self.stats[r] = tb5sync.sync(local_src, local_dst, **opts)  # type: ignore[arg-type]
            elif r == "push":
                self.stats[r] = tb5sync.sync(local_src, self.server.url("push/" + dst_spec), **opts)  # type: ignore[arg-type]
            else:
                self.stage_pull()
                self.stats[r] = tb5sync.sync(self.server.url("pullsrc/" + src_spec), local_dst, **opts)  # type: ignore[arg-type]

    def check(self, ignore_mtime: Iterable[str] = ()) -> None:
        """Every tb5sync route's destination parent equals rsync's (``""`` mtime always ignored)."""
        ign = ("", *ignore_mtime)
        ref = digest_snapshot(self.dp["rsync"], ign)
        assert len(ref) > 1, "rsync produced nothing: the scenario is broken"
        for r in self.routes:
            if r != "rsync":
                assert_same(ref, digest_snapshot(self.dp[r], ign), r)



def write(path: str, data: bytes, mode: int | None = None, mtime_ns: int | None = None) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    if mode is not None:
        os.chmod(path, mode)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))


def freeze_dirs(base: str, mtime_ns: int = T0) -> None:
    """Give every directory under ``base`` a fixed mtime (deepest first), so later edits show."""
    for _dirpath, _dirs, _files, dfd in os.fwalk(base, topdown=False):
        os.utime(dfd, ns=(mtime_ns, mtime_ns))


# ---- cold copies and trailing slashes ---------------------------------------------------------


def test_cold_copy_make_tree(h: Harness) -> None:
    make_tree(h.src)
    h.run("src/", "dst")
    h.check()
    for r in ("local", "push", "pull"):
        s = h.stats[r]
        assert s.files_transferred == s.files_total > 0
        assert s.bytes_transferred == s.bytes_total


def test_push_then_pull_back_round_trip(h: Harness, server: Any) -> None:
    """Push to the server, pull that copy back: both equal what rsync -a makes of the source."""
    make_tree(h.src)
    h.prepare()
    settle(h.src)
    rsync(h.src + "/", os.path.join(h.dp["rsync"], "dst"))
    tb5sync.sync(h.src + "/", server.url("push/dst"))
    tb5sync.sync(server.url("push/dst/"), os.path.join(h.dp["pull"], "dst"))
    ref = digest_snapshot(h.dp["rsync"])
    assert_same(ref, digest_snapshot(h.dp["push"]), "push")
    assert_same(ref, digest_snapshot(h.dp["pull"]), "pull-back")


@pytest.mark.parametrize("slash", [True, False], ids=["src-slash", "src-noslash"])
@pytest.mark.parametrize("dst_exists", [True, False], ids=["dst-exists", "dst-new"])
def test_trailing_slash(h: Harness, tmp_path: Any, slash: bool, dst_exists: bool) -> None:
    make_tree(h.src, seed=3, files=12)
    tpl = str(tmp_path / "tpl")
    os.makedirs(tpl)
    if dst_exists:
        write(os.path.join(tpl, "dst", "already.txt"), b"here before", 0o640, T0)
        os.utime(os.path.join(tpl, "dst"), ns=(T0, T0))
    h.prepare(tpl)
    h.run("src/" if slash else "src", "dst")
    # without the slash, dst is only the place src lands in: not part of the transfer
    h.check(ignore_mtime=() if slash else ("dst",))
    landed = os.path.join(h.dp["local"], "dst" if slash else "dst/src")
    assert os.path.isfile(os.path.join(landed, "big.bin"))


@pytest.mark.parametrize(
    "src_spec,dst_spec,ignore",
    [
        ("src/big.bin", "new.bin", ()),  # large file (chunked path) to a new name
        ("src/d0/sub0/f0.bin", "new.bin", ()),  # small file, mode 0o751
        ("src/big.bin", "into", ("into",)),  # into an existing directory
        ("src/big.bin", "into/", ("into",)),
        ("src/d0/sub0/f0.bin", "into", ("into",)),
        ("src/rel_link", "into/", ("into",)),  # a symlink is copied as a link
        ("src/big.bin", "newdir/", ("newdir",)),  # trailing slash on a missing DST makes a directory
    ],
)
def test_single_file(h: Harness, tmp_path: Any, src_spec: str, dst_spec: str, ignore: tuple[str, ...]) -> None:
    make_tree(h.src, seed=5, files=6)
    tpl = str(tmp_path / "tpl")
    os.makedirs(os.path.join(tpl, "into"))
    write(os.path.join(tpl, "into", "other.txt"), b"other", 0o600, T0)
    h.prepare(tpl)
    h.run(src_spec, dst_spec)
    h.check(ignore_mtime=ignore)


def test_single_file_replaces_existing_file(h: Harness, tmp_path: Any) -> None:
    make_tree(h.src, seed=6, files=6)
    tpl = str(tmp_path / "tpl")
    write(os.path.join(tpl, "new.bin"), b"old content, other size", 0o666, T0)
    h.prepare(tpl)
    h.run("src/big.bin", "new.bin")
    h.check()


# ---- --delete and --exclude -------------------------------------------------------------------


def _prefilled_template(h: Harness, tmp_path: Any, extras: Callable[[str], None]) -> str:
    """A template destination parent holding ``dst`` = a copy of the source plus ``extras``."""
    tpl = str(tmp_path / "tpl")
    os.makedirs(tpl)
    settle(h.src)
    cp_a(h.src, os.path.join(tpl, "dst"))
    extras(os.path.join(tpl, "dst"))
    freeze_dirs(os.path.join(tpl, "dst"), T0 + 7 * S)
    return tpl


def _extras(dst: str) -> None:
    write(os.path.join(dst, "extra.txt"), b"x", 0o644, T0)
    write(os.path.join(dst, "keep.log"), b"log", 0o644, T0)
    write(os.path.join(dst, "d1", "sub1", "extra_in_existing.bin"), b"e" * 5000, 0o644, T0)
    write(os.path.join(dst, "d3", "deep.log"), b"deep log", 0o600, T0)
    write(os.path.join(dst, "extradir", "deep", "f.bin"), b"f" * 100, 0o644, T0)
    write(os.path.join(dst, "extradir", "g.log"), b"g", 0o644, T0)
    os.makedirs(os.path.join(dst, "extra_empty"))
    os.makedirs(os.path.join(dst, "keepdir", "inner"))
    write(os.path.join(dst, "keepdir", "inner", "k.bin"), b"k", 0o644, T0)
    os.symlink("nowhere", os.path.join(dst, "extra_link"))


def test_delete_extra_files_and_dirs(h: Harness, tmp_path: Any) -> None:
    make_tree(h.src, seed=7, files=20)
    h.prepare(_prefilled_template(h, tmp_path, _extras))
    h.run("src/", "dst", delete=True)
    h.check()
    assert not os.path.exists(os.path.join(h.dp["local"], "dst", "extradir"))
    for r in ("local", "push", "pull"):
        # rsync counts every deleted entry: 3 top files/links + 1 in d1/sub1 + d3/deep.log,
        # extradir/{deep/f.bin, deep, g.log} + extradir, extra_empty, keepdir/{inner/k.bin, inner} + keepdir
        assert h.stats[r].files_deleted == 13, r


def _extras_flat(dst: str) -> None:
    """Extras where every protected (``*.log``, ``keepdir/``) entry sits in a directory that stays."""
    write(os.path.join(dst, "extra.txt"), b"x", 0o644, T0)
    write(os.path.join(dst, "keep.log"), b"log", 0o644, T0)
    write(os.path.join(dst, "d3", "deep.log"), b"deep log", 0o600, T0)
    write(os.path.join(dst, "extradir", "deep", "f.bin"), b"f" * 100, 0o644, T0)
    os.makedirs(os.path.join(dst, "keepdir", "inner"))
    write(os.path.join(dst, "keepdir", "inner", "k.bin"), b"k", 0o644, T0)
    os.symlink("nowhere", os.path.join(dst, "extra_link"))


def test_delete_with_exclude_protects(h: Harness, tmp_path: Any) -> None:
    make_tree(h.src, seed=7, files=20)
    h.prepare(_prefilled_template(h, tmp_path, _extras_flat))
    write(os.path.join(h.src, "src_side.log"), b"never sent", 0o644, T0)  # excluded at the source too
    h.run("src/", "dst", delete=True, exclude=["*.log", "keepdir/"])
    h.check()
    dst = os.path.join(h.dp["local"], "dst")
    assert os.path.exists(os.path.join(dst, "keep.log"))
    assert os.path.exists(os.path.join(dst, "d3", "deep.log"))
    assert os.path.exists(os.path.join(dst, "keepdir", "inner", "k.bin"))
    assert not os.path.exists(os.path.join(dst, "src_side.log"))
    assert not os.path.exists(os.path.join(dst, "extra.txt"))
    assert not os.path.exists(os.path.join(dst, "extradir"))


def test_delete_keeps_excluded_files_inside_extra_dirs(h: Harness, tmp_path: Any) -> None:
    """``extradir/g.log`` is protected by ``*.log``: rsync deletes the rest but keeps it and its directory."""
    make_tree(h.src, seed=7, files=20)
    h.prepare(_prefilled_template(h, tmp_path, _extras))
    h.run("src/", "dst", delete=True, exclude=["*.log", "keepdir/"])
    # extradir is kept for its protected file; deleting its other children sets its mtime to "now"
    h.check(ignore_mtime=["dst/extradir"])


def _exclude_tree(base: str) -> None:
    make_tree(base, seed=11, files=30)
    # nested names that tell anchored from floating patterns apart
    write(os.path.join(base, "f1.bin"), b"top-level f1", 0o644, T0)
    write(os.path.join(base, "d3", "d2", "nested_d2.bin"), b"n" * 300, 0o644, T0)
    write(os.path.join(base, "d4", "d1"), b"a file called d1", 0o644, T0)  # not a dir: `d1/` must not match
    write(os.path.join(base, "x", "sub1", "f99.bin"), b"deep sub1", 0o644, T0)
    write(os.path.join(base, "x", "notsub1", "f98.bin"), b"not sub1", 0o644, T0)
    write(os.path.join(base, "sub1", "f97.bin"), b"top sub1", 0o644, T0)


EXCLUDES = ["*.bin", "d1/", "/d2", "sub1/f*.bin", "d3/d2"]


@pytest.mark.parametrize("pattern", EXCLUDES)
def test_exclude_patterns(h: Harness, pattern: str) -> None:
    _exclude_tree(h.src)
    h.run("src/", "dst", exclude=[pattern])
    h.check()


def test_exclude_double_star_prefix_matches_top_level(h: Harness) -> None:
    _exclude_tree(h.src)
    h.run("src/", "dst", exclude=["**/f1.bin"])
    h.check()


def test_exclude_double_star_prefix_nested(h: Harness) -> None:
    """``**/f1.bin`` at depth as well as at the top level."""
    make_tree(h.src, seed=11, files=30)
    h.run("src/", "dst", exclude=["**/f1.bin"])
    h.check()
    assert not os.path.exists(os.path.join(h.dp["local"], "dst", "d1", "sub1", "f1.bin"))


@pytest.mark.parametrize(
    "pattern", EXCLUDES + ["**/f1.bin"]
)
def test_exclude_with_delete_on_prefilled(h: Harness, tmp_path: Any, pattern: str) -> None:
    """Excluded source entries are not sent, and matching destination entries survive --delete."""
    make_tree(h.src, seed=11, files=30)
    h.prepare(_prefilled_template(h, tmp_path, _extras))
    h.run("src/", "dst", delete=True, exclude=[pattern])
    # an extra directory kept for protected entries gets "now" as mtime when its other children go
    h.check(ignore_mtime=["dst/extradir"])


# ---- type changes -----------------------------------------------------------------------------


def _type_tree(base: str) -> None:
    write(os.path.join(base, "f2d"), b"file becoming a dir", 0o644, T0)
    os.makedirs(os.path.join(base, "emptyd2f"))
    os.makedirs(os.path.join(base, "d2f"))
    write(os.path.join(base, "d2f", "inner.bin"), b"i" * 1000, 0o644, T0)
    os.makedirs(os.path.join(base, "d2l"))
    write(os.path.join(base, "d2l", "inner.bin"), b"j" * 1000, 0o644, T0)
    os.symlink("f2d", os.path.join(base, "l2f"))
    os.symlink("f2d", os.path.join(base, "l2d"))
    write(os.path.join(base, "f2l"), b"file becoming a link", 0o644, T0)
    write(os.path.join(base, "stays.bin"), b"s" * 5000, 0o644, T0)
    freeze_dirs(base, T0)


def _change_types(base: str, nonempty_dirs: bool) -> None:
    os.unlink(os.path.join(base, "f2d"))
    write(os.path.join(base, "f2d", "now_inside.bin"), b"now a dir", 0o600, T0 + 1 * S)
    os.rmdir(os.path.join(base, "emptyd2f"))
    write(os.path.join(base, "emptyd2f"), b"was an empty dir", 0o644, T0 + 2 * S)
    os.unlink(os.path.join(base, "l2f"))
    write(os.path.join(base, "l2f"), b"was a link", 0o644, T0 + 3 * S)
    os.unlink(os.path.join(base, "l2d"))
    write(os.path.join(base, "l2d", "x.bin"), b"was a link", 0o644, T0 + 4 * S)
    os.unlink(os.path.join(base, "f2l"))
    os.symlink("stays.bin", os.path.join(base, "f2l"))
    if nonempty_dirs:
        shutil.rmtree(os.path.join(base, "d2f"))
        write(os.path.join(base, "d2f"), b"was a non-empty dir", 0o644, T0 + 5 * S)
        shutil.rmtree(os.path.join(base, "d2l"))
        os.symlink("stays.bin", os.path.join(base, "d2l"))
    freeze_dirs(base, T0 + 10 * S)


@pytest.mark.parametrize(
    "delete,nonempty",
    [(False, False), (True, False), (True, True)],
    ids=["no-delete", "delete", "delete-nonempty-dirs"],
)
def test_type_changes(h: Harness, tmp_path: Any, delete: bool, nonempty: bool) -> None:
    """file->dir, empty dir->file, link->file, link->dir, file->link; with --delete also
    non-empty dir->file and dir->link (rsync refuses those without --delete)."""
    _type_tree(h.src)
    tpl = str(tmp_path / "tpl")
    os.makedirs(tpl)
    settle(h.src)
    cp_a(h.src, os.path.join(tpl, "dst"))
    h.prepare(tpl)
    _change_types(h.src, nonempty_dirs=nonempty)
    h.run("src/", "dst", delete=delete)
    h.check()


@pytest.mark.parametrize("route", ["local", "push"])
def test_dir_replaced_by_symlink_with_delete_loses_no_data(tmp_path: Any, server: Any, route: str) -> None:
    """``sw/`` (holding ``x.bin``) becomes a symlink to ``keep`` (also holding an ``x.bin``) and,
    for push, ``out`` becomes a symlink leading outside the served root. After ``--delete`` the
    destination must equal the source (rsync: it does) and nothing outside it may be touched;
    today the stale ``sw/x.bin`` is unlinked *through* the new link, deleting ``keep/x.bin``
    (and, on the server, a file outside ROOT)."""
    src = str(tmp_path / "src")
    outside = str(tmp_path / "outside")
    write(os.path.join(outside, "x.bin"), b"outside the destination", 0o644, T0)
    write(os.path.join(src, "keep", "x.bin"), b"precious", 0o644, T0)
    write(os.path.join(src, "sw", "x.bin"), b"old", 0o644, T0)
    write(os.path.join(src, "out", "x.bin"), b"old", 0o644, T0)
    dst = str(tmp_path / "dst") if route == "local" else server.url("dst")
    final = dst if route == "local" else os.path.join(server.root, "dst")
    tb5sync.sync(src + "/", dst)
    shutil.rmtree(os.path.join(src, "sw"))
    os.symlink("keep", os.path.join(src, "sw"))
    shutil.rmtree(os.path.join(src, "out"))
    os.symlink(outside, os.path.join(src, "out"))
    try:
        tb5sync.sync(src + "/", dst, delete=True)
    finally:
        assert os.path.exists(os.path.join(outside, "x.bin")), "a file outside the destination was deleted"
    assert digest_snapshot(final) == digest_snapshot(src)


def test_nonempty_dir_to_file_without_delete_refused_like_rsync(h: Harness, tmp_path: Any) -> None:
    """rsync -a (no --delete) cannot replace a non-empty directory by a file, syncs the rest and
    exits 23; so do we (the tree as rsync leaves it, :class:`PartialTransferError` naming d2f)."""
    _type_tree(h.src)
    dst = str(tmp_path / "dst-ref")
    settle(h.src)
    cp_a(h.src, dst)
    mine = str(tmp_path / "dst-mine")
    settle(h.src)
    cp_a(h.src, mine)
    shutil.rmtree(os.path.join(h.src, "d2f"))
    write(os.path.join(h.src, "d2f"), b"was a non-empty dir", 0o644, T0 + 5 * S)
    proc = rsync(h.src + "/", dst, check=False)
    assert proc.returncode != 0 and "d2f" in proc.stderr
    with pytest.raises(tb5sync.PartialTransferError, match="d2f") as info:
        tb5sync.sync(h.src + "/", mine)
    assert info.value.exit_code == 23 and [f.path for f in info.value.failures] == ["d2f"]
    assert os.path.isfile(os.path.join(mine, "d2f", "inner.bin"))  # nothing of it was lost
    assert_same(digest_snapshot(dst, ()), digest_snapshot(mine, ()), "local")


# ---- metadata-only changes --------------------------------------------------------------------


def _meta_tree(base: str) -> None:
    make_tree(base, seed=13, files=15)
    freeze_dirs(base, T0)


def _first_sync_template(h: Harness, tmp_path: Any) -> None:
    """Each destination parent starts as ``dst`` = an exact copy of the current source."""
    tpl = str(tmp_path / "tpl")
    os.makedirs(tpl)
    settle(h.src)
    cp_a(h.src, os.path.join(tpl, "dst"))
    h.prepare(tpl)


def test_mode_change_only(h: Harness, tmp_path: Any) -> None:
    """chmod at the source (content and mtime unchanged): rsync -a updates the mode; so do we."""
    _meta_tree(h.src)
    _first_sync_template(h, tmp_path)
    os.chmod(os.path.join(h.src, "big.bin"), 0o600)
    os.chmod(os.path.join(h.src, "d0", "sub0", "f0.bin"), 0o644)
    os.chmod(os.path.join(h.src, "d1"), 0o700)  # directory mode (its mtime is unchanged by chmod)
    h.run("src/", "dst")
    h.check()
    st = os.stat(os.path.join(h.dp["push"], "dst", "big.bin"))
    assert stat.S_IMODE(st.st_mode) == 0o600
    for r in ("local", "push", "pull"):
        assert h.stats[r].chunks_sent == 0, r


def test_mtime_change_only(h: Harness, tmp_path: Any) -> None:
    """touch at the source (same content): rsync -a sets the new mtime; so do we."""
    _meta_tree(h.src)
    _first_sync_template(h, tmp_path)
    os.utime(os.path.join(h.src, "big.bin"), ns=(T0 + 123 * S, T0 + 123_456_789))
    os.utime(os.path.join(h.src, "d1", "sub1", "f1.bin"), ns=(T0, T0 - 5 * S))
    os.utime(os.path.join(h.src, "d3"), ns=(T0, T0 + 999 * S))  # directory mtime only
    h.run("src/", "dst")
    h.check()
    for r in ("local", "push", "pull"):
        assert h.stats[r].chunks_sent <= 1, r  # same content: found at the destination


def test_symlink_mtime_change_only(h: Harness, tmp_path: Any) -> None:
    _meta_tree(h.src)
    _first_sync_template(h, tmp_path)
    os.utime(os.path.join(h.src, "rel_link"), ns=(T0, T0 + 42 * S), follow_symlinks=False)
    h.run("src/", "dst")
    h.check()


def test_checksum_same_size_same_mtime(h: Harness, tmp_path: Any) -> None:
    """Content differs at the destination with equal size and mtime: only -c notices."""
    _meta_tree(h.src)
    tpl = str(tmp_path / "tpl")
    os.makedirs(tpl)
    settle(h.src)
    cp_a(h.src, os.path.join(tpl, "dst"))
    for rel in ("big.bin", "d1/sub1/f1.bin"):
        p = os.path.join(tpl, "dst", rel)
        st0 = os.stat(p)
        if st0.st_size == 0:
            continue
        with open(p, "r+b") as f:
            b = f.read(1)
            f.seek(0)
            f.write(bytes([b[0] ^ 0x5A]))
        os.utime(p, ns=(st0.st_atime_ns, st0.st_mtime_ns))
    h.prepare(tpl)
    h.run("src/", "dst")  # quick check: nothing to do, both sides keep the corrupted copy
    h.check()
    h.run("src/", "dst", checksum=True)
    h.check()
    assert digest_snapshot(os.path.join(h.dp["local"], "dst")) == digest_snapshot(h.src)


# ---- modes, names, sizes ----------------------------------------------------------------------


def test_readonly_dir_with_files(h: Harness) -> None:
    """A 0o555 source directory holding files (and a 0o555 subdirectory): created, filled,
    then given its mode and mtime, as rsync -a does when run as root; and re-synced after a change."""
    make_tree(h.src, seed=17, files=6)
    ro = os.path.join(h.src, "ro")
    write(os.path.join(ro, "a.bin"), b"a" * 1000, 0o444, T0)
    write(os.path.join(ro, "inner", "b.bin"), os.urandom(5 * 1024 * 1024), 0o400, T0)
    write(os.path.join(ro, "c.bin"), b"", 0o000, T0)
    os.chmod(os.path.join(ro, "inner"), 0o555)
    os.utime(os.path.join(ro, "inner"), ns=(T0, T0))
    os.chmod(ro, 0o555)
    os.utime(ro, ns=(T0 + 1 * S, T0 + 1 * S))
    h.run("src/", "dst")
    h.check()
    # second run: a new file inside the read-only directory, a changed one, mode and mtime restored
    os.chmod(ro, 0o755)
    write(os.path.join(ro, "new.bin"), b"new" * 100, 0o644, T0 + 2 * S)
    write(os.path.join(ro, "a.bin"), b"b" * 1001, 0o444, T0 + 3 * S)
    os.chmod(ro, 0o555)
    os.utime(ro, ns=(T0 + 4 * S, T0 + 4 * S))
    h.run("src/", "dst")
    h.check()


ODD_NAMES = ["a b", "ünï", "#x", "-dash", " lead", "trail ", "x*y?[z]", "%41", "'q'", '"dq"', "ä/ö", ".hidden", "~t"]


def test_odd_names(h: Harness) -> None:
    for n in ODD_NAMES:
        write(os.path.join(h.src, n), n.encode() * 7, 0o644, T0)
        write(os.path.join(h.src, "dir " + n.replace("/", "_"), n.split("/")[-1] + ".bin"), b"z" * 9000, 0o640, T0)
    os.symlink("a b", os.path.join(h.src, "link to a b"))
    os.symlink("ünï", os.path.join(h.src, "-dash link"))
    freeze_dirs(h.src, T0)
    h.run("src/", "dst")
    h.check()
    h.run("src", "dst2")  # the names also as the transfer's top level
    h.check(ignore_mtime=("dst2",))


SIZES = [0, 1, 256 * 1024, 4 * 1024 * 1024 - 1, 4 * 1024 * 1024, 4 * 1024 * 1024 + 1]


def test_hard_to_chunk_sizes(h: Harness) -> None:
    rnd = random.Random(21)
    for n in SIZES:
        write(os.path.join(h.src, f"s{n}.bin"), rnd.randbytes(n), 0o644, T0 + n)
        write(os.path.join(h.src, "zeros", f"z{n}.bin"), bytes(n), 0o600, T0 + n)
    freeze_dirs(h.src, T0)
    h.run("src/", "dst")
    h.check()
    # then change one byte in the middle of each non-empty file (same size, new mtime)
    for n in SIZES:
        if n:
            for p in (os.path.join(h.src, f"s{n}.bin"), os.path.join(h.src, "zeros", f"z{n}.bin")):
                with open(p, "r+b") as f:
                    f.seek(n // 2)
                    b = f.read(1)
                    f.seek(n // 2)
                    f.write(bytes([b[0] ^ 1]))
                os.utime(p, ns=(T0 + 7 * S, T0 + 7 * S))
    freeze_dirs(h.src, T0 + 1 * S)
    h.run("src/", "dst")
    h.check()


# ---- repeated runs ------------------------------------------------------------------------------


def test_second_run_after_modifying_a_few_files(h: Harness) -> None:
    make_tree(h.src, seed=23, files=30)
    freeze_dirs(h.src, T0)
    h.run("src/", "dst")
    h.check()
    # no change: nothing moves
    h.run("src/", "dst")
    h.check()
    for r in ("local", "push", "pull"):
        assert h.stats[r].files_transferred == 0 and h.stats[r].chunks_sent == 0, r
    # a few modifications
    big = os.path.join(h.src, "big.bin")
    with open(big, "r+b") as f:
        f.seek(4 * 1024 * 1024)
        f.write(b"changed!" * 64)
    os.utime(big, ns=(T0 + 1 * S, T0 + 1 * S))
    with open(os.path.join(h.src, "d0", "sub0", "f0.bin"), "ab") as f:
        f.write(b"appended")
    os.truncate(os.path.join(h.src, "d1", "sub1", "f1.bin"), 0)
    p = os.path.join(h.src, "d2", "sub2", "f2.bin")
    write(p, b"rewritten " * 50, 0o700, T0 + 2 * S)
    write(os.path.join(h.src, "newdir", "new.bin"), b"new file", 0o644, T0 + 3 * S)
    os.unlink(os.path.join(h.src, "d3", "sub0", "f3.bin"))  # stays at DST without --delete
    os.unlink(os.path.join(h.src, "rel_link"))
    os.symlink("big.bin", os.path.join(h.src, "rel_link"))  # retargeted link
    h.run("src/", "dst")
    h.check()
    assert h.stats["local"].files_transferred == 5
    assert os.path.exists(os.path.join(h.dp["pull"], "dst", "d3", "sub0", "f3.bin"))
    for r in ("local", "push", "pull"):
        assert h.stats[r].chunks_sent <= 8, (r, h.stats[r])  # big.bin: a delta, not 9 MiB
    # and a third run with --delete removes what the source lost
    h.run("src/", "dst", delete=True)
    h.check()
    assert not os.path.exists(os.path.join(h.dp["push"], "dst", "d3", "sub0", "f3.bin"))


# ---- property test: random small trees, local -> local ------------------------------------------

_names = st.sampled_from(["a", "b", "c", "dd", "e.bin", "f 1", "ü"])
_relpaths = st.lists(_names, min_size=1, max_size=3).map("/".join)
_file = st.tuples(
    st.just("f"),
    _relpaths,
    st.sampled_from([0, 1, 17, 4096, 70_000, 300_001]),
    st.sampled_from([0o644, 0o600, 0o755, 0o444, 0o640, 0o700]),
    st.integers(0, 1000),
)
_dir = st.tuples(st.just("d"), _relpaths, st.just(0), st.sampled_from([0o755, 0o700, 0o750, 0o775, 0o555]),
                 st.integers(0, 1000))
_link = st.tuples(st.just("l"), _relpaths, st.sampled_from(["a", "../b", "/abs/x", "dd/e.bin", "missing"]),
                  st.just(0o777), st.integers(0, 1000))
_tree = st.lists(st.one_of(_file, _dir, _link), min_size=1, max_size=14)


def build_tree(base: str, items: list[tuple[Any, ...]], salt: int) -> None:
    """Materialise generated items ``(kind, relpath, size or link target, mode, mtime in s from T0)``
    under ``base`` (kinds: ``f`` file, ``d`` directory, ``l`` symlink, ``p`` FIFO); items clashing
    with earlier ones are skipped."""
    os.makedirs(base)
    kinds: dict[str, str] = {}
    dirs: list[tuple[str, int, int]] = []
    for i, (kind, rel, arg, mode, dm) in enumerate(items):
        parts = rel.split("/")
        if rel in kinds or any(kinds.get("/".join(parts[:k]), "d") != "d" for k in range(1, len(parts))):
            continue
        for k in range(1, len(parts)):
            parent = "/".join(parts[:k])
            if parent not in kinds:
                kinds[parent] = "d"
                os.makedirs(os.path.join(base, parent), exist_ok=True)
                dirs.append((parent, 0o755, T0 + k * S))
        full = os.path.join(base, rel)
        kinds[rel] = kind
        mtime = T0 + dm * S
        if kind == "f":
            data = bytes((j * 31 + i + salt) & 0xFF for j in range(min(arg, 4096))) * (arg // 4096 + 1)
            write(full, data[:arg], None, None)
            os.chmod(full, mode)
            os.utime(full, ns=(mtime, mtime))
        elif kind == "d":
            os.makedirs(full)
            dirs.append((rel, mode, mtime))
        elif kind == "p":  # a FIFO
            os.mkfifo(full, mode)
            os.utime(full, ns=(mtime, mtime))
        else:
            os.symlink(arg, full)
            os.utime(full, ns=(mtime, mtime), follow_symlinks=False)
    for rel, mode, mtime in sorted(dirs, key=lambda d: -d[0].count("/")):
        p = os.path.join(base, rel)
        os.chmod(p, mode)
        os.utime(p, ns=(mtime, mtime))
    os.utime(base, ns=(T0, T0))


@settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(src_items=_tree, dst_items=st.one_of(st.none(), _tree), delete=st.booleans())
def test_property_local_equals_rsync(src_items: list[Any], dst_items: list[Any] | None, delete: bool) -> None:
    if not have_rsync():
        pytest.skip("rsync is not installed")
    with tempfile.TemporaryDirectory(prefix="tb5-prop-") as tmp:
        src = os.path.join(tmp, "src")
        build_tree(src, src_items, salt=1)
        ref, mine = os.path.join(tmp, "ref"), os.path.join(tmp, "mine")
        if dst_items is not None:
            build_tree(ref, dst_items, salt=2)
            cp_a(ref, mine)
        proc = rsync(src + "/", ref, delete=delete, check=False)
        if proc.returncode != 0:
            # rsync could not make way (a non-empty directory without --delete), synced the rest
            # and exited 23: so do we, naming the same entries
            assert proc.returncode == 23 and not delete and dst_items is not None, proc.stderr
            with pytest.raises(tb5sync.PartialTransferError) as info:
                tb5sync.sync(src + "/", mine, delete=delete)
            assert info.value.exit_code == 23
            # rsync writes a non-ASCII byte of a name as \#ooo (octal)
            unescaped = re.sub(rb"\\#([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), proc.stderr.encode()).decode()
            refused = {ln.rpartition(": ")[2] for ln in unescaped.splitlines() if ln.startswith("could not make way for new")}
            assert {f.path for f in info.value.failures} == refused, proc.stderr
            assert all(f.side == "destination" for f in info.value.failures)
        else:
            tb5sync.sync(src + "/", mine, delete=delete)
        assert_same(digest_snapshot(ref, ()), digest_snapshot(mine, ()), "local")


def _walk(p: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), p) for d, ds, ns in os.walk(p) for n in ds + ns)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("inside", ["inside", "d/inside"])
@pytest.mark.parametrize("spec", ["src/", "src"])
@pytest.mark.parametrize("made", [False, True], ids=["new-dst", "dst-exists"])
def test_destination_inside_its_source_vs_rsync(tmp_path: Any, spec: str, made: bool, inside: str) -> None:
    """``sync SRC SRC/inside``: rsync lists the source before it writes, so each run nests the
    tree one level more (twice after two runs when ``inside`` existed); every route does the same.
    Also a destination deeper in the source (``SRC/d/inside``).

    The reference is ``rsync -a --no-inc-recursive``. With its default incremental recursion,
    rsync's sender lists each directory only when the receiver gets to it, while the receiver is
    already making ``inside/...``, so whether the new directories are listed depends on which of
    the two processes runs first. Its result then varies between runs (about 1 run in 10 nests
    one level deeper here, and 1 in 5 on two busy cores), which is why this test was flaky.
    tb5sync lists the whole source before it writes, on every route: that is the result of
    rsync's whole-list-first mode, every time."""
    from conftest import start_server

    got: dict[str, list[list[str]]] = {}
    for r in ("rsync", "local", "push", "pull"):
        base = str(tmp_path / r)
        write(os.path.join(base, "src", "f"), b"f")
        write(os.path.join(base, "src", "d", "g"), b"g")
        if made:
            os.makedirs(os.path.join(base, "src", inside))
        src, dst = os.path.join(base, spec), os.path.join(base, "src", inside)
        live = start_server(base) if r in ("push", "pull") else None
        try:
            runs = []
            for _ in range(2):
                if r == "rsync":
                    subprocess.run(["rsync", "-a", "--no-inc-recursive", src, dst], check=True, timeout=60)
                elif r == "local":
                    tb5sync.sync(src, dst)
                elif r == "push":
                    tb5sync.sync(src, live.url("src/" + inside))
                else:
                    tb5sync.sync(live.url(spec), dst)
                runs.append(_walk(os.path.join(base, "src")))
            got[r] = runs
        finally:
            if live is not None:
                live.server.stop()
    for r in ("local", "push", "pull"):
        assert got[r] == got["rsync"], r
