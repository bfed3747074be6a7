"""Names are bytes, as rsync treats them: a name that is not valid UTF-8, a name of 255 bytes in
any script, symlink targets alike, on local, push and pull, compared with ``rsync -a``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import pytest
from conftest import local_agrees_with_rsync
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_vs_rsync import T0, Harness, rsync, write

import tb5sync
from tb5sync._os.paths import NAME_MAX, is_temp_name, temp_name
from tb5sync.tree.entry import Entry, path_from_wire, path_to_wire, show_path


def fsname(raw: bytes) -> str:
    """The str Python's os functions use for the name ``raw`` (surrogate escapes where not UTF-8)."""
    return os.fsdecode(raw)


#: names as bytes: Latin-1 (not UTF-8), a lone continuation byte, 0xFF, and 255-byte names in
#: ASCII, two-byte, three-byte and four-byte scripts (the last one 252 bytes: 63 characters).
NAMES = [
    b"caf\xe9.txt",
    b"in\x80between",
    b"\xff",
    b"a" * 255,
    "é".encode() * 127 + b"e",
    "日".encode() * 85,
    "😀".encode() * 63,
]


pytestmark = pytest.mark.usefixtures("need_rsync")  # conftest: skipped without rsync



def _names_tree(src: str, salt: bytes) -> None:
    for i, raw in enumerate(NAMES):
        assert len(raw) <= NAME_MAX
        write(os.path.join(src, fsname(raw)), salt + raw, 0o644, T0 + i)
    d = os.path.join(src, fsname(b"dir\xe9"))
    write(os.path.join(d, fsname(b"inner\xfe.bin")), salt * 100, 0o600, T0)
    write(os.path.join(d, fsname("ü".encode() * 127)), os.urandom(5 * 1024 * 1024), 0o644, T0)  # a large file
    os.symlink(fsname(b"caf\xe9.txt"), os.path.join(src, fsname(b"link\xe9")))
    os.utime(os.path.join(src, fsname(b"link\xe9")), ns=(T0, T0), follow_symlinks=False)
    os.utime(d, ns=(T0, T0))


def test_names_as_bytes_like_rsync(h: Harness, tmp_path: Any) -> None:
    """A first copy, then an update of every file (temporary names beside 255-byte names), then
    ``--delete`` of entries with such names: each time the same tree as rsync's."""
    _names_tree(h.src, b"v1")
    h.run("src/", "dst")
    h.check()
    for raw in NAMES:  # second version: every file rewritten through a temporary name
        write(os.path.join(h.src, fsname(raw)), b"version two " + raw, 0o640, T0 + 99 * 10**9)
    os.unlink(os.path.join(h.src, fsname(b"\xff")))
    os.unlink(os.path.join(h.src, fsname(b"link\xe9")))
    os.utime(h.src, ns=(T0, T0))
    h.run("src/", "dst", delete=True)
    h.check()
    for r in ("local", "push", "pull"):
        assert h.stats[r].files_deleted == 2, r
        assert h.stats[r].files_transferred == len(NAMES) - 1, r


def test_cli_shows_escaped_names(tmp_path: Any) -> None:
    """``-n`` lists and ``--json`` carry a name that is not UTF-8 with a ``\\xNN`` escape."""
    src = str(tmp_path / "src")
    write(os.path.join(src, fsname(b"caf\xe9.txt")), b"x", 0o644, T0)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(tb5sync.__file__))}
    cmd = [sys.executable, "-m", "tb5sync.cli", "sync"]
    dry = subprocess.run([*cmd, "-n", src + "/", str(tmp_path / "dst")], capture_output=True, text=True, env=env, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert "caf\\xe9.txt" in dry.stdout.splitlines()
    js = subprocess.run([*cmd, "-n", "--json", src + "/", str(tmp_path / "dst")], capture_output=True, text=True, env=env, timeout=60)
    assert json.loads(js.stdout)["changes"]["transfer"] == ["caf\\xe9.txt"]


def test_wire_form_of_names() -> None:
    for raw in NAMES:
        name = fsname(raw)
        wire = path_to_wire(name)
        assert isinstance(wire, str if raw.decode("utf-8", "replace").encode() == raw else bytes)
        assert path_from_wire(wire) == name
        e = Entry(name, "l", 0o777, len(raw), -5, name)
        assert Entry.from_wire(e.to_wire()) == e
    assert show_path(fsname(b"caf\xe9")) == "caf\\xe9"


@pytest.mark.parametrize("raw", NAMES + ["é".encode() * 127 + b"x"], ids=range(len(NAMES) + 1))
def test_temp_name_fits_name_max(raw: bytes) -> None:
    """``.NAME.XXXXXXXX.tb5tmp`` stays within 255 bytes, cut at a character boundary, and is
    recognised as a temporary name (the filesystem accepts it)."""
    tmp = temp_name(fsname(raw))
    b = os.fsencode(tmp)
    assert len(b) <= NAME_MAX and is_temp_name(tmp)
    if raw.decode("utf-8", "replace").encode() == raw:  # valid UTF-8 stays valid
        b.decode("utf-8")
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, tmp), "wb"):
            pass


_byte_names = st.binary(min_size=1, max_size=255).filter(lambda b: b"/" not in b and b"\0" not in b and b not in (b".", b".."))


@settings(max_examples=20, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(names=st.lists(_byte_names, min_size=1, max_size=5, unique=True))
def test_property_any_byte_name_like_rsync(names: list[bytes]) -> None:
    """Any name the filesystem takes (bytes but ``/`` and NUL, up to 255) syncs as rsync -a syncs it."""
    with tempfile.TemporaryDirectory(prefix="tb5-names-") as tmp:
        src = os.path.join(tmp, "src")
        os.makedirs(src)
        for i, raw in enumerate(names):
            write(os.path.join(src, fsname(raw)), raw, 0o644, T0 + i)
        os.utime(src, ns=(T0, T0))
        local_agrees_with_rsync(src, tmp)
