"""The directory lister's twins (Cython ``cy``, pure-Python ``py``) give the same listings and scans."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import make_tree, require_cython

import tb5sync.tree.scan as m
from tb5sync.tree.excludes import ExcludeRules

pytestmark = pytest.mark.timeout(60)

Lister = Callable[[str], list[tuple[str, int, int, int]]]


@pytest.fixture(params=["cy", "py"])
def lister(request: pytest.FixtureRequest) -> Lister:
    """Each twin in turn; the Cython one skips when not built (fails under TB5SYNC_REQUIRE_CYTHON=1)."""
    if request.param == "py":
        return m.py_listdir_stat
    if m.cy_listdir_stat is None:
        if require_cython():
            pytest.fail("tb5sync._scan is not built but TB5SYNC_REQUIRE_CYTHON=1")
        pytest.skip("tb5sync._scan is not built")
    return m.cy_listdir_stat


@pytest.fixture
def odd_tree(tmp_path: Path) -> str:
    """make_tree plus a FIFO, a name that is not UTF-8, a hidden name, an empty dir and a 0-mode file."""
    base = make_tree(str(tmp_path / "t"), files=12)
    os.mkfifo(os.path.join(base, "fifo"))
    with open(os.path.join(os.fsencode(base), b"caf\xe9-latin1.txt"), "wb") as f:
        f.write(b"x")
    Path(base, ".hidden").write_bytes(b"h")
    os.makedirs(os.path.join(base, "d0", "nothing"))
    locked = Path(base, "locked.bin")
    locked.write_bytes(b"12345")
    locked.chmod(0)
    os.utime(locked, ns=(1, 1_234_567_891))
    return base


def reference(path: str) -> list[tuple[str, int, int, int]]:
    out = []
    for name in os.listdir(path):
        st = os.lstat(os.path.join(path, name))
        out.append((name, st.st_mode, st.st_size, st.st_mtime_ns))
    return sorted(out)


def test_listing_matches_lstat(lister: Lister, odd_tree: str) -> None:
    for d in (odd_tree, os.path.join(odd_tree, "d0"), os.path.join(odd_tree, "d0", "nothing")):
        assert sorted(lister(d)) == reference(d)
    names = [n for n, *_ in lister(odd_tree)]
    assert os.fsdecode(b"caf\xe9-latin1.txt") in names and "." not in names and ".." not in names


def test_twins_agree(odd_tree: str) -> None:
    if m.cy_listdir_stat is None:
        pytest.skip("tb5sync._scan is not built")
    for dirpath, _, _ in os.walk(odd_tree):
        assert sorted(m.cy_listdir_stat(dirpath)) == sorted(m.py_listdir_stat(dirpath))


@pytest.mark.parametrize(("what", "exc"), [("missing", FileNotFoundError), ("file", NotADirectoryError)])
def test_errors(lister: Lister, tmp_path: Path, what: str, exc: type[OSError]) -> None:
    path = tmp_path / "x"
    if what == "file":
        path.write_bytes(b"")
    with pytest.raises(exc) as info:
        lister(str(path))
    assert info.value.filename == str(path)


def test_scan_is_the_same_with_either_twin(lister: Lister, odd_tree: str, monkeypatch: pytest.MonkeyPatch) -> None:
    want = m.scan(odd_tree)
    monkeypatch.setattr(m, "listdir_stat", lister)
    got = m.scan(odd_tree)
    assert got == want
    assert "fifo" not in {e.path for e in got}  # special files are skipped (with a warning)
    rules = ExcludeRules(("*.bin", "d1/"))
    assert m.scan(odd_tree, rules) == [e for e in want if not e.path.endswith(".bin") and not e.path.startswith("d1")]
    tree = m.scan_tree(odd_tree)
    assert tree.entries == want


def test_scan_order_is_by_name(odd_tree: str) -> None:
    tree = m.scan_tree(odd_tree)
    for d, kids in tree.children.items():
        names = [e.path.rpartition("/")[2] for e in kids]
        assert names == sorted(names), d


def test_listers_take_a_descriptor(tmp_path: Path) -> None:
    """Both twins list a directory given by descriptor the same as by path, and leave the descriptor open."""
    import tb5sync.tree.scan as scan_mod

    (tmp_path / "a").write_bytes(b"abc")
    (tmp_path / "sub").mkdir()
    os.symlink("a", tmp_path / "l")
    listers = [scan_mod.py_listdir_stat] + ([scan_mod.cy_listdir_stat] if scan_mod.cy_listdir_stat is not None else [])
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for lister in listers:
            by_fd = sorted(lister(fd))
            assert by_fd == sorted(lister(str(tmp_path)))
            assert [n for n, *_ in by_fd] == ["a", "l", "sub"]
            assert sorted(lister(fd)) == by_fd  # listed again from the start: the descriptor is left as it was
        os.fstat(fd)  # still open
    finally:
        os.close(fd)
