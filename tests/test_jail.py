"""The path jail (tb5sync._os.paths.Jail) and its two users' views of it (FsOps, Sender).

Every test runs twice where it matters: with ``openat2`` (skipped where the kernel
lacks it) and with the portable walk forced, so both lookups refuse the same paths.

The tree each test gets::

    tmp/outside/secret            "SECRET"      (a file outside the root)
    tmp/outside/sub/secret        "SUBSECRET"
    tmp/root/a/b/f                "inside"
    tmp/root/a/b/leaf   -> tmp/outside/secret   (the symlink as the last component)
    tmp/root/a/mid      -> tmp/outside/sub      (a middle component)
    tmp/root/top        -> tmp/outside          (a child of the root)
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tb5sync._os.paths as _paths
from tb5sync._os.paths import PORTABLE_ENV, Jail, openat2_available
from tb5sync.errors import PathError
from tb5sync.wire.parts import close_parts
from tb5sync.daemon.fsops import FsOps
from tb5sync.roles.sender import Sender
from tb5sync.tree.state import TreeState

pytestmark = pytest.mark.timeout(30)

#: Paths through a symlink leading outside, by the symlink's position.
THROUGH = {"root-child": "top/sub/secret", "middle": "a/mid/secret", "leaf": "a/b/leaf"}
#: Where a new file would land through each of them.
CREATE = {"root-child": "top/sub/new", "middle": "a/mid/new", "leaf": "a/b/leaf"}


class Tree:
    def __init__(self, tmp: Path) -> None:
        self.outside = tmp / "outside"
        self.root = tmp / "root"
        (self.outside / "sub").mkdir(parents=True)
        (self.outside / "secret").write_bytes(b"SECRET")
        (self.outside / "sub" / "secret").write_bytes(b"SUBSECRET")
        (self.root / "a" / "b").mkdir(parents=True)
        (self.root / "a" / "b" / "f").write_bytes(b"inside")
        os.symlink(self.outside / "secret", self.root / "a" / "b" / "leaf")
        os.symlink(self.outside / "sub", self.root / "a" / "mid")
        os.symlink(self.outside, self.root / "top")
        self.before = self.snapshot()

    def snapshot(self) -> dict[str, bytes]:
        """Every file under ``outside`` with its contents."""
        out = {}
        for dirpath, _dirs, files in os.walk(self.outside):
            for name in files:
                p = os.path.join(dirpath, name)
                with open(p, "rb") as f:
                    out[os.path.relpath(p, self.outside)] = f.read()
        return out

    def assert_outside_untouched(self) -> None:
        assert self.snapshot() == self.before


@pytest.fixture
def tree(tmp_path: Path) -> Tree:
    return Tree(tmp_path)


@pytest.fixture(params=["openat2", "portable"])
def lookup(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which lookup the jails of this test use; set through the environment, as an operator would."""
    if request.param == "openat2":
        if not openat2_available():
            pytest.skip("this kernel has no usable openat2 (the portable walk is tested)")
        monkeypatch.delenv(PORTABLE_ENV, raising=False)
    else:
        monkeypatch.setenv(PORTABLE_ENV, "1")
    return str(request.param)


@pytest.fixture
def jail(tree: Tree, lookup: str) -> Iterator[Jail]:
    j = Jail(str(tree.root))
    assert j.uses_openat2 == (lookup == "openat2")
    yield j
    j.close()


@pytest.fixture
def ops(tree: Tree, lookup: str) -> Iterator[FsOps]:
    state = TreeState(str(tree.root), writable=False)
    o = FsOps(str(tree.root), state)
    assert o.jail.uses_openat2 == (lookup == "openat2")
    yield o
    o.close()
    state.close()


def swap_for_symlink(where: Path, target: Path) -> Path:
    """Rename directory ``where`` away (it stays inside the root) and put a symlink to ``target`` in its place."""
    moved = where.with_name(where.name + ".old")
    os.rename(where, moved)
    os.symlink(target, where)
    return moved


# ---- choosing the lookup --------------------------------------------------------------------


def test_portable_walk_forced_by_the_environment(tree: Tree, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PORTABLE_ENV, "1")
    with Jail(str(tree.root)) as j:
        assert not j.uses_openat2
        fd = j.open_file("a/b/f")
        os.close(fd)
    monkeypatch.setenv(PORTABLE_ENV, "0")
    with Jail(str(tree.root)) as j:
        assert j.uses_openat2 == openat2_available()
    with Jail(str(tree.root), portable=True) as j:
        assert not j.uses_openat2


def test_portable_walk_used_when_openat2_is_missing(tree: Tree, monkeypatch: pytest.MonkeyPatch) -> None:
    """As on macOS or a kernel before 5.6: the run-time choice falls back to the walk."""
    monkeypatch.delenv(PORTABLE_ENV, raising=False)
    monkeypatch.setattr(_paths, "_openat2_probed", True)
    monkeypatch.setattr(_paths, "_openat2_fn", None)
    assert not openat2_available()
    with Jail(str(tree.root)) as j:
        assert not j.uses_openat2
        with pytest.raises(PathError):
            j.open_file("a/mid/secret")


def test_openat2_used_where_the_kernel_has_it(tree: Tree, monkeypatch: pytest.MonkeyPatch) -> None:
    if not openat2_available():
        pytest.skip("this kernel has no usable openat2")
    monkeypatch.delenv(PORTABLE_ENV, raising=False)
    with Jail(str(tree.root)) as j:
        assert j.uses_openat2
        fd = j.open_file(["a", "b", "f"])
        try:
            assert os.read(fd, 100) == b"inside"
        finally:
            os.close(fd)


# ---- symlinks leading outside, at every position ------------------------------------------------


@pytest.mark.parametrize("where", THROUGH)
def test_jail_reads_through_a_symlink_are_refused(tree: Tree, jail: Jail, where: str) -> None:
    path = THROUGH[where]
    with pytest.raises(PathError):
        jail.open_file(path)
    with pytest.raises(PathError):
        jail.open_read(path)
    with pytest.raises(PathError):
        jail.open_cached(path)
    parent = path.rpartition("/")[0]
    if where != "leaf":
        with pytest.raises(PathError):
            jail.open_dir(parent)
        with pytest.raises(PathError):
            jail.dir_fd(parent)


@pytest.mark.parametrize("where", THROUGH)
def test_jail_creates_through_a_symlink_are_refused(tree: Tree, jail: Jail, where: str) -> None:
    path = CREATE[where]
    with pytest.raises(PathError):
        jail.open_file(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with pytest.raises(PathError):
        jail.open_dir(path + "/newdir", create=True)
    if where != "leaf":
        with pytest.raises(PathError):
            with jail.parent(path, create=True):
                pass
    tree.assert_outside_untouched()
    assert not (tree.outside / "sub" / "new").exists()


@pytest.mark.parametrize("where", ["root-child", "middle"])
def test_jail_renames_and_deletes_through_a_symlink_are_refused(tree: Tree, jail: Jail, where: str) -> None:
    with pytest.raises(PathError):
        with jail.parent(THROUGH[where]):
            pass
    tree.assert_outside_untouched()


def test_jail_leaf_symlink_is_renamed_and_deleted_itself(tree: Tree, jail: Jail) -> None:
    """A symlink as the last component is what a rename or delete acts on (never its target)."""
    with jail.parent("a/b/leaf") as (dfd, name, rel):
        assert (name, rel) == ("leaf", "a/b/leaf")
        os.rename(name, "leaf2", src_dir_fd=dfd, dst_dir_fd=dfd)
        os.unlink("leaf2", dir_fd=dfd)
    assert not os.path.lexists(tree.root / "a" / "b" / "leaf")
    tree.assert_outside_untouched()


@pytest.mark.parametrize("where", THROUGH)
def test_fs_ops_through_a_symlink_are_refused(tree: Tree, ops: FsOps, where: str) -> None:
    """The fs session's reads, creates, renames and deletes, each through the symlink at ``where``."""
    path, new = THROUGH[where], CREATE[where]
    with pytest.raises(PathError):
        ops.cat(path)
    with pytest.raises(PathError):
        ops.put(new, b"x")
    with pytest.raises(PathError):
        ops.touch(new)
    with pytest.raises(PathError):
        ops.copy("a/b/f", new)
    with pytest.raises(PathError):
        ops.move("a/b/f", new if where != "leaf" else "a/mid/moved")
    with pytest.raises(PathError):
        ops.wopen(1, new)
    if where != "leaf":  # the leaf link itself may be renamed and removed (below)
        with pytest.raises(PathError):
            ops.move(path, "a/b/taken")
        with pytest.raises(PathError):
            ops.rm([path])
        with pytest.raises(PathError):
            ops.mkdir(new + "dir")
    tree.assert_outside_untouched()
    assert (tree.root / "a" / "b" / "f").read_bytes() == b"inside"


def test_fs_leaf_symlink_is_moved_and_removed_itself(tree: Tree, ops: FsOps) -> None:
    ops.move("a/b/leaf", "a/leaf2")
    assert os.path.islink(tree.root / "a" / "leaf2")
    ops.rm(["a/leaf2"])
    ops.rm(["top"], recursive=True)  # a link to a directory outside: the link goes, not the directory
    assert not os.path.lexists(tree.root / "top")
    tree.assert_outside_untouched()


def test_sender_reads_through_a_symlink_are_refused(tree: Tree, lookup: str) -> None:
    from tb5sync.tree.options import SyncOptions

    s = Sender(str(tree.root), SyncOptions())
    try:
        for path in THROUGH.values():
            with pytest.raises(PathError):
                s._open(path)
        fd = s._open("a/b/f")
        os.close(fd)
    finally:
        s.close()


# ---- '..' and absolute paths --------------------------------------------------------------------

DOTDOT = ["..", "../outside/secret", "a/../../outside/secret", "a/b/../../..", "a/.."]


@pytest.mark.parametrize("path", DOTDOT)
def test_dotdot_is_refused_everywhere(tree: Tree, jail: Jail, path: str) -> None:
    with pytest.raises(PathError):
        jail.open_file(path)
    with pytest.raises(PathError):
        jail.open_dir(path)
    with pytest.raises(PathError):
        jail.open_dir(path.split("/"))
    with pytest.raises(PathError):
        jail.open_file(path.split("/"))
    with pytest.raises(PathError):
        jail.open_cached(path)
    with pytest.raises(PathError):
        jail.dir_fd(path)
    with pytest.raises(PathError):
        jail.resolve(path)
    with pytest.raises(PathError):
        with jail.parent(path, create=True):
            pass
    with pytest.raises(PathError):
        jail.open_file(path + "/x", os.O_WRONLY | os.O_CREAT, 0o644)
    tree.assert_outside_untouched()


@pytest.mark.parametrize("path", ["/etc/passwd", "a/\0b", ""])
def test_absolute_nul_and_empty_components_are_refused(tree: Tree, jail: Jail, path: str) -> None:
    with pytest.raises(PathError):
        jail.open_dir(path.split("/"))  # "" -> [""], "/etc" -> ["", "etc"]
    if path:
        with pytest.raises(PathError):
            jail.open_file(path)


@pytest.mark.parametrize("path", DOTDOT + ["/etc/passwd"])
def test_fs_ops_refuse_dotdot(tree: Tree, ops: FsOps, path: str) -> None:
    for call in (
        lambda: ops.cat(path),
        lambda: ops.put(path + "/x", b"x"),
        lambda: ops.move("a/b/f", path + "/x"),
        lambda: ops.move(path, "a/x"),
        lambda: ops.rm([path]),
        lambda: ops.mkdir(path + "/d"),
    ):
        with pytest.raises(PathError):
            call()
    tree.assert_outside_untouched()


# ---- a directory swapped for a symlink between (and inside) operations ---------------------------


def test_swap_between_operations_does_not_escape(tree: Tree, jail: Jail) -> None:
    """Open a directory, swap it for a symlink leading outside, go on: nothing lands outside."""
    os.makedirs(tree.root / "d")
    (tree.root / "d" / "f").write_bytes(b"in d")
    with jail.parent("d/new") as (dfd, name, _):
        moved = swap_for_symlink(tree.root / "d", tree.outside)
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dfd)  # lands in the moved dir
        os.close(fd)
    assert (moved / "new").exists()
    assert not (tree.outside / "new").exists()
    for later in (
        lambda: jail.open_file("d/secret"),
        lambda: jail.open_read("d/secret"),
        lambda: jail.open_dir("d/sub"),
        lambda: jail.open_file("d/new2", os.O_WRONLY | os.O_CREAT, 0o644),
        lambda: jail.parent("d/secret").__enter__(),
    ):
        with pytest.raises(PathError):
            later()
    tree.assert_outside_untouched()


def test_swap_between_cached_opens_does_not_escape(tree: Tree, jail: Jail) -> None:
    """The sender's cache keeps the directory it opened; a fresh walk refuses the symlink."""
    os.makedirs(tree.root / "d")
    (tree.root / "d" / "f").write_bytes(b"in d")
    os.close(jail.open_cached("d/f"))  # "d" is now cached
    swap_for_symlink(tree.root / "d", tree.outside)
    fd = jail.open_cached("d/f")  # through the cached descriptor: the moved directory, inside the root
    try:
        assert os.read(fd, 100) == b"in d"
    finally:
        os.close(fd)
    with pytest.raises(FileNotFoundError):
        jail.open_cached("d/secret")  # not outside/secret
    for i in range(70):  # fill the cache until "d" is dropped and walked again
        os.makedirs(tree.root / "many" / str(i))
        jail.dir_fd(f"many/{i}")
    with pytest.raises(PathError):
        jail.open_cached("d/secret")
    tree.assert_outside_untouched()


def test_swap_between_resolve_and_walk_is_refused(tree: Tree, ops: FsOps, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check (resolve) passes, then the directory becomes a symlink before the walk: refused."""
    os.makedirs(tree.root / "d")
    (tree.root / "d" / "f").write_bytes(b"in d")
    (tree.outside / "f").write_bytes(b"OUTSIDE F")
    tree.before = tree.snapshot()
    real = ops.jail.resolve
    real_literal = ops.jail.literal
    swapped: list[bool] = []

    def swap_once() -> None:
        if not swapped:
            swapped.append(True)
            swap_for_symlink(tree.root / "d", tree.outside)

    def resolve_then_swap(path: str, *, follow: bool = False) -> list[str]:
        parts = real(path, follow=follow)
        swap_once()
        return parts

    def literal_then_swap(path: str) -> list[str]:  # the lookups that try the path as written first
        parts = real_literal(path)
        swap_once()
        return parts

    calls: list[Any] = [
        lambda: ops.cat("d/f"),
        lambda: ops.info("d/f"),
        lambda: ops.put("d/f", b"overwritten"),
        lambda: ops.touch("d/f"),
        lambda: ops.move("d/f", "moved"),
        lambda: ops.rm(["d/f"]),
        lambda: ops.copy("a/b/f", "d/f"),
    ]
    for call in calls:
        swapped.clear()
        if os.path.islink(tree.root / "d"):  # undo the previous swap
            os.unlink(tree.root / "d")
            os.rename(tree.root / "d.old", tree.root / "d")
        monkeypatch.setattr(ops.jail, "resolve", resolve_then_swap)
        monkeypatch.setattr(ops.jail, "literal", literal_then_swap)
        with pytest.raises(PathError):
            call()
        monkeypatch.undo()
        assert swapped
        tree.assert_outside_untouched()
    assert (tree.root / "d.old" / "f").read_bytes() == b"in d"


def test_a_file_where_a_directory_is_expected(tree: Tree, jail: Jail) -> None:
    """Not a symlink: the plain OSError, the same from both lookups."""
    with pytest.raises(NotADirectoryError):
        jail.open_file("a/b/f/x")
    with pytest.raises(NotADirectoryError):
        jail.open_dir("a/b/f", create=True)
    with pytest.raises(FileNotFoundError):
        jail.open_file("a/nothing/x")
    fd = jail.open_dir("a/new/deeper", create=True)
    os.close(fd)
    assert (tree.root / "a" / "new" / "deeper").is_dir()


def test_request_paths_through_symlinks_inside_the_root(tree: Tree, ops: FsOps) -> None:
    """info and cat take a path as written when nothing on it is a symlink, and resolve the ones
    that go through a symlink inside the root (a parent or the last component) as before; a
    symlink leading outside is refused at every position, whichever lookup runs first."""
    os.symlink("a/b", tree.root / "inner")  # a parent symlink inside the root
    os.symlink("f", tree.root / "a" / "b" / "again")  # a last component inside the root
    assert ops.info("a/b/f")["info"]["size"] == 6
    assert ops.info("inner/f")["info"]["name"] == "inner/f"
    meta, parts = ops.cat("inner/f")
    close_parts(parts)
    assert meta["size"] == 6
    assert ops.info("inner/again")["info"]["islink"] is True
    meta, parts = ops.cat("inner/again")
    close_parts(parts)
    assert meta["size"] == 6
    for path in ("top/secret", "a/mid/secret", "a/b/leaf", "inner/leaf"):
        with pytest.raises(PathError):
            ops.cat(path)
    with pytest.raises(PathError):
        ops.info("top/secret")
    with pytest.raises(PathError, match="own state"):
        ops.info(".tb5sync/x")
    tree.assert_outside_untouched()


# ---- listings and writes take the path as written first: a swap at each step --------------------


def _restore_d(tree: Tree) -> None:
    if os.path.islink(tree.root / "d"):
        os.unlink(tree.root / "d")
        os.rename(tree.root / "d.old", tree.root / "d")


@pytest.mark.parametrize("at_call", [1, 2, 3])
def test_swap_during_listing_and_write_lookups_never_escapes(tree: Tree, ops: FsOps, monkeypatch: pytest.MonkeyPatch,
                                                           at_call: int) -> None:
    """``ls``, ``find``, ``wopen``, ``mkdir``, ``rmdir`` (and the writes of the test above) look the
    path up as written first. The directory on the path becomes a symlink leading outside at the
    ``at_call``-th look at the path (before the info, between the info and the open, later):
    every call is refused, or lists/acts on the link itself; nothing outside is read or written."""
    os.makedirs(tree.root / "d" / "e")
    (tree.root / "d" / "f").write_bytes(b"in d")
    (tree.outside / "f").write_bytes(b"OUTSIDE F")
    (tree.outside / "e").mkdir()
    tree.before = tree.snapshot()
    real_literal = ops.jail.literal
    seen: list[int] = []

    def literal_then_swap(path: str) -> list[str]:
        parts = real_literal(path)
        seen.append(1)
        if len(seen) == at_call:
            swap_for_symlink(tree.root / "d", tree.outside)
        return parts

    calls: dict[str, Any] = {
        "ls": lambda: ops.ls("d"),
        "find": lambda: ops.find("d", withdirs=True),
        "wopen": lambda: ops.wopen(7, "d/new"),
        "wopen-over": lambda: ops.wopen(8, "d/f"),
        "mkdir": lambda: ops.mkdir("d/newdir"),
        "rmdir": lambda: ops.rmdir("d/e"),
        "put-mkdirs": lambda: ops.put("d/x/y", b"deep", mkdirs=True),
    }
    for name, call in calls.items():
        seen.clear()
        _restore_d(tree)
        monkeypatch.setattr(ops.jail, "literal", literal_then_swap)
        try:
            got = call()
        except (PathError, FileNotFoundError, NotADirectoryError):
            got = None
        finally:
            monkeypatch.undo()
        if got and "entries" in got:  # listed after the swap: only the link itself, never what it leads to
            names = {e["name"] for e in got["entries"]}
            assert names <= {"d", "d/e", "d/f"}, (name, names)
        assert at_call > 1 or os.path.islink(tree.root / "d"), name  # the swap happened
        if any(h in ops._writes for h in (7, 8)):
            for h in (7, 8):
                if h in ops._writes:
                    try:
                        ops.wwrite(h, b"through the link?")
                        ops.wclose(h, commit=True)
                    except (PathError, OSError):
                        ops.wclose(h, commit=False)
        tree.assert_outside_untouched()
        assert not (tree.outside / "new").exists() and not (tree.outside / "newdir").exists()
        assert (tree.outside / "e").is_dir() and not (tree.outside / "x").exists()
    _restore_d(tree)
    assert (tree.root / "d" / "f").read_bytes() in (b"in d", b"through the link?")


def test_a_last_component_swapped_for_a_symlink_after_its_check_is_replaced_not_followed(
        tree: Tree, ops: FsOps, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write through a final symlink checks the name (``lstat``) before it writes: a file swapped
    for a link leading outside right after that check is replaced by the new file (rename over the
    link), never written through."""
    (tree.root / "a" / "b" / "g").write_bytes(b"old g")
    real_stat = os.stat
    done: list[bool] = []

    def stat_then_swap(path: Any, *args: Any, **kwargs: Any) -> Any:
        st = real_stat(path, *args, **kwargs)
        if path == "g" and kwargs.get("dir_fd") is not None and not done:
            done.append(True)
            os.unlink(tree.root / "a" / "b" / "g")
            os.symlink(tree.outside / "secret", tree.root / "a" / "b" / "g")
        return st

    for call in (lambda: ops.put("a/b/g", b"new g"), lambda: ops.touch("a/b/g")):
        done.clear()
        if os.path.islink(tree.root / "a" / "b" / "g"):
            os.unlink(tree.root / "a" / "b" / "g")
            (tree.root / "a" / "b" / "g").write_bytes(b"old g")
        monkeypatch.setattr(_paths.os, "stat", stat_then_swap)
        try:
            call()
        except (PathError, OSError):
            pass
        finally:
            monkeypatch.undo()
        assert done
        tree.assert_outside_untouched()
