"""A non-root user updating entries inside directories of mode 0555: rsync gives such a directory
``u+w`` while it writes in it and gives the mode back at the end. So must tb5sync, with the
writing side unprivileged on every route: local (the command as ``nobody``), push (to a server
run as ``nobody``) and pull (the command as ``nobody``)."""

from __future__ import annotations

import os
import shutil

import pytest
from conftest import start_server
from test_partial_vs_rsync import NobodyServer, _chown_tree, _unprivileged, cli, rsync_rc, shared_tmp  # noqa: F401
from test_vs_rsync import T0, assert_same, cp_a, digest_snapshot, freeze_dirs, write

S = 1_000_000_000


pytestmark = pytest.mark.usefixtures("need_rsync")  # conftest: skipped without rsync


def _lock(base: str) -> None:
    """Mode 0555 on every directory under ``base`` (deepest first), mtimes fixed."""
    freeze_dirs(base, T0)
    for dirpath, _d, _f in sorted(os.walk(base), key=lambda t: -t[0].count("/")):
        if dirpath != base:
            os.chmod(dirpath, 0o555)
            os.utime(dirpath, ns=(T0, T0))


def _unlock(base: str) -> None:
    for dirpath, _d, _f in os.walk(base):
        os.chmod(dirpath, 0o755)


def _change(src: str) -> None:
    """Changes inside the read-only directories: a file rewritten (small and large), one added,
    one deleted, a symlink and a subdirectory added; then the directories locked again."""
    _unlock(src)
    write(os.path.join(src, "ro", "f.txt"), b"version two, longer", 0o644, T0 + 5 * S)
    write(os.path.join(src, "ro", "inner", "big.bin"), os.urandom(5 * 1024 * 1024 + 1), 0o644, T0 + 5 * S)
    write(os.path.join(src, "ro", "added.txt"), b"new", 0o600, T0 + 5 * S)
    os.unlink(os.path.join(src, "ro", "inner", "gone.txt"))
    os.symlink("f.txt", os.path.join(src, "ro", "link"))
    os.utime(os.path.join(src, "ro", "link"), ns=(T0, T0), follow_symlinks=False)
    write(os.path.join(src, "ro", "newdir", "n.txt"), b"n", 0o644, T0)
    _lock(src)


def test_update_inside_mode_0555_directories_like_rsync(shared_tmp: str) -> None:
    user = _unprivileged()
    src = os.path.join(shared_tmp, "sp", "src")
    write(os.path.join(src, "ro", "f.txt"), b"version one", 0o644, T0)
    write(os.path.join(src, "ro", "inner", "big.bin"), os.urandom(5 * 1024 * 1024), 0o644, T0)
    write(os.path.join(src, "ro", "inner", "gone.txt"), b"deleted later", 0o644, T0)
    _lock(src)
    srv_root = os.path.join(shared_tmp, "server")
    os.makedirs(srv_root)
    dps = {r: os.path.join(shared_tmp, f"dp-{r}") for r in ("rsync", "local", "pull")}
    for d in dps.values():
        os.makedirs(d)
    _chown_tree(shared_tmp, user)
    live = start_server(os.path.join(shared_tmp, "rootsrv"))  # pull: the source on a root server
    nobody_srv = NobodyServer(srv_root, user)  # push: the destination written as nobody
    try:
        for step in ("first", "second"):
            if step == "second":
                _change(src)
            _chown_tree(src, user)
            staged = os.path.join(live.root, "src")
            if os.path.lexists(staged):
                _unlock(staged)
                shutil.rmtree(staged)
            cp_a(src, staged)
            proc = rsync_rc(["--delete", src + "/", os.path.join(dps["rsync"], "dst")], user)
            assert proc.returncode == 0, proc.stderr
            runs = {
                "local": cli(["sync", "--delete", src + "/", os.path.join(dps["local"], "dst")], user),
                "push": cli(["sync", "--delete", src + "/", nobody_srv.url("dst")], user),
                "pull": cli(["sync", "--delete", live.url("src/"), os.path.join(dps["pull"], "dst")], user),
            }
            finals = {"local": os.path.join(dps["local"], "dst"), "push": os.path.join(srv_root, "dst"),
                      "pull": os.path.join(dps["pull"], "dst")}
            ref = digest_snapshot(os.path.join(dps["rsync"], "dst"), ())
            assert ref["ro"][1] == 0o555 and ref["ro/inner"][1] == 0o555
            for r, p in runs.items():
                assert p.returncode == 0, f"{step} {r}: {p.returncode} {p.stderr}"
                assert_same(ref, digest_snapshot(finals[r], ()), f"{step} {r}")
    finally:
        nobody_srv.stop()
        live.server.stop()
        for d in (shared_tmp,):
            _unlock(d)


def test_unlistable_destination_directories_like_rsync(shared_tmp: str) -> None:
    """A non-root user's destination directory without ``u+r`` (mode 0300) still gets its
    contents synced and, with ``--delete``, its extra entries deleted, as rsync makes its way in.
    (Such a directory that the source lacks altogether is another matter: rsync cannot list
    it to delete it, says "opendir failed" and deletes nothing more; not compared here.)"""
    user = _unprivileged()
    src = os.path.join(shared_tmp, "sp", "src")
    write(os.path.join(src, "d", "a.txt"), b"new a", 0o644, T0)
    write(os.path.join(src, "d", "sub", "b.txt"), b"b", 0o644, T0)
    freeze_dirs(src, T0)
    tpl = os.path.join(shared_tmp, "tpl", "dst")
    write(os.path.join(tpl, "d", "a.txt"), b"old a, longer", 0o644, T0 - S)
    write(os.path.join(tpl, "d", "extra.txt"), b"only at the destination", 0o644, T0)
    write(os.path.join(tpl, "d", "sub", "extra2.txt"), b"deeper", 0o644, T0)
    freeze_dirs(tpl, T0)
    for p in ("d/sub", "d"):
        os.chmod(os.path.join(tpl, p), 0o300)
    srv_root = os.path.join(shared_tmp, "server")
    os.makedirs(srv_root)
    dps = {r: os.path.join(shared_tmp, f"dp-{r}") for r in ("rsync", "local", "pull")}
    for r, d in dps.items():
        os.makedirs(d)
        cp_a(tpl, os.path.join(d, "dst"))
    cp_a(tpl, os.path.join(srv_root, "dst"))
    _chown_tree(shared_tmp, user)
    live = start_server(os.path.join(shared_tmp, "rootsrv"))
    cp_a(src, os.path.join(live.root, "src"))
    nobody_srv = NobodyServer(srv_root, user)
    try:
        proc = rsync_rc(["--delete", src + "/", os.path.join(dps["rsync"], "dst")], user)
        assert proc.returncode == 0, proc.stderr
        runs = {
            "local": cli(["sync", "--delete", src + "/", os.path.join(dps["local"], "dst")], user),
            "push": cli(["sync", "--delete", src + "/", nobody_srv.url("dst")], user),
            "pull": cli(["sync", "--delete", live.url("src/"), os.path.join(dps["pull"], "dst")], user),
        }
        finals = {"local": os.path.join(dps["local"], "dst"), "push": os.path.join(srv_root, "dst"),
                  "pull": os.path.join(dps["pull"], "dst")}
        ref = digest_snapshot(os.path.join(dps["rsync"], "dst"), ())
        assert "d/extra.txt" not in ref and "d/sub/extra2.txt" not in ref and ref["d"][1] == 0o755
        for r, p in runs.items():
            assert p.returncode == 0, f"{r}: {p.returncode} {p.stderr}"
            assert_same(ref, digest_snapshot(finals[r], ()), r)
    finally:
        nobody_srv.stop()
        live.server.stop()
        _unlock(shared_tmp)
