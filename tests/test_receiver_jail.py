"""The receiving side's jail: no listing and no race writes outside the destination's root.

Every change a sync makes goes through :class:`tb5sync.roles.destination.Destination`, relative to
directory descriptors of a :class:`tb5sync._os.paths.Jail`. These tests give the receiver a
listing that names a file under a symlink (an authenticated peer's crafted listing), and swap
a directory for a symlink leading out of the root between the steps of a run (deterministic
hooks) and during runs (a racing thread, bounded in time). The expectation in each case comes
from the issue: not one byte outside the root.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from conftest import snapshot, start_server

import tb5sync
import tb5sync.roles.destination as destination_mod
import tb5sync.roles.generator as generator_mod
from tb5sync.roles.destination import Destination
from tb5sync.tree.entry import LINK
from tb5sync.remote.client import default_state_dir
from tb5sync.errors import PathError, RemoteProtocolError, Tb5syncError
from tb5sync.roles.generator import Generator
from tb5sync.roles.receiver import Receiver
from tb5sync.roles.sender import Sender
from tb5sync.tree.state import TreeState

T0 = 1_600_000_000_000_000_000
MiB = 1024 * 1024


def write(path: str, data: bytes, mtime_ns: int = T0) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def everything_under(path: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), path) for d, dirs, files in os.walk(path) for n in dirs + files)


class ForgingLink:
    """A link to an honest sender whose ``entries`` replies are rewritten by ``forge(entries)``."""

    streams = 1
    wire_bytes = 0

    def __init__(self, sender: Sender, forge: Any) -> None:
        self.sender = sender
        self.forge = forge

    def submit(self, method: str, **args: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        try:
            result = getattr(self.sender, method)(**args)
            if method == "entries":
                result = {**result, "entries": self.forge(list(result["entries"]))}
            fut.set_result(result)
        except BaseException as exc:
            fut.set_exception(exc)
        return fut

    def recycle(self, parts: list[Any]) -> None:
        pass


@pytest.fixture
def crafted(tmp_path: Path) -> tuple[str, str, str, Sender]:
    """A source with ``d/x`` (a file of each size class), a destination holding ``d -> outside``, the outside dir, a sender."""
    src, dst, outside = str(tmp_path / "src"), str(tmp_path / "dst"), str(tmp_path / "outside")
    write(os.path.join(src, "d", "x"), b"planted by a crafted listing\n")
    write(os.path.join(src, "d", "big"), os.urandom(5 * MiB))
    os.makedirs(dst)
    os.makedirs(outside)
    os.symlink(outside, os.path.join(dst, "d"))  # pushed legitimately by an earlier run
    return src, dst, outside, Sender(src)


def as_link_to(target: str) -> Any:
    """Rewrite the listing so that ``d`` is the symlink ``d -> target`` (what the destination has)."""

    def forge(entries: list[list[Any]]) -> list[list[Any]]:
        out = []
        for e in entries:
            if e[0] == "d":
                e = ["d", LINK, 0o777, len(target), T0, target]
            out.append(e)
        return out

    return forge


def test_listing_with_a_file_under_a_symlink_is_refused(crafted: tuple[str, str, str, Sender]) -> None:
    src, dst, outside, sender = crafted
    try:
        with pytest.raises(RemoteProtocolError, match=r"'d/(x|big)'.*parent 'd' is not a directory"):
            Receiver(dst, ForgingLink(sender, as_link_to(outside))).run()
    finally:
        sender.close()
    assert everything_under(outside) == []
    assert os.readlink(os.path.join(dst, "d")) == outside


def test_jail_alone_refuses_to_write_through_the_symlink(
    crafted: tuple[str, str, str, Sender], jail_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the listing check, the jail still refuses: writes go through O_NOFOLLOW directory descriptors."""
    src, dst, outside, sender = crafted
    monkeypatch.setattr(generator_mod, "_check_parents", lambda src, same: None)
    try:
        with pytest.raises(PathError, match="symlink"):
            Receiver(dst, ForgingLink(sender, as_link_to(outside))).run()
    finally:
        sender.close()
    assert everything_under(outside) == []


def test_entry_listed_twice_is_refused(tmp_path: Path) -> None:
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write(os.path.join(src, "d", "x"), b"x")
    sender = Sender(src)

    def twice(entries: list[list[Any]]) -> list[list[Any]]:
        return entries + [e for e in entries if e[0] == "d"]

    try:
        with pytest.raises(RemoteProtocolError):
            Receiver(dst, ForgingLink(sender, twice)).run()
    finally:
        sender.close()


def _swap_for_link(path: str, target: str) -> None:
    os.rename(path, path + ".moved")
    os.symlink(target, path)


@pytest.mark.parametrize("size", [100, 5 * MiB], ids=["small", "large"])
def test_directory_swapped_for_a_symlink_after_mkdir(tmp_path: Path, jail_mode: str, size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the run's mkdir of ``d`` and the files written into it, ``d`` becomes ``d -> outside``."""
    src, dst, outside = str(tmp_path / "src"), str(tmp_path / "dst"), str(tmp_path / "outside")
    for i in range(3):
        write(os.path.join(src, "d", f"f{i}"), os.urandom(size))
    os.makedirs(outside)
    prepare = Generator.prepare

    def prepare_then_swap(self: Generator, plan: Any, src_entries: Any) -> None:
        prepare(self, plan, src_entries)
        _swap_for_link(os.path.join(dst, "d"), outside)

    monkeypatch.setattr(Generator, "prepare", prepare_then_swap)
    with pytest.raises(PathError, match="symlink"):
        tb5sync.sync(src + "/", dst)
    assert everything_under(outside) == []


def test_directory_swapped_after_its_first_file(tmp_path: Path, jail_mode: str, write_impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files after the swap land in the directory the run opened (moved, still inside the root), never
    outside: with either small-file writer (the Cython batch is split so the swap falls inside it)."""
    src, dst, outside = str(tmp_path / "src"), str(tmp_path / "dst"), str(tmp_path / "outside")
    for i in range(5):
        write(os.path.join(src, "d", f"f{i}"), b"%d" % i)
    os.makedirs(outside)
    swapped = []
    if write_impl == "python":
        write_file = Destination.write_file

        def write_then_swap(self: Destination, rel: str, *args: Any) -> os.stat_result:
            st = write_file(self, rel, *args)
            if not swapped:
                swapped.append(rel)
                _swap_for_link(os.path.join(dst, "d"), outside)
            return st

        monkeypatch.setattr(Destination, "write_file", write_then_swap)
    else:
        cy_write = destination_mod._cy_write_files

        def batch_then_swap(files: list[Any], fsync: bool = False, tmpfile: bool = False) -> list[Any]:
            first = cy_write(files[:1], fsync, tmpfile)
            swapped.append(files[0][2])
            _swap_for_link(os.path.join(dst, "d"), outside)
            return first + cy_write(files[1:], fsync, tmpfile)

        monkeypatch.setattr(destination_mod, "_cy_write_files", batch_then_swap)
    with pytest.raises(PathError):
        tb5sync.sync(src + "/", dst)  # finishing d's mode and mtime meets the symlink
    assert swapped
    assert everything_under(outside) == []
    assert sorted(os.listdir(os.path.join(dst, "d.moved"))) == [f"f{i}" for i in range(5)]


def test_base_parent_swapped_for_a_symlink(tmp_path: Path, jail_mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The destination's own parent directory (inside the root) swapped for a symlink: refused too."""
    src, root, outside = str(tmp_path / "src"), str(tmp_path / "root"), str(tmp_path / "outside")
    write(os.path.join(src, "f"), b"data")
    os.makedirs(os.path.join(root, "a"))
    os.makedirs(outside)
    state = TreeState(root)
    base = os.path.join(root, "a", "b")
    sender = Sender(src)
    link = ForgingLink(sender, lambda entries: entries)
    receiver = Receiver(base, link, state=state, state_prefix="a/b")
    _swap_for_link(os.path.join(root, "a"), outside)
    try:
        with pytest.raises(PathError):
            receiver.run()
    finally:
        sender.close()
        state.close()
    assert everything_under(outside) == []


def _racer(dst_dir: str, outside: str, stop: threading.Event, swaps: list[int]) -> None:
    """Swap ``dst_dir`` for a symlink to ``outside`` and back, as fast as it can, until ``stop``."""
    i = 0
    while not stop.is_set():
        try:
            os.rename(dst_dir, f"{dst_dir}.old{i}")
            os.symlink(outside, dst_dir)
            swaps[0] += 1
            time.sleep(0.0005)
            os.unlink(dst_dir)
        except OSError:
            pass
        i += 1
        time.sleep(0.0005)


def _race(run: Any, dst_dir: str, outside: str, seconds: float) -> int:
    stop = threading.Event()
    swaps = [0]
    t = threading.Thread(target=_racer, args=(dst_dir, outside, stop, swaps), daemon=True)
    t.start()
    deadline = time.monotonic() + seconds
    runs = 0
    try:
        while time.monotonic() < deadline:
            try:
                run()
            except (Tb5syncError, OSError):
                pass  # refused or disturbed: either is fine, a byte outside is not
            runs += 1
    finally:
        stop.set()
        t.join(10)
    assert not t.is_alive(), "the racing thread did not stop"
    assert swaps[0] > 0
    return runs


def test_race_local_sync_never_writes_outside(tmp_path: Path, jail_mode: str) -> None:
    src, dst, outside = str(tmp_path / "src"), str(tmp_path / "dst"), str(tmp_path / "outside")
    for i in range(200):
        write(os.path.join(src, "race", "d", f"f{i:03d}"), b"%d\n" % i)
    os.makedirs(outside)
    os.makedirs(os.path.join(dst, "race", "d"))
    runs = _race(lambda: tb5sync.sync(src + "/", dst), os.path.join(dst, "race", "d"), outside, 2.0)
    assert runs > 0
    assert everything_under(outside) == []


def test_race_push_to_server_never_writes_outside(tmp_path: Path) -> None:
    """The issue's race with a stock client: a push into ROOT/race/d while d is swapped for a link out of ROOT."""
    src, outside = str(tmp_path / "src"), str(tmp_path / "outside")
    for i in range(200):
        write(os.path.join(src, "d", f"f{i:03d}"), b"%d\n" % i)
    os.makedirs(outside)
    live = start_server(str(tmp_path / "root"))
    try:
        os.makedirs(os.path.join(live.root, "race", "d"))
        runs = _race(lambda: tb5sync.sync(src + "/", live.url("race/"), streams=2), os.path.join(live.root, "race", "d"), outside, 2.0)
        assert runs > 0
    finally:
        live.server.stop()
    assert everything_under(outside) == []


# ---- concurrent writers ----------------------------------------------------------------------


def test_two_runs_creating_the_same_tree(tmp_path: Path) -> None:
    """Two syncs making the same directories at once both succeed (a directory made meanwhile is taken as it is)."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    for i in range(60):
        write(os.path.join(src, f"a{i % 6}", f"b{i % 5}", f"f{i}"), b"%d" % i)
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def run() -> None:
        try:
            barrier.wait(10)
            tb5sync.sync(src + "/", dst)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a sync hung"
    assert errors == []
    assert snapshot(dst) == snapshot(src)


def test_mkdir_over_a_file_still_fails(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    write(os.path.join(root, "base", "x"), b"a file")
    d = Destination(os.path.join(root, "base"))
    try:
        d.mkdir("y")
        d.mkdir("y")  # made meanwhile: fine
        with pytest.raises(FileExistsError):
            d.mkdir("x")
    finally:
        d.close()


def test_destination_rejects_the_root_itself(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    os.makedirs(root)
    state = TreeState(root)
    d = Destination(root, state, "")
    try:
        with pytest.raises(PathError):
            d.remove("", True)
    finally:
        d.close()
        state.close()


def test_every_kind_goes_through_the_jail(tmp_path: Path) -> None:
    """A full sync (files, links, modes, deletions) through Destination gives the same tree as the source."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write(os.path.join(src, "a", "f"), b"f")
    os.chmod(os.path.join(src, "a", "f"), 0o640)
    os.symlink("a/f", os.path.join(src, "l"))
    write(os.path.join(dst, "gone", "g"), b"g")
    tb5sync.sync(src + "/", dst, delete=True)
    assert snapshot(dst) == snapshot(src)
    assert os.readlink(os.path.join(dst, "l")) == "a/f"
    assert os.stat(os.path.join(dst, "a", "f")).st_mode & 0o777 == 0o640



def test_two_pushes_creating_the_same_tree(tmp_path: Path) -> None:
    """The issue's two pushes of one new tree at once: both succeed, the tree is the source's."""
    src = str(tmp_path / "src")
    for i in range(60):
        write(os.path.join(src, f"a{i % 6}", f"b{i % 5}", f"f{i}"), b"%d" % i)
    live = start_server(str(tmp_path / "root"))
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def push() -> None:
        try:
            barrier.wait(10)
            tb5sync.sync(src + "/", live.url("new/tree/"), streams=2)
        except BaseException as exc:
            errors.append(exc)

    try:
        threads = [threading.Thread(target=push) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a push hung"
        assert errors == []
        assert snapshot(os.path.join(live.root, "new", "tree")) == snapshot(src)
    finally:
        live.server.stop()


def test_concurrent_runs_of_two_versions_leave_exactly_one(tmp_path: Path) -> None:
    """Two versions of one large file with equal size and mtime, synced at once into one path: the result is one of them, whole."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    va, vb = os.urandom(9 * MiB), os.urandom(9 * MiB)
    write(os.path.join(a, "big"), va)
    write(os.path.join(b, "big"), vb)
    for round_ in range(3):
        dst = str(tmp_path / f"dst{round_}")
        errors: list[BaseException] = []
        barrier = threading.Barrier(2)

        def run(src: str) -> None:
            try:
                barrier.wait(10)
                tb5sync.sync(src + "/", dst)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(s,)) for s in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a sync hung"
        assert errors == []
        with open(os.path.join(dst, "big"), "rb") as f:
            got = f.read()
        assert got in (va, vb), f"round {round_}: neither version"
        # a local destination's state lives in the user's cache directory (not dst/.tb5sync)
        assert os.listdir(os.path.join(default_state_dir(dst) or "/nonexistent", "partial")) == []


# ---- listings never follow a directory swapped for a symlink ------------------------------------


@pytest.mark.parametrize("lister", ["cython", "python"])
def test_scan_does_not_follow_a_directory_swapped_during_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lister: str) -> None:
    """``d`` becomes ``d -> outside`` right after its parent was listed: nothing of ``outside`` is listed."""
    import tb5sync.tree.scan as scan_mod

    if lister == "python":
        monkeypatch.setattr(scan_mod, "listdir_stat", scan_mod.py_listdir_stat)
    elif scan_mod.cy_listdir_stat is None:
        pytest.skip("tb5sync._scan is not built (the Python twin is tested)")
    else:
        monkeypatch.setattr(scan_mod, "listdir_stat", scan_mod.cy_listdir_stat)
    base, outside = str(tmp_path / "base"), str(tmp_path / "outside")
    write(os.path.join(base, "d", "mine"), b"m")
    write(os.path.join(base, "e", "f"), b"f")
    write(os.path.join(outside, "secret-name"), b"s")
    write(os.path.join(outside, "sub", "deeper"), b"s")
    real = scan_mod._list_fd
    swapped: list[bool] = []

    def list_then_swap(fd: int) -> Any:
        items = real(fd)
        if not swapped:  # the base was just listed
            swapped.append(True)
            _swap_for_link(os.path.join(base, "d"), outside)
        return items

    monkeypatch.setattr(scan_mod, "_list_fd", list_then_swap)
    tree = scan_mod.scan_tree(base)
    paths = [e.path for e in tree.entries]
    assert not any("secret" in p or "deeper" in p for p in paths), paths
    assert "e/f" in paths
    # a directory opened before the swap is listed through its descriptor: its own entries
    swapped.clear()
    os.unlink(os.path.join(base, "d"))
    os.rename(os.path.join(base, "d.moved"), os.path.join(base, "d"))
    real_open = os.open
    opened: list[bool] = []

    def open_then_swap(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        fd = real_open(path, flags, *args, **kw)
        if path == "d" and kw.get("dir_fd") is not None and not opened:
            opened.append(True)
            _swap_for_link(os.path.join(base, "d"), outside)
        return fd

    monkeypatch.setattr(scan_mod, "_list_fd", real)
    monkeypatch.setattr(scan_mod.os, "open", open_then_swap)
    paths = [e.path for e in scan_mod.scan_tree(base).entries]
    assert opened and "d/mine" in paths and not any("secret" in p or "deeper" in p for p in paths), paths

