"""The destination directory against rsync 3.x: "created directory DST" (-v, -i, -n), the
missing-parent rule (exit 11, a single file's missing directory exit 3) and ``--mkpath``
("created N directories for DST"), local, pull and push, each compared with rsync on the same
layout in the test (exit code, the lines printed, the resulting tree).

rsync runs in a directory of its own with the destination written relative to it, as the CLI
does in another one, and as a push names it (the URL's path, relative to the server's ROOT):
rsync names the destination as it was given.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
from conftest import assert_same, digest_snapshot, slurp
from test_options_vs_rsync import ITEM
from test_vs_rsync import T0, cp_a, write

import tb5sync
from tb5sync.errors import MissingDirectoryError, MissingParentError

pytestmark = pytest.mark.usefixtures("need_rsync")


def _lines(stdout: str) -> list[str]:
    """The created-directory lines and the itemized lines of a run (a push's ``<f`` as ``>f``)."""
    out = []
    for ln in stdout.splitlines():
        if ln.startswith("created ") or ITEM.match(ln):
            out.append(">" + ln[1:] if ln.startswith("<f") else ln)
    return out


def _src(base: str) -> None:
    write(os.path.join(base, "a"), b"alpha\n", 0o644, T0)
    write(os.path.join(base, "sub", "b"), b"beta\n", 0o600, T0 + 7)
    os.utime(os.path.join(base, "sub"), ns=(T0, T0))
    os.utime(base, ns=(T0, T0))


CASES = [
    # (source spec, destination spec, --mkpath, -n)
    ("src/", "new", False, False),
    ("src", "new", False, False),
    ("src/a", "new/", False, False),
    ("src/a", "newfile", False, False),
    ("src/", "p/q/d", False, False),
    ("src/", "p/q/d", False, True),
    ("src/a", "p/q/f", False, False),
    ("src/a", "p/q/f", False, True),
    ("src/a", "p/q/d/", False, False),
    ("src/", "p/q/d", True, False),
    ("src", "p/q/d", True, False),
    ("src/", "p/q/d", True, True),
    ("src/a", "p/x/f", True, False),
    ("src/a", "p/x/d/", True, False),
    ("src/a", "p/x/f", True, True),
    ("src/", "new", True, False),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("src_spec,dst_spec,mkpath,dry", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_destination_directory_like_rsync(tmp_path: Any, server: Any, src_spec: str, dst_spec: str, mkpath: bool, dry: bool) -> None:
    src_root = str(tmp_path / "work")
    _src(os.path.join(src_root, "src"))
    cp_a(os.path.join(src_root, "src"), os.path.join(server.root, "src"))  # the pull's source
    flags = ["-i", *(["--mkpath"] if mkpath else []), *(["-n"] if dry else [])]
    top = dst_spec.split("/")[0]
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    ref = subprocess.run(["rsync", "-a", *flags, os.path.join(src_root, src_spec), dst_spec], cwd=ref_dir,
                         capture_output=True, text=True, timeout=60, check=False)
    assert ref.returncode in (0, 3, 11), ref.stderr
    parts = dst_spec.rstrip("/").split("/")
    dirs_made_now = ["/".join(parts[1:k]) for k in range(1, len(parts) + 1)]  # mtimes: the time of the run
    want_tree = digest_snapshot(str(ref_dir / top), dirs_made_now) if os.path.lexists(ref_dir / top) else None

    routes = {"local": (os.path.join(src_root, src_spec), dst_spec, tmp_path / "local"),
              "pull": (server.url(src_spec), dst_spec, tmp_path / "pull"),
              "push": (os.path.join(src_root, src_spec), server.url(dst_spec), tmp_path / "push")}
    for route, (a, b, cwd) in routes.items():
        cwd.mkdir()
        got = subprocess.run([sys.executable, "-m", "tb5sync.cli", "sync", *flags, a, b], cwd=cwd,
                             capture_output=True, text=True, timeout=60, check=False)
        assert got.returncode == ref.returncode, (route, got.stderr, ref.stderr)
        assert sorted(_lines(got.stdout)) == sorted(_lines(ref.stdout)), (route, got.stdout, ref.stdout)
        if ref.returncode:  # rsync's words, and the new option named
            assert "failed: No such file or directory (2)" in got.stderr and "--mkpath" in got.stderr, got.stderr
            assert len(got.stderr.strip().splitlines()) == 1, got.stderr
        where = os.path.join(server.root, top) if route == "push" else str(cwd / top)
        got_tree = digest_snapshot(where, dirs_made_now) if os.path.lexists(where) else None
        if want_tree is None or got_tree is None:
            assert got_tree == want_tree, route
        else:
            assert_same(want_tree, got_tree, route)


@pytest.mark.timeout(60)
def test_api_keeps_making_parents_and_takes_mkpath_false(tmp_path: Any, server: Any) -> None:
    """The Python API creates missing parents by default (as it always did), on every route, else as
    rsync without --mkpath; ``mkpath=True`` is rsync's --mkpath; ``mkpath=False`` applies rsync's
    rule and raises before writing anything."""
    src = str(tmp_path / "src")
    _src(src)
    cp_a(src, os.path.join(server.root, "src"))
    for dst in (str(tmp_path / "l" / "x" / "d"), server.url("p/x/d")):
        st = tb5sync.sync(src + "/", dst)
        assert st.files_transferred == 2 and st.created == (f"created directory {dst.split('/', 3)[-1] if '://' in dst else dst}",)
    st = tb5sync.sync(src + "/", str(tmp_path / "k" / "x" / "d"), mkpath=True, itemize_changes=True)  # rsync --mkpath's
    assert st.created == (f"created 3 directories for {tmp_path / 'k' / 'x' / 'd'}",) and ".d..t...... ./" in st.itemized
    st = tb5sync.sync(server.url("src/"), str(tmp_path / "pl" / "x" / "d"))
    assert st.files_transferred == 2 and os.path.isfile(tmp_path / "pl" / "x" / "d" / "sub" / "b")
    for dst in (str(tmp_path / "m" / "x" / "d"), server.url("m/x/d")):
        with pytest.raises(MissingParentError, match='mkdir ".*m/x/d" failed.*--mkpath') as ei:
            tb5sync.sync(src + "/", dst, mkpath=False)
        assert ei.value.exit_code == 11
    with pytest.raises(MissingParentError, match="--mkpath"):
        tb5sync.sync(server.url("src/"), str(tmp_path / "m2" / "x" / "d"), mkpath=False)
    with pytest.raises(MissingDirectoryError, match='change_dir ".*m/x" failed') as ej:
        tb5sync.sync(src + "/a", server.url("m/x/f"), mkpath=False)
    assert ej.value.exit_code == 3
    assert not os.path.exists(tmp_path / "m") and not os.path.exists(os.path.join(server.root, "m"))
    assert not os.path.exists(tmp_path / "m2")
    with pytest.raises(TypeError, match="mkpath"):
        tb5sync.sync(src + "/", str(tmp_path / "n"), mkpath="yes")  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_fsspec_put_into_missing_directory_as_local_filesystem(tmp_path: Any, server: Any) -> None:
    """The ``tb5://`` filesystem keeps fsspec's LocalFileSystem behaviour (unchanged by ``--mkpath``):
    ``put`` into a missing directory raises FileNotFoundError; after ``makedirs`` it works."""
    import fsspec
    from conftest import tb5fs

    f = tmp_path / "f"
    f.write_bytes(b"hi")
    local = fsspec.filesystem("file")
    with pytest.raises(FileNotFoundError):
        local.put(str(f), str(tmp_path / "x" / "y" / "f"))
    fs = tb5fs(server)
    with pytest.raises(FileNotFoundError):
        fs.put(str(f), "/x/y/f")
    assert not os.path.exists(os.path.join(server.root, "x"))
    fs.makedirs("/x/y", exist_ok=True)
    fs.put(str(f), "/x/y/f")
    assert slurp(os.path.join(server.root, "x", "y", "f")) == b"hi"


FILE_CASES = [
    # (source spec, destination spec, --mkpath, -n): "afile" is an existing regular file
    ("src/", "afile", False, False),
    ("src", "afile", False, False),
    ("src/", "afile", False, True),
    ("empty/", "afile", False, False),
    ("src/", "afile/", False, False),
    ("src/a", "afile/", False, False),
    ("src/", "afile/sub", False, False),
    ("src/a", "afile/x", False, False),
    ("src/a", "afile/x/", False, True),
    ("src/", "afile/sub", True, False),
    ("src/a", "afile", False, False),  # a single file onto a file: replaced, exit 0
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("src_spec,dst_spec,mkpath,dry", FILE_CASES, ids=["-".join(map(str, c)) for c in FILE_CASES])
def test_destination_is_a_file_like_rsync(tmp_path: Any, server: Any, src_spec: str, dst_spec: str, mkpath: bool,
                                          dry: bool) -> None:
    """A regular file where the sync needs a directory (the destination itself for a directory
    source, or a directory on its path): rsync's exit code (3, or 11 when --mkpath's mkdir fails),
    one line in rsync's words, and the file left as it was; a single file onto a file replaces it."""
    src_root = str(tmp_path / "work")
    _src(os.path.join(src_root, "src"))
    os.makedirs(os.path.join(src_root, "empty"))
    cp_a(os.path.join(src_root, "src"), os.path.join(server.root, "src"))  # the pull's source
    os.makedirs(os.path.join(server.root, "empty"))
    flags = ["-i", *(["--mkpath"] if mkpath else []), *(["-n"] if dry else [])]
    places = {"ref": tmp_path / "ref", "local": tmp_path / "local", "pull": tmp_path / "pull", "push": tmp_path / "push"}
    for where in [*places.values(), server.root]:
        os.makedirs(where, exist_ok=True)
        write(os.path.join(where, "afile"), b"the destination's own file\n", 0o644, T0)
    ref = subprocess.run(["rsync", "-a", *flags, os.path.join(src_root, src_spec), dst_spec], cwd=places["ref"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert ref.returncode in (0, 3, 11), ref.stderr
    want = slurp(str(places["ref"] / "afile"))
    routes = {"local": (os.path.join(src_root, src_spec), dst_spec),
              "pull": (server.url(src_spec), dst_spec),
              "push": (os.path.join(src_root, src_spec), server.url(dst_spec))}
    for route, (a, b) in routes.items():
        got = subprocess.run([sys.executable, "-m", "tb5sync.cli", "sync", *flags, a, b], cwd=places[route],
                             capture_output=True, text=True, timeout=60, check=False)
        assert got.returncode == ref.returncode, (route, got.stderr, ref.stderr)
        where = os.path.join(server.root, "afile") if route == "push" else str(places[route] / "afile")
        assert slurp(where) == want, route
        assert sorted(os.listdir(os.path.dirname(where))) == sorted(os.listdir(places["ref"])) or route == "push", route
        if ref.returncode == 3:  # rsync's words for the same case, on one line naming the destination
            words = ("cannot stat destination", "Not a directory (20)") if "cannot stat" in ref.stderr else \
                    ("destination must be a directory",)
            assert all(w in got.stderr for w in words) and "afile" in got.stderr, (route, got.stderr, ref.stderr)
            assert len(got.stderr.strip().splitlines()) == 1, got.stderr
        elif ref.returncode:  # --mkpath: rsync's mkdir failure
            assert 'mkdir "' in got.stderr and "failed: Not a directory (20)" in got.stderr, (route, got.stderr)
            assert len(got.stderr.strip().splitlines()) == 1, got.stderr


@pytest.mark.timeout(60)
def test_api_destination_is_a_file_raises_exit_3(tmp_path: Any, server: Any) -> None:
    """The Python API raises :class:`DestinationNotADirectoryError` (exit 3, also a
    ``NotADirectoryError``) on every route, before writing anything."""
    from tb5sync.errors import DestinationNotADirectoryError

    src = str(tmp_path / "src")
    _src(src)
    cp_a(src, os.path.join(server.root, "src"))
    for where in (str(tmp_path), server.root):
        write(os.path.join(where, "afile"), b"mine", 0o644, T0)
    for a, b in ((src + "/", str(tmp_path / "afile")), (src, server.url("afile")),
                 (server.url("src/"), str(tmp_path / "afile")), (src + "/a", server.url("afile/x"))):
        with pytest.raises(DestinationNotADirectoryError) as ei:
            tb5sync.sync(a, b)
        assert ei.value.exit_code == 3 and isinstance(ei.value, NotADirectoryError), (a, b)
    assert slurp(str(tmp_path / "afile")) == b"mine" and slurp(os.path.join(server.root, "afile")) == b"mine"
