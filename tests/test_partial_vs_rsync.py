"""rsync's error model, against rsync itself: copy everything that can be copied, name each entry
that could not, exit 23 (24 when source files only vanished).

Each scenario runs ``rsync -a`` on one copy of the inputs and tb5sync local, push and pull on
identical copies; the resulting trees must be equal, and each tb5sync route must name the same
entries (path, side, and whether the side was the server's) and exit as rsync did.

Unreadable sources need an unprivileged reader (root reads everything): those tests run rsync
and the tb5sync command as ``nobody`` through ``setpriv`` (and, for pull, a server started as
``nobody``); they are skipped when the tests do not run as root or ``setpriv`` is missing.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import slurp, start_server
from test_vs_rsync import ROUTES, Harness, T0, assert_same, cp_a, digest_snapshot, freeze_dirs, settle, write

import tb5sync
from tb5sync.errors import PartialTransferError, SourceChangedError, VanishedSourceError, partial_error
from tb5sync.tree.options import Failure, SyncStats


pytestmark = pytest.mark.usefixtures("need_rsync")  # conftest: skipped without rsync



def rsync_rc(args: list[str], user: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = ["rsync", "-a", *args]
    if user is not None:
        cmd = [*as_user(user), *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=100, check=False)


def as_user(user: str) -> list[str]:
    return ["setpriv", f"--reuid={user}", f"--regid={pwd.getpwnam(user).pw_gid}", "--clear-groups"]


def cli(args: list[str], user: str | None = None) -> subprocess.CompletedProcess[str]:
    """The tb5sync command (``python -m tb5sync.cli``), as ``user`` when given."""
    cmd = [sys.executable, "-m", "tb5sync.cli", *args]
    if user is not None:
        cmd = [*as_user(user), *cmd]
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(tb5sync.__file__))}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=100, check=False, env=env)


def failures_of(proc: subprocess.CompletedProcess[str]) -> set[tuple[str, str, bool]]:
    """``(path, side, server)`` of each failure in the ``--json`` output of a run."""
    out = json.loads(proc.stdout)
    return {(f["path"], f["side"], f["server"]) for f in out["failures"]}


# ---- type changes the destination cannot take -------------------------------------------------


def _type_change_inputs(h: Harness, tmp_path: Any) -> None:
    """``output`` was a non-empty directory and is now a file; ``config.d`` was a file and is now
    a directory; ``plain.txt`` changed; the destination also holds an extra file."""
    src = h.src
    os.makedirs(os.path.join(src, "output", "sub"))
    write(os.path.join(src, "output", "sub", "result.bin"), b"r" * 3000, 0o644, T0)
    write(os.path.join(src, "config.d"), b"old config", 0o644, T0)
    write(os.path.join(src, "plain.txt"), b"v1", 0o644, T0)
    freeze_dirs(src, T0)
    tpl = str(tmp_path / "tpl")
    os.makedirs(tpl)
    settle(src)
    cp_a(src, os.path.join(tpl, "dst"))
    write(os.path.join(tpl, "dst", "extra.txt"), b"only at the destination", 0o644, T0)
    write(os.path.join(tpl, "dst", "output", "hold.keep"), b"protected by --exclude", 0o644, T0)
    freeze_dirs(os.path.join(tpl, "dst"), T0)
    h.prepare(tpl)
    shutil.rmtree(os.path.join(src, "output"))
    write(os.path.join(src, "output"), b"now a file", 0o644, T0 + 2 * S)
    os.unlink(os.path.join(src, "config.d"))
    write(os.path.join(src, "config.d", "a.conf"), b"a", 0o600, T0 + 3 * S)
    write(os.path.join(src, "config.d", "b.conf"), b"b" * 5000, 0o644, T0 + 3 * S)
    write(os.path.join(src, "plain.txt"), b"version 2", 0o644, T0 + 4 * S)
    freeze_dirs(src, T0 + 10 * S)


S = 1_000_000_000


def _run_partial(h: Harness, delete: bool, dry_run: bool = False) -> dict[str, PartialTransferError]:
    """Run every route on ``src/`` -> ``dst``; rsync must exit 23, each tb5sync route raise."""
    settle(h.sp)
    got: dict[str, PartialTransferError] = {}
    for r in h.routes:
        local_src = os.path.join(h.sp, "src/")
        local_dst = os.path.join(h.dp[r], "dst")
        if r == "rsync":
            opts = ["--delete", "--exclude=*.keep"] if delete else []
            proc = rsync_rc([*opts, *(["-n"] if dry_run else []), local_src, local_dst])
            assert proc.returncode == 23, proc.stderr
            assert "output" in proc.stderr
            continue
        if r == "local":
            src, dst = local_src, local_dst
        elif r == "push":
            src, dst = local_src, h.server.url("push/dst")
        else:
            h.stage_pull()
            src, dst = h.server.url("pullsrc/src/"), local_dst
        with pytest.raises(PartialTransferError) as info:
            tb5sync.sync(src, dst, delete=delete, exclude=["*.keep"] if delete else [], dry_run=dry_run)
        got[r] = info.value
    return got


@pytest.mark.parametrize("delete", [False, True], ids=["no-delete", "delete"])
def test_type_change_refused_syncs_everything_else(h: Harness, tmp_path: Any, delete: bool) -> None:
    """rsync: "cannot delete non-empty directory: output", everything else synced (config.d
    becomes a directory, plain.txt updated), exit 23. With ``--delete --exclude=*.keep`` the
    directory's other contents and extra.txt are deleted, the protected file keeps it."""
    _type_change_inputs(h, tmp_path)
    got = _run_partial(h, delete)
    h.check(ignore_mtime=["dst/output"] if delete else [])  # deleting in it made its mtime "now"
    for r, exc in got.items():
        assert exc.exit_code == 23
        assert not isinstance(exc, SourceChangedError)
        assert [(f.path, f.side, f.server) for f in exc.failures] == [("output", "destination", r == "push")], r
        assert exc.stats.files_transferred == 3, r  # config.d/a.conf, config.d/b.conf, plain.txt
        assert os.path.isfile(os.path.join(h.dp[r], "dst", "output", "hold.keep"))
        assert os.path.isfile(os.path.join(h.dp[r], "dst", "output", "sub", "result.bin")) != delete


def test_type_change_dry_run_agrees_with_the_run(h: Harness, tmp_path: Any) -> None:
    """``-n`` names the same failures and exits 23 as rsync -n does; nothing changes."""
    _type_change_inputs(h, tmp_path)
    before = {r: digest_snapshot(h.dp[r]) for r in h.routes}
    dry = _run_partial(h, False, dry_run=True)
    for r in h.routes:
        assert digest_snapshot(h.dp[r]) == before[r], f"{r}: the dry run changed the destination"
    for r, exc in dry.items():
        assert [(f.path, f.side, f.server) for f in exc.failures] == [("output", "destination", r == "push")], r
        assert "output" not in exc.stats.extra["changes"]["transfer"], r
    real = _run_partial(h, False)
    for r in real:
        assert [f.path for f in real[r].failures] == [f.path for f in dry[r].failures]


def test_cli_names_each_failure_and_exits_23(tmp_path: Any, server: Any) -> None:
    """The command prints one line per failure (path and side), ``--json`` carries them, exit 23."""
    src = str(tmp_path / "src")
    write(os.path.join(src, "output"), b"a file now", 0o644, T0)
    write(os.path.join(src, "ok.txt"), b"fine", 0o644, T0)
    for dst in (str(tmp_path / "dst"), os.path.join(server.root, "dst")):
        write(os.path.join(dst, "output", "kept.txt"), b"in the way", 0o644, T0)
    ref = str(tmp_path / "ref")
    write(os.path.join(ref, "output", "kept.txt"), b"in the way", 0o644, T0)
    assert rsync_rc([src + "/", ref]).returncode == 23
    for dst, server_side in ((str(tmp_path / "dst"), False), (server.url("dst"), True)):
        proc = cli(["sync", "--json", src + "/", dst])
        assert proc.returncode == 23, proc.stderr
        assert failures_of(proc) == {("output", "destination", server_side)}
        lines = [ln for ln in proc.stderr.splitlines() if "'output'" in ln]
        assert lines == [f"tb5sync: destination{' (server)' if server_side else ''} 'output': "
                         "cannot delete non-empty directory: could not make way for the new entry"], proc.stderr
        final = dst if not server_side else os.path.join(server.root, "dst")
        assert slurp(os.path.join(final, "ok.txt")) == b"fine"


# ---- unreadable sources (an unprivileged reader) ----------------------------------------------


def _unprivileged() -> str:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root (to run the syncs as nobody through setpriv)")
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user nobody")
    return "nobody"


@pytest.fixture
def shared_tmp() -> Iterator[str]:
    """A temporary directory that ``nobody`` can enter (pytest's own are root-only)."""
    d = tempfile.mkdtemp(prefix="tb5-partial-")
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        for dirpath, dirnames, _ in os.walk(d):
            for n in dirnames:
                os.chmod(os.path.join(dirpath, n), 0o755)
        shutil.rmtree(d, ignore_errors=True)


def _chown_tree(base: str, user: str) -> None:
    pw = pwd.getpwnam(user)
    for dirpath, dirnames, filenames in os.walk(base):
        for n in [dirpath, *[os.path.join(dirpath, x) for x in dirnames + filenames]]:
            os.lchown(n, pw.pw_uid, pw.pw_gid)


class NobodyServer:
    """``tb5sync serve ROOT`` run as ``user`` on 127.0.0.1, a free port; stopped by :meth:`stop`."""

    def __init__(self, root: str, user: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(tb5sync.__file__))}
        env.pop("TB5SYNC_TOKEN", None)
        self.proc = subprocess.Popen(
            [*as_user(user), sys.executable, "-m", "tb5sync.cli", "serve", root, "--bind", "127.0.0.1:0"],
            stderr=subprocess.PIPE, text=True, env=env,
        )
        assert self.proc.stderr is not None
        line = self.proc.stderr.readline()
        if "serving" not in line:
            self.stop()
            raise AssertionError(f"server did not start: {line}")
        self.port = int(line.rsplit(":", 1)[1])

    def url(self, path: str) -> str:
        return f"tb5://127.0.0.1:{self.port}/{path}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


def _unreadable_inputs(base: str, locked_dir: bool) -> tuple[str, str]:
    """A source with an unreadable small file, an unreadable large file and (``locked_dir``) an
    unlistable directory; a destination template with an extra file and the locked dir's old
    contents. Returns ``(src, tpl)``."""
    src = os.path.join(base, "sp", "src")
    write(os.path.join(src, "ok", "a.txt"), b"readable", 0o644, T0)
    write(os.path.join(src, "secret.txt"), b"private", 0o000, T0)
    write(os.path.join(src, "big.bin"), os.urandom(5 * 1024 * 1024), 0o000, T0)
    write(os.path.join(src, "z.txt"), b"after the failures", 0o644, T0)
    tpl = os.path.join(base, "tpl")
    write(os.path.join(tpl, "dst", "extra.txt"), b"only at the destination", 0o644, T0)
    write(os.path.join(tpl, "dst", "ok", "stale.txt"), b"stale", 0o644, T0)
    if locked_dir:
        write(os.path.join(src, "locked", "inner.txt"), b"cannot be listed", 0o644, T0)
        write(os.path.join(tpl, "dst", "locked", "old.txt"), b"old", 0o644, T0)
        os.utime(os.path.join(src, "locked"), ns=(T0, T0))
        os.chmod(os.path.join(src, "locked"), 0o000)
    freeze_dirs(os.path.join(tpl, "dst"), T0)
    return src, tpl


@pytest.mark.parametrize("locked_dir", [False, True], ids=["files", "files-and-dir"])
def test_unreadable_source_entries_like_rsync(shared_tmp: str, locked_dir: bool) -> None:
    """As ``nobody``: rsync copies the rest, names each unreadable entry, exits 23; with a directory
    it cannot list it deletes nothing ("IO error encountered -- skipping file deletion"), so
    nothing under that directory either.
    tb5sync, local, push (client as nobody) and pull (server as nobody), must leave the same trees
    and name the same entries, the server's side marked as such."""
    user = _unprivileged()
    src, tpl = _unreadable_inputs(shared_tmp, locked_dir)
    settle(src)
    srv_root = os.path.join(shared_tmp, "server")
    os.makedirs(srv_root)
    cp_a(os.path.join(shared_tmp, "sp"), os.path.join(srv_root, "pullsrc"))
    dps = {r: os.path.join(shared_tmp, f"dp-{r}") for r in ROUTES}
    for r in ROUTES:
        cp_a(tpl, dps[r] if r != "push" else os.path.join(shared_tmp, "push-tpl"))
    _chown_tree(shared_tmp, user)
    # rsync's rule after a sender I/O error is "skipping file deletion" for the whole file list;
    # with incremental recursion (its default) the directories whose deletions already ran
    # before the error keep them, an order-dependent scope: tb5sync takes the whole-list rule,
    # which is rsync's with --no-inc-recursive (and rsync 2.x's).
    proc = rsync_rc(["--delete", "--no-inc-recursive", src + "/", os.path.join(dps["rsync"], "dst")], user)
    assert proc.returncode == 23, proc.stderr
    assert ("IO error encountered" in proc.stdout + proc.stderr) == locked_dir

    expected = {("secret.txt", "source"), ("big.bin", "source")} | ({("locked", "source")} if locked_dir else set())
    live = start_server(os.path.join(shared_tmp, "rootsrv"))  # push: a root server, the client as nobody
    nobody_srv = NobodyServer(srv_root, user)  # pull: the server reads as nobody
    try:
        cp_a(os.path.join(shared_tmp, "push-tpl", "dst"), os.path.join(live.root, "dst"))
        runs = {
            "local": cli(["sync", "--json", "--delete", src + "/", os.path.join(dps["local"], "dst")], user),
            "push": cli(["sync", "--json", "--delete", src + "/", live.url("dst")], user),
            "pull": cli(["sync", "--json", "--delete", nobody_srv.url("pullsrc/src/"), os.path.join(dps["pull"], "dst")]),
        }
        finals = {"local": os.path.join(dps["local"], "dst"), "push": os.path.join(live.root, "dst"),
                  "pull": os.path.join(dps["pull"], "dst")}
        ref = digest_snapshot(os.path.join(dps["rsync"], "dst"), ())
        for r, p in runs.items():
            assert p.returncode == 23, f"{r}: {p.returncode} {p.stderr}"
            assert failures_of(p) == {(path, side, r == "pull") for path, side in expected}, r
            for path, _side in expected:
                assert sum(f"'{path}'" in ln for ln in p.stderr.splitlines()) == 1, p.stderr
            assert "Errno" not in p.stderr and "remote: remote" not in p.stderr, p.stderr
            # rsync's line, on the client whichever side planned (a push's server used to keep it)
            assert (p.stderr.count("IO error encountered -- skipping file deletion") == 1) == locked_dir, (r, p.stderr)
            assert_same(ref, digest_snapshot(finals[r], ()), r)
    finally:
        nobody_srv.stop()
        live.server.stop()


# ---- exit codes --------------------------------------------------------------------------------


def test_exit_code_24_only_when_every_failure_vanished() -> None:
    """rsync(1), EXIT VALUES: 23 "Partial transfer due to error", 24 "Partial transfer due to
    vanished source files" (23 wins when both happened)."""
    vanished = Failure("a", "source", "vanished", vanished=True)
    denied = Failure("b", "source", "Permission denied (13)")
    assert SyncStats().exit_code == 0
    only = partial_error(SyncStats(failures=(vanished,)))
    assert isinstance(only, VanishedSourceError) and isinstance(only, SourceChangedError)
    assert only.exit_code == 24 and only.path == "a"
    both = partial_error(SyncStats(failures=(vanished, denied)))
    assert type(both) is PartialTransferError and both.exit_code == 23
    assert both.stats.failures == (vanished, denied)


def test_failure_wire_form_round_trips() -> None:
    f = Failure("d/é", "destination", "Permission denied (13)", server=True)
    assert Failure.from_wire(f.to_wire()) == f
    with pytest.raises(ValueError):
        Failure.from_wire({"path": "x", "side": "elsewhere", "reason": "r"})
    with pytest.raises(ValueError):
        Failure.from_wire({"path": 1, "side": "source", "reason": "r"})
