"""Names that only a case-insensitive or normalizing destination confuses (APFS by default):
``A.txt`` / ``a.txt``, NFC ``caf\\u00e9`` / NFD ``cafe\\u0301``, ``D/`` / ``d/``. Each later one is a
collision: named once (both source paths in the line), not synced, exit 23; the first syncs.

The destination's behaviour is probed at run time (a temporary name looked up case-swapped and
NFD). On a casefold ext4 directory made by the test (root, a loop device, a kernel with
CONFIG_UNICODE) the probe itself is tested; elsewhere ``$TB5SYNC_DEST_FOLD`` forces the planner's
simulation. The expected tree is rsync's with the later names excluded (rsync on such a
destination would let them overwrite each other)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_vs_rsync import T0, Harness, assert_same, digest_snapshot, freeze_dirs, rsync, settle, write

import tb5sync
from tb5sync.roles.destination import Destination
from tb5sync.errors import PartialTransferError, UsageError
from tb5sync.tree.plan import name_fold, plan_sync
from tb5sync.tree.entry import Entry

NFC, NFD = "caf\u00e9", "cafe\u0301"
#: each pair: the name synced (first in source order, bytewise) and the one refused
PAIRS = [("A.txt", "a.txt"), (NFD, NFC), ("D", "d"), ("sub/README", "sub/Readme")]


pytestmark = pytest.mark.usefixtures("need_rsync")  # conftest: skipped without rsync


def _tree(src: str) -> None:
    for rel, data in [("A.txt", b"upper"), ("a.txt", b"lower"), (NFD, b"nfd"), (NFC, b"nfc"),
                      ("D/x", b"D's x"), ("d/y", b"d's y"), ("d/z/deep", b"deep"), ("sub/README", b"R"),
                      ("sub/Readme", b"r"), ("sub/other", b"o"), ("plain", b"p")]:
        write(os.path.join(src, rel), data, 0o644, T0)
    freeze_dirs(src, T0)


def _check_failures(stats: Any, route: str) -> None:
    lines = sorted(f.line() for f in stats.failures)
    assert len(lines) == len(PAIRS), (route, lines)
    for kept, refused in PAIRS:
        mine = [f for f in stats.failures if f.path.endswith(refused)]
        assert len(mine) == 1, (route, refused, lines)
        assert kept in mine[0].line() and "collides" in mine[0].line(), (route, mine[0].line())


@pytest.mark.parametrize("delete", [False, True], ids=["plain", "delete"])
def test_collisions_on_every_route(tmp_path: Any, server: Any, monkeypatch: pytest.MonkeyPatch, delete: bool) -> None:
    monkeypatch.setenv("TB5SYNC_DEST_FOLD", "case,unicode")
    h = Harness(tmp_path, server)
    _tree(h.src)
    h.prepare()
    settle(h.sp)
    rsync(h.src + "/", os.path.join(h.dp["rsync"], "dst"), delete=delete, exclude=[f"/{r}" for _, r in PAIRS])
    ref = digest_snapshot(h.dp["rsync"], ("", "dst"))
    for _ in range(2):  # a re-run names the same collisions and changes nothing
        for route in ("local", "push", "pull"):
            if route == "pull":
                h.stage_pull()
                src, dst = server.url("pullsrc/src/"), os.path.join(h.dp[route], "dst")
            else:
                src = h.src + "/"
                dst = server.url("push/dst") if route == "push" else os.path.join(h.dp[route], "dst")
            with pytest.raises(PartialTransferError) as err:
                tb5sync.sync(src, dst, delete=delete)
            assert err.value.exit_code == 23
            _check_failures(err.value.stats, route)
            assert_same(ref, digest_snapshot(h.dp[route], ("", "dst")), route)
    with pytest.raises(PartialTransferError) as err:  # a dry run names them too
        tb5sync.sync(h.src + "/", os.path.join(h.dp["local"], "dst2"), dry_run=True)
    _check_failures(err.value.stats, "dry run")


def test_cli_prints_one_line_each_and_exits_23(tmp_path: Path) -> None:
    src = str(tmp_path / "src")
    _tree(src)
    env = {**os.environ, "TB5SYNC_DEST_FOLD": "case,unicode", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run([sys.executable, "-m", "tb5sync.cli", "sync", src + "/", str(tmp_path / "dst")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 23, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "collides" in ln]
    assert len(lines) == len(PAIRS), proc.stderr
    assert any("a.txt" in ln and "A.txt" in ln for ln in lines)


def test_plan_matches_destination_names_by_fold() -> None:
    """An existing destination ``a.txt`` is the source's ``A.txt`` there: compared, never deleted."""
    e = Entry("A.txt", "f", 0o644, 3, T0, None)
    d = Entry("a.txt", "f", 0o644, 3, T0, None)
    root = Entry("", "d", 0o755, 0, T0, None)
    plan = plan_sync([root, e], [root, d], delete=True, fold=name_fold(True, False))
    assert not plan.files and not plan.delete and plan.unchanged == 1
    plan = plan_sync([root, e], [root, d], delete=True)
    assert [x.path for x in plan.files] == ["A.txt"] and [x.path for x in plan.delete] == ["a.txt"]
    assert name_fold(False, False) is None
    assert name_fold(False, True)(NFC) == name_fold(False, True)(NFD) and name_fold(False, True)("A") != "a"  # type: ignore[misc]


def test_probe_on_this_file_system(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe of a case-sensitive, byte-exact directory: neither; it leaves nothing behind; the
    variable overrides it and is checked."""
    monkeypatch.delenv("TB5SYNC_DEST_FOLD", raising=False)
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "Keep").write_bytes(b"k")
    dest = Destination(str(tmp_path / "dst"))
    try:
        mtime = os.stat(tmp_path / "dst").st_mtime_ns - 10**9
        os.utime(tmp_path / "dst", ns=(mtime, mtime))
        assert dest.folding(write=True) == (False, False)
        assert os.stat(tmp_path / "dst").st_mtime_ns == mtime  # the probe leaves the directory's mtime as it was
        assert dest.folding(write=False) == (False, False)  # existing names only
        assert os.listdir(tmp_path / "dst") == ["Keep"]
        monkeypatch.setenv("TB5SYNC_DEST_FOLD", "unicode")
        assert dest.folding() == (False, True)
        monkeypatch.setenv("TB5SYNC_DEST_FOLD", "none")
        assert dest.folding() == (False, False)
        monkeypatch.setenv("TB5SYNC_DEST_FOLD", "nocase")
        with pytest.raises(UsageError, match="TB5SYNC_DEST_FOLD"):
            dest.folding()
    finally:
        dest.close()


@pytest.fixture
def casefold_dir(tmp_path: Path) -> Iterator[Path]:
    """A casefold (+F) directory on an ext4 file system with the casefold feature, on a loop device."""
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4") or not shutil.which("chattr"):
        pytest.skip("a casefold ext4 needs root, mkfs.ext4 and chattr")
    img, mnt = tmp_path / "cf.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(64 * 1024 * 1024)
    run = lambda *a: subprocess.run(a, capture_output=True, text=True, timeout=60)  # noqa: E731
    r = run("mkfs.ext4", "-q", "-O", "casefold", "-E", "encoding=utf8", str(img))
    if r.returncode:
        pytest.skip(f"mkfs.ext4 -O casefold failed: {r.stderr.strip()}")
    r = run("mount", "-o", "loop", str(img), str(mnt))
    if r.returncode:
        dm = run("dmesg").stdout.strip().splitlines()[-1:] or [r.stderr.strip()]
        pytest.skip(f"this kernel cannot mount a casefold ext4: {dm[0]}")
    try:
        (mnt / "cf").mkdir()
        r = run("chattr", "+F", str(mnt / "cf"))
        if r.returncode:
            pytest.skip(f"chattr +F refused: {r.stderr.strip()}")
        yield mnt / "cf"
    finally:
        run("umount", str(mnt))


def test_real_casefold_directory(casefold_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TB5SYNC_DEST_FOLD", raising=False)
    src = str(tmp_path / "src")
    _tree(src)
    dest = Destination(str(casefold_dir / "dst"))
    try:
        assert dest.folding() == (True, True)
    finally:
        dest.close()
    with pytest.raises(PartialTransferError) as err:
        tb5sync.sync(src + "/", str(casefold_dir / "dst"))
    _check_failures(err.value.stats, "casefold ext4")
    assert (casefold_dir / "dst" / "a.txt").read_bytes() == b"upper"
