"""What a user installs and calls: the sdist carries the Cython sources, a build without the
Cython chunker says so, the API checks its arguments' types, and a bad thread count in the
environment is reported as the process starts.

The full round trip (sdist and wheel built with ``python -m build``, each installed into a fresh
venv and run) needs the package index and a compiler's minute: ``make dist-check``, run by CI."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from typing import Any

import pytest

import tb5sync
from tb5sync.daemon.server import Server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(tb5sync.__file__))}


def test_sdist_holds_the_cython_sources(tmp_path: Any) -> None:
    """The sdist once lacked ``ext/*.pyx`` and ``_gear.pxi``, so ``pip install`` from it failed."""
    r = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--no-isolation", "--skip-dependency-check", "--outdir", str(tmp_path), REPO],
        capture_output=True, text=True, timeout=100,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (sdist,) = [p for p in os.listdir(tmp_path) if p.endswith(".tar.gz")]
    with tarfile.open(tmp_path / sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    needed = {"setup.py", "pyproject.toml", "ext/_cdc.pyx", "ext/_scan.pyx", "ext/_write.pyx", "ext/_gear.pxi", "tb5sync/__init__.py", "tb5sync/py.typed"}
    assert needed <= names, needed - names
    with open(os.path.join(REPO, "ext", "_cdc.pyx")) as f:  # what the .pyx includes is shipped too
        included = {line.split('"')[1] for line in f if line.startswith("include ")}
    assert {f"ext/{n}" for n in included} <= names


_NO_CYTHON = "import sys; sys.modules['tb5sync._cdc'] = None; sys.modules['tb5sync._scan'] = None; sys.modules['tb5sync._write'] = None; "


def test_pure_python_build_warns_once_and_version_says_so(tmp_path: Any) -> None:
    """A build without a C compiler installs the pure-Python chunker: ``tb5sync --version`` shows
    it, and a sync warns once (``RuntimeWarning``) however many syncs run."""
    r = subprocess.run([sys.executable, "-c", _NO_CYTHON + "from tb5sync.cli.command import main; main(['--version'])"],
                       capture_output=True, text=True, env=ENV, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"tb5sync {tb5sync.__version__}",
                                     "pure-Python chunker: tb5sync._cdc is not built (no C compiler at install?)"]
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"x" * 1000)
    code = _NO_CYTHON + f"""
import warnings, tb5sync
with warnings.catch_warnings(record=True) as got:
    warnings.simplefilter("always")
    for i in range(3):
        tb5sync.sync({str(src)!r} + "/", {str(tmp_path)!r} + f"/dst{{i}}")
print(sum(issubclass(w.category, RuntimeWarning) and "pure-Python" in str(w.message) for w in got))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "1"
    r = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", "import tb5sync; tb5sync.sync('/nonexistent-x', '/tmp/y')"],
                       capture_output=True, text=True, env=ENV, timeout=60)
    assert "RuntimeWarning" not in r.stderr  # the Cython build does not warn


@pytest.mark.parametrize(
    "kw,name",
    [
        ({"exclude": "*.log"}, "exclude"),
        ({"exclude": [b"*.log"]}, "exclude"),
        ({"delete": "yes"}, "delete"),
        ({"checksum": 1}, "checksum"),
        ({"dry_run": None}, "dry_run"),
        ({"streams": "4"}, "streams"),
        ({"streams": True}, "streams"),
        ({"compress": None}, "compress"),
        ({"progress": 5}, "progress"),
        ({"token": 5}, "token"),
        ({"state_dir": 3}, "state_dir"),
    ],
)
def test_sync_checks_argument_types(tmp_path: Any, kw: dict[str, Any], name: str) -> None:
    """``sync(..., exclude="*.log")`` used to exclude nothing (a str is a sequence of one-character
    patterns); every argument is checked at the API boundary, and nothing is written."""
    src = tmp_path / "src"
    src.mkdir()
    with pytest.raises(TypeError, match=rf"sync\(\): {name} must be") as info:
        tb5sync.sync(str(src) + "/", str(tmp_path / "dst"), **kw)
    assert isinstance(info.value, tb5sync.UsageError)
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("which", ["src", "dst"])
def test_sync_checks_paths(tmp_path: Any, which: str) -> None:
    args = {"src": str(tmp_path) + "/", "dst": str(tmp_path / "dst")}
    args[which] = None  # type: ignore[assignment]
    with pytest.raises(TypeError, match=rf"sync\(\): {which} must be"):
        tb5sync.sync(args["src"], args["dst"])


@pytest.mark.parametrize("value", ["abc", "-1", "100000"])
def test_bad_thread_count_reported_at_start(tmp_path: Any, value: str) -> None:
    """A bad ``$TB5SYNC_HASH_THREADS`` (or CHUNK_THREADS) is a usage error as the CLI or a server
    starts, even for a sync that never hashes a large file."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "small").write_bytes(b"small")
    for var in ("TB5SYNC_HASH_THREADS", "TB5SYNC_CHUNK_THREADS"):
        env = {**ENV, var: value}
        r = subprocess.run([sys.executable, "-m", "tb5sync.cli", "sync", f"{src}/", str(tmp_path / "dst")],
                           capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 2 and var in r.stderr, r.stderr
        assert not (tmp_path / "dst").exists()
        r = subprocess.run([sys.executable, "-m", "tb5sync.cli", "serve", str(tmp_path), "--bind", "127.0.0.1:0"],
                           capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 2 and var in r.stderr, r.stderr


def test_bad_thread_count_refused_by_server(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TB5SYNC_HASH_THREADS", "many")
    with pytest.raises(tb5sync.UsageError, match="TB5SYNC_HASH_THREADS"):
        Server(str(tmp_path), host="127.0.0.1", port=0)


@pytest.mark.parametrize(
    "kw,name",
    [
        ({"allow": "10.0.0.0/8"}, "allow"),  # a str used to be iterated as one-character networks
        ({"allow": 5}, "allow"),
        ({"port": "8873"}, "port"),
        ({"host": None}, "host"),
        ({"token": 1}, "token"),
        ({"read_only": "no"}, "read_only"),
        ({"state_dir": 1}, "state_dir"),
    ],
)
def test_server_checks_argument_types(tmp_path: Any, kw: dict[str, Any], name: str) -> None:
    args: dict[str, Any] = {"host": "127.0.0.1", "port": 0, **kw}
    with pytest.raises(TypeError, match=rf"Server\(\): {name} must be"):
        Server(str(tmp_path), **args)
    assert os.listdir(tmp_path) == []  # not even a state directory
