"""Source trees deeper than PATH_MAX (4096 bytes below the transfer root), built with
directory-relative calls: rsync names each entry whose path overflows ("filename overflows
max-path len by N"), leaves it out with what is below it, skips deletion (an I/O error on the
sending side) and exits 23. tb5sync does the same on every route, and never a traceback."""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
from test_vs_rsync import T0, Harness, assert_same, digest_snapshot, freeze_dirs, rsync, write

import tb5sync
from tb5sync.errors import PartialTransferError

SEG = "d" * 200


pytestmark = pytest.mark.usefixtures("need_rsync")  # conftest: skipped without rsync


def _put(dfd: int, name: str, data: bytes) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dfd)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.utime(name, ns=(T0, T0), dir_fd=dfd)


def deep_tree(src: str) -> None:
    """22 levels of 200-byte names (4,422 bytes); files at levels 10 and 20, files whose paths end
    right at and right past 4,095 bytes (with and without the source's name in front), one deeper."""
    write(os.path.join(src, "top.txt"), b"top", 0o644, T0)
    fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY)
    fds = [fd]
    try:
        for level in range(1, 23):
            os.mkdir(SEG, 0o755, dir_fd=fds[-1])
            fds.append(os.open(SEG, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fds[-1]))
            if level in (10, 20):
                _put(fds[-1], f"at{level}.txt", b"level %d" % level)
            if level == 20:  # the path so far: 20 * 201 - 1 = 4019 bytes, then "/" + name
                for total in (4091, 4092, 4095, 4096):
                    _put(fds[-1], "f" * (total - 4020), b"%d" % total)
        _put(fds[-1], "deepest.txt", b"deep")
        for dfd, _ in zip(reversed(fds[1:]), range(len(fds) - 1)):  # directories' mtimes last, deepest first
            os.utime(dfd, ns=(T0, T0))
    finally:
        for f in fds:
            os.close(f)


@pytest.mark.parametrize("delete", [False, True], ids=["plain", "delete"])
@pytest.mark.parametrize("slash", [True, False], ids=["slash", "noslash"])
def test_deep_tree_like_rsync(tmp_path: Any, server: Any, slash: bool, delete: bool) -> None:
    h = Harness(tmp_path, server)
    deep_tree(h.src)
    pull_src = os.path.join(server.root, "pullsrc", "src")  # built in place: cp -a cannot copy it
    deep_tree(pull_src)
    for d in (h.src, pull_src):
        os.utime(d, ns=(T0, T0))
    tpl = str(tmp_path / "tpl")  # a prefilled destination: --delete must delete nothing after the error
    landing = os.path.join(tpl, "dst") if slash else os.path.join(tpl, "dst", "src")
    write(os.path.join(landing, "extra.txt"), b"not at the source", 0o644, T0)
    freeze_dirs(tpl, T0)
    h.prepare(tpl)
    spec = "src/" if slash else "src"
    proc = rsync(os.path.join(h.sp, spec), os.path.join(h.dp["rsync"], "dst"), delete=delete, check=False)
    assert proc.returncode == 23, proc.stderr
    overflows = sorted(int(n) for n in re.findall(r"filename overflows max-path len by (\d+)", proc.stderr))
    assert overflows, proc.stderr
    ignore = ("", "dst", "dst/src")
    ref = digest_snapshot(h.dp["rsync"], ignore)
    for route in ("local", "push", "pull"):
        if route == "pull":
            src, dst = server.url("pullsrc/" + spec), os.path.join(h.dp[route], "dst")
        else:
            src = os.path.join(h.sp, spec)
            dst = server.url("push/dst") if route == "push" else os.path.join(h.dp[route], "dst")
        with pytest.raises(PartialTransferError) as err:
            tb5sync.sync(src, dst, delete=delete)
        assert err.value.exit_code == 23, route
        fails = err.value.stats.failures
        assert all(f.side == "source" for f in fails), (route, [f.line()[-80:] for f in fails])
        mine = sorted(int(n) for f in fails for n in re.findall(r"filename overflows max-path len by (\d+)", f.reason))
        assert mine == overflows, route
        assert_same(ref, digest_snapshot(h.dp[route], ignore), route)
