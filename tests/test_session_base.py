"""A session's base (a pull's source, an ``ls``, a push's ``--link-dest``) is opened through ROOT's jail.

The server computes where a request path lies (``realpath`` of its parents, inside ROOT), then
opens it. Opened by that path again, a parent swapped for a symlink in between (an
authenticated client can do it: its fs session renames, its pushes copy symlinks) would lead
the session outside ROOT. Opened from ROOT's descriptor with no symlink on the way, it is
refused. Each kind is tried with a deterministic swap right after the computation (both
lookup strategies of the jail) and with a racing thread bounded in time; the expectation is
the promise: no byte from outside ROOT reaches the client.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import start_server

import tb5sync
import tb5sync.daemon.sessions as sessions_mod
from tb5sync.remote.client import ls
from tb5sync.errors import PathError, Tb5syncError
from tb5sync.wire.urls import parse_url

SECRET = b"OUTSIDE-SECRET\n"


def _layout(tmp_path: Path) -> tuple[str, str]:
    """ROOT/x/a/sub/inside.txt, ROOT/x/b -> OUTSIDE (OUTSIDE/sub/secret.txt); returns (root, outside)."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "secret.txt").write_bytes(SECRET)
    (root / "x" / "a" / "sub").mkdir(parents=True)
    (root / "x" / "a" / "sub" / "inside.txt").write_bytes(b"inside\n")
    os.symlink(str(outside), str(root / "x" / "b"))
    return str(root), str(outside)


def _swap(xdir: str) -> None:
    """Exchange ``x/a`` (a directory) and ``x/b`` (the symlink out of ROOT)."""
    os.rename(os.path.join(xdir, "a"), os.path.join(xdir, "t"))
    os.rename(os.path.join(xdir, "b"), os.path.join(xdir, "a"))
    os.rename(os.path.join(xdir, "t"), os.path.join(xdir, "b"))


def _secret_under(path: str) -> list[str]:
    found = []
    for d, _, files in os.walk(path):
        for n in files:
            with open(os.path.join(d, n), "rb") as f:
                if f.read() == SECRET:
                    found.append(os.path.join(d, n))
    return found


def _swap_after_resolution(monkeypatch: pytest.MonkeyPatch, xdir: str) -> list[int]:
    """Make the server's path computation swap ``x/a`` for the symlink right after it ran (once)."""
    real = sessions_mod.resolve_in_root
    done = [0]

    def hooked(root: str, path: str) -> str:
        full = real(root, path)
        if not done[0]:
            _swap(xdir)
            done[0] += 1
        return full

    monkeypatch.setattr(sessions_mod, "resolve_in_root", hooked)
    return done


@pytest.mark.timeout(60)
def test_pull_base_parent_swapped_after_the_check(tmp_path: Path, jail_mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    root, _ = _layout(tmp_path)
    done = _swap_after_resolution(monkeypatch, os.path.join(root, "x"))
    live = start_server(root)
    out = str(tmp_path / "out")
    try:
        with pytest.raises(PathError, match="symlink"):
            tb5sync.sync(live.url("x/a/sub/"), out + "/", timeout=10)
    finally:
        live.server.stop()
    assert done[0] == 1
    assert _secret_under(out) == []


@pytest.mark.timeout(60)
def test_ls_parent_swapped_after_the_check(tmp_path: Path, jail_mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    root, _ = _layout(tmp_path)
    done = _swap_after_resolution(monkeypatch, os.path.join(root, "x"))
    live = start_server(root)
    try:
        with pytest.raises(PathError, match="symlink"):
            ls(parse_url(live.url("x/a/sub")), timeout=10)
        # an honest listing still works once nothing moves
        monkeypatch.undo()
        names = [e.path for e in ls(parse_url(live.url("x/b/sub")), timeout=10)]
    finally:
        live.server.stop()
    assert done[0] == 1
    assert names == ["", "inside.txt"]


def _race(run: Callable[[], Any], xdir: str, seconds: float) -> tuple[int, int]:
    """Run ``run`` again and again for ``seconds`` while a thread keeps swapping ``x/a`` and ``x/b``."""
    stop = threading.Event()
    swaps = [0]

    def racer() -> None:
        while not stop.is_set():
            try:
                _swap(xdir)
                swaps[0] += 1
            except OSError:
                pass

    t = threading.Thread(target=racer, daemon=True)
    t.start()
    runs = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            try:
                run()
            except (Tb5syncError, OSError):
                pass  # refused or disturbed: either is fine, a byte from outside is not
            runs += 1
    finally:
        stop.set()
        t.join(10)
    assert not t.is_alive()
    return runs, swaps[0]


@pytest.mark.timeout(60)
def test_race_pull_never_reads_outside(tmp_path: Path) -> None:
    """The report's race: pull x/a/sub/ while x/a and the symlink x/b are exchanged, for 3 s."""
    root, _ = _layout(tmp_path)
    live = start_server(root)
    n = [0]
    listed: list[str] = []

    def pull() -> None:
        n[0] += 1
        out = str(tmp_path / "out" / str(n[0]))
        tb5sync.sync(live.url("x/a/sub/"), out + "/", timeout=10)

    def listing() -> None:
        listed.extend(e.path for e in ls(parse_url(live.url("x/a/sub")), timeout=10))

    try:
        runs, swaps = _race(pull, os.path.join(root, "x"), 2.0)
        lruns, lswaps = _race(listing, os.path.join(root, "x"), 1.0)
    finally:
        live.server.stop()
    assert runs > 0 and swaps > 0 and lruns > 0 and lswaps > 0
    assert _secret_under(str(tmp_path / "out")) == []
    assert "secret.txt" not in listed


@pytest.mark.timeout(60)
def test_race_link_dest_never_links_from_outside(tmp_path: Path) -> None:
    """A push with --link-dest x/a/sub while x/a and the symlink x/b are exchanged: no file of the
    destination is a hard link to a file outside ROOT."""
    root, outside = _layout(tmp_path)
    t0 = 1_600_000_000
    # the same name, size, mode and mtime inside and outside: --link-dest would link either
    for d in (os.path.join(root, "x", "a", "sub"), os.path.join(outside, "sub")):
        p = os.path.join(d, "f.bin")
        with open(p, "wb") as f:
            f.write(b"z" * 100)
        os.chmod(p, 0o644)
        os.utime(p, (t0, t0))
    src = tmp_path / "src"
    src.mkdir()
    (src / "f.bin").write_bytes(b"z" * 100)
    os.chmod(src / "f.bin", 0o644)
    os.utime(src / "f.bin", (t0, t0))
    secret_ino = os.stat(os.path.join(outside, "sub", "f.bin")).st_ino
    live = start_server(root)
    n = [0]

    def push() -> None:
        n[0] += 1
        tb5sync.sync(str(src) + "/", live.url(f"dst/{n[0]}/"), link_dest=["../../x/a/sub"], timeout=10)

    try:
        runs, swaps = _race(push, os.path.join(root, "x"), 2.0)
    finally:
        live.server.stop()
    assert runs > 0 and swaps > 0
    got = [os.stat(os.path.join(d, f)).st_ino for d, _, fs in os.walk(os.path.join(root, "dst")) for f in fs]
    assert got, "no push completed"
    assert secret_ino not in got


def test_push_destination_scan_goes_through_roots_jail(tmp_path: Path, jail_mode: str) -> None:
    """A push's destination is scanned (as its session opens) from ROOT's descriptor: with x/a
    swapped for the symlink after the server's check, the scan is refused, it lists nothing outside."""
    from tb5sync.tree.excludes import NO_RULES
    from tb5sync.roles.receiver import scan_in_background

    root, _ = _layout(tmp_path)
    root = os.path.realpath(root)
    dest = os.path.join(root, "x", "a", "sub")
    _swap(os.path.join(root, "x"))  # x/a is now the symlink to OUTSIDE
    with pytest.raises(PathError, match="symlink"):
        scan_in_background(dest, NO_RULES, unlock=False, root=root).result(30)
    # a destination that does not exist yet is an empty tree; one inside ROOT is listed
    assert scan_in_background(os.path.join(root, "new", "d"), NO_RULES, root=root).result(30).entries == []
    got = scan_in_background(os.path.join(root, "x", "b", "sub"), NO_RULES, unlock=False, root=root).result(30)
    assert [e.path for e in got.entries] == ["", "inside.txt"]


# ---- -L on a server: a followed link's target is looked up through ROOT's jail ----------------


def _link_layout(tmp_path: Path) -> tuple[str, str]:
    """ROOT/tree/{ok, link -> ROOT/in}, ROOT/in/inside.txt, OUTSIDE/secret.txt; returns (root, outside)."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(SECRET)
    (root / "tree").mkdir(parents=True)
    (root / "tree" / "ok").write_bytes(b"ok\n")
    (root / "in").mkdir()
    (root / "in" / "inside.txt").write_bytes(b"inside\n")
    os.symlink(str(root / "in"), str(root / "tree" / "link"))
    return str(root), str(outside)


def _swap_after_realpath(monkeypatch: pytest.MonkeyPatch, path: str, swap: Callable[[], None]) -> list[int]:
    """Run ``swap`` once, right after the first ``realpath`` of ``path`` (the server's check of the link)."""
    real = os.path.realpath
    done = [0]

    def hooked(p: Any, *a: Any, **kw: Any) -> Any:
        out = real(p, *a, **kw)
        if not done[0] and os.fspath(p) == path:
            done[0] += 1
            swap()
        return out

    monkeypatch.setattr(os.path, "realpath", hooked)
    return done


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["link retargeted", "target dir swapped"])
def test_pull_copy_links_target_swapped_after_the_check(tmp_path: Path, jail_mode: str, monkeypatch: pytest.MonkeyPatch, what: str) -> None:
    """``sync -L`` from a server: the link (or the directory it leads to) is swapped for a way out
    of ROOT right after the server checked where it leads. Nothing from outside is listed or sent:
    the swapped entry is a source failure (its listed content, ROOT/in's, may or may not follow),
    never OUTSIDE's names."""
    root, outside = _link_layout(tmp_path)
    link = os.path.join(root, "tree", "link")

    def retarget() -> None:
        os.symlink(outside, link + ".new")
        os.replace(link + ".new", link)

    def swap_dir() -> None:
        os.rename(os.path.join(root, "in"), os.path.join(root, "in.old"))
        os.symlink(outside, os.path.join(root, "in"))

    done = _swap_after_realpath(monkeypatch, link, retarget if what == "link retargeted" else swap_dir)
    live = start_server(root)
    out = str(tmp_path / "out")
    try:
        try:
            tb5sync.sync(live.url("tree/"), out + "/", copy_links=True, timeout=10)
            failures: list[str] = []
        except Tb5syncError as exc:
            failures = [f.path for f in getattr(exc, "failures", [])]
            assert failures, exc
    finally:
        live.server.stop()
    assert done[0] == 1
    assert _secret_under(out) == []
    names = {n for _, _, files in os.walk(out) for n in files}
    assert "secret.txt" not in names
    assert "ok" in names
    # what went is the checked target's content or nothing; only the swapped entry fails
    assert names <= {"ok", "inside.txt"}
    assert failures and all(f == "link" or f.startswith("link/") for f in failures)
    assert not [f for f in failures if "secret" in f]  # not even listed: a name from outside ROOT
