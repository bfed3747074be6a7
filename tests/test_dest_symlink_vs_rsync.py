"""A destination that is a symlink to a directory is that directory, as rsync takes it.

``rsync -a src/ link/`` (and ``link`` without the slash, and ``src link``) write into the
directory the link points to and leave the link itself in place; tb5sync refused it ("the
destination root itself cannot be replaced") locally and on a pull.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import start_server

import tb5sync


def _tree(base: Path) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for d, dirs, files in os.walk(base):
        for n in dirs:
            out[os.path.relpath(os.path.join(d, n), base)] = None
        for n in files:
            p = os.path.join(d, n)
            out[os.path.relpath(p, base)] = Path(p).read_bytes()
    return out


@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync is not installed")
@pytest.mark.parametrize("spec", [("src/", "link/"), ("src/", "link"), ("src", "link"), ("src", "link/")])
@pytest.mark.parametrize("route", ["local", "pull"])
def test_destination_symlink_to_a_directory(tmp_path: Path, route: str, spec: tuple[str, str]) -> None:
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "f").write_bytes(b"f")
    (src / "g").write_bytes(b"g")
    got: dict[str, dict[str, bytes | None]] = {}
    for tool in ("rsync", "tb5sync"):
        work = tmp_path / tool
        (work / "real").mkdir(parents=True)
        os.symlink("real", work / "link")
        dst = str(work / spec[1].rstrip("/")) + ("/" if spec[1].endswith("/") else "")
        s = str(tmp_path / spec[0].rstrip("/")) + ("/" if spec[0].endswith("/") else "")
        if tool == "rsync":
            subprocess.run(["rsync", "-a", s, dst], check=True, capture_output=True, timeout=60)
        elif route == "local":
            tb5sync.sync(s, dst)
        else:
            live = start_server(str(tmp_path))
            try:
                tb5sync.sync(live.url(spec[0]), dst)
            finally:
                live.server.stop()
        assert os.path.islink(work / "link"), tool  # the link stays a link
        got[tool] = _tree(work / "real")
    assert got["tb5sync"] == got["rsync"]
    assert got["rsync"]  # the scenario wrote something


@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync is not installed")
@pytest.mark.parametrize("rules", [["- *.log"], ["*.tmp", "!", "- *.log"], ["- a/", "x"], ["!"]])
def test_exclude_option_prefixes_as_rsync_reads_them(tmp_path: Path, rules: list[str]) -> None:
    """``--exclude '- PAT'`` is the exclude rule PAT and ``--exclude '!'`` clears the list, as
    rsync reads its --exclude options (the trees compared with rsync's)."""
    src = tmp_path / "src"
    for p in ("a/f.log", "a/g.tmp", "b.log", "c.tmp", "x", "- b.log"):
        (src / p).parent.mkdir(parents=True, exist_ok=True)
        (src / p).write_bytes(p.encode())
    for tool in ("rsync", "tb5sync"):
        dst = tmp_path / tool
        if tool == "rsync":
            subprocess.run(["rsync", "-a", *[f"--exclude={r}" for r in rules], f"{src}/", str(dst)], check=True,
                           capture_output=True, timeout=60)
        else:
            tb5sync.sync(f"{src}/", str(dst), exclude=rules)
    assert _tree(tmp_path / "tb5sync") == _tree(tmp_path / "rsync")


@pytest.mark.timeout(60)
def test_exclude_option_include_rule_is_refused(tmp_path: Path) -> None:
    """``--exclude '+ PAT'`` is an include rule for rsync; tb5sync has none and says so, in one line,
    before anything is written (it took it as a literal pattern and copied everything)."""
    from tb5sync.errors import UsageError

    src = tmp_path / "src"
    src.mkdir()
    (src / "f.txt").write_bytes(b"f")
    with pytest.raises(UsageError, match=r"include rule .*exclude rules only"):
        tb5sync.sync(f"{src}/", str(tmp_path / "d"), exclude=["+ */", "+ *.txt", "*"])
    assert not (tmp_path / "d").exists()
    r = subprocess.run([os.sys.executable, "-m", "tb5sync.cli", "sync", "--exclude", "+ *.txt", f"{src}/", str(tmp_path / "d")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "include rule" in r.stderr
