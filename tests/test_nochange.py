"""Re-runs over an unchanged or slightly changed tree: directory listings compared by digest.

The receiver skips every directory whose listing digest is the same on both sides
(``tree``/``entries``, protocol version 3). These tests check that what the quick check
must see is still seen after that shortcut, on each route (local, push, pull), and that
the shortcut is taken when nothing changed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import LiveServer, snapshot

import tb5sync
import tb5sync.roles.sender as sender_mod
from tb5sync.errors import RemoteProtocolError
from tb5sync.tree.entry import DIR, FILE, LINK, Entry
from tb5sync.tree.scan import listing_digest, scan, scan_tree
from tb5sync.roles.receiver import Receiver
from tb5sync.roles.sender import Sender

pytestmark = pytest.mark.timeout(60)

T0 = 1_700_000_000_000_000_000  # a fixed mtime (ns) for files the tests touch


@dataclass
class Route:
    src: str  # the source directory, to be edited between runs
    s: str  # sync source argument
    d: str  # sync destination argument
    final: str  # where the copy lands, to be inspected (and edited) locally


@pytest.fixture(params=["local", "push", "pull"])
def route(request: pytest.FixtureRequest, server: LiveServer, tmp_path: Path) -> Route:
    if request.param == "pull":
        src = os.path.join(server.root, "src")
        return Route(src, server.url("src/"), str(tmp_path / "out"), str(tmp_path / "out"))
    src = str(tmp_path / "src")
    if request.param == "push":
        return Route(src, src + "/", server.url("out"), os.path.join(server.root, "out"))
    return Route(src, src + "/", str(tmp_path / "out"), str(tmp_path / "out"))


def write(path: str, data: bytes, mtime_ns: int | None = None) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))
    return path


def build(src: str) -> None:
    """Three levels of directories with a few small files each, and a symlink."""
    for d in ("", "a", "a/b", "a/b/c", "e"):
        for i in range(3):
            write(os.path.join(src, d, f"f{i}.txt"), f"{d}/{i}\n".encode() * 50, T0 + i)
    os.makedirs(os.path.join(src, "empty"))
    os.symlink("a/f0.txt", os.path.join(src, "link"))


def keep_dir_mtime(path: str) -> Any:
    """Context: restore the directory's mtime afterwards (a change that leaves its own entry as it was)."""

    class _Keep:
        def __enter__(self) -> None:
            self.ns = os.lstat(path).st_mtime_ns

        def __exit__(self, *exc: object) -> None:
            os.utime(path, ns=(self.ns, self.ns))

    return _Keep()


@pytest.fixture
def synced(route: Route) -> Iterator[Route]:
    """The route with the source built and synced once (the copy equal to the source)."""
    build(route.src)
    tb5sync.sync(route.s, route.d)
    assert snapshot(route.final) == snapshot(route.src)
    yield route


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """Records the directories each ``Sender.entries`` request asks for (all routes run in this process)."""
    seen: dict[str, list[Any]] = {"entries": []}
    orig = Sender.entries

    def entries(self: Sender, dirs: list[str], skip: int = 0) -> dict[str, Any]:
        seen["entries"].append(list(dirs))
        return orig(self, dirs, skip)

    monkeypatch.setattr(Sender, "entries", entries)
    return seen


# ---- the shortcut -------------------------------------------------------------------------------


def test_nothing_changed_fetches_no_entries(synced: Route, calls: dict[str, list[Any]]) -> None:
    stats = tb5sync.sync(synced.s, synced.d)
    assert calls["entries"] == []
    assert (stats.files_transferred, stats.files_deleted, stats.chunks_sent) == (0, 0, 0)
    files = [e for e in scan(synced.src) if e.kind == FILE]
    assert stats.files_total == len(files) == 15
    assert stats.bytes_total == sum(e.size for e in files)
    assert snapshot(synced.final) == snapshot(synced.src)


def test_one_change_fetches_only_its_directory(synced: Route, calls: dict[str, list[Any]]) -> None:
    path = os.path.join(synced.src, "a", "b", "f1.txt")
    with keep_dir_mtime(os.path.dirname(path)):
        write(path, b"new content\n", T0 + 99)
    stats = tb5sync.sync(synced.s, synced.d)
    assert calls["entries"] == [["a/b"]]
    assert stats.files_transferred == 1
    assert snapshot(synced.final) == snapshot(synced.src)


# ---- what the quick check must still see ----------------------------------------------------------


def test_same_size_new_mtime_is_sent(synced: Route) -> None:
    path = os.path.join(synced.src, "a", "b", "c", "f2.txt")
    size = os.path.getsize(path)
    with keep_dir_mtime(os.path.dirname(path)):
        write(path, b"x" * size, T0 + 12345)
    stats = tb5sync.sync(synced.s, synced.d)
    assert stats.files_transferred == 1
    assert snapshot(synced.final) == snapshot(synced.src)


def test_same_size_and_mtime_content_change_is_missed_as_by_rsync(synced: Route) -> None:
    """Documented behaviour: the quick check (size + mtime, rsync's) cannot see this; --checksum does."""
    path = os.path.join(synced.src, "e", "f0.txt")
    st = os.lstat(path)
    with keep_dir_mtime(os.path.dirname(path)):
        write(path, b"y" * st.st_size, st.st_mtime_ns)
    copy = os.path.join(synced.final, "e", "f0.txt")
    stats = tb5sync.sync(synced.s, synced.d)
    assert stats.files_transferred == 0
    assert Path(copy).read_bytes() != Path(path).read_bytes()
    stats = tb5sync.sync(synced.s, synced.d, checksum=True)
    assert stats.files_transferred == 1
    assert snapshot(synced.final) == snapshot(synced.src)


@pytest.mark.parametrize("delete", [False, True], ids=["keep", "delete"])
def test_deleted_file(synced: Route, delete: bool) -> None:
    path = os.path.join(synced.src, "a", "b", "c", "f0.txt")
    with keep_dir_mtime(os.path.dirname(path)):
        os.unlink(path)
    stats = tb5sync.sync(synced.s, synced.d, delete=delete)
    copy = os.path.join(synced.final, "a", "b", "c", "f0.txt")
    assert os.path.exists(copy) is not delete
    assert stats.files_deleted == int(delete)
    if delete:
        assert snapshot(synced.final) == snapshot(synced.src)


def test_new_file_in_unchanged_looking_directory(synced: Route) -> None:
    d = os.path.join(synced.src, "a", "b")
    with keep_dir_mtime(d):
        write(os.path.join(d, "new.txt"), b"new\n", T0)
    assert os.lstat(d).st_mtime_ns == os.lstat(os.path.join(synced.final, "a", "b")).st_mtime_ns
    stats = tb5sync.sync(synced.s, synced.d)
    assert stats.files_transferred == 1
    assert snapshot(synced.final) == snapshot(synced.src)


def test_new_directory_deep_down(synced: Route) -> None:
    d = os.path.join(synced.src, "a", "b", "c")
    with keep_dir_mtime(d):
        write(os.path.join(d, "x", "y", "deep.txt"), b"deep\n", T0)
    stats = tb5sync.sync(synced.s, synced.d)
    assert stats.files_transferred == 1
    assert snapshot(synced.final) == snapshot(synced.src)  # directory mtimes included


@pytest.mark.parametrize("what", ["file", "dir", "root"])
def test_mode_change(synced: Route, what: str) -> None:
    path = {"file": os.path.join(synced.src, "a", "f1.txt"), "dir": os.path.join(synced.src, "a", "b"), "root": synced.src}[what]
    with keep_dir_mtime(os.path.dirname(path)):
        os.chmod(path, 0o700 if what != "file" else 0o600)
    stats = tb5sync.sync(synced.s, synced.d)
    assert stats.files_transferred == 0
    assert snapshot(synced.final) == snapshot(synced.src)


def test_symlink_retargeted(synced: Route) -> None:
    link = os.path.join(synced.src, "link")
    with keep_dir_mtime(synced.src):
        os.unlink(link)
        os.symlink("e/f1.txt", link)
    tb5sync.sync(synced.s, synced.d)
    assert os.readlink(os.path.join(synced.final, "link")) == "e/f1.txt"
    assert snapshot(synced.final) == snapshot(synced.src)


def test_file_becomes_directory(synced: Route) -> None:
    path = os.path.join(synced.src, "e", "f2.txt")
    with keep_dir_mtime(os.path.dirname(path)):
        os.unlink(path)
        write(os.path.join(path, "inner.txt"), b"inner\n", T0)
    tb5sync.sync(synced.s, synced.d)
    assert snapshot(synced.final) == snapshot(synced.src)


def test_destination_side_changes_are_repaired(synced: Route) -> None:
    """A copy edited at the destination (its listing then differs) is put back; extras go with --delete."""
    copy_dir = os.path.join(synced.final, "a", "b", "c")
    with keep_dir_mtime(copy_dir):
        write(os.path.join(copy_dir, "f1.txt"), b"tampered, and longer than before\n" * 20)
        write(os.path.join(copy_dir, "extra.txt"), b"extra\n")
    os.chmod(os.path.join(synced.final, "e"), 0o700)
    stats = tb5sync.sync(synced.s, synced.d, delete=True)
    assert stats.files_transferred == 1
    assert stats.files_deleted == 1
    assert snapshot(synced.final) == snapshot(synced.src)


def test_excluded_destination_entries_survive_delete(synced: Route, calls: dict[str, list[Any]]) -> None:
    """Excluded names are left out of both listings: equal digests, nothing fetched, nothing deleted."""
    kept = write(os.path.join(synced.final, "a", "b", "local.tmp"), b"mine\n")
    os.utime(os.path.dirname(kept), ns=(os.lstat(os.path.join(synced.src, "a", "b")).st_mtime_ns,) * 2)
    stats = tb5sync.sync(synced.s, synced.d, delete=True, exclude=["*.tmp"])
    assert calls["entries"] == []
    assert stats.files_deleted == 0
    assert os.path.exists(kept)


def test_paged_tree_and_entries(synced: Route, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny pages: every directory summary and entry still arrives (all directories changed)."""
    monkeypatch.setattr(sender_mod, "MAX_PAGE", 2)
    for d in ("", "a", "a/b", "a/b/c", "e"):
        path = os.path.join(synced.src, d, "f0.txt")
        with keep_dir_mtime(os.path.dirname(path)):
            write(path, b"paged\n", T0 + 7)
    stats = tb5sync.sync(synced.s, synced.d)
    assert stats.files_transferred == 5
    assert stats.files_total == 15
    assert snapshot(synced.final) == snapshot(synced.src)


# ---- the digest itself ------------------------------------------------------------------------------


def test_listing_digest_sees_every_field() -> None:
    base = [Entry("d/a", FILE, 0o644, 10, T0), Entry("d/b", DIR, 0o755, 0, T0), Entry("d/c", LINK, 0o777, 3, T0, "a/x")]
    seen = {listing_digest(base)}
    variants = [
        [base[0]._replace(path="d/A"), *base[1:]],
        [base[0]._replace(kind=LINK), *base[1:]],
        [base[0]._replace(mode=0o600), *base[1:]],
        [base[0]._replace(size=11), *base[1:]],
        [base[0]._replace(mtime_ns=T0 + 1), *base[1:]],
        [*base[:2], base[2]._replace(target="a/y")],
        base[:2],
        [*base, Entry("d/d", FILE, 0o644, 0, T0)],
        [],
    ]
    for v in variants:
        seen.add(listing_digest(v))
    assert len(seen) == len(variants) + 1
    assert listing_digest(list(base)) == listing_digest(tuple(base))
    assert len(listing_digest(base)) == 32


def test_scan_tree_matches_scan(synced: Route) -> None:
    tree = scan_tree(synced.src)
    assert tree.entries == scan(synced.src)
    assert list(tree.children) == [e.path for e in tree.entries if e.kind == DIR]
    assert sorted(e for kids in tree.children.values() for e in kids) == sorted(tree.entries[1:])
    files = [e for e in tree.entries if e.kind == FILE]
    assert sum(r[2] for r in tree.summary()) == len(files)
    assert sum(r[3] for r in tree.summary()) == sum(e.size for e in files)
    assert scan_tree(synced.src).digests() == scan_tree(synced.final).digests()


# ---- a sender that breaks the rules -----------------------------------------------------------------


class _FakeLink:
    """A link to a sender that answers ``tree`` honestly and ``entries`` with ``bad_entries``."""

    streams = 1
    wire_bytes = 0

    def __init__(self, sender: Sender, bad_entries: list[list[Any]]) -> None:
        self.sender = sender
        self.bad = bad_entries

    def submit(self, method: str, **args: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        if method == "entries":
            fut.set_result({"entries": self.bad, "more": False})
        else:
            fut.set_result(getattr(self.sender, method)(**args))
        return fut

    def recycle(self, parts: list[Any]) -> None:
        pass


def test_entry_outside_the_asked_directory_is_refused(tmp_path: Path) -> None:
    src = str(tmp_path / "src")
    build(src)
    sender = Sender(src)
    bad = [["elsewhere/x.txt", FILE, 0o644, 1, T0, ""]]
    with pytest.raises(RemoteProtocolError, match="not in the directories asked for"):
        Receiver(str(tmp_path / "out"), _FakeLink(sender, bad)).run()
    sender.close()
